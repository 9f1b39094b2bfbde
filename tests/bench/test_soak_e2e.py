"""`hotstart bench soak` end to end: a few seconds of the whole mix against a real many-models server (a
random-weight tiny model served under two names: two engines), one engine SIGKILLed mid-run. Every
request kind is sent and answered as it should be, the counts are the server's own (its
hotstart_http_requests counter by endpoint and status matches the soak's records one for one), the kill
is found, recovered from and excused, and the report's process table is the server's real tree. 12 s of
soak after the server's start (46 s in all on the development machine with a load average of 12)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import httpx
from helpers import REPO
from helpers.models import make_tiny
from helpers.procs import run_session
from helpers.server import Server

from hotstart.bench.prometheus import samples
from hotstart.bench.soak_workload import BAD_VARIANTS, KINDS
from hotstart.procs import descendants


def server_counts(metrics: str) -> Counter:
    """(endpoint, status) -> requests, from the server's own counter."""
    out: Counter = Counter()
    for name, labels, value in samples(metrics):
        if name == "hotstart_http_requests_total":
            out[(labels["endpoint"], int(labels["status"]))] += int(value)
    return out


def test_short_soak_sends_every_kind_and_survives_a_kill(tmp_path):
    model = make_tiny(tmp_path / "tiny")
    engine = "--max-model-len 256 --max-num-seqs 8 --dtype float32 --zygote off --preload a,b".split()
    # one torch thread per engine: two engines and the soak client share the cores
    s = Server(f"a={model}", f"b={model}", *engine, env={"OMP_NUM_THREADS": "1"})
    try:
        engines_before = set(descendants(s.proc.pid))
        out = tmp_path / "soak.json"
        # a few seconds: RSS still grows then (KV pages touched for the first time), so the growth limit
        # is loose; the long soak checks the 15 % (docs/reliability.md)
        args = (
            "--duration 12 --window 6 --clients 6 --sample-every 0.5 --min-tokens 2 --max-tokens 8 "
            "--request-timeout 60 --fault-every 6 --fault kill --rss-growth 100"
        ).split()
        cmd = [sys.executable, "-m", "hotstart", "bench", "soak", "--url", s.url, *args, "--out", str(out)]
        res = run_session(cmd, 180, os.environ, merge_stderr=True, cwd=REPO)
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
    finally:
        s.stop()
    assert res.returncode == 0, res.stdout[-4000:]
    assert "PASS" in res.stdout and "window (s)" in res.stdout, res.stdout[-4000:]
    data = json.loads(out.read_text())
    assert data["ok"] and data["failures"] == [] and data["models"] == ["a", "b"]

    t = data["totals"]
    assert set(t["by_kind"]) == set(KINDS), t["by_kind"]
    for kind, counts in t["by_kind"].items():  # each kind answered right at least once, never hung
        assert counts["hangup" if kind == "hangup" else "ok"] > 0 and counts["hung"] == 0, (kind, counts)
    records = data["records"]
    bad = [r["variant"] for r in sorted(records, key=lambda r: r["t0"]) if r["kind"] == "bad"]
    assert bad == [BAD_VARIANTS[i % len(BAD_VARIANTS)] for i in range(len(bad))]  # in turn, from the first
    assert {r["model"] for r in records} == {"a", "b"}
    assert all(400 <= r["status"] < 500 for r in records if r["kind"] == "bad" and r["outcome"] == "ok")

    # the counts are real: the server saw exactly these requests (plus one warm-up chat per model)
    mine = Counter(
        (r["kind"] in ("text", "text_stream") or r["variant"] == "max_tokens_zero", r["status"])
        for r in records
    )
    mine[(False, 200)] += 2
    theirs = server_counts(metrics)
    chat, text = "/v1/chat/completions", "/v1/completions"
    srv = {(e == text, st): n for (e, st), n in theirs.items() if e in (chat, text)}
    # a request whose status the client never saw (its connection broken by the kill, or a hang-up before
    # the headers) was still counted by the server, under some status
    unknown = {k: n for k, n in mine.items() if k[1] is None}
    known = {k: n for k, n in mine.items() if k[1] is not None}
    assert sum(srv.values()) == sum(mine.values()), (theirs, mine)
    assert all(srv.get(k, 0) >= n for k, n in known.items()), (theirs, mine)
    assert sum(unknown.values()) <= 3, mine

    # the kill: found, excused, recovered from
    [fault] = data["faults"]
    assert fault["kind"] == "kill" and fault["pid"] in engines_before and fault["recovery_s"] is not None
    assert 6.0 <= fault["t"] < 8.0 and fault["recovery_s"] < 30 and fault["hung"] == 0
    assert t["errors"]["outside"] == {"5xx": 0, "failed": 0, "not_4xx": 0, "hung": 0}

    # the process table is the server's tree: its API process, forkserver, two engines and the killed one
    procs = data["processes"]
    assert procs[str(s.proc.pid)]["role"] == "api" and procs[str(s.proc.pid)]["checked"]
    roles = Counter(p["role"] for p in procs.values() if not p["gone"])
    assert roles["forkserver"] == 1 and roles["engine"] == 2, procs
    assert procs[str(fault["pid"])]["gone"] and procs[str(fault["pid"])]["role"] == "engine"
    # real figures for the server's own processes: one that lives on has them at the end; a gone one's last
    # sample may catch it exiting (memory and descriptors already released: a loaded suite run saw that). An
    # engine's short-lived children (g++ building the kernel library on a fresh machine) are small: skipped
    own = [p for p in procs.values() if p["role"] in ("api", "forkserver", "engine")]
    assert all(p["rss_end"] > 10 and p["fds_end"] > 0 for p in own if not p["gone"]), procs
    assert all(p["rss_max"] > 10 for p in own), procs

    windows = data["windows"]
    assert [w["t0"] for w in windows] == [0, 6] and sum(w["requests"] for w in windows) == len(records)
    assert all(set(w["kv_usage_max"]) == {"a", "b"} for w in windows), windows
    assert any(w["ttft"]["p50"] is not None and w["total"]["p99"] is not None for w in windows)
