"""`hotstart bench serve` end to end: a real hotstart on the default model against a stdlib stand-in peer
(tests/helpers/fake_openai.py), a running server by --url, the peers of commands.env forced their way,
bad arguments. Bounded: ~30 s on 2 quiet cores."""

from __future__ import annotations

import json
import os
import sys

import pytest
from helpers import REPO
from helpers.fake_openai import bodies, fake_server_cmd, peers_env
from helpers.procs import run_session

from hotstart.bench.process import Server, free_port
from hotstart.text.tokenizer import Tokenizer

QUIET = ["--max-load", "100", "--noise-cores", "99", "--retries", "0", "--max-wait", "0", "--bandwidth", "10"]


def bench(args: list[str], env: dict, timeout: float = 240):
    return run_session([sys.executable, "-m", "hotstart", "bench", "serve", *args], timeout, env, cwd=REPO)


def test_hotstart_against_a_peer_interleaved(tmp_path, default_model_dir):
    # the user's prefix-cache folder is not the one the benchmarked server reads and writes: each start
    # gets an empty one (under TMPDIR), removed when it stops
    (tmp_path / "tmp").mkdir()
    env = {**peers_env(tmp_path, os.environ), "TMPDIR": str(tmp_path / "tmp"),
           "HOTSTART_KV_DIR": str(tmp_path / "user-kv")}
    out = tmp_path / "out"
    peer = fake_server_cmd(tmp_path, first=0.05, gap=0.02)
    res = bench([str(default_model_dir), "--hotstart", "=", "--peer", peer, "--peer-name", "fake",
                 "--input-len", "16,24", "--concurrency", "1,2", "--output-len", "4", "--num-prompts", "2",
                 "--rounds", "2", *QUIET, "--out", str(out)], env)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["baseline"] == "fake" and data["meta"]["bandwidth"]["bandwidth_gbs"] == 10
    assert len(data["runs"]) == 2 * 2 * 2 * 2  # targets x lengths x concurrencies x rounds
    # interleaved: within a round each level runs on both targets back to back, the first rotating
    firsts = [r["target"] for r in data["runs"][::2]]
    assert firsts[:4] == ["hotstart"] * 4 and firsts[4:] == ["fake"] * 4
    hot = [r for r in data["runs"] if r["target"] == "hotstart"]
    for r in hot:
        assert r["metrics"]["failed"] == 0
        for q in r["requests"]:  # the server counted exactly the prompt built and generated all 4
            assert q["prompt_tokens"] == r["input_len"] and q["output_tokens"] == 4 and q["error"] is None
        assert r["roofline_fraction"] > 0
    target = {t["label"]: t for t in data["meta"]["targets"]}
    # bf16 where the CPU computes it natively (avx512_bf16 / amx), else float32 (engine/placement.py)
    assert target["hotstart"]["weights"] in ("bfloat16 safetensors", "float32 safetensors")
    assert target["hotstart"]["fast_path"]
    assert target["hotstart"]["kv_dir"].startswith(str(tmp_path / "tmp"))
    assert not list((tmp_path / "tmp").iterdir()) and not (tmp_path / "user-kv").exists()
    assert target["hotstart"]["bytes_per_step"] > 2e8
    rows = {(r["target"], r["input_len"], r["concurrency"]): r for r in data["summary"]}
    assert len(rows) == 8 and all(r["rounds"] == 2 and r["completed"] == 4 for r in rows.values())
    fake = rows[("fake", 16, 1)]
    # the peer sleeps 50 ms before its first token and 20 ms between tokens: lower bounds, whatever the load
    assert fake["ttft_ms"]["median"] >= 50 and fake["tpot_ms"]["median"] >= 20
    assert fake["itl_ms"]["median"] >= 20
    levels = {(q["input_len"], q["concurrency"]) for q in data["ratios"]}
    assert levels == {(16, 1), (16, 2), (24, 1), (24, 2)}
    assert all(q["target"] == "hotstart" and q["output_throughput"] > 0 for q in data["ratios"])
    # the peer got the same workload: completions of random prompts, forced length, usage asked for
    sent = bodies(tmp_path)
    tok = Tokenizer.from_dir(default_model_dir)
    measured = [b for b in sent if b["max_tokens"] == 4]
    assert len(measured) == 2 * 2 * 2 * 2 + 2  # runs x prompts, and one warm-up per length
    assert all(b["ignore_eos"] and b["stream"] and b["stream_options"] == {"include_usage": True}
               and b["model"] == "fake-model" and "temperature" not in b for b in measured)
    assert {len(tok.encode(b["prompt"])) for b in measured} == {16, 24}
    assert len({b["prompt"] for b in measured}) == len(measured)  # no prompt repeated: no prefix-cache hits
    table = (out / "table.md").read_text()
    weights = target["hotstart"]["weights"]
    assert f"| 24 | 2 | hotstart | {weights} |" in table and "output tok/s / fake" in table


def test_url_target_sequential_and_peers_forced_their_way(tmp_path, default_model_dir):
    env = peers_env(tmp_path, os.environ)
    port = free_port()
    argv = fake_server_cmd(tmp_path).replace("{port}", str(port)).replace("{model}", "x").split()
    running = Server.launch(argv, port, env, tag="fake")
    try:
        running.wait_healthy(running.t_launch + 30)
        out = tmp_path / "out"
        res = bench([str(default_model_dir), "--url", running.url, "--url-name", "mine",
                     "--peers", "vllm,llamacpp", "--baseline", "mine", "--schedule", "sequential",
                     "--endpoint", "/v1/chat/completions", "--input-len", "8", "--concurrency", "2",
                     "--output-len", "3", "--num-prompts", "2", "--rounds", "1", "--temperature", "0",
                     "--extra-body", '{"top_k": 5}', *QUIET, "--out", str(out)], env)
        assert running.proc.poll() is None  # a --url server is never stopped
    finally:
        running.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert [t["label"] for t in data["meta"]["targets"]] == ["mine", "vLLM", "llama.cpp"]
    assert [r["target"] for r in data["runs"]] == ["mine", "vLLM", "llama.cpp"]  # sequential: one at a time
    assert {q["target"] for q in data["ratios"]} == {"vLLM", "llama.cpp"}
    chats = [b for b in bodies(tmp_path) if b["max_completion_tokens"] == 3]
    assert all(b["temperature"] == 0 and b["top_k"] == 5 and len(b["messages"]) == 1 for b in chats)
    vllm = [b for b in chats if b.get("min_tokens") == 3 and b.get("ignore_eos")]
    llama = [b for b in chats if "logit_bias" in b]
    assert len(vllm) == 3 and len(llama) == 3  # 2 measured + 1 warm-up each
    assert all("stream_options" not in b and "ignore_eos" not in b and b["min_tokens"] == 3 for b in llama)
    assert set(llama[0]["logit_bias"]) == {"0", "2"}  # SmolLM2's end tokens
    llama_target = data["meta"]["targets"][2]
    assert llama_target["weights"] == "GGUF" and llama_target["bytes_per_step"] is None


@pytest.mark.parametrize(("args", "message"), [
    (["--input-len", "0"], "--input-len '0': give integers >= 1"),
    (["--concurrency", "a"], "must be comma-separated integers"),
    (["--baseline", "nope"], "--baseline 'nope': no such target"),
    (["--extra-body", "{"], "--extra-body: not JSON"),
    (["--url", "ftp://x"], "must start with http://"),
    (["--hotstart", "no-equals"], "must be LABEL=FLAGS"),
    (["--peer", "python -m http.server"], "must contain {port}"),
    (["--url", "http://127.0.0.1:9"], "GET /v1/models did not answer"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
    res = bench([*args, "--no-roofline", "--max-wait", "0", "--out", str(tmp_path / "o")], os.environ, 60)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and message in last and last.startswith("hotstart: error:"), res.stderr
    assert "Traceback" not in res.stderr


def test_hotstart_targets_say_what_they_serve(tmp_path, tiny_checkpoint):
    """The table's "serves" column: the default model's Q4_1 GGUF, a folder holding one GGUF, a GGUF file by
    its quantization (from its name), a safetensors folder by the dtype served."""
    from hotstart.bench.servers import weights_label

    assert weights_label(None, "auto") == "Q4_1 GGUF"
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "model.Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(20))
    assert weights_label(str(tmp_path / "g"), "auto") == "Q4_K_M GGUF"
    (tmp_path / "plain.gguf").write_bytes(b"GGUF" + bytes(20))
    assert weights_label(str(tmp_path / "plain.gguf"), "auto") == "GGUF"
    assert weights_label(str(tiny_checkpoint("qwen2")), "bfloat16") == "bfloat16 safetensors"
