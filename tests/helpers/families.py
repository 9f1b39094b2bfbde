"""The tiny checkpoints the tests compare against transformers: one per family of hotstart/families.py,
odd-shaped on purpose, and a tensor-parallel variant of each ("NAME-tp": heads and MLP divisible by 2).
Read by tests/conftest.py (TINY, make_tiny_checkpoint) and benchmarks/gpu_check.py; data only (no torch)."""

from __future__ import annotations

import copy
from typing import Any

from hotstart import families

# family -> transformers config kwargs
CONFIGS: dict[str, dict[str, Any]] = {
    # 5 heads / 1 KV head, llama3 RoPE scaling with a short original context
    "llama": dict(hidden_size=80, intermediate_size=144, num_hidden_layers=2, num_attention_heads=5,
                  num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.2, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    # 6 heads / 3 KV heads, q/k/v biases
    "qwen2": dict(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=3, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2),
    # head_dim 24 != hidden / heads, tied embeddings
    "qwen3": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=24, vocab_size=512, max_position_embeddings=1024,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.2),
    # head_dim 20 != hidden / heads; a window of 16, shorter than the test prompts
    "mistral": dict(hidden_size=96, intermediate_size=136, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=20, vocab_size=512, max_position_embeddings=1024,
                    sliding_window=16, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    initializer_range=0.2),
    # 5 heads / 1 KV head; 5 experts, 3 per token (not a multiple)
    "mixtral": dict(hidden_size=80, intermediate_size=48, num_hidden_layers=2, num_attention_heads=5,
                    num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5,
                    num_local_experts=5, num_experts_per_tok=3, rope_theta=1000000.0,
                    tie_word_embeddings=False, initializer_range=0.2),
    # 6 heads / 3 KV heads; 5 experts, 3 per token; layer 1 dense (`mlp_only_layers`)
    "qwen2-moe": dict(hidden_size=96, intermediate_size=72, num_hidden_layers=4, num_attention_heads=6,
                      num_key_value_heads=3, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0,
                      rms_norm_eps=1e-6, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=40,
                      shared_expert_intermediate_size=56, norm_topk_prob=False, mlp_only_layers=[1],
                      tie_word_embeddings=False, initializer_range=0.2),
    # head_dim 24 != hidden / heads, 7 experts, 3 per token; decoder_sparse_step 2: layers 0 and 2 dense
    "qwen3-moe": dict(hidden_size=96, intermediate_size=88, num_hidden_layers=4, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=24, vocab_size=512, max_position_embeddings=1024,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=7, num_experts_per_tok=3,
                      moe_intermediate_size=36, norm_topk_prob=True, decoder_sparse_step=2,
                      tie_word_embeddings=False, initializer_range=0.2),
    # 3 heads / 1 KV head of 20 (!= 72 / 3), a window of 8 on layers 0 and 2, caps that bite
    "gemma2": dict(hidden_size=72, intermediate_size=136, num_hidden_layers=3, num_attention_heads=3,
                   num_key_value_heads=1, head_dim=20, vocab_size=512, max_position_embeddings=1024,
                   sliding_window=8, query_pre_attn_scalar=18, attn_logit_softcapping=4.0,
                   final_logit_softcapping=8.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   initializer_range=0.2),
    # head_dim 24 != 96 / 6, a window of 12 on all but every 3rd layer, linear RoPE on global layers
    "gemma3": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6,
                   num_key_value_heads=3, head_dim=24, vocab_size=512, max_position_embeddings=1024,
                   sliding_window=12, sliding_window_pattern=3, query_pre_attn_scalar=20,
                   final_logit_softcapping=8.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   initializer_range=0.2,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # 6 heads / 2 KV heads of 16, 12 of them rotary; LongRoPE with an original context of 6: prompts
    # of the reference tests (and benchmarks/gpu_check.py's 8 tokens) take the long factors as
    # transformers does for them; test_phi_olmo.py serves the short ones too
    "phi3": dict(hidden_size=96, intermediate_size=136, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                 original_max_position_embeddings=6, partial_rotary_factor=0.75, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.2, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, sliding_window=None,
                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                               "long_factor": [1.5, 2.5, 4.0, 7.0, 11.0, 16.0]}),
    # 6 heads / 2 KV heads, head_dim 20 != hidden / heads
    "olmo2": dict(hidden_size=96, intermediate_size=136, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=20, vocab_size=512, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2),
}

# family -> changes to CONFIGS for its "-tp" checkpoint
TP_CHANGES: dict[str, dict[str, Any]] = {
    # attention and MLP biases: the row-parallel layers add theirs after the all-reduce
    "llama": dict(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                  attention_bias=True, mlp_bias=True),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    # an odd vocabulary: the last rank's vocabulary shard is shorter
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, vocab_size=509),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2),
    "qwen2-moe": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3-moe": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, moe_intermediate_size=32),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16),
    "gemma3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16),
    # the fused tensors split per rank: q, k, v (gate, up) row ranges out of one tensor
    "phi3": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2),
    "olmo2": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2),
}


def tiny_checkpoints() -> dict[str, tuple[str, dict[str, Any]]]:
    """Test checkpoint name ("qwen2", "qwen2-tp", ...) -> (model_type, transformers config kwargs).

    Deep copies: transformers' config classes rewrite nested dicts they are given (rope_scaling gains
    the partial_rotary_factor), which would change these tables for every later reader."""
    out = {}
    for f in families.FAMILIES:
        base = {"architectures": [f.architectures[0]], **copy.deepcopy(CONFIGS[f.name])}
        out[f.name] = (f.model_type, base)
        out[f"{f.name}-tp"] = (f.model_type, copy.deepcopy({**base, **TP_CHANGES[f.name]}))
    return out
