"""A request that raises inside the engine fails alone (engine/step_guard.py): in the forward (--debug-fault
step), while added (--debug-fault add), in sampling (a failing transform: forks are undone) and in one
sequence's bookkeeping; the other requests of the step get the tokens they get alone, and nothing leaks."""

from __future__ import annotations

import pytest

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.messages import EngineRequest
from hotstart.sampling_params import SamplingParams

STEP, ADD = 7, 8  # token ids the engine fails on (--debug-fault)


@pytest.fixture(scope="module")
def core(tiny_checkpoint) -> EngineCore:
    return EngineCore.build(EngineConfig(
        model_path=str(tiny_checkpoint("llama")), device="cpu", dtype="float32", max_model_len=128,
        kv_cache_memory=8 << 20, compile="off", debug_fault=f"step@{STEP},add@{ADD}"))


def _prompts() -> dict[str, list[int]]:  # odd lengths; none holds 7 or 8
    return {f"ok{i}": [(11 + 5 * i + j) % 90 + 10 for j in range(3 + 4 * i)] for i in range(3)}


def _run(core: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    out: dict[str, list] = {rid: [[], None, None] for rid in reqs}
    for rid, (ids, params) in reqs.items():
        err = core.add_request(EngineRequest(rid, ids, params))
        if err is not None:
            out[rid][1:] = [err.finish_reason, err.error]
    for _ in range(1000):
        if not core.has_work():
            break
        for o in core.step():
            out[o.request_id][0] += o.new_token_ids
            if o.finish_reason:
                out[o.request_id][1:] = [o.finish_reason, o.error]
    assert not core.requests and core.blocks.num_used == 0 and not core.sampler.num_active  # nothing leaks
    return {rid: tuple(v) for rid, v in out.items()}


def _greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw})


def test_a_request_failing_in_the_forward_fails_alone(core):
    alone = {rid: _run(core, {rid: (ids, _greedy())})[rid] for rid, ids in _prompts().items()}
    mixed = {rid: (ids, _greedy()) for rid, ids in _prompts().items()}
    mixed["bad"] = ([12, STEP, 13, 14, 15], _greedy())
    mixed["bad2"] = ([12, 13, STEP], _greedy(3, n=2, seed=1, temperature=0.8, presence_penalty=1.0))
    got = _run(core, mixed)
    for rid in ("bad", "bad2"):
        _, reason, error = got[rid]
        assert reason == "error" and "in the forward" in error and f"--debug-fault step@{STEP}" in error
    for rid, (tokens, _, _) in alone.items():
        assert got[rid] == (tokens, "length", None) and len(tokens) == 6


def test_a_request_failing_while_added_leaves_nothing(core):
    got = _run(core, {"bad": ([ADD, 20, 21], _greedy(2, presence_penalty=0.5)),
                      "ok": (_prompts()["ok1"], _greedy())})
    assert got["bad"][1] == "error" and "while it was added" in got["bad"][2]
    assert got["ok"][1] == "length" and len(got["ok"][0]) == 6


def test_a_failure_in_sampling_undoes_the_forks_and_retries_the_others(core, monkeypatch):
    """A sampler transform raising on one row (a library error in a logits processor): that request's
    n = 3 choices, forked in the failed step, are dropped with it; the rest run one at a time."""
    biased = _greedy(logit_bias={5: 1.0})
    alone = {rid: _run(core, {rid: (ids, biased)})[rid] for rid, ids in _prompts().items()}

    def broken(logits, seqs):
        if any(s.params.n == 3 for s in seqs):
            raise ValueError("a logits processor broke")
        return logits

    monkeypatch.setattr(core.sampler, "transforms", [broken, *core.sampler.transforms])
    reqs = {rid: (ids, biased) for rid, ids in _prompts().items()}
    reqs["n3"] = ([30, 31, 32, 33], _greedy(n=3, logit_bias={5: 1.0}))
    got = _run(core, reqs)
    assert got["n3"][1] == "error" and "in the sampling" in got["n3"][2]
    assert "ValueError: a logits processor broke" in got["n3"][2]
    for rid, (tokens, _, _) in alone.items():
        assert got[rid][:2] == (tokens, "length")


def test_a_failure_in_one_sequences_bookkeeping_fails_only_it(core, monkeypatch):
    real = core._finish_reason

    def finish(seq, token):
        if seq.request_id == "bad" and seq.num_generated == 2:
            raise KeyError("bookkeeping")
        return real(seq, token)

    monkeypatch.setattr(core, "_finish_reason", finish)
    reqs = {rid: (ids, _greedy()) for rid, ids in _prompts().items()}
    reqs["bad"] = ([40, 41, 42], _greedy())
    got = _run(core, reqs)
    assert got["bad"][1] == "error" and "token bookkeeping" in got["bad"][2]
    assert all(got[rid][1] == "length" and len(got[rid][0]) == 6 for rid in _prompts())
