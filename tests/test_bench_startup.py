"""`hotstart bench startup`: the real harness on the default model, and servers that fail in every way.

Each test runs the CLI in its own session with a hard timeout and checks, with psutil, that no process
of any launched group survives. Bounded: ~30-60 s in all on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


def bench(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hotstart", "bench", "startup", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_groups_gone(data: dict) -> None:
    pgids = {r["stop"]["pgid"] for r in data["runs"] if "stop" in r}
    for r in data["runs"]:
        assert r.get("stop", {}).get("leftover", []) == [], r
    alive = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) in pgids:
                alive.append(p.pid)
        except (OSError, psutil.Error):
            continue
    assert not alive, f"processes left in groups {pgids}: {alive}"


@pytest.mark.e2e
def test_default_model_cold_weights(tmp_path, default_model_dir):
    # A private copy: a server someone else runs on the default model maps its weights, and mapped
    # pages cannot be evicted, which would make "cold" untestable here.
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    out = tmp_path / "out"
    t = time.monotonic()
    res = bench([str(model), "--config", "hotstart", "--cold", "weights", "--runs", "1", "--warmup", "0",
                 "--max-tokens", "4", "--timeout", "90", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    (run,) = data["runs"]
    assert run["ok"], run
    assert run["residency"]["weights"] < 2.0, run  # evicted right before launch
    assert 0 < run["t_health"] <= run["t_first"] < time.monotonic() - t
    assert run["answer"].strip()
    assert run["timeline"]["phases"], "hotstart's /startup timeline is kept"
    whats = {f["what"]: f for f in data["floor"]}
    assert whats["import_torch"]["ok"] and whats["import_torch"]["seconds"] > 0
    assert whats["read_weights"]["bytes"] >= data["meta"]["weights_bytes"] * 0.99
    assert whats["read_weights"]["residency"]["weights"] < 2.0
    assert_groups_gone(data)
    table = (out / "table.md").read_text()
    assert "| weights | hotstart | 1/1 |" in table and "floor: import torch" in table
    assert (out / "startup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hotstart" in res.stderr and "health" in res.stderr  # progress lines


def test_failing_peers_are_reported_not_hung(tmp_path):
    """A server that exits at once, one that never answers /health with 200, one that never listens."""
    out = tmp_path / "out"
    py = sys.executable
    t = time.monotonic()
    res = bench(["--peer", f"{py} -c 'import sys; sys.stderr.write(\"boom\\n\"); sys.exit(3)' {{port}}",
                 "--peer", f"{py} -m http.server --bind 127.0.0.1 {{port}}",
                 "--peer", "sleep 600 {port}",
                 "--cold", "none", "--runs", "1", "--warmup", "0", "--timeout", "3", "--no-floor",
                 "--out", str(out)], timeout=60)
    assert time.monotonic() - t < 40
    assert res.returncode == 1, res.stderr
    data = json.loads((out / "results.json").read_text())
    runs = {r["config"]: r for r in data["runs"]}
    assert [r["ok"] for r in runs.values()] == [False, False, False]
    crashed = runs[next(k for k in runs if k.startswith("python") and "http" not in k)]
    assert "exited with code 3" in crashed["error"] and "boom" in crashed["stderr_tail"]
    assert "within 3 s" in runs["python -m http.server"]["error"]
    assert "within 3 s" in runs["sleep"]["error"]
    assert "FAILED" in res.stdout
    assert_groups_gone(data)


def test_interrupt_stops_the_server_and_keeps_results(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hotstart", "bench", "startup", "--peer", "sleep 600 {port}", "--cold", "none",
           "--runs", "3", "--warmup", "0", "--timeout", "1", "--no-floor", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait for the first (failed) run, then interrupt the second
            if (out / "results.json").is_file() and json.loads((out / "results.json").read_text())["runs"]:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["interrupted"] and len(data["runs"]) >= 2
    assert data["runs"][-1].get("interrupted"), data["runs"][-1]  # the run in flight is on record too
    assert_groups_gone(data)


def test_bad_arguments_are_one_line_errors(tmp_path):
    cases = [(["--config", "hotstart:turbo"], "unknown variant 'turbo'"),
             (["--config", "vllm"], "must be hotstart"),
             (["--peer", "transformers serve"], "must contain {port}"),
             (["--runs", "0"], "--runs must be >= 1")]
    for args, message in cases:
        res = bench([*args, "--out", str(tmp_path / "o")], timeout=60)
        assert res.returncode == 2, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, res.stderr)


def test_bench_help_does_not_import_torch():
    code = ("import sys\nfrom hotstart.cli import build_parser\n"
            "for a in (['bench', 'startup', '--help'], ['make-model', '--help'], ['bench', '--help']):\n"
            "    try: build_parser().parse_args(a)\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr
