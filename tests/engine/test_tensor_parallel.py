"""Tensor parallelism on CPU (gloo): two ranks give the logits and greedy tokens of one; each rank reads
only its part of the weights; a dead rank takes the group down and it is forked again; bad sizes are one
error line. The reference is the single-rank engine (itself checked against transformers in
test_model_reference.py), in float32."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from helpers.cli import assert_fails_with, hotstart
from helpers.server import Server
from helpers.tp_ranks import executor_for_case, prefill_and_decode, run_two_ranks

from hotstart.config import EngineConfig, load_model_config
from hotstart.engine import distributed
from hotstart.engine.core import EngineCore
from hotstart.engine.model_runner import StepInputs
from hotstart.messages import EngineRequest
from hotstart.model.cursor import LoadCursor
from hotstart.model.files import weight_files
from hotstart.model.loader import load_model
from hotstart.model.parallel import TensorParallel
from hotstart.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["qwen2-tp", "qwen3-tp", "llama-tp", "gemma2-tp", "gemma3-tp"]  # gemma: windows, soft-caps
LOGIT_ATOL = 1e-4
SERVE = ("--device", "cpu", "--dtype", "float32", "--compile", "off", "--max-num-seqs", "4")


def _servable(tiny_checkpoint, default_model_dir, family: str, tmp_path: Path | None = None) -> Path:
    """The tiny checkpoint with the default model's tokenizer beside it (prompts are token ids below the
    tiny vocabulary); a copy in TMP_PATH if given."""
    folder = tiny_checkpoint(family)
    if tmp_path is not None:
        folder = Path(shutil.copytree(folder, tmp_path / family))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (folder / name).exists():
            shutil.copy(default_model_dir / name, folder / name)
    return folder


def _prompt(vocab: int, n: int = 19, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model: Path) -> EngineCore:
    cfg = EngineConfig(model_path=str(model), weight_files=tuple(map(str, weight_files(model))), device="cpu",
                       dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    return EngineCore.build(cfg)


# ---- one forward: the group against one rank --------------------------------------------------------

def test_two_ranks_give_the_logits_of_one(tiny_checkpoint, tmp_path):
    cases = [{"name": f"{fam}{'-fused' if fused else ''}", "model": str(tiny_checkpoint(fam)), "fused": fused,
              "ids": _prompt(load_model_config(tiny_checkpoint(fam)).vocab_size)}
             for fam in FAMILIES for fused in (False, True)]
    got = run_two_ranks(cases, tmp_path, 180)
    for case in cases:
        want = prefill_and_decode(executor_for_case(case, None), case["ids"])
        for step, (ours, ref) in enumerate(zip(got[case["name"]], want)):
            assert ours.shape == ref.shape, (case["name"], step)
            assert torch.allclose(ours, ref, atol=LOGIT_ATOL, rtol=0), (
                case["name"],
                step,
                (ours - ref).abs().max(),
            )


# ---- rank-aware reads ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True])
def test_each_rank_holds_its_slice_and_column_slices_stay_views_of_the_file(tiny_checkpoint, fused):
    model_dir = tiny_checkpoint("llama-tp")
    cfg, files = load_model_config(model_dir), weight_files(model_dir)
    full = load_model(cfg, files, fused=False)
    attn, mlp = full.model.layers[1].self_attn, full.model.layers[1].mlp
    q, kv, inter = cfg.q_size // 2, cfg.kv_size // 2, cfg.intermediate_size // 2
    for rank in (0, 1):
        part = load_model(cfg, files, fused=fused, tp=TensorParallel(rank, 2))
        a, m = part.model.layers[1].self_attn, part.model.layers[1].mlp
        def rows(w: torch.Tensor, n: int, rank: int = rank) -> torch.Tensor:
            return w[rank * n:(rank + 1) * n]

        if fused:
            assert a.qkv_proj.sources == {"q_proj": (rank * q, q, 2 * q), "k_proj": (rank * kv, kv, 2 * kv),
                                          "v_proj": (rank * kv, kv, 2 * kv)}
            assert torch.equal(
                a.qkv_proj.weight,
                torch.cat(
                    [rows(attn.q_proj.weight, q), rows(attn.k_proj.weight, kv), rows(attn.v_proj.weight, kv)]
                ),
            )
            assert torch.equal(
                a.qkv_proj.bias,
                torch.cat(
                    [rows(attn.q_proj.bias, q), rows(attn.k_proj.bias, kv), rows(attn.v_proj.bias, kv)]
                ),
            )
            assert torch.equal(m.gate_up_proj.weight, torch.cat([rows(mlp.gate_proj.weight, inter),
                                                                rows(mlp.up_proj.weight, inter)]))
        else:
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w = getattr(a, name).weight
                assert torch.equal(w, rows(getattr(attn, name).weight, n))
                assert w.untyped_storage().nbytes() >= 2 * w.nbytes  # a view of the whole tensor's bytes
            assert torch.equal(m.up_proj.weight, rows(mlp.up_proj.weight, inter))
        o = a.o_proj.weight
        assert torch.equal(o, attn.o_proj.weight[:, rank * q:(rank + 1) * q]) and o.is_contiguous()
        assert o.untyped_storage().nbytes() == o.nbytes  # strided in the file: copied
        assert torch.equal(a.o_proj.bias, attn.o_proj.bias)  # whole: added once, after the all-reduce
        assert torch.equal(m.down_proj.weight, mlp.down_proj.weight[:, rank * inter:(rank + 1) * inter])
        half = cfg.vocab_size // 2
        assert torch.equal(part.model.embed_tokens.weight, rows(full.model.embed_tokens.weight, half))
        assert torch.equal(part.lm_head.weight, rows(full.lm_head.weight, half))
        assert (
            part.cfg.num_key_value_heads == cfg.num_key_value_heads // 2
        )  # the KV cache is split by KV heads


def test_the_load_cursor_is_the_slowest_rank():
    with LoadCursor.create(ranks=3) as cur:
        ranks = [LoadCursor.open(cur.path, r) for r in range(3)]
        assert cur.position() == -1
        ranks[0].advance(500)
        ranks[2].advance(300)
        assert cur.position() == -1  # rank 1 has not started
        ranks[1].advance(400)
        assert cur.position() == 300
        ranks[2].advance(900)
        assert cur.position() == 400
        with pytest.raises(ValueError, match="no slot for rank 3"):
            LoadCursor.open(cur.path, 3)
        for r in ranks:
            r.close()
    with LoadCursor.create() as one:  # one rank: as before
        one.advance(7)
        assert one.position() == 7


def test_a_step_round_trips_through_its_tensors():
    s = StepInputs([5, 6, 7, 8], [0, 9], [3, 1], [[1, 2], [3]], [True, False], [False, True])
    header, payload = distributed.encode_step(s)
    assert header[1] == len(payload) and distributed.decode_step(header + [0], payload) == s
    s.all_logits = None
    assert distributed.decode_step(*distributed.encode_step(s)) == s


def test_sizes_that_cannot_be_split_name_the_numbers(tiny_checkpoint, monkeypatch):
    cfg = load_model_config(tiny_checkpoint("qwen2"))  # 6 heads, 3 KV heads
    msg = distributed.topology_error(2, cfg, torch.device("cpu"))
    assert (
        "num_key_value_heads (3)" in msg and "must be divisible" in msg and "num_attention_heads" not in msg
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert distributed.topology_error(2, cfg, torch.device("cuda")) == \
        "--tensor-parallel-size 2: more ranks than the 1 visible CUDA devices"


# ---- the real server ----------------------------------------------------------------------------------

def _phases(s: Server) -> list[dict]:
    return httpx.get(s.url + "/startup", timeout=10).json()["phases"]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_serve_the_greedy_tokens_of_one(tiny_checkpoint, default_model_dir, family):
    from openai import OpenAI

    from hotstart.text.tokenizer import Tokenizer

    model = _servable(tiny_checkpoint, default_model_dir, family)
    ids = _prompt(load_model_config(model).vocab_size, 13, seed=2)
    core = _engine(model)
    core.add_request(EngineRequest("r", ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                            logprobs=0)))
    ref_ids, ref_lps = [], []
    while core.has_work():
        for o in core.step():
            ref_ids += o.new_token_ids
            ref_lps += [lp.logprob for lp in o.logprobs or []]
    s = Server(str(model), "-tp", "2", *SERVE, "--max-model-len", "256")
    try:
        client = OpenAI(base_url=s.url + "/v1", api_key="none")
        r = client.completions.create(model=model.name, prompt=ids, max_tokens=32, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
        choice = r.choices[0]
        tok = Tokenizer.from_dir(model)
        assert choice.logprobs.tokens == [tok.token_text(i) for i in ref_ids] and len(ref_ids) == 32
        assert (
            max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, ref_lps, strict=True)) < LOGIT_ATOL
        )
        names = [p["name"] for p in _phases(s)]
        assert (
            names.count("forkserver up (torch + engine imported)") == 1
        )  # torch imported once for the group
        assert "engine forked (rank 0)" in names and "engine forked (rank 1)" in names
        assert "tensor-parallel group joined" in names and "engine forked" not in names
    finally:
        s.stop()


def _rank_pids(s: Server) -> dict[int, int]:
    forks = {p["name"]: p["detail"] for p in _phases(s) if p["name"].startswith("engine forked (rank")}
    return {int(name[-2]): int(detail.split()[-1]) for name, detail in forks.items()}


def _forkserver(s: Server) -> psutil.Process:
    return next(p for p in psutil.Process(s.proc.pid).children() if "forkserver" in " ".join(p.cmdline()))


def test_a_killed_rank_fails_the_stream_and_the_group_is_forked_again(tiny_checkpoint, default_model_dir):
    model = _servable(tiny_checkpoint, default_model_dir, "qwen2-tp")
    s = Server(str(model), "-tp", "2", *SERVE, "--compile", "eager-only")  # each rank packs its own shards
    ask = {
        "model": model.name,
        "prompt": _prompt(512, 8),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    try:
        deadline = time.monotonic() + 30
        # the engine's first fast-path report can come a moment after the server answers
        while httpx.get(s.url + "/startup").json().get("fast_path", {}).get("packing") != "packed":
            assert time.monotonic() < deadline, httpx.get(s.url + "/startup").json().get("fast_path")
            time.sleep(0.05)
        fast = httpx.get(s.url + "/startup").json()["fast_path"]
        # off: --compile eager-only (the suite's servers), else tensor parallel
        assert fast["compile"] == "off" and fast["compile_detail"], fast
        before = httpx.post(s.url + "/v1/completions", json=ask, timeout=60).json()["choices"][0]["text"]
        pids = _rank_pids(s)
        assert sorted(pids) == [0, 1] and sorted(p.pid for p in _forkserver(s).children()) == sorted(
            pids.values()
        )
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={**ask, "max_tokens": 900, "stream": True}) as r:
            lines = r.iter_lines()
            assert "cmpl" in next(line for line in lines if line.startswith("data:"))
            os.kill(pids[1], signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
        assert any('"engine_dead"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
        saw_503 = False
        while time.monotonic() - killed < 60:
            code = httpx.get(s.url + "/health").status_code
            saw_503 |= code == 503
            if code == 200 and saw_503:
                break
            time.sleep(0.05)
        assert saw_503 and code == 200, s.output[-3000:]
        assert "engine rank 1 of 2 exited (code -9)" in s.output
        after = httpx.post(s.url + "/v1/completions", json=ask, timeout=60).json()["choices"][0]["text"]
        assert after == before
        fresh = [p.pid for p in _forkserver(s).children()]
        assert len(fresh) == 2 and not set(fresh) & set(pids.values())  # both ranks forked again
    finally:
        took = s.stop()
    assert took < 3.0, took  # SIGTERM: the server and every rank gone within 3 s
    assert "Traceback" not in s.output, s.output[-3000:]


def test_a_stopped_rank_fails_the_stream_and_the_group_is_killed_and_forked_again(tiny_checkpoint,
                                                                                  default_model_dir):
    """SIGSTOP rank 1 mid-stream: rank 0 waits in a collective, rank 1 beats no more; both ranks are
    SIGKILLed after the heartbeat timeout and the group is forked again."""
    model = _servable(tiny_checkpoint, default_model_dir, "qwen2-tp")
    s = Server(str(model), "-tp", "2", *SERVE, "--engine-heartbeat-timeout", "1.5")
    ask = {"model": model.name, "prompt": _prompt(512, 8), "max_tokens": 8, "temperature": 0,
           "ignore_eos": True}
    frozen = None
    try:
        pids = _rank_pids(s)
        frozen = psutil.Process(pids[1])
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={**ask, "max_tokens": 900, "stream": True}) as r:
            lines = r.iter_lines()
            assert "cmpl" in next(line for line in lines if line.startswith("data:"))
            frozen.suspend()
            t = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
            took = time.monotonic() - t
        assert any('"engine_dead"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
        assert took < 10, took
        while time.monotonic() - t < 30 and httpx.get(s.url + "/health").status_code != 200:
            time.sleep(0.05)
        answer = httpx.post(s.url + "/v1/completions", json=ask, timeout=60)
        assert answer.status_code == 200, s.output[-3000:]
        again = time.monotonic() - t
        assert f"engine rank 1 of 2 (pid {pids[1]}) sent no heartbeat for" in s.output
        fresh = [p.pid for p in _forkserver(s).children()]
        assert len(fresh) == 2 and not set(fresh) & set(pids.values())  # both ranks killed, forked again
        assert not psutil.pid_exists(pids[0]) and not psutil.pid_exists(pids[1])
        print(f"rank 1 stopped -> stream error {took:.2f} s, -> answered again {again:.2f} s")
    finally:
        if frozen is not None and frozen.is_running():
            frozen.resume()  # a stopped leftover would never exit
        s.stop()
    assert "Traceback" not in s.output, s.output[-3000:]


def test_sizes_that_cannot_work_are_one_error_line(tiny_checkpoint, default_model_dir, tmp_path):
    cores = len(os.sched_getaffinity(0))
    model = _servable(tiny_checkpoint, default_model_dir, "qwen2-tp")
    assert_fails_with(hotstart("serve", str(model), "--port", "0", "-tp", str(cores + 1), timeout=60),
                      f"--tensor-parallel-size {cores + 1}", f"more ranks than the {cores} CPU cores")
    odd = _servable(tiny_checkpoint, default_model_dir, "qwen2", tmp_path)  # 6 heads, 3 KV heads
    assert_fails_with(hotstart("serve", str(odd), "--port", "0", "-tp", "2", timeout=60),
                      "num_key_value_heads (3)", "divisible by it")
