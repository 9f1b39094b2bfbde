"""Model correctness against Hugging Face transformers (the oracle): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import (
    LOGIT_ATOL,
    float32_engine,
    greedy,
    prefill_logits,
    reference_greedy,
    reference_model,
)

from hotstart import families
from hotstart.config import EngineConfig, load_model_config
from hotstart.engine.core import EngineCore
from hotstart.engine.model_runner import ModelRunner
from hotstart.model.files import weight_files

# every registered family (hotstart/families.py), and the first one sharded too (several files, an index)
CASES = [(name, False) for name in families.names()] + [(families.names()[0], True)]


@pytest.mark.parametrize("family,shard", CASES)
def test_random_checkpoints_match_transformers(tiny_checkpoint, family, shard):
    model_dir = tiny_checkpoint(family, shard)
    if shard:
        assert len(weight_files(model_dir)) > 1, "expected a sharded checkpoint with an index"
    core = float32_engine(model_dir)
    ref = reference_model(model_dir)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, core.model_cfg.vocab_size, (23,), generator=g).tolist()
    ours = prefill_logits(core, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0), (ours - theirs).abs().max()
    # eos disabled on both sides: 32 tokens exactly, token for token
    assert greedy(core, ids, 32) == reference_greedy(ref, ids, 32, eos=None)


def test_default_model_matches_transformers(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    core = float32_engine(default_model_dir)
    ref = reference_model(default_model_dir)
    ids = tok.encode_chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    ours = prefill_logits(core, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0), (ours - theirs).abs().max()
    mine = greedy(core, ids, 32)
    assert len(mine) == 32
    assert mine == reference_greedy(ref, ids, 32, eos=None)


def test_fused_projections_match_unfused(tiny_checkpoint):
    """The fused q/k/v and gate/up layout (used on GPUs) computes the same logits."""
    from hotstart.model.loader import load_model

    model_dir = tiny_checkpoint("qwen2")
    cfg = load_model_config(model_dir)
    ids = list(range(5, 30))
    logits = []
    for fused in (True, False):
        core = float32_engine(model_dir)
        model = load_model(cfg, weight_files(model_dir), fused=fused)
        assert hasattr(model.model.layers[0].self_attn, "qkv_proj") == fused
        core.runner = ModelRunner(model, core.blocks.num_blocks, core.blocks.block_size, torch.device("cpu"),
                                  torch.float32)
        logits.append(prefill_logits(core, ids))
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0)


def test_default_model_answers_paris(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    core = float32_engine(default_model_dir)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    text = tok.decode(greedy(core, ids, 32, ignore_eos=False))
    assert "Paris" in text


def test_bf16_runs_close_to_float32(default_model_dir):
    """The checkpoint's own dtype also works (logits within bf16 tolerance of float32)."""
    cfg = load_model_config(default_model_dir)
    assert cfg.torch_dtype == "bfloat16"
    core32 = float32_engine(default_model_dir)
    core16 = EngineCore.build(EngineConfig(model_path=str(default_model_dir), device="cpu", dtype="bfloat16",
                                           max_model_len=1024,
                                           kv_cache_memory=64 << 20))
    ids = list(range(100, 140))
    a, b = prefill_logits(core32, ids), prefill_logits(core16, ids)
    assert a.argmax() == b.argmax()
    assert (a - b).abs().max() < 0.5
