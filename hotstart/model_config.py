"""ModelConfig: a model folder's config.json read as its family's transformers code reads it, without
transformers or torch. What differs between families comes from hotstart/families.py; a config feature
the code does not implement is refused with one line naming the file and the field, never ignored. The
RoPE is read by rope_config.py, the attention window by sliding_window.py."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotstart import config_fields as fields
from hotstart import families, gguf_arch
from hotstart.errors import ModelConfigError
from hotstart.gguf_file import lean_header
from hotstart.rope_config import RopeConfig, parse_ropes
from hotstart.sliding_window import parse_window

# config.json activation name -> the MLP's function (layers.ACTIVATIONS); silu and swish are the same
# function in transformers' ACT2FN, gelu_pytorch_tanh is GELU's tanh approximation (Gemma)
SUPPORTED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, as the engine needs it."""

    path: str
    architecture: str
    family: str  # hotstart/families.py name
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # the window of the layers that slide; None: every layer attends to all
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # -- mixture of experts (hotstart/model/moe.py); num_experts 0: every MLP is dense --
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's MLP width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is a mixture of experts (the others: dense)
    # -- sliding windows and Gemma's attention (defaults: none of it) --
    sliding_layers: tuple[bool, ...] = ()  # per layer: a "sliding_attention" layer (empty: none)
    hidden_act: str = "silu"  # the MLP's activation, a layers.ACTIVATIONS key
    attn_scale: float | None = None  # query scaling (Gemma: query_pre_attn_scalar ** -0.5); None: D ** -0.5
    attn_softcap: float | None = None  # attention logits -> tanh(x / c) * c before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits
    rope_local: RopeConfig | None = None  # the sliding layers' RoPE (Gemma 3); None: `rope` everywhere

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer LAYER (a query at p sees keys p - W + 1 .. p); None: full."""
        slides = self.sliding_layers[layer] if self.sliding_layers else False
        return self.sliding_window if slides else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _ids(value: Any, src: Path, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelConfigError(f"{src}: field '{name}' must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _flag(rule: bool | str, raw: dict, src: Path, defaults: dict | None = None) -> bool:
    """A family's bias rule: a constant, or the config.json field that holds it (absent: the family's
    default, else False)."""
    if isinstance(rule, bool):
        return rule
    return fields.read(raw, rule, bool, src, (defaults or {}).get(rule, False))


def _moe(fam: families.Family, raw: dict, src: Path, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of FAM's config.json, as its transformers code reads them."""
    moe = fam.moe
    if moe is None:
        return {}

    def get(name: str, kind: type, default: Any = ..., positive: bool = True):
        return fields.read(raw, name, kind, src, fam.defaults.get(name, default), positive)

    # transformers maps `num_experts` and `num_local_experts` onto one attribute (attribute_map)
    experts = get("num_local_experts" if "num_local_experts" in raw else "num_experts", int,
                  fam.defaults.get("num_experts", fam.defaults.get("num_local_experts", ...)))
    top_k = get("num_experts_per_tok", int)
    if top_k > experts:
        raise ModelConfigError(f"{src}: field 'num_experts_per_tok' ({top_k}) is more than the experts "
                               f"({experts})")
    step, dense = 1, []
    if moe.sparse_step:
        step = get("decoder_sparse_step", int, 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
            raise ModelConfigError(f"{src}: field 'mlp_only_layers' must be a list of layer indices, "
                                   f"got {dense!r}")
    return dict(
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=get(moe.intermediate, int),
        shared_expert_intermediate_size=(get("shared_expert_intermediate_size", int) if moe.shared_expert
                                         else 0),
        norm_topk_prob=_flag(moe.norm_topk, raw, src),
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    )


def _softcap(fam: families.Family, raw: dict, src: Path, name: str) -> float | None:
    """A Gemma soft-capping field: null is no capping, absent the family's default."""
    if name not in fam.softcaps:
        if raw.get(name) is not None:
            raise ModelConfigError(f"{src}: field '{name}' is not supported for {fam.name} "
                                   "(its transformers code does not apply it)")
        return None
    if name in raw and raw[name] is None:
        return None
    return fields.read(raw, name, float, src, default=fam.defaults.get(name), positive=True)


def _family(raw: dict, src: Path) -> tuple[str, families.Family]:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelConfigError(f"{src}: missing field 'architectures'")
    arch = archs[0]
    fam = families.for_architecture(arch)
    if arch in families.REFUSED:
        raise ModelConfigError(f"{src}: architecture '{arch}' is not supported: {families.REFUSED[arch]}")
    if fam is None:
        supported = ", ".join(families.architectures())
        raise ModelConfigError(f"{src}: unknown architecture '{arch}' (supported: {supported})")
    return arch, fam


def parse_model_config(raw: Any, src: Path, extra_eos: tuple[int, ...] = ()) -> ModelConfig:
    """RAW (config.json's content, read from SRC) as a ModelConfig; EXTRA_EOS: generation_config.json's."""
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{src}: must hold a JSON object")
    arch, fam = _family(raw, src)

    def get(name: str, kind: type, default: Any = ..., positive: bool = False):
        return fields.read(raw, name, kind, src, fam.defaults.get(name, default), positive)

    act = raw.get(fam.activation, fam.defaults.get(fam.activation, "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelConfigError(f"{src}: field '{fam.activation}' {act!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    quant = raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ModelConfigError(f"{src}: field 'quantization_config' ({method}): quantized checkpoints are "
                               "not supported (float32, float16 or bfloat16 weights only)")

    hidden = get("hidden_size", int, positive=True)
    heads = get("num_attention_heads", int, positive=True)
    # transformers: an explicit null means "as many as the query heads", an absent field the family's default
    kv_heads = heads if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None else \
        get("num_key_value_heads", int, default=heads, positive=True)
    if heads % kv_heads:
        raise ModelConfigError(
            f"{src}: field 'num_attention_heads' ({heads}) must be a multiple of 'num_key_value_heads' "
            f"({kv_heads})")
    head_dim = get("head_dim", int, default=None, positive=True)
    if head_dim is None:
        if hidden % heads:
            raise ModelConfigError(f"{src}: field 'head_dim' is needed: "
                                   "hidden_size % num_attention_heads != 0")
        head_dim = hidden // heads
    layers = get("num_hidden_layers", int, positive=True)
    max_pos = get("max_position_embeddings", int, default=2048, positive=True)

    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ModelConfigError(f"{src}: field 'torch_dtype' must be float32, float16 or bfloat16, "
                               f"got {dtype!r}")
    bos = _ids(raw.get("bos_token_id"), src, "bos_token_id")
    window, sliding_layers = parse_window(fam, raw, src, layers)
    rope, rope_local = parse_ropes(raw, src, fam, max_pos, head_dim)
    scalar = get("query_pre_attn_scalar", float, positive=True) if fam.query_scalar else None

    return ModelConfig(
        path=str(src.parent),
        architecture=arch,
        family=fam.name,
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", int, positive=True),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=get("vocab_size", int, positive=True),
        max_position_embeddings=max_pos,
        rms_norm_eps=get("rms_norm_eps", float, default=1e-6, positive=True),
        rope=rope,
        tie_word_embeddings=get("tie_word_embeddings", bool, default=False),
        qkv_bias=_flag(fam.qkv_bias, raw, src, fam.defaults),
        o_bias=_flag(fam.o_bias, raw, src, fam.defaults),
        mlp_bias=_flag(fam.mlp_bias, raw, src, fam.defaults),
        qk_norm=fam.qk_norm is True,  # per head; OLMo 2's over the projection: its own module
        sliding_window=window,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(dict.fromkeys(_ids(raw.get("eos_token_id"), src, "eos_token_id") + extra_eos)),
        torch_dtype=dtype,
        sliding_layers=sliding_layers,
        hidden_act=SUPPORTED_ACTIVATIONS[act],
        attn_scale=scalar**-0.5 if scalar is not None else None,
        attn_softcap=_softcap(fam, raw, src, "attn_logit_softcapping"),
        final_softcap=_softcap(fam, raw, src, "final_logit_softcapping"),
        rope_local=rope_local,
        **_moe(fam, raw, src, layers),
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: cannot be parsed: {e}") from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse MODEL_DIR/config.json (and generation_config.json's eos ids), or MODEL_DIR's metadata where it
    is a GGUF file (hotstart/gguf_arch.py). Errors name file and field (or GGUF key)."""
    model_dir = Path(model_dir)
    if model_dir.is_file():  # a GGUF file (GGUFFile refuses anything else in one line)
        gf = lean_header(model_dir)  # the vocabulary's strings: the tokenizer's, not ours
        mc = parse_model_config(gguf_arch.config_dict(gf), model_dir)
        return dataclasses.replace(mc, path=str(model_dir))
    src = model_dir / "config.json"
    if not src.is_file():
        raise ModelConfigError(f"{src}: not found (is '{model_dir}' a model folder?)")
    raw = _read_json(src)
    gen = model_dir / "generation_config.json"
    extra_eos = ()
    if gen.is_file():
        gen_raw = _read_json(gen)
        eos = gen_raw.get("eos_token_id") if isinstance(gen_raw, dict) else None
        extra_eos = _ids(eos, gen, "eos_token_id")
    return parse_model_config(raw, src, extra_eos)
