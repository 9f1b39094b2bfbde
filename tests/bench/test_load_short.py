"""A short run of benchmarks/load.py: 16 streaming clients for ~10 s against a spawned default-model server,
some of them hanging up mid-stream; no errors, and the server ends idle (no KV blocks, no queued requests)
with no file descriptors leaked. About 20-30 s on 2 quiet cores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from util import REPO


@pytest.mark.e2e
def test_short_load_no_errors_no_leaks(default_model_dir, tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "load.py"), "--spawn", "--clients", "16", "--duration", "10",
           "--min-tokens", "8", "--max-tokens", "32", "--abort-frac", "0.1", "--drain-timeout", "120",
           "--request-timeout", "120", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["failures"] == []
    assert res["errors"] == 0, res["error_samples"]
    assert res["completed"] > 0
    assert res["kv_back_to_zero"] and res["queues_empty"], res["gauges_after"]
    assert res["gauges_after"]["hotstart_kv_cache_usage_ratio"] == 0
    assert res["fd_leak"] is False, (res["before"], res["after"])
    assert res["after"]["fds"] <= res["before"]["fds"] + res["fd_slack"]
    assert res["server_alive"]
