"""The engine core with the real default model: batching, sampling, limits, aborts."""

from __future__ import annotations

import pytest

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.messages import EngineRequest
from hotstart.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def core(default_model_dir) -> EngineCore:
    return EngineCore.build(
        EngineConfig(
            model_path=str(default_model_dir),
            device="cpu",
            dtype="float32",
            max_model_len=512,
            kv_cache_memory=256 << 20,
            max_num_seqs=16,
        )
    )


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


def run(
    core: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, tuple[list[int], str]]:
    for rid, (ids, params) in reqs.items():
        assert core.add_request(EngineRequest(rid, ids, params)) is None
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    reasons: dict[str, str] = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        for o in core.step():
            out[o.request_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    return {rid: (out[rid], reasons[rid]) for rid in reqs}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def test_output_does_not_depend_on_batch(core, tok):
    prompts = ["What is the capital of France?", "Name three colours.", "Count to five.",
               "Why is the sky blue?", "Say hello in Spanish."]
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    alone = [run(core, {"x": (i, greedy(24))})["x"] for i in ids]
    together = run(core, {f"r{k}": (i, greedy(24)) for k, i in enumerate(ids)})
    for k, a in enumerate(alone):
        assert together[f"r{k}"] == a
    assert core.blocks.num_used == 0  # every block came back


def test_finish_reasons_and_stop_token_ids(core, tok):
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    tokens, reason = run(core, {"a": (ids, greedy(64))})["a"]
    assert reason == "stop" and tokens[-1] in core.model_cfg.eos_token_ids
    assert "Paris" in tok.decode(tokens)
    short, reason = run(core, {"b": (ids, greedy(3))})["b"]
    assert reason == "length" and short == tokens[:3]
    stop_at = tokens[2]
    cut, reason = run(
        core, {"c": (ids, SamplingParams(max_tokens=64, temperature=0, stop_token_ids=[stop_at]))}
    )["c"]
    assert reason == "stop" and cut == tokens[:3]
    more, reason = run(
        core, {"d": (ids, SamplingParams(max_tokens=len(tokens) + 5, temperature=0, ignore_eos=True))}
    )["d"]
    assert reason == "length" and len(more) == len(tokens) + 5


def test_seeded_sampling_is_reproducible(core, tok):
    ids = tok.encode("Once upon a time")
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = run(core, {"a": (ids, p)})["a"][0]
    b = run(core, {"b": (ids, p), "other": (tok.encode("Hello"), greedy(8))})["b"][0]
    c = run(core, {"c": (ids, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99))})[
        "c"
    ][0]
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(core, tok):
    ids = tok.encode("The quick brown fox")
    g = run(core, {"g": (ids, greedy(12))})["g"][0]
    k1 = run(core, {"k": (ids, SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3))})["k"][0]
    assert g == k1


def test_rejects_what_cannot_run(core):
    too_long = core.add_request(EngineRequest("long", [1] * 500, greedy(100)))
    assert too_long.finish_reason == "error" and "maximum context length is 512" in too_long.error
    empty = core.add_request(EngineRequest("empty", [], greedy(4)))
    assert empty.finish_reason == "error" and "empty" in empty.error
    bad = core.add_request(EngineRequest("bad", [10**9], greedy(4)))
    assert bad.finish_reason == "error" and "token ids" in bad.error
    assert not core.has_work()


def test_abort_frees_blocks(core, tok):
    ids = tok.encode("Tell me a long story about dragons.")
    core.add_request(EngineRequest("a", ids, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)))
    core.step()
    core.step()
    assert core.blocks.num_used > 0
    outs = core.abort(["a"])
    assert outs[0].finish_reason == "abort"
    assert core.blocks.num_used == 0 and not core.has_work()
    assert core.abort(["unknown"]) == []
