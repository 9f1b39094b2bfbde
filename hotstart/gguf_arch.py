"""The one place that knows GGUF's metadata keys and tensor names: a GGUF file's architecture mapped onto
hotstart's family table (hotstart/families.py), torch-free.

The metadata becomes the config.json its Hugging Face original had (the fields transformers' own GGUF
loader maps), read by model_config.load_model_config as any config.json is, so every family rule and
refusal applies unchanged. Tensor names map onto the checkpoint names the model classes use. What
llama.cpp's converter changed in the weights is undone where the model reads them (model/gguf_loader.py):
  - llama: q and k rows permuted within each head for llama.cpp's interleaved RoPE (UNPERMUTE_QK);
  - gemma2 / gemma3: every RMSNorm weight stored as 1 + w (NORM_SHIFT), where hotstart's Gemma norm
    scales by (1 + w) itself;
  - Llama 3.x: llama3 RoPE scaling stored as per-frequency divisors in the tensor `rope_freqs`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from hotstart.errors import ModelConfigError
from hotstart.gguf_file import GGUFFile, TensorInfo


@dataclass(frozen=True)
class Arch:
    architecture: str  # config.json's architectures[0] (hotstart/families.py)
    norms: dict[str, str]  # GGUF per-layer norm tensor -> checkpoint module
    unpermute_qk: bool = False
    norm_shift: bool = False
    fused: bool = False  # phi3: attn_qkv and ffn_up (gate and up) fused


LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
ARCHES = {
    "llama": Arch("LlamaForCausalLM", LLAMA_NORMS, unpermute_qk=True),
    "qwen2": Arch("Qwen2ForCausalLM", LLAMA_NORMS),
    "qwen3": Arch("Qwen3ForCausalLM", LLAMA_NORMS),
    "gemma2": Arch("Gemma2ForCausalLM", GEMMA_NORMS, norm_shift=True),
    "gemma3": Arch("Gemma3ForCausalLM", GEMMA_NORMS, norm_shift=True),
    "phi3": Arch("Phi3ForCausalLM", LLAMA_NORMS, fused=True),
}
# per-layer tensors other than norms: GGUF name -> checkpoint name (below model.layers.N.)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def arch_of(gf: GGUFFile) -> tuple[str, Arch]:
    name = gf.get("general.architecture")
    if not isinstance(name, str):
        raise ModelConfigError(f"{gf.path}: GGUF key 'general.architecture' is missing")
    if name not in ARCHES:
        raise ModelConfigError(f"{gf.path}: GGUF architecture '{name}' is not served (served: "
                               f"{', '.join(ARCHES)})")
    return name, ARCHES[name]


def _key(gf: GGUFFile, key: str, kind: type, default=...):
    value = gf.get(key)
    if value is None:
        if default is ...:
            raise ModelConfigError(f"{gf.path}: GGUF key '{key}' is missing")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, list) and kind is int and value and all(v == value[0] for v in value):
        value = value[0]  # a per-layer array with one value (head_count_kv of some converters)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ModelConfigError(f"{gf.path}: GGUF key '{key}' must be {kind.__name__}, got {value!r}")
    return value


def float_tensor(gf: GGUFFile, info: TensorInfo) -> list[float]:
    """A small F32 tensor's values (RoPE factors), read without numpy."""
    if info.type_name != "F32" or len(info.shape) != 1:
        raise ModelConfigError(f"{gf.path}: tensor '{info.name}' must be a 1-D F32 tensor")
    with open(gf.path, "rb") as f:
        f.seek(info.start)
        raw = f.read(info.end - info.start)
    return list(struct.unpack(f"<{info.shape[0]}f", raw))


def config_dict(gf: GGUFFile) -> dict:
    """GF's metadata as the config.json of its original (the fields parse_model_config reads)."""
    name, arch = arch_of(gf)
    k = lambda key, kind, default=...: _key(gf, f"{name}.{key}", kind, default)  # noqa: E731
    if k("expert_count", int, 0):
        raise ModelConfigError(f"{gf.path}: GGUF key '{name}.expert_count': mixture-of-experts GGUF files "
                               "are not served (dense models only)")
    heads = k("attention.head_count", int)
    hidden = k("embedding_length", int)
    embed = gf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelConfigError(f"{gf.path}: tensor 'token_embd.weight' is missing")
    layers = k("block_count", int)
    tensors = gf.tensors
    cfg = {
        "architectures": [arch.architecture],
        "hidden_size": hidden,
        "intermediate_size": k("feed_forward_length", int),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": k("attention.head_count_kv", int, heads),
        "head_dim": k("attention.key_length", int, hidden // heads),
        "vocab_size": embed.shape[0],
        "max_position_embeddings": k("context_length", int),
        "rms_norm_eps": k("attention.layer_norm_rms_epsilon", float),
        "rope_theta": k("rope.freq_base", float, 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_down.bias" in tensors,
        "torch_dtype": _dtype(gf),
    }
    if k("attention.value_length", int, cfg["head_dim"]) != cfg["head_dim"]:
        raise ModelConfigError(f"{gf.path}: GGUF key '{name}.attention.value_length' differs from "
                               "key_length (not served)")
    ids = {key: gf.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "eot", "eom")}
    ids = {key: v for key, v in ids.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    if "bos" in ids:
        cfg["bos_token_id"] = ids["bos"]
    eos = list(dict.fromkeys(ids[key] for key in ("eos", "eot", "eom") if key in ids))  # llama.cpp's ends
    if eos:
        cfg["eos_token_id"] = eos
    cfg.update(_rope(gf, name, k, cfg))
    cfg.update(_family_fields(gf, name, k, cfg))
    return cfg


def _dtype(gf: GGUFFile) -> str:
    """The activations' dtype hotstart computes in (`--dtype auto` reads it): the matrices' float type,
    bfloat16 for quantized ones (float32 where the CPU lacks bf16, as for any bf16 checkpoint)."""
    kinds = {t.type_name for t in gf.tensors.values() if len(t.shape) == 2}
    if kinds <= {"F32"}:
        return "float32"
    if kinds <= {"F32", "F16"}:
        return "float16"
    return "bfloat16"


def _rope(gf: GGUFFile, name: str, k, cfg: dict) -> dict:
    scaling = k("rope.scaling.type", str, "none")
    factor = k("rope.scaling.factor", float, 1.0)
    orig = k("rope.scaling.original_context_length", int, cfg["max_position_embeddings"])
    dims = k("rope.dimension_count", int, cfg["head_dim"])
    out: dict = {}
    if dims != cfg["head_dim"]:
        out["partial_rotary_factor"] = dims / cfg["head_dim"]
    freqs = gf.tensors.get("rope_freqs.weight")
    if freqs is not None:  # Llama 3.x: llama3 scaling as one divisor per frequency
        divisors = float_tensor(gf, freqs)
        out["rope_scaling"] = {"rope_type": "longrope", "short_factor": divisors, "long_factor": divisors,
                               "factor": 1.0, "attention_factor": 1.0,
                               "original_max_position_embeddings": cfg["max_position_embeddings"]}
    elif "rope_factors_long.weight" in gf.tensors:  # Phi-3 LongRoPE
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": float_tensor(gf, gf.tensors["rope_factors_long.weight"]),
            "short_factor": float_tensor(gf, gf.tensors.get("rope_factors_short.weight",
                                                            gf.tensors["rope_factors_long.weight"])),
            "attention_factor": k("rope.scaling.attn_factor", float, None)}
        out["original_max_position_embeddings"] = orig
    elif scaling in ("linear", "yarn") and factor != 1.0:
        out["rope_scaling"] = {"rope_type": scaling, "factor": factor,
                               "original_max_position_embeddings": orig}
    elif scaling not in ("none", "linear", "yarn"):
        raise ModelConfigError(f"{gf.path}: GGUF key '{name}.rope.scaling.type' {scaling!r} is not served "
                               "(none, linear, yarn)")
    return out


def _family_fields(gf: GGUFFile, name: str, k, cfg: dict) -> dict:
    window = k("attention.sliding_window", int, None)
    if name in ("gemma2", "gemma3"):
        # llama.cpp's query scale: 1/sqrt(head_dim), but hidden/heads for the 27B sizes (46 / 62 layers)
        big = cfg["num_hidden_layers"] == (46 if name == "gemma2" else 62)
        out = {"query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big
               else cfg["head_dim"], "sliding_window": window, "hidden_activation": "gelu_pytorch_tanh",
               "sliding_window_pattern": 2 if name == "gemma2" else 6,
               "final_logit_softcapping": k("final_logit_softcapping", float, None)}
        if name == "gemma2":
            out["attn_logit_softcapping"] = k("attn_logit_softcapping", float, None)
        else:
            out["rope_local_base_freq"] = 10000.0
        return out
    if name == "phi3":
        return {"sliding_window": window}
    if window is not None:
        raise ModelConfigError(f"{gf.path}: GGUF key '{name}.attention.sliding_window' is not served for "
                               f"{name}")
    return {}


def checkpoint_name(arch: Arch, gguf_name: str) -> str | None:
    """The checkpoint name of GGUF tensor GGUF_NAME ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.
    q_proj.weight"); None: a tensor the model does not hold (RoPE factors, read into the config)."""
    if gguf_name in CONFIG_TENSORS:
        return None
    base, _, leaf = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, what = base.split(".", 2)
        module = arch.norms.get(what) or LAYER_TENSORS.get(what)
        if arch.fused and what == "ffn_up":
            module = "mlp.gate_up_proj"
        return f"model.layers.{layer}.{module}.{leaf}" if module else ""
    module = GLOBAL_TENSORS.get(base)
    return f"{module}.{leaf}" if module else ""
