"""`hotstart bench load`: N concurrent streaming clients for D seconds, then leak checks on the server.

    hotstart bench load --url http://127.0.0.1:8000 [--clients 64] [--duration 60] [--out load.json]
    hotstart bench load --spawn [--model DIR] [--server-args "..."] ...   # starts `hotstart serve` itself

Each client loops until the duration is over: a random prompt from a small list, random max_tokens in
[--min-tokens, --max-tokens], chat (or, one time in five, text) completion, streamed, temperature 0 or
0.7; the stream must be HTTP 200, carry no error event, end with a finish_reason and `data: [DONE]`.
A client finishes the request it is in when time is up; everything is bounded by duration + drain timeout
(requests still running then count as errors). With --abort-frac F a fraction F of requests is dropped by
the client after a few tokens (not an error: it checks that aborts free their KV blocks too).

After the run, with no client connected: /metrics must show hotstart_num_requests_running,
hotstart_num_requests_waiting and hotstart_kv_cache_usage_ratio back at 0, and the open file
descriptors of the server process and its children (psutil num_fds) must be <= before + --fd-slack
(before = after one warm-up request). Exit status 1 if any request failed, nothing completed, a gauge
stays above 0, descriptors leaked, the server died or its process tree changed (engine refork). JSON
results go to --out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from hotstart.bench import servers as sv
from hotstart.bench.process import Server
from hotstart.bench.procgroup import processes
from hotstart.bench.prometheus import metric_value
from hotstart.bench.streams import CpuNoise, pct, stream_request
from hotstart.errors import HotstartError
from hotstart.procs import alive

PROMPTS = [
    "What is the capital of France?",
    "Name three fruits.",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "Tell me a joke about computers.",
    "How many legs does a spider have?",
    "Give me five ideas for a birthday party.",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Describe the color blue to someone who cannot see.",
]
GAUGES = ("hotstart_num_requests_running", "hotstart_num_requests_waiting", "hotstart_kv_cache_usage_ratio")


def fd_snapshot(pid: int) -> dict:
    """Open fds and RSS of the server process and all its descendants."""
    import psutil

    out = {"fds": 0, "rss_mb": 0.0, "procs": {}}
    for p in processes(pid):
        try:
            n = p.num_fds()
            out["procs"][p.pid] = {"name": " ".join(p.cmdline()[:4])[:80], "fds": n}
            out["fds"] += n
            out["rss_mb"] += p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    out["rss_mb"] = round(out["rss_mb"], 1)
    return out


async def read_gauges(client, url: str) -> dict:
    text = (await client.get(url + "/metrics", timeout=10)).text
    return {name: metric_value(text, name) for name in GAUGES}


def make_body(rng: random.Random, model: str, min_tokens: int, max_tokens: int) -> tuple[str, dict, bool]:
    prompt = rng.choice(PROMPTS)
    chat = rng.random() >= 0.2
    body = {"model": model, "max_tokens": rng.randint(min_tokens, max_tokens), "stream": True,
            "temperature": rng.choice([0.0, 0.7]), "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, chat


async def aborted_request(client, url: str, body: dict, after_chunks: int, timeout: float) -> dict:
    """Stream and hang up after a few content chunks; only HTTP/connection failures are errors."""
    import httpx

    rec = {"aborted": True, "error": None}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    return rec
                seen = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    ev = json.loads(line[5:])
                    choices = ev.get("choices") or []
                    if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
                        seen += 1
                        if seen >= after_chunks:
                            break  # leaving the block closes the connection mid-stream
    except TimeoutError:
        rec["error"] = f"timeout after {timeout:.0f} s"
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def stream_problem(rec: dict) -> str | None:
    """What is wrong with a stream stream_request() read without error: no [DONE], no finish_reason or
    no usage chunk (None: nothing)."""
    if not rec["done"]:
        return "stream ended without [DONE]"
    if rec["finish_reason"] is None:
        return "no finish_reason"
    if rec["tokens"] is None:
        return "no usage chunk"
    return None


async def client_loop(idx: int, client, url: str, model: str, args, deadline: float, records: list) -> None:
    rng = random.Random(args.seed * 1000 + idx)
    while time.monotonic() < deadline:
        path, body, chat = make_body(rng, model, args.min_tokens, args.max_tokens)
        t_start = time.monotonic()
        if rng.random() < args.abort_frac:
            rec = await aborted_request(client, url + path, body, rng.randint(1, 8), args.request_timeout)
        else:
            rec = await stream_request(client, url + path, body, args.request_timeout, chat=chat)
            rec["error"] = rec["error"] or stream_problem(rec)
        rec.update(client=idx, t=t_start, path=path, max_tokens=body["max_tokens"], t_end=time.monotonic())
        records.append(rec)


async def run(args, url: str, pid: int | None) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    res: dict = {"url": url, "server_pid": pid}
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = (await client.get(url + "/v1/models", timeout=30)).json()["data"][0]["id"]
        warm = await stream_request(client, url + "/v1/chat/completions",
                                    {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 8, "stream": True}, args.request_timeout)
        if warm["error"] or not warm["done"]:
            raise HotstartError(f"bench load: the warm-up request failed: {warm['error'] or 'no [DONE]'}")
    res["gauges_before"] = await fetch_gauges(url)
    res["before"] = fd_snapshot(pid) if pid else None

    records: list[dict] = []
    noise = CpuNoise(pid)
    noise.start()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(client_loop(i, client, url, model, args, deadline, records))
                 for i in range(args.clients)]
        done, pending = await asyncio.wait(tasks, timeout=args.duration + args.drain_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        crashed = [repr(t.exception()) for t in done if t.exception() is not None]
    wall = time.monotonic() - t0
    res["cpu"] = noise.stop()  # other_cores: CPU other processes took meanwhile (2 shared cores here)
    res.update(hung_clients=len(pending), client_exceptions=crashed, wall_s=round(wall, 2))

    full = [r for r in records if not r.get("aborted")]
    ok = [r for r in full if r["error"] is None]
    errors = [r for r in records if r["error"] is not None]
    toks = sum(r["tokens"] for r in ok)
    res.update(
        completed=len(ok), aborted=sum(1 for r in records if r.get("aborted") and r["error"] is None),
        errors=len(errors) + len(pending) + len(crashed),
        error_samples=sorted({r["error"] for r in errors})[:10],
        ttft_p50=pct([r["ttft"] for r in ok], 50), ttft_p99=pct([r["ttft"] for r in ok], 99),
        e2e_p50=pct([r["e2e"] for r in ok], 50), e2e_p99=pct([r["e2e"] for r in ok], 99),
        output_tokens=toks, output_tps=toks / wall if wall else 0.0,
        requests_per_s=len(ok) / wall if wall else 0.0,
        finish_reasons={k: sum(1 for r in ok if r["finish_reason"] == k)
                        for k in sorted({r["finish_reason"] for r in ok})},
    )

    # Settle: no client is connected now; the server must drop back to idle without leaking.
    t_settle = time.monotonic()
    while True:
        gauges = await fetch_gauges(url)
        after = fd_snapshot(pid) if pid and alive(pid) else None
        idle = all(v == 0 for v in gauges.values() if v is not None) and None not in gauges.values()
        before = res["before"]
        fds_ok = after is None or before is None or after["fds"] <= before["fds"] + args.fd_slack
        if (idle and fds_ok) or time.monotonic() - t_settle > args.settle_timeout:
            break
        await asyncio.sleep(0.5)
    res.update(gauges_after=gauges, after=after, settle_s=round(time.monotonic() - t_settle, 2))
    res["server_alive"] = pid is None or alive(pid)
    res["kv_back_to_zero"] = gauges.get("hotstart_kv_cache_usage_ratio") == 0
    res["queues_empty"] = (gauges.get("hotstart_num_requests_running") == 0
                           and gauges.get("hotstart_num_requests_waiting") == 0)
    if res["before"] and after:
        res["fd_leak"] = after["fds"] > res["before"]["fds"] + args.fd_slack
        res["engine_pids_same"] = set(res["before"]["procs"]) == set(after["procs"])
    else:
        res["fd_leak"] = None if pid is None else True
        res["engine_pids_same"] = None
    return res


async def fetch_gauges(url: str) -> dict:
    import httpx

    try:
        async with httpx.AsyncClient() as c:
            return await read_gauges(c, url)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def failures(res: dict) -> list[str]:
    why = []
    if res["errors"]:
        why.append(f"{res['errors']} errors")
    if not res["completed"]:
        why.append("no request completed")
    if not res["server_alive"]:
        why.append("server died")
    if not res["kv_back_to_zero"]:
        why.append(f"KV cache not released: {res['gauges_after']}")
    if not res["queues_empty"]:
        why.append(f"requests still running/waiting: {res['gauges_after']}")
    if res["engine_pids_same"] is False:
        why.append("the server's process tree changed (an engine crashed and was reforked?)")
    if res["fd_leak"]:
        b, a = res["before"], res["after"]
        why.append(f"fd leak: {b and b['fds']} -> {a and a['fds']}")
    return why


def report(res: dict) -> str:
    f = lambda x: "n/a" if x is None else f"{x:.2f}"
    b, a = res.get("before") or {}, res.get("after") or {}
    return "\n".join([
        (f"clients {res['clients']} x {res['duration']} s (wall {res['wall_s']} s): "
         f"completed {res['completed']}, aborted {res['aborted']}, errors {res['errors']}"),
        (f"TTFT p50 {f(res['ttft_p50'])} s, p99 {f(res['ttft_p99'])} s; "
         f"end-to-end p50 {f(res['e2e_p50'])} s, p99 {f(res['e2e_p99'])} s"),
        (f"output {res['output_tokens']} tokens, {res['output_tps']:.1f} tok/s, "
         f"{res['requests_per_s']:.2f} req/s; finish reasons {res['finish_reasons']}"),
        (f"CPU: server+client {res['cpu']['our_cores']:.2f} cores, "
         f"other processes {res['cpu']['other_cores']:.2f} cores (load average {res['load1']})"),
        f"after (settled in {res['settle_s']} s): {res['gauges_after']}",
        (f"server fds {b.get('fds')} -> {a.get('fds')} (slack {res['fd_slack']}), "
         f"RSS {b.get('rss_mb')} -> {a.get('rss_mb')} MB, same processes: {res['engine_pids_same']}"),
        *(f"  error: {e}" for e in res["error_samples"]),
    ])


def _check(args) -> None:
    for flag in ("clients", "min_tokens", "max_tokens"):
        if getattr(args, flag) < 1:
            raise HotstartError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.min_tokens > args.max_tokens:
        raise HotstartError(f"--min-tokens {args.min_tokens} > --max-tokens {args.max_tokens}")
    if not 0 <= args.abort_frac <= 1:
        raise HotstartError(f"--abort-frac must be in 0..1, got {args.abort_frac}")


@contextlib.contextmanager
def served(args, models: list[str] | None = None, extra: list[str] = ()) -> Iterator[tuple[str, int | None]]:
    """The server under test, as (url, pid): `--spawn` starts `hotstart serve MODELS --server-args EXTRA`
    (MODELS: [--model] by default) and stops it after, printing its last output if anything failed;
    `--url` is a running one (pid: --pid, else the port's owner, else None). SIGTERM ends the run as
    Ctrl-C does, so the spawned server is stopped either way."""

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    srv: Server | None = None
    try:
        if args.spawn:
            env = {"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else {}
            models = [args.model] if models is None and args.model else models or []
            # the models last, after `--`: leading VAR=value words of the flags are the server's environment
            words = [*args.server_args.split(), *extra, *(["--", *models] if models else [])]
            spec = sv.hotstart_spec(None, args.dtype, words)
            srv = sv.spawn(spec, 300.0, env)
            print(f"spawned hotstart (pid {srv.pid}) at {srv.url}, healthy after {srv.t_health:.1f} s",
                  flush=True)
            yield srv.url, srv.pid
        else:
            url = args.url.rstrip("/")
            pid = args.pid or sv.server_pid_for(url)
            if pid is None:
                print("warning: server process not found: process checks skipped", file=sys.stderr)
            yield url, pid
    except BaseException:
        if srv is not None:
            print("".join(srv.lines[-60:]), file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
        if srv is not None:
            srv.stop()


def run_load_bench(args) -> int:
    """Entry point of `hotstart bench load`. Exit code 0: PASS, 1: FAIL (the reasons printed)."""
    _check(args)
    with served(args) as (url, pid):
        res = asyncio.run(run(args, url, pid))
    res.update(clients=args.clients, duration=args.duration, fd_slack=args.fd_slack,
               args={k: v for k, v in vars(args).items() if v is None or isinstance(v, (str, int, float))},
               load1=round(os.getloadavg()[0], 2))
    why = failures(res)
    res["ok"], res["failures"] = not why, why
    print(report(res))
    print("PASS" if not why else "FAIL: " + "; ".join(why))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0 if not why else 1
