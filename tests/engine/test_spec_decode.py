"""Prompt-lookup speculative decoding (--speculative-config, engine/spec_decode.py) in EngineCore, in
float32 on a random-weight Qwen2-shaped checkpoint (small weights: its greedy text runs in loops, so drafts
land; the grammar test's has the real tokenizer) and on the real default model copying a text: greedy
output identical to the plain engine's (the same core with its speculator off), beside non-drafting
sequences, with prefix caching, penalties, logprobs, stop tokens / max_tokens inside drafts and grammars;
sampled output has the target distribution; bad configs are one-line errors."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager

import pytest
from helpers.families import tiny_checkpoints

from hotstart.bench.prometheus import samples
from hotstart.cli import main as hotstart_main
from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.spec_decode import MAX_BACKOFF, NgramSpeculator, SpecState, propose
from hotstart.messages import EngineRequest
from hotstart.model.files import weight_files
from hotstart.sampling_params import SamplingParams
from hotstart.spec_config import SpecConfig, speculative_config

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen2 test checkpoint (512 ids) written by transformers, with initializer_range 0.02."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = tiny_checkpoints()["qwen2"]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**kwargs, "initializer_range": 0.02})
    out = tmp_path_factory.mktemp("spec-qwen2")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def build(model_dir, **kw) -> EngineCore:
    cfg = dict(
        device="cpu",
        dtype="float32",
        kv_cache_memory=32 << 20,
        max_model_len=512,
        max_num_seqs=64,
        speculative_config=speculative_config(SPEC),
    )
    cfg.update(kw)
    return EngineCore.build(
        EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))), **cfg)
    )


@pytest.fixture(scope="module")
def core(model_dir):
    return build(model_dir)


@contextmanager
def plain(core):
    """CORE without its speculator: the plain engine."""
    spec, core.spec = core.spec, None
    try:
        yield core
    finally:
        core.spec = spec


def run(core, reqs, max_steps=5000):
    """{request id (choice index appended past 0): (tokens, finish reason, logprobs)}; every block and
    sampler row came back."""
    for rid, (ids, params) in reqs.items():
        assert core.add_request(EngineRequest(rid, ids, params)) is None
    out = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for o in core.step():
            key = o.request_id + (f"/{o.index}" if o.index else "")
            tokens, _, lps = out.get(key, ([], None, []))
            tokens += o.new_token_ids
            lps += o.logprobs or []
            out[key] = (tokens, o.finish_reason, lps)
    assert not core.has_work() and core.blocks.num_used == 0 and core.sampler.num_active == 0
    return out


def accepted(core) -> int:
    return core.spec.num_accepted_tokens


def both(core, reqs):
    """(plain outputs, speculative outputs, draft tokens accepted by the speculative run)."""
    with plain(core):
        ref = run(core, reqs)
    before = accepted(core)
    got = run(core, reqs)
    return ref, got, accepted(core) - before


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def loop_prompt(core):
    """A prompt of the model's own greedy text: it goes on in loops the drafts find."""
    with plain(core):
        ((tokens, _, _),) = run(core, {"seed": ([11, 22, 33, 44], greedy(24))}).values()
    return [11, 22, 33, 44] + tokens


# --- proposing ---------------------------------------------------------------------------------------
def ctx(*ids):
    return SpecState().context + bytes().join(i.to_bytes(4, "little", signed=True) for i in ids)


def test_propose_longest_ngram_latest_with_k_followers():
    # suffix 1 2 3: the 3-gram occurs at 0 (followed by 9 8) and at 5 (followed by 7 7 7 ...)
    assert propose(ctx(1, 2, 3, 9, 8, 1, 2, 3, 7, 7, 7, 7, 5, 1, 2, 3), 4, 3, 1) == [7, 7, 7, 7]
    assert propose(ctx(1, 2, 3, 9, 8, 1, 2, 3, 7, 7, 7, 7, 5, 1, 2, 3), 2, 3, 1) == [7, 7]
    # a run of one token: the latest occurrence with K followers
    assert propose(ctx(4, 5, 5, 5, 5, 5, 5), 3, 2, 1) == [5, 5, 5]
    assert propose(ctx(1, 2, 3, 4), 3, 2, 1) == []  # nothing repeats
    assert propose(ctx(7, 1, 2, 3, 2), 3, 3, 2) == []  # only a 1-gram repeats, min is 2
    assert propose(ctx(7, 1, 2, 3, 2), 3, 3, 1) == [3, 2]  # the follower runs to the end
    # a byte pattern across token boundaries is no match: 0x01000000 0x00000002 vs 0x00000200 ...
    assert propose(ctx(0x01000000, 2, 9, 0x200, 1), 2, 1, 1) == []


def test_draft_length_follows_acceptance():
    """After a tokens of k accepted (a < k) the next draft has at most a + 1; a fully accepted draft
    doubles the limit up to K; nothing accepted also pauses (back-off)."""
    from hotstart.engine.sequence import Sequence

    spec = NgramSpeculator(SpecConfig("ngram", 6, 3, 1), max_model_len=4096)
    tokens = list(range(3)) * 20
    seq = Sequence("r", tokens, len(tokens), SamplingParams(max_tokens=500, temperature=0))
    seq.num_computed_tokens = seq.num_tokens - 1  # decoding
    seq.spec = SpecState()
    limits = []
    for drafted, accepted in ((6, 2), (3, 3), (6, 6), (6, 0), (1, 1), (2, 2), (4, 1)):
        spec.record(seq, drafted, accepted)
        limits.append(seq.spec.limit)
    assert limits == [3, 6, 6, 1, 2, 4, 2]
    seq.spec.pause = 0
    spec.draft([seq])
    assert seq.draft == [0, 1]  # the repeating text offers 6 tokens, the limit allows 2
    assert spec.stats()["spec_decode_num_draft_tokens"] == 6 + 3 + 6 + 6 + 1 + 2 + 4


def test_spec_config_parse_and_errors():
    c = SpecConfig.parse(SPEC)
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (4, 3, 1)
    assert SpecConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    ) == SpecConfig("ngram", 2, 3, 3)  # vLLM: the missing bound equals the other
    assert SpecConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_min == 5
    ngram = '{"method": "ngram", "num_speculative_tokens": 2, '
    bad = {
        "{bad": "not valid JSON",
        "[1]": "JSON object",
        '{"method": "eagle", "num_speculative_tokens": 2}': "method must be",
        '{"method": "ngram"}': "num_speculative_tokens is required",
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens must be",
        '{"method": "ngram", "num_speculative_tokens": 2.5}': "num_speculative_tokens must be",
        ngram + '"prompt_lookup_min": 4, "prompt_lookup_max": 2}': "must not exceed",
        ngram + '"prompt_lookup_max": 65}': "prompt_lookup_max must be an integer from 1 to 64",
        ngram + '"model": "x"}': "unknown key(s) 'model'",
    }
    for text, needle in bad.items():
        with pytest.raises(argparse.ArgumentTypeError, match=None) as e:
            speculative_config(text)
        assert needle in str(e.value), (text, str(e.value))


def test_cli_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        hotstart_main(["serve", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hotstart: error: argument --speculative-config: method must")


def test_engine_without_the_option_imports_nothing_of_it(model_dir):
    code = (
        "import sys\n"
        "from hotstart.config import EngineConfig\n"
        "from hotstart.engine.core import EngineCore\n"
        "from hotstart.messages import EngineRequest\nfrom hotstart.sampling_params import SamplingParams\n"
        f"cfg = EngineConfig({str(model_dir)!r}, device='cpu', max_model_len=256, kv_cache_memory=8 << 20)\n"
        "core = EngineCore.build(cfg)\n"
        "core.add_request(EngineRequest('r', [5, 6, 7, 5, 6, 7], SamplingParams(max_tokens=4)))\n"
        "while core.has_work(): core.step()\n"
        "assert core.spec is None\n"
        "print(sorted(m for m in sys.modules if m.startswith(('hotstart.engine.spec', 'hotstart.spec'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['hotstart.spec_config']"  # the flag's parser only (stdlib)


# --- greedy: identical output --------------------------------------------------------------------------
def test_greedy_identical_in_a_mixed_batch(core, loop_prompt):
    long_prompt = [(7 * i) % 400 + 50 for i in range(300)]  # prefilled in chunks while the others draft
    reqs = {
        "loop": (loop_prompt, greedy(40)),
        "loop-short": (loop_prompt[:10], greedy(33)),
        "other": ([5, 6, 7, 8, 9], greedy(30)),
        "one": (loop_prompt, greedy(1)),  # never drafts
        "long": (long_prompt, greedy(20)),
        "n2": (loop_prompt[3:], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, n=2)),
        # seeded sampling draws once per token from its own generator, drafts or not: the same tokens
        "seeded": (loop_prompt, SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True)),
    }
    steps = []
    execute = core.executor.execute

    def spy(batch, want, all_logits):  # which entries drafted in each step
        steps.append([bool(seq.draft) for seq, _ in batch])
        return execute(batch, want, all_logits)

    core.executor.execute = spy
    try:
        old_budget = core.scheduler.max_num_batched_tokens
        core.scheduler.max_num_batched_tokens = 64
        ref, got, n_accepted = both(core, reqs)
    finally:
        core.executor.execute = execute
        core.scheduler.max_num_batched_tokens = old_budget
    assert set(got) == set(ref) == {*reqs, "n2/1"}
    for rid in ref:
        assert got[rid][:2] == ref[rid][:2], rid
    assert n_accepted > 20
    assert any(any(s) and not all(s) for s in steps)  # drafting beside non-drafting entries


def test_greedy_identical_with_prefix_cache_hits(core, loop_prompt):
    reqs = {"a": (loop_prompt * 3, greedy(30))}
    ref, got, n_accepted = both(core, reqs)
    hits = core.blocks.cache_hits
    again = run(core, reqs)  # its prompt blocks are cached now, and the blocks its drafts filled
    assert core.blocks.cache_hits > hits
    assert got["a"][0] == ref["a"][0] == again["a"][0] and n_accepted > 0


def test_greedy_identical_with_penalties_and_logprobs(core, loop_prompt):
    reqs = {
        "rep": (loop_prompt, greedy(30, repetition_penalty=1.05)),
        "pres": (loop_prompt, greedy(30, presence_penalty=0.05, frequency_penalty=0.02)),
        "lp": (loop_prompt, greedy(30, logprobs=3)),
        "min": (loop_prompt, SamplingParams(max_tokens=30, temperature=0, min_tokens=20)),
    }
    ref, got, n_accepted = both(core, reqs)
    for rid in reqs:
        assert got[rid][:2] == ref[rid][:2], rid
    assert n_accepted > 0
    (tokens, _, lps), (_, _, ref_lps) = got["lp"], ref["lp"]
    assert len(lps) == len(tokens) == 30
    for a, b in zip(lps, ref_lps, strict=True):
        assert a.top_ids == b.top_ids and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
    # penalties only ever see verified tokens: with a strong one the loops break, drafts stop landing
    strong = {"r": (loop_prompt, greedy(30, repetition_penalty=2.0, frequency_penalty=1.0))}
    ref, got, _ = both(core, strong)
    assert got == ref


def test_max_tokens_and_stop_tokens_inside_drafts(core, loop_prompt):
    with plain(core):
        ((full, _, _),) = run(core, {"f": (loop_prompt, greedy(40))}).values()
    # a stop token first generated late, where the speculative run verifies drafts
    at = max(i for i, t in enumerate(full) if t not in full[:i])
    assert at >= 8
    before = accepted(core)
    out = run(
        core,
        {
            **{f"len{n}": (loop_prompt, greedy(n)) for n in (2, 3, 7, 13)},
            "stop": (loop_prompt, greedy(40, stop_token_ids=[full[at]])),
        },
    )
    assert accepted(core) > before
    for n in (2, 3, 7, 13):
        assert out[f"len{n}"][:2] == (full[:n], "length")
    assert out["stop"][:2] == (full[: at + 1], "stop")


def test_greedy_identical_under_preemption(model_dir, loop_prompt):
    """A KV cache too small for the batch: sequences with drafts are preempted and recomputed."""
    per_block = 2 * 3 * 48 * 4 * 16  # k/v x layers x KV heads x head_dim x float32 x block_size
    core = build(model_dir, max_num_seqs=8, max_model_len=128, kv_cache_memory=20 * per_block)
    assert core.blocks.num_blocks == 20
    reqs = {f"r{i}": (loop_prompt[i:], greedy(40)) for i in range(6)}  # 5 blocks each at the end
    with plain(core):
        ref = run(core, reqs)
    preempted = core.scheduler.num_preemptions
    assert run(core, reqs) == ref and accepted(core) > 0
    assert core.scheduler.num_preemptions > preempted


def test_greedy_identical_on_the_packed_fast_path(model_dir, loop_prompt):
    """The fast path's prepacked weights take the 1 + k token verify steps as any step of that size."""
    import time

    import torch

    from hotstart.engine.fastpath import FastPath
    from hotstart.model import onednn

    if not onednn.available(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN packing in this torch build")
    core = build(model_dir, max_num_seqs=8, kv_cache_memory=8 << 20)
    reqs = {"a": (loop_prompt, greedy(30)), "b": (loop_prompt[5:], greedy(25))}
    with plain(core):
        ref = run(core, reqs)  # eager, plain
    fast = FastPath(core, "eager-only", (8,), lambda m: None)
    deadline = time.monotonic() + 300
    while fast.busy() and time.monotonic() < deadline:
        fast.tick(idle=True)
        time.sleep(0.02)
    assert fast.status().packing.value == "packed", fast.status()
    assert run(core, reqs) == ref and accepted(core) > 0


def test_back_off_stops_drafting_for_unrepetitive_text(model_dir):
    from hotstart.engine.spec_decode import NgramSpeculator

    sp = NgramSpeculator(SpecConfig.parse(SPEC), 512)

    class Seq:  # the fields the speculator reads
        def __init__(self):
            self.spec, self.draft = SpecState(), []

    seq = Seq()
    pauses = []
    for _ in range(10):
        sp.record(seq, 4, 0)
        pauses.append(seq.spec.pause)
    assert pauses[:4] == [1, 2, 4, 8] and pauses[-1] == MAX_BACKOFF
    sp.record(seq, 4, 1)
    assert seq.spec.backoff == 0
    assert (sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens) == (11, 44, 1)


def test_stats_carry_vllm_counters(core, loop_prompt):
    run(core, {"s": (loop_prompt, greedy(20))})
    st = core.stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_draft_tokens >= st.spec_decode_num_drafts
    assert 0 < st.spec_decode_num_accepted_tokens <= st.spec_decode_num_draft_tokens


# --- sampling: the same distribution -------------------------------------------------------------------
def test_sampled_tokens_follow_the_target_distribution(core, loop_prompt):
    """Pairs (t1, t2) at temperature 1, top_k 3: t2 is verified against a draft in the speculative run.
    Their frequencies over 400 requests against the exact probabilities (from the raw logprobs): a
    chi-square test; the plain engine's sampling passes the same test."""
    k, n = 3, 400
    prompt = loop_prompt[:16]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=k, ignore_eos=True)

    def top(ids):  # the renormalised top-k distribution after IDS
        with plain(core):
            ((_, _, (lp,)),) = run(core, {"p": (ids, greedy(1, logprobs=k))}).values()
        z = sum(math.exp(v) for v in lp.top_logprobs)
        return {t: math.exp(v) / z for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}

    exact = {(a, b): pa * pb for a, pa in top(prompt).items() for b, pb in top(prompt + [a]).items()}

    def chi2(out):
        seen = Counter(tuple(tokens[:2]) for tokens, _, _ in out.values())
        assert set(seen) <= set(exact)
        return sum((seen[c] - n * p) ** 2 / (n * p) for c, p in exact.items())

    reqs = {f"r{i}": (prompt, params) for i in range(n)}
    with plain(core):
        ref = chi2(run(core, reqs))
    before = accepted(core)
    got = chi2(run(core, reqs))
    assert accepted(core) - before > 30  # drafts were verified and accepted at t2
    limit = 27.9  # chi-square, 8 degrees of freedom, p = 0.0005
    assert ref < limit and got < limit, (ref, got)


# --- grammars --------------------------------------------------------------------------------------------
def test_grammar_masks_drafted_positions(tmp_path, default_model_dir):
    """Drafts a grammar forbids are never accepted: every answer validates, identical to the plain
    engine's (greedy, and seeded sampling), and the grammar never consumed a rejected draft. On
    `hotstart make-model --size tiny` (run in this process): the default tokenizer, random weights."""
    from hotstart.frontend.structured import compile_grammar
    from hotstart.text.tokenizer import Tokenizer

    model_dir = tmp_path / "qwen2-tiny"
    make = "make-model --family qwen2 --size tiny --dtype float32 --out".split()
    assert hotstart_main([*make, str(model_dir)]) == 0
    core = build(model_dir, max_num_seqs=8)
    with plain(core):
        ((loop, _, _),) = run(core, {"seed": ([11, 22, 33, 44], greedy(24))}).values()
    loop_prompt = [11, 22, 33, 44] + loop
    tok = Tokenizer.from_dir(model_dir)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"enum": ["aa", "ab"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "x-guidance": {"whitespace_pattern": "[ ]{0,1}"},
    }
    grammar = compile_grammar("json", schema, "response_format")
    prompt = loop_prompt + tok.encode(' {"name": "aaaa", "tags": ["aa", "aa", "aa"]}')
    reqs = {
        "g": (prompt, SamplingParams(max_tokens=120, temperature=0, grammar=grammar)),
        **{
            f"s{i}": (prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=i, grammar=grammar))
            for i in range(3)
        },
        "free": (loop_prompt, greedy(30)),
    }
    ref, got, n_accepted = both(core, reqs)
    assert got == ref
    assert n_accepted > 0
    for rid in reqs:
        if rid != "free":
            assert got[rid][1] == "stop", got[rid]
            assert set(json.loads(tok.decode(got[rid][0]))) == {"name", "tags"}


# --- the real model copying a text ----------------------------------------------------------------------
def test_real_model_copies_with_accepted_drafts(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    text = (
        "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump!"
    )
    ids = tok.encode_chat([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}])
    core = build(default_model_dir, max_num_seqs=2, max_model_len=256)
    ref, got, n_accepted = both(core, {"copy": (ids, greedy(16))})
    assert got == ref
    assert "quick brown fox" in tok.decode(got["copy"][0])
    assert n_accepted >= 8  # most of the copy came from accepted drafts


def test_metrics_export_vllm_spec_decode_counters():
    from hotstart.frontend.metrics import Metrics
    from hotstart.messages import EngineStats

    m = Metrics("m")
    m.update_engine(EngineStats(), True)
    assert b"spec_decode" not in m.render()  # no series without drafts (without the option)
    for drafts, tokens, ok in ((3, 12, 5), (10, 40, 30)):
        m.update_engine(
            EngineStats(
                spec_decode_num_drafts=drafts,
                spec_decode_num_draft_tokens=tokens,
                spec_decode_num_accepted_tokens=ok,
            ),
            True,
        )
    text = m.render().decode()
    for line in (
        'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0',
    ):
        assert line in text


def test_llm_api_checks_the_config_as_vllm_spells_it():
    from hotstart.llm import LLM

    with pytest.raises(ValueError, match="speculative_config: method must be"):
        LLM("unused", speculative_config={"method": "eagle", "num_speculative_tokens": 2})


# --- served: the flag through the CLI, the engine process and /metrics ---------------------------------
def test_served_with_the_flag_same_text_and_acceptance_in_metrics(
    model_dir, default_model_dir, tmp_path, core, loop_prompt
):
    import shutil

    import httpx
    from helpers.server import Server

    folder = tmp_path / "served"
    shutil.copytree(model_dir, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    with plain(core):
        ((expected, _, _),) = run(core, {"x": (loop_prompt, greedy(40))}).values()
    srv = Server(
        str(folder),
        "--served-model-name",
        "m",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--dtype",
        "float32",
        "--speculative-config",
        SPEC,
        env={"HOTSTART_HOME": str(tmp_path)},
    )
    try:
        r = httpx.post(
            srv.url + "/v1/completions",
            timeout=120,
            json={
                "model": "m",
                "prompt": loop_prompt,
                "max_tokens": 40,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 40
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 40
        text = r.json()["choices"][0]["text"]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    values = {name: v for name, _, v in samples(metrics) if name.startswith("vllm:spec_decode_")}
    assert (
        0
        < values["vllm:spec_decode_num_accepted_tokens_total"]
        <= values["vllm:spec_decode_num_draft_tokens_total"]
    )
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    from hotstart.text.tokenizer import Tokenizer

    assert text == Tokenizer.from_dir(folder).decode(expected)  # the plain engine's greedy text
