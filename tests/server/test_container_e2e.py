"""Sized to its container: a server inside a real 2.5 GiB memory cgroup sizes its KV cache for the cgroup (not
the host's RAM), shows the limit on /startup, and answers 64 concurrent long prompts, or refuses some with a
clean 503, without an OOM kill (hotstart/system.py available_memory; docs/security.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.cgroup import memory_cgroup
from helpers.server import Server

LIMIT = int(2.5 * 2**30)
# KV-heavy and cheap to run: 16 layers x 2 x 64 KV heads x 128 x 4 bytes = 1 MiB of KV per token; 64
# requests of 40 + 1 tokens hold 3 blocks of 16 tokens each: 3 GiB together (a cache sized for the host's
# RAM admits them all and the cgroup OOM-kills the engine; one sized for the cgroup holds ~20 at a time)
SHAPE = ["--layers", "16", "--hidden", "16", "--intermediate", "32", "--heads", "64", "--kv-heads", "64",
         "--head-dim", "128"]
KV_PER_TOKEN = 1 << 20


@pytest.fixture(scope="module")
def kv_heavy(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv-heavy") / "m"
    cmd = [sys.executable, "-m", "hotstart", "make-model", "--family", "llama", *SHAPE, "--dtype", "float32",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def test_kv_sized_for_the_cgroup_and_64_long_prompts_without_an_oom_kill(kv_heavy):
    cg, why = memory_cgroup(LIMIT)
    if cg is None:
        pytest.skip(why)
    srv = None
    try:
        srv = Server(str(kv_heavy), "--served-model-name", "m", "--max-model-len", "64", prefix=cg.prefix)
        memory = httpx.get(srv.url + "/startup", timeout=10).json()["memory"]
        assert memory["limit_bytes"] == LIMIT and memory["total_bytes"] == LIMIT, memory
        assert cg.path.name in json.dumps(memory["cgroups"]), memory
        kv = next(line for line in srv.lines if "KV cache allocated" in line)
        assert f"cgroup /{cg.path.name}'s room" in kv, kv
        blocks = int(re.search(r"\((\d+) blocks x 16 tokens", kv).group(1))
        assert blocks * 16 * KV_PER_TOKEN < LIMIT / 2, kv  # not the host's: a share of what the cgroup leaves

        def ask(i: int) -> tuple[int, str]:
            prompt = [(7 + 13 * i + 5 * j) % 40000 + 100 for j in range(40)]  # none shared
            r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
                "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0})
            return r.status_code, r.text

        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(ask, range(64)))
        codes = [code for code, _ in answers]
        assert set(codes) <= {200, 503}, [a for a in answers if a[0] not in (200, 503)][:2]
        refused = [text for code, text in answers if code == 503]
        assert all("insufficient_memory" in text for text in refused), refused[:2]
        assert codes.count(200) >= 32, codes  # the cache holds some at a time; the rest wait their turn
        assert cg.oom_kills() == 0
        print(f"{codes.count(200)} answered, {len(refused)} refused; {kv.strip()}")
        assert not [line for line in srv.lines if "exited" in line or "OOM" in line], srv.output[-2000:]
        ok = httpx.get(srv.url + "/health", timeout=10)
        assert ok.status_code == 200
        srv.stop()
    finally:
        if srv is not None and srv.proc.poll() is None:
            srv.kill()
        cg.remove()
