"""Odd-shaped random-weight GGUF files (hotstart/bench/gguf_make.py) and their float32 reference: a
transformers model holding the very values the file's blocks dequantize to (the gguf package's numpy
dequantization), with llama.cpp's converter changes undone as the converter's inverse says."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# family -> (transformers model_type, config): hidden and MLP widths whole blocks of 32 (K-quants need
# 256: such a tensor falls back to Q8_0 in a K mix, as llama.cpp does), odd head counts, odd layer counts
CONFIGS = {
    "llama": ("llama", dict(architectures=["LlamaForCausalLM"], hidden_size=96, intermediate_size=160,
                            num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                            rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(architectures=["Qwen2ForCausalLM"], hidden_size=96, intermediate_size=224,
                            num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                            rope_theta=1000000.0, tie_word_embeddings=False)),
    "gemma2": ("gemma2", dict(architectures=["Gemma2ForCausalLM"], hidden_size=96, intermediate_size=160,
                              num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                              query_pre_attn_scalar=32, sliding_window=4096, tie_word_embeddings=True)),
}
COMMON = dict(vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
              torch_dtype="float32", bos_token_id=1, eos_token_id=2)


def make(family: str, quant: str, out: Path, seed: int = 0) -> tuple[Path, object]:
    """(the GGUF file, the transformers float32 model of its dequantized weights)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hotstart import gguf_arch
    from hotstart.bench import gguf_make
    from hotstart.bench.make_model import tensor_plan
    from hotstart.boot.default_model import find_gguf
    from hotstart.gguf_file import GGUFFile
    from hotstart.model_config import parse_model_config

    model_type, config = CONFIGS[family]
    cfg = {**COMMON, **config}
    mc = parse_model_config(cfg, out / "config.json")
    path = out / f"{family}.{quant}.gguf"
    written = gguf_make.write_gguf(path, mc, tensor_plan(cfg), quant, GGUFFile(find_gguf()), seed)
    arch = gguf_arch.ARCHES[gguf_make.ARCH_OF[mc.architecture]]
    state = {}
    for name, (kind, blocks) in written.items():
        values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).astype(np.float32)
        hf = gguf_arch.checkpoint_name(arch, name)
        module = hf.rpartition(".")[0]
        if arch.unpermute_qk and module.endswith(("q_proj", "k_proj")):
            heads = mc.num_attention_heads if module.endswith("q_proj") else mc.num_key_value_heads
            values = values.reshape(heads, -1, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        if arch.norm_shift and module.endswith("norm"):
            values = values - np.float32(1.0)
        state[hf] = torch.from_numpy(np.ascontiguousarray(values).reshape(
            values.shape if values.ndim == 2 and values.shape[0] > 1 else -1))
    ref_cfg = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "architectures"})
    ref = AutoModelForCausalLM.from_config(ref_cfg, dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all(n == "lm_head.weight" for n in missing), (missing, unexpected)
    return path, ref.eval()
