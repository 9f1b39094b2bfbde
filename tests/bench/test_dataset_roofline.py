"""The random prompts of `bench serve` (exact token counts from the real tokenizer, seeded, never repeated
across rounds) and the roofline's bytes per decode step of real checkpoints."""

from __future__ import annotations

import json
import struct

import pytest

from hotstart.bench import roofline
from hotstart.bench.dataset import RandomPrompts
from hotstart.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return RandomPrompts(Tokenizer.from_dir(default_model_dir), seed=3)


def test_prompts_have_exactly_the_tokens_asked(prompts):
    tok = prompts.tok
    for n in (1, 2, 17, 200, 1000):
        for p in prompts.batch(n, 4, ("round", 0, n)):
            assert p.tokens == n
            assert len(tok.encode(p.text, add_special_tokens=True)) == n  # what a server counts


def test_prompts_are_seeded_and_distinct(prompts, default_model_dir):
    a = prompts.batch(50, 3, ("round", 0))
    assert [p.text for p in a] == [p.text for p in prompts.batch(50, 3, ("round", 0))]
    assert len({p.text for p in a}) == 3  # no two requests of a run share a prompt
    b = prompts.batch(50, 3, ("round", 1))
    assert not {p.text[:40] for p in a} & {p.text[:40] for p in b}  # rounds share no prefix
    other = RandomPrompts(Tokenizer.from_dir(default_model_dir), seed=4).batch(50, 3, ("round", 0))
    assert [p.text for p in other] != [p.text for p in a]


def _tensor_bytes(folder) -> dict[str, int]:
    out = {}
    for f in folder.glob("*.safetensors"):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        for k, v in json.loads(raw[8:8 + n]).items():
            if k != "__metadata__":
                out[k] = v["data_offsets"][1] - v["data_offsets"][0]
    return out


def test_bytes_per_step_of_the_default_model(default_model_dir):
    mb = roofline.model_bytes(default_model_dir)
    # tied embeddings: the table is the LM head, read whole every step; every tensor counts
    assert mb.weights == sum(_tensor_bytes(default_model_dir).values())
    assert mb.dtype == "BF16"
    assert mb.kv_per_token == 2 * 30 * 3 * 64 * 2  # K and V x 30 layers x 3 KV heads x 64 dims x bf16
    assert roofline.model_bytes(default_model_dir, "float32").weights == 2 * mb.weights


def test_untied_embedding_table_is_not_read_whole(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")  # float32, separate lm_head
    sizes = _tensor_bytes(path)
    mb = roofline.model_bytes(path)
    assert mb.weights == sum(sizes.values()) - sizes["model.embed_tokens.weight"]
    assert mb.kv_per_token == 2 * 3 * 3 * 16 * 4


def test_a_mixture_of_experts_reads_the_experts_its_tokens_pick(tiny_checkpoint):
    path = tiny_checkpoint("qwen3-moe")  # 7 experts, 3 per token, in layers 1 and 3
    sizes = _tensor_bytes(path)
    mb = roofline.model_bytes(path)
    routed = sum(v for k, v in sizes.items() if ".mlp.experts." in k)
    assert mb.weights == sum(sizes.values()) - sizes["model.embed_tokens.weight"]
    assert (mb.experts, mb.num_experts, mb.top_k) == (routed, 7, 3)
    dense = mb.weights - routed
    assert mb.step_bytes(1) == pytest.approx(dense + routed * 3 / 7)  # one token: its 3 experts of 7
    assert mb.step_bytes(2) == pytest.approx(dense + routed * (1 - (4 / 7) ** 2))
    assert mb.step_bytes(64) == pytest.approx(mb.weights, rel=1e-6)  # a large batch touches them all
    assert mb.per_token(2, 10) == pytest.approx(mb.step_bytes(2) / 2 + mb.kv_per_token * 10)


def test_fraction():
    mb = roofline.ModelBytes(weights=1000, kv_per_token=10, dtype="BF16")
    # batch 4, 50 tokens attended: 1000 / 4 + 10 x 50 = 750 bytes per token; 2e6 tok/s x 750 B / 3 GB/s
    assert roofline.fraction(2e6, mb, 4, 50, 3.0) == pytest.approx(0.5)
    assert roofline.fraction(None, mb, 4, 50, 3.0) is None and roofline.fraction(1.0, mb, 1, 0, None) is None
