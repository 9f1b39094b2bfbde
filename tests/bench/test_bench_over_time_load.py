"""`hotstart bench over-time` against a stand-in peer that listens late (the clients must retry), and
`hotstart bench load`: 16 streaming clients for ~10 s against a spawned default-model server, some hanging
up mid-stream; no errors, and the server ends idle (no KV blocks, no queued requests) with no file
descriptors leaked. About 30-40 s on 2 quiet cores."""

from __future__ import annotations

import json
import os
import sys

from helpers import REPO
from helpers.fake_openai import peers_env
from helpers.procs import run_session


def hotstart_bench(verb: str, args: list[str], env: dict, timeout: float):
    return run_session([sys.executable, "-m", "hotstart", "bench", verb, *args], timeout, env,
                       merge_stderr=True, cwd=REPO)


def test_over_time_retries_until_the_server_answers(tmp_path, default_model_dir):
    out = tmp_path / "ot"
    args = ["--model", str(default_model_dir), "--servers", "llamacpp", "--streams", "3", "--duration", "4",
            "--window", "1", "--max-tokens", "5", "--max-load", "100", "--out", str(out)]
    res = hotstart_bench("over-time", args, peers_env(tmp_path, os.environ, delay=1.5), 90)
    assert res.returncode == 0, res.stdout[-3000:]
    r = json.loads((out / "over_time.json").read_text())["results"]["llamacpp"]
    assert r["first_answer_s"] >= 1.5 and r["health_path"] == "/v1/models" and r["health_s"] >= 1.5
    assert [w["t0"] for w in r["windows"]] == [0, 1, 2, 3]
    assert r["windows"][0]["tps"] == 0 and r["windows"][3]["tps"] > 0
    assert r["requests_answered"] >= 3 and r["stop"]["leftover"] == []
    assert (out / "over_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_over_time_unknown_server_is_a_one_line_error(tmp_path):
    res = run_session([sys.executable, "-m", "hotstart", "bench", "over-time", "--servers", "sglang",
                       "--out", str(tmp_path / "o")], 60, os.environ, cwd=REPO)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "hotstart: error: --servers: unknown server 'sglang' (known: hotstart-cold, hotstart-warm, vllm, "
        "vllm-cold, llamacpp, transformers)"], res.stderr


def test_short_load_no_errors_no_leaks(default_model_dir, tmp_path):
    out = tmp_path / "load.json"
    args = ["--spawn", "--model", str(default_model_dir), "--clients", "16", "--duration", "10",
            "--min-tokens", "8", "--max-tokens", "32", "--abort-frac", "0.1", "--drain-timeout", "120",
            "--request-timeout", "120", "--out", str(out)]
    res = hotstart_bench("load", args, os.environ, 300)
    assert res.returncode == 0, res.stdout[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] and data["failures"] == []
    assert data["errors"] == 0, data["error_samples"]
    assert data["completed"] > 0
    assert data["kv_back_to_zero"] and data["queues_empty"], data["gauges_after"]
    assert data["gauges_after"]["hotstart_kv_cache_usage_ratio"] == 0
    assert data["fd_leak"] is False, (data["before"], data["after"])
    assert data["after"]["fds"] <= data["before"]["fds"] + data["fd_slack"]
    assert data["server_alive"] and "PASS" in res.stdout
