"""The many-models memory budget: each model's KV cache is a share of it, so --max-loaded-models of them
fit together."""

import argparse
import json

from hotstart.server.multi_launch import KV_FRACTION, estimate_cost

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128,
          "vocab_size": 256, "max_position_embeddings": 8192}


def _model(tmp_path, weight_bytes):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    return tmp_path


def test_slots_models_fit_the_budget_together(tmp_path):
    path = _model(tmp_path, 1 << 20)
    args = argparse.Namespace(max_num_seqs=256, max_model_len=None, kv_cache_memory=None)
    budget = 1 << 30
    for slots in (1, 2, 3, 5):
        weights, kv = estimate_cost(path, args, budget, slots)
        assert weights == 1 << 20
        # 256 x 8192 tokens want 2 x 4 layers x 2 heads x 16 dims x 4 bytes x 2M = 1 GiB: capped at a share
        assert kv == int(KV_FRACTION * (budget - weights * slots) / slots)
        assert slots * (weights + kv) <= budget


def test_a_small_need_or_an_explicit_size_is_kept(tmp_path):
    path = _model(tmp_path, 1000)
    small = argparse.Namespace(max_num_seqs=2, max_model_len=128, kv_cache_memory=None)
    assert estimate_cost(path, small, 1 << 30, 3) == (1000, 2 * 4 * 2 * 16 * 4 * 256)
    given = argparse.Namespace(max_num_seqs=256, max_model_len=None, kv_cache_memory=12345)
    assert estimate_cost(path, given, 1 << 30, 3) == (1000, 12345)
