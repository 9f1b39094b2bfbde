"""Random-weight GGUF files of real shapes (`hotstart make-model --format gguf --quant Q4_K_M`), written
with the `gguf` package's GGUFWriter; the tests build their odd-shaped GGUFs here too.

Weights are random ggml blocks, made directly in each type's layout (random quants, float16 scales drawn
small so activations stay finite): no float weights are quantized, so no quantizer is needed, for any
type, and a 7B-shaped file is written at disk speed from a pool of blocks. The tensor names, metadata
keys and the converter's changes (llama's q/k head permutation, Gemma's 1 + w norms) are the inverse of
hotstart/gguf_arch.py's; the tokenizer is the default model's (its GGUF metadata copied).

Mixes (llama.cpp's llama_model_quantize rules, simplified): Q4_K_M / Q5_K_M put Q6_K on the output
matrix and on attn_v and ffn_down of the first and last eighth of the layers and every third between,
Q4_K / Q5_K elsewhere; a matrix whose rows are not whole blocks of 256 falls back to Q8_0 (as
llama.cpp falls back); norms and biases stay F32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hotstart import gguf_arch
from hotstart.errors import HotstartError
from hotstart.gguf_file import TYPE_IDS, TYPES, GGUFFile
from hotstart.model_config import ModelConfig

QUANTS = ("Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16",
          "F32")
# llama.cpp's general.file_type of each mix (llama.h's LLAMA_FTYPE_*)
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 15,
              "Q4_K_M": 15, "Q5_K": 17, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}
ARCH_OF = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
           "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
           "Phi3ForCausalLM": "phi3"}
# the f16 scale fields of each block layout: (offset, count of f16) per type
SCALES = {"Q4_0": (0, 1), "Q4_1": (0, 2), "Q5_0": (0, 1), "Q5_1": (0, 2), "Q8_0": (0, 1), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208, 1)}


def gguf_name(arch: gguf_arch.Arch, hf_name: str) -> str:
    """The inverse of gguf_arch.checkpoint_name."""
    module, _, leaf = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        names = {v: k for k, v in {**gguf_arch.LAYER_TENSORS, **arch.norms}.items()}
        names["mlp.gate_up_proj"] = "ffn_up"
        return f"blk.{layer}.{names[rest]}.{leaf}"
    return {v: k for k, v in gguf_arch.GLOBAL_TENSORS.items()}[module] + f".{leaf}"


def tensor_type(quant: str, name: str, cols: int, layers: int) -> str:
    """The ggml type of tensor NAME (GGUF name) of a file of mix QUANT."""
    if not name.endswith(".weight") or "norm" in name:
        return "F32"
    kind = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}.get(quant, quant)
    if quant in ("Q4_K_M", "Q5_K_M"):
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        more = layer < layers // 8 or layer >= layers - layers // 8 or (layer - layers // 8) % 3 == 2
        if name == "output.weight" or (layer >= 0 and more and (".attn_v." in name or ".ffn_down." in name)):
            kind = "Q6_K"
    if cols % TYPES[TYPE_IDS[kind]][1]:
        kind = "Q8_0" if cols % 32 == 0 else "F16"
    return kind


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator,
                  scale: float = 0.002) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid KIND blocks (float types: normal(0, 0.02) values, as bytes)."""
    if kind in ("F32", "F16", "BF16"):
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        if kind == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return values.astype(np.float16 if kind == "F16" else np.float32).view(np.uint8).reshape(rows, -1)
    _, block, size = TYPES[TYPE_IDS[kind]]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    off, n = SCALES[kind]
    d = (rng.uniform(0.5, 1.5, (rows, cols // block, n)) * scale).astype(np.float16)
    blocks[..., off:off + 2 * n] = d.view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # 6-bit sub-block scales: keep them small too (0..15), mins likewise
        blocks[..., 4:16] &= 0x0F
    return blocks.reshape(rows, -1)


POOL_BLOCKS = 1 << 20  # per type: 1 Mi blocks (18 - 210 MiB) of random weights, sliced at random offsets


def _pooled(pools: dict, kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes] of KIND: a slice of that type's pool (a view: a 7B-shaped file is written
    without holding its weights in memory), or fresh blocks where the pool is too small."""
    _, block, size = TYPES[TYPE_IDS[kind]]
    n = rows * (cols // block)
    if n > POOL_BLOCKS:
        return random_blocks(kind, rows, cols, rng)
    if kind not in pools:
        pools[kind] = random_blocks(kind, 1, POOL_BLOCKS * block, rng).reshape(POOL_BLOCKS, -1)
    start = int(rng.integers(0, POOL_BLOCKS - n + 1))
    return pools[kind][start:start + n].reshape(rows, -1)


def metadata(writer, arch_name: str, mc: ModelConfig, quant: str, name: str) -> None:
    """The general.* and {arch}.* keys of MC (what gguf_arch.config_dict reads back)."""
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[quant])
    writer.add_context_length(mc.max_position_embeddings)
    writer.add_embedding_length(mc.hidden_size)
    writer.add_block_count(mc.num_hidden_layers)
    writer.add_feed_forward_length(mc.intermediate_size)
    writer.add_head_count(mc.num_attention_heads)
    writer.add_head_count_kv(mc.num_key_value_heads)
    writer.add_key_length(mc.head_dim)
    writer.add_value_length(mc.head_dim)
    writer.add_layer_norm_rms_eps(mc.rms_norm_eps)
    writer.add_rope_freq_base(mc.rope.theta)
    writer.add_rope_dimension_count(int(mc.head_dim * mc.rope.partial_rotary_factor))
    if mc.sliding_window is not None and arch_name in ("gemma2", "gemma3", "phi3"):
        writer.add_sliding_window(mc.sliding_window)
    if arch_name == "gemma2":
        writer.add_attn_logit_softcapping(mc.attn_softcap or 50.0)
        writer.add_final_logit_softcapping(mc.final_softcap or 30.0)


def copy_tokenizer(writer, src: GGUFFile) -> int:
    """SRC's tokenizer.* keys into WRITER; -> its vocabulary size."""
    for key, value in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            writer.add_array(key, value)  # strings, int32 token types, float32 scores
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    return len(src.fields["tokenizer.ggml.tokens"])


def write_gguf(path: Path, mc: ModelConfig, plan, quant: str, tokenizer: GGUFFile | None, seed: int = 0,
               name: str = "hotstart random weights") -> dict[str, tuple[str, np.ndarray]]:
    """A GGUF of MC's shapes with random weights of mix QUANT at PATH. PLAN: make_model.tensor_plan's
    (checkpoint name, shape, fill). -> GGUF name -> (ggml type, the blocks written), for references."""
    import gguf  # noqa: PLC0415 - the writer: make-model and the tests only

    arch_name = ARCH_OF.get(mc.architecture)
    if arch_name is None:
        raise HotstartError(f"--format gguf: {mc.architecture} has no GGUF architecture here "
                            f"(served: {', '.join(sorted(set(ARCH_OF)))})")
    arch = gguf_arch.ARCHES[arch_name]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch_name)
    metadata(writer, arch_name, mc, quant, name)
    if tokenizer is not None:
        copy_tokenizer(writer, tokenizer)
    written = {}
    pools: dict[str, np.ndarray] = {}  # kind -> random blocks, [n, block bytes]: tensors are slices of it
    for hf_name, shape, fill in plan:
        g = gguf_name(arch, hf_name)
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        if fill == "ones":  # norms (Gemma's file holds 1 + w: w = 0 is 1, others 1 too)
            data = (1 + rng.standard_normal(shape[0], dtype=np.float32) * 0.05).astype(np.float32)
            kind = "F32"
            blocks = data.view(np.uint8).reshape(1, -1)
        else:
            kind = tensor_type(quant, g, cols, mc.num_hidden_layers)
            blocks = _pooled(pools, kind, rows, cols, rng)
        dtype = gguf.GGMLQuantizationType[kind]
        # the byte shape [rows, row_bytes]: the writer turns it into the element shape
        writer.add_tensor(g, blocks if len(shape) == 2 else blocks.reshape(-1), raw_dtype=dtype)
        written[g] = (kind, blocks)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
