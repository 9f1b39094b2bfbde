"""`hotstart make-model`'s shapes: each family's published sizes (the dimensions of its config.json) and
the config.json fields make-model writes beside them; `--size tiny` for any family. Data only (argparse
reads it for --help). How a family's config.json is read is hotstart/families.py's; model_table() is the
README's model table (a test checks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hotstart import families


class Shape(NamedTuple):
    """A checkpoint's dimensions, as its published config.json gives them."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None  # None: hidden // heads
    tied: bool


@dataclass(frozen=True)
class Sizes:
    name: str  # the family (hotstart/families.py)
    sizes: dict[str, Shape]  # `--size NAME` -> the published shape
    config: dict[str, Any]  # config.json fields beside the shape
    # per size (or tiny): changes to config
    size_config: dict[str, dict[str, Any]] = field(default_factory=dict)


# `make-model --size tiny` (any family): 4 heads / 2 KV heads of 32
TINY = Shape(128, 384, 2, 4, 2, 32, True)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_1M = {"rope_type": "default", "rope_theta": 1000000.0}
# Gemma 3: one RoPE per layer type (transformers >= 5 writes them so)
GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# Phi-3.5-mini-instruct's and Phi-4-mini-instruct's LongRoPE factors (rotary dims / 2 = 48 each), rounded
PHI35_LONG = [1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62, 3.23, 3.23, 4.79, 7.4, 7.7, 9.09, 12.2, 17.67,
              24.46, 28.57, 30.42, 30.84, 32.59, 32.93, 42.32, 44.96, 50.34, 50.45, 57.55, 57.93, 58.21,
              60.14, 62.61, 62.62, 62.71, 63.14, 63.14, 63.77, 63.93, 63.96, 63.97, 64.03, 64.07, 64.08,
              64.12, 64.41, 64.48, 64.51, 64.53, 64.84]
PHI35_SHORT = [1.0, 1.02, 1.03, 1.03, 1.05, 1.05, 1.05, 1.05, 1.05, 1.07, 1.1, 1.11, 1.16, 1.16, 1.17, 1.29,
               1.34, 1.68, 1.79, 1.82, 1.85, 1.88, 1.91, 1.94, 1.99, 2.02, 2.02, 2.02, 2.02, 2.02, 2.02, 2.03,
               2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.08, 2.09, 2.19, 2.22, 2.59, 2.73, 2.75, 2.84]
PHI4_LONG = [1.0, 1.1183, 1.2506, 1.3986, 1.5641, 1.7492, 1.9561, 2.1876, 2.4464, 2.7359, 3.0596, 3.4216,
             3.8265, 4.2792, 4.7855, 5.3517, 5.985, 6.6931, 7.485, 8.3707, 9.3611, 10.4687, 11.7074, 13.0926,
             14.6417, 16.3742, 18.3116, 20.4782, 22.9012, 25.6109, 28.6412, 32.03, 32.1, 32.13, 32.23, 32.6,
             32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]

FAMILIES: tuple[Sizes, ...] = (
    Sizes(
        "llama",
        # Llama-3.2-1B / 3B, Llama-3-8B (which has no RoPE scaling and an 8k context: Llama-3.1 added them)
        sizes={"1b": Shape(2048, 8192, 16, 32, 8, 64, True), "3b": Shape(3072, 8192, 28, 24, 8, 128, True),
               "8b": Shape(4096, 14336, 32, 32, 8, 128, False)},
        config={"rms_norm_eps": 1e-5, "rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 131072,
                "attention_bias": False, "mlp_bias": False},
        size_config={"8b": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                            "max_position_embeddings": 8192}},
    ),
    Sizes(
        "qwen2",
        # Qwen2.5-0.5B / 1.5B / 3B / 7B
        sizes={"0.5b": Shape(896, 4864, 24, 14, 2, None, True),
               "1.5b": Shape(1536, 8960, 28, 12, 2, None, True),
               "3b": Shape(2048, 11008, 36, 16, 2, None, True),
               "7b": Shape(3584, 18944, 28, 28, 4, None, False)},
        config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 32768,
                "use_sliding_window": False, "sliding_window": None},
    ),
    Sizes(
        "qwen3",
        # Qwen3-0.6B / 1.7B / 4B / 8B
        sizes={"0.6b": Shape(1024, 3072, 28, 16, 8, 128, True),
               "1.7b": Shape(2048, 6144, 28, 16, 8, 128, True),
               "4b": Shape(2560, 9728, 36, 32, 8, 128, True),
               "8b": Shape(4096, 12288, 36, 32, 8, 128, False)},
        config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 40960,
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    ),
    Sizes(
        "mistral",
        # Mistral-7B-v0.3 (no sliding window)
        sizes={"7b": Shape(4096, 14336, 32, 32, 8, 128, False)},
        config={"rms_norm_eps": 1e-5, "rope_parameters": ROPE_1M, "max_position_embeddings": 32768,
                "sliding_window": None},
    ),
    Sizes(
        "mixtral",
        # Mixtral-8x7B-v0.1: 8 experts of 14336, 2 per token
        sizes={"8x7b": Shape(4096, 14336, 32, 32, 8, 128, False)},
        config={"rms_norm_eps": 1e-5, "rope_parameters": ROPE_1M, "max_position_embeddings": 32768,
                "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
        size_config={"tiny": {"num_local_experts": 4}},
    ),
    Sizes(
        "qwen2-moe",
        # Qwen1.5-MoE-A2.7B: 60 experts of 1408, 4 per token, a shared expert of 5632
        sizes={"14b-a2.7b": Shape(2048, 5632, 24, 16, 16, None, False)},
        config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 8192,
                "use_sliding_window": False, "qkv_bias": True, "num_experts": 60,
                "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "mlp_only_layers": []},
        size_config={"tiny": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                              "shared_expert_intermediate_size": 192}},
    ),
    Sizes(
        "qwen3-moe",
        # Qwen3-30B-A3B: 128 experts of 768, 8 per token; 3b-a0.6b: that shape scaled to fit a 24 GB host
        sizes={"30b-a3b": Shape(2048, 6144, 48, 32, 4, 128, False),
               "3b-a0.6b": Shape(1024, 3072, 28, 16, 4, 128, True)},
        config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 40960,
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
        size_config={"3b-a0.6b": {"num_experts": 64, "moe_intermediate_size": 512},
                     "tiny": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96}},
    ),
    Sizes(
        "gemma2",
        # gemma-2-2b / 9b
        sizes={"2b": Shape(2304, 9216, 26, 8, 4, 256, True), "9b": Shape(3584, 14336, 42, 16, 8, 256, True)},
        config={"rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 256, "sliding_window": 4096, "attention_bias": False,
                "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    ),
    Sizes(
        "gemma3",
        # gemma-3-1b-it / the text model of gemma-3-4b-it
        sizes={"1b": Shape(1152, 6912, 26, 4, 1, 256, True), "4b": Shape(2560, 10240, 34, 8, 4, 256, True)},
        config={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
                "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512,
                "attention_bias": False, "rope_parameters": GEMMA3_ROPE,
                "final_logit_softcapping": None, "attn_logit_softcapping": None},
        size_config={"4b": {"sliding_window": 1024, "max_position_embeddings": 131072,
                            "rope_parameters": {**GEMMA3_ROPE, "full_attention": {
                                "rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}},
    ),
    Sizes(
        "phi3",
        # Phi-3.5-mini-instruct (3.8B) and Phi-4-mini-instruct
        sizes={"mini": Shape(3072, 8192, 32, 32, 32, None, False),
               "phi4-mini": Shape(3072, 8192, 32, 24, 8, None, True)},
        config={"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 131072,
                "original_max_position_embeddings": 4096, "sliding_window": 262144,
                "attention_bias": False, "rope_scaling": {"type": "longrope", "long_factor": PHI35_LONG,
                                                          "short_factor": PHI35_SHORT}},
        # tiny: 48 LongRoPE factors fit no tiny head
        size_config={"phi4-mini": {"partial_rotary_factor": 0.75, "rope_scaling": {
                         "type": "longrope", "long_factor": PHI4_LONG, "short_factor": [1.0] * 48}},
                     "tiny": {"rope_scaling": None, "max_position_embeddings": 4096}},
    ),
    Sizes(
        "olmo2",
        # OLMo-2-0425-1B, OLMo-2-1124-7B
        sizes={"1b": Shape(2048, 8192, 16, 16, 16, None, False),
               "7b": Shape(4096, 11008, 32, 32, 32, None, False)},
        config={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "attention_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    ),
)


def names() -> list[str]:
    return [s.name for s in FAMILIES]


def by_name(name: str) -> Sizes:
    for s in FAMILIES:
        if s.name == name:
            return s
    raise KeyError(f"unknown family {name!r} (known: {', '.join(names())})")


def model_table() -> str:
    """The README's model table (markdown): every family, its architectures, sizes and status."""
    rows = ["| family | architectures | `make-model --size` | status |", "|---|---|---|---|"]
    for f in families.FAMILIES:
        archs = ", ".join(f"`{a}`" for a in f.architectures)
        rows.append(f"| {f.name} | {archs} | {', '.join(by_name(f.name).sizes)}, tiny | {f.status} |")
    return "\n".join(rows) + "\n"
