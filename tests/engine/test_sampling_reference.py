"""Sampling features through EngineCore on tiny float32 random checkpoints, against transformers:
raw logprobs (generated and prompt) vs log_softmax of its logits, greedy outputs with penalties / biases /
min_tokens vs `generate` with the corresponding logits processors; n > 1 sharing the prompt's blocks
(copy-on-write), seeded choices, preemption, and prefix caching (hits counted, outputs unchanged)."""

from __future__ import annotations

import pytest
import torch

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.logits_transforms import min_p_filter
from hotstart.engine.sequence import Sequence
from hotstart.messages import EngineRequest
from hotstart.model.files import weight_files
from hotstart.sampling_params import SamplingParams

ATOL = 1e-3
FAMILIES = ["qwen2", "llama"]


def engine(model_dir, **kw) -> EngineCore:
    cfg = dict(device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_model_len=1024, max_num_seqs=16)
    cfg.update(kw)
    return EngineCore.build(EngineConfig(model_path=str(model_dir),
                                         weight_files=tuple(map(str, weight_files(model_dir))), **cfg))


def run(core: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], dict]:
    """Run REQS to the end: (request id, choice) -> {"ids", "logprobs", "prompt_logprobs", "reason"}."""
    for rid, (ids, params) in reqs.items():
        assert core.add_request(EngineRequest(rid, ids, params)) is None
    out: dict[tuple[str, int], dict] = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        for o in core.step():
            d = out.setdefault((o.request_id, o.index), {"ids": [], "logprobs": [], "prompt_logprobs": None})
            d["ids"] += o.new_token_ids
            d["logprobs"] += o.logprobs or []
            if o.prompt_logprobs is not None:
                d["prompt_logprobs"] = o.prompt_logprobs
            d["reason"] = o.finish_reason
    assert not core.requests and core.blocks.num_used == 0 and core.sampler.num_active == 0
    return out


def only(out: dict) -> list[int]:
    (d,) = out.values()
    return d["ids"]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family):
        if family not in cache:
            d = tiny_checkpoint(family)
            cache[family] = (
                d,
                engine(d),
                AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(),
            )
        return cache[family]

    return get


def prompt(n: int = 23, seed: int = 1, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(tokens=32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, **kw)


def hf_greedy(ref, ids, n, processors=(), eos=None):
    from transformers import LogitsProcessorList

    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            logits_processor=LogitsProcessorList(list(processors)),
        )
    return out[0, len(ids):].tolist()


def openai_penalties(prompt_len: int, presence: float, frequency: float):
    """OpenAI's presence / frequency penalties over generated tokens, as a transformers LogitsProcessor."""
    from transformers import LogitsProcessor

    class Penalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            gen = input_ids[:, prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
            return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

    return Penalties()


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_are_the_models_raw_logprobs(models, family):
    _d, core, ref = models(family)
    ids = prompt()
    out = run(
        core,
        {
            "a": (
                ids,
                SamplingParams(
                    max_tokens=8, temperature=0.7, seed=2, ignore_eos=True, logprobs=5, prompt_logprobs=3
                ),
            )
        },
    )
    (res,) = out.values()
    full = ids + res["ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([full])).logits[0].float(), dim=-1)  # [L, V]
    # generated token i was predicted at position len(ids) - 1 + i
    for i, (tok, lp) in enumerate(zip(res["ids"], res["logprobs"], strict=True)):
        row = logprobs[len(ids) - 1 + i]
        assert abs(lp.logprob - row[tok].item()) < ATOL
        top = torch.topk(row, 5)
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=ATOL)
        assert torch.allclose(row[lp.top_ids], top.values, atol=ATOL)
    plp = res["prompt_logprobs"]
    assert len(plp) == len(ids) - 1  # the first prompt token has none
    for j, lp in enumerate(plp, start=1):
        row = logprobs[j - 1]
        assert abs(lp.logprob - row[ids[j]].item()) < ATOL
        assert len(lp.top_ids) == 3 and torch.allclose(row[lp.top_ids], torch.topk(row, 3).values, atol=ATOL)


def test_prompt_logprobs_of_a_long_prompt_prefilled_in_chunks(models):
    """A long prompt is prefilled in bounded chunks; its prompt logprobs come out whole, once."""
    d, _, ref = models("qwen2")
    core = engine(d, max_num_batched_tokens=64)
    ids = prompt(300, seed=4)
    res = run(core, {"a": (ids, greedy(2, prompt_logprobs=0))})[("a", 0)]
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor([lp.logprob for lp in res["prompt_logprobs"]])
    assert res["prompt_logprobs"][0].top_ids == [] and torch.allclose(got, want, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_penalties_and_biases_match_transformers_greedy(models, family):
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    _d, core, ref = models(family)
    ids = prompt(17, seed=3)
    plain = hf_greedy(ref, ids, 32)
    cases = {
        "repetition": (dict(repetition_penalty=1.8), [RepetitionPenaltyLogitsProcessor(1.8)]),
        "repetition_below_1": (dict(repetition_penalty=0.7), [RepetitionPenaltyLogitsProcessor(0.7)]),
        "presence": (dict(presence_penalty=1.5), [openai_penalties(len(ids), 1.5, 0.0)]),
        "frequency": (dict(frequency_penalty=0.8), [openai_penalties(len(ids), 0.0, 0.8)]),
        "presence_and_frequency": (dict(presence_penalty=-0.5, frequency_penalty=1.2),
                                   [openai_penalties(len(ids), -0.5, 1.2)]),
        "logit_bias": (dict(logit_bias={plain[0]: -100.0, plain[3]: -4.0, 7: 6.5}),
                       [SequenceBiasLogitsProcessor([[[plain[0]], -100.0], [[plain[3]], -4.0], [[7], 6.5]])]),
    }
    reqs = {name: (ids, greedy(32, **kw)) for name, (kw, _) in cases.items()}
    together = run(core, reqs)  # all in one batch: each row gets only its own transforms
    for name, (_kw, procs) in cases.items():
        want = hf_greedy(ref, ids, 32, procs)
        assert want != plain, name  # the feature changes the output: the comparison means something
        assert together[(name, 0)]["ids"] == want, name
    assert only(run(core, {"alone": reqs["repetition"]})) == together[("repetition", 0)]["ids"]
    # min_tokens: the first greedy token is made the stop token; it cannot come before 5 tokens
    stop = plain[0]
    mine = run(
        core,
        {
            "m": (
                ids,
                SamplingParams(
                    max_tokens=32, temperature=0, stop_token_ids=[stop], min_tokens=5, ignore_eos=True
                ),
            )
        },
    )[("m", 0)]
    want = hf_greedy(ref, ids, 32, [MinNewTokensLengthLogitsProcessor(len(ids), 5, [stop])], eos=stop)
    assert len(mine["ids"]) >= 6 and mine["ids"] == want
    assert mine["reason"] == ("stop" if mine["ids"][-1] == stop else "length")
    unbounded = run(core, {"u": (ids, SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[stop]))})
    assert only(unbounded) == [stop]


def test_min_p_matches_transformers_warper():
    from transformers import MinPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    temps, min_ps = [0.5, 1.0, 1.7, 1.0], [0.1, 0.3, 0.05, 0.0]
    seqs = [Sequence(f"s{i}", [1], 1, SamplingParams(max_tokens=1, temperature=t, min_p=m))
            for i, (t, m) in enumerate(zip(temps, min_ps))]
    ours = min_p_filter(logits.clone(), seqs)
    for i, (t, m) in enumerate(zip(temps, min_ps)):
        want = MinPLogitsWarper(m)(None, logits[i:i + 1] / t)[0] if m else logits[i] / t
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(want)), i


def test_min_p_one_is_greedy(models):
    _d, core, ref = models("qwen2")
    ids = prompt(11, seed=8)
    sampled = run(
        core, {"a": (ids, SamplingParams(max_tokens=16, temperature=1.5, min_p=1.0, seed=1, ignore_eos=True))}
    )
    assert only(sampled) == hf_greedy(ref, ids, 16)


def test_n_choices_share_the_prompt_and_match_single_requests(models):
    """Choice i of a seeded n-choice request samples as a single request seeded seed + i would: so the
    shared prompt blocks (and the copied partly filled one) hold the right K/V for every choice."""
    d, _, _ = models("llama")
    core = engine(d, enable_prefix_caching=False)
    ids = prompt(21, seed=5)  # 21 tokens: one full block + a partly filled one, shared by the choices
    p = dict(max_tokens=24, temperature=1.0, top_k=20, ignore_eos=True)
    before = core.prompt_tokens_computed
    out = run(core, {"n": (ids, SamplingParams(n=4, seed=100, **p))})
    assert core.prompt_tokens_computed - before == len(ids)  # prefilled once, not 4 times
    singles = [only(run(core, {f"s{i}": (ids, SamplingParams(seed=100 + i, **p))})) for i in range(4)]
    assert [out[("n", i)]["ids"] for i in range(4)] == singles
    assert len({tuple(s) for s in singles}) == 4
    again = run(core, {"n2": (ids, SamplingParams(n=4, seed=100, **p))})
    assert [again[("n2", i)]["ids"] for i in range(4)] == singles  # reproducible


def test_n_choices_hold_one_copy_of_the_prompt(models):
    d, _, _ = models("qwen2")
    core = engine(d, enable_prefix_caching=False)
    ids = prompt(100, seed=6)  # 7 blocks of 16 (the last partly filled)
    assert core.add_request(EngineRequest("n", ids, greedy(8, n=5))) is None
    core.step()  # prefill + the first token of each choice
    assert len(core.requests["n"]) == 5 and core.blocks.num_used == 7
    core.step()  # each choice writes its own copy of the last block
    assert core.blocks.num_used == 7 + 4
    while core.has_work():
        core.step()
    assert core.blocks.num_used == 0


def test_preempted_choices_recompute_correctly(models):
    """A cache too small for all choices: some are preempted and recomputed; outputs are unchanged."""
    d, _, _ = models("qwen2")
    ids = prompt(40, seed=9)
    p = SamplingParams(n=3, max_tokens=60, temperature=0.8, seed=11, ignore_eos=True)
    roomy = run(engine(d), {"a": (ids, p)})
    block_bytes = 2 * 3 * 48 * 4 * 16  # layers x K/V x kv size x float32 x block size
    tight = engine(d, kv_cache_memory=12 * block_bytes, max_model_len=160, enable_prefix_caching=False)
    cramped = run(tight, {"a": (ids, p)})
    assert tight.scheduler.num_preemptions > 0
    assert [cramped[("a", i)]["ids"] for i in range(3)] == [roomy[("a", i)]["ids"] for i in range(3)]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_skips_the_shared_prefix_and_changes_nothing(models, family):
    d, _, ref = models(family)
    on, off = engine(d), engine(d, enable_prefix_caching=False)
    turn1 = prompt(70, seed=12)
    outputs = {}
    for name, core in (("on", on), ("off", off)):
        first = only(run(core, {"t1": (turn1, greedy(20))}))
        turn2 = turn1 + first + prompt(9, seed=13)  # the next turn: the whole conversation so far
        before = core.prompt_tokens_computed
        second = only(run(core, {"t2": (turn2, greedy(32))}))
        outputs[name] = (first, second, core.prompt_tokens_computed - before)
    assert outputs["on"][:2] == outputs["off"][:2]
    assert outputs["on"][1] == hf_greedy(ref, turn1 + outputs["on"][0] + prompt(9, seed=13), 32)
    turn2_len = 70 + 20 + 9
    # with the cache, turn 2 computes only what follows turn 1's full blocks (prompt + generated)
    cached = (70 + 20 - 1) // 16 * 16  # turn 1's last token was sampled, never computed
    assert outputs["off"][2] == turn2_len and outputs["on"][2] == turn2_len - cached
    stats = on.stats()
    assert stats.prefix_cache_hits == cached and stats.prefix_cache_queries == 70 + turn2_len
