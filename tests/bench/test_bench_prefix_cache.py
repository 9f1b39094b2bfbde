"""`hotstart bench prefix-cache` end to end: two real servers (prefix caching on, then off), one short
conversation each; the second turn hits the cache only where it is on. ~20 s on 2 quiet cores."""

from __future__ import annotations

import json
import os
import sys

from helpers import REPO
from helpers.procs import run_session


def test_prefix_cache_on_hits_off_does_not(tmp_path, default_model_dir):
    out = tmp_path / "pc.json"
    cmd = [sys.executable, "-m", "hotstart", "bench", "prefix-cache", "--model", str(default_model_dir),
           "--repeats", "1", "--words", "80", "--out", str(out)]
    res = run_session(cmd, 300, os.environ, merge_stderr=True, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:]
    on, off = json.loads(out.read_text())
    assert on["server"] == "prefix caching on" and off["flags"] == "--no-enable-prefix-caching"
    assert on["turn2_prompt_tokens"] == off["turn2_prompt_tokens"] > 100
    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_hits"] == 0
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
    assert "turn-2 TTFT, off / on:" in res.stdout
