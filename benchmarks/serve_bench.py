"""Serving throughput and TTFT: hotstart against `transformers serve` on the same model, in one run.

    python benchmarks/serve_bench.py [--model DIR] [--concurrency 1,4,16] [--rounds 3] [--out serve_bench.json]

Each server is started fresh by this script on a free port (its own session; the whole group is killed
at the end, also on Ctrl-C or an error), waits for /health, answers one warm-up request, then for each
concurrency level C runs R rounds of C concurrent streaming chat requests (different prompts,
temperature 0, max_tokens 128, generation forced to the full length). Servers run one after the other,
never together, so they do not share the cores.

Per request: TTFT (send -> first non-empty content delta) and decode rate ((completion tokens - 1) /
(last content delta - first content delta)). Completion tokens come from the usage the server reports
(hotstart: stream_options.include_usage; transformers serve: always in its final chunk, and it rejects
stream_options); SSE content chunks are counted too, as a cross-check. Per round: median and p90 TTFT,
median per-stream decode rate, and total output tokens/s = sum of completion tokens / round wall time.
A level's figure is the median over its rounds.

Noise (2 shared cores here): before each server the 1-minute load average must fall below --max-load,
and before each round other processes must use at most --noise-cores cores over a 2 s sample. CPU time
taken by other processes during a round (/proc/stat busy time minus the server tree's and this client's
own) is recorded; a round above --noise-cores is rerun (--retries) and, if still noisy, flagged.

Forcing full length: hotstart takes `ignore_eos: true` (vLLM extension). transformers serve rejects
unknown fields (422), so it gets `generation_config` (a JSON string it accepts) with
min_new_tokens = max_new_tokens = max_tokens and do_sample false. Both get the same --dtype (default
auto: both then run the checkpoint's bf16 on a CPU with AVX512-BF16, like the dev machine; hotstart
resolves auto to float32 on CPUs without native bf16, so pass --dtype explicitly there).

transformers serve runs requests one at a time unless started with --continuous-batching; add
`--peer-cb` to measure that mode as well (server "transformers-cb"; ratios are printed against each peer).

Servers are launched, health-checked and stopped by hotstart.bench.process.Server (the startup
benchmark's and the tests' launcher too); spawn, stream_request and CpuNoise here are reused by
benchmarks/load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hotstart.bench.process import RunFailed, Server, free_port  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle gear system works.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between cats and dogs as pets?",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Explain in detail.",
    "Write a poem about autumn leaves.",
    "List some tips for learning a new language.",
    "Tell me about the history of the printing press.",
    "How do airplanes stay in the air?",
    "Describe a day in the life of a honeybee.",
    "What should I pack for a week-long hiking trip?",
    "Explain what a computer's memory does.",
    "Write a letter to a friend about moving to a new city.",
    "What makes a good team leader?",
    "Describe the planets of the solar system.",
]


# ---------------------------------------------------------------- servers

def spawn(name: str, argv: list[str], env: dict, url: str | None = None,
          ready_timeout: float = 300.0) -> Server:
    """Launch a server (own session, output read into .lines) and wait for /health; if it never gets
    there it is stopped again. The URL is `url`, else the one it prints (`--port 0`)."""
    srv = Server.launch(argv, env={**os.environ, **env}, tag=name, url=url)
    try:
        srv.wait_healthy(srv.t_launch + ready_timeout)
    except BaseException as e:
        srv.stop()
        if isinstance(e, RunFailed):
            raise RuntimeError(f"{name}: {e}:\n{last_lines(srv)}") from None
        raise
    return srv


def last_lines(srv: Server, n: int = 60) -> str:
    return "".join(srv.lines[-n:])


def hotstart_server(model: str | None, dtype: str, extra: list[str], max_num_seqs: int | None = None) -> Server:
    argv = [sys.executable, "-m", "hotstart", "serve", *([model] if model else []), "--port", "0",
            "--dtype", dtype, *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []), *extra]
    return spawn("hotstart", argv, env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})


def peer_server(model: str, dtype: str, extra: list[str], cb: bool = False) -> Server:
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise SystemExit('`transformers` CLI not found: pip install "transformers[serving]"')
    port = free_port()
    argv = [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", dtype,
            *(["--continuous-batching"] if cb else []), *extra, model]
    return spawn("transformers-cb" if cb else "transformers", argv, env={"HF_HUB_OFFLINE": "1"},
                 url=f"http://127.0.0.1:{port}")


def wait_quiet(max_load: float, max_wait: float) -> dict:
    """Wait until the 1-minute load average is below max_load (at most max_wait seconds)."""
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    announced = False
    while load > max_load and time.monotonic() - t0 < max_wait:
        if not announced:
            print(f"  load average {load:.2f} > {max_load}: waiting (at most {max_wait:.0f} s)", flush=True)
            announced = True
        time.sleep(5)
        load = os.getloadavg()[0]
    return {"load1_at_start": round(load, 2), "waited_s": round(time.monotonic() - t0, 1)}


class CpuNoise:
    """CPU seconds burnt by processes other than the watched ones (a server tree and this client) while
    a measurement ran: busy time from /proc/stat minus the watched processes' own CPU time."""

    def __init__(self, pid: int | None):
        self.pid = pid

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    def _ours(self) -> float:
        import psutil

        procs = [psutil.Process()]
        if self.pid:
            try:
                root = psutil.Process(self.pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def start(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()

    def stop(self) -> dict:
        wall = time.monotonic() - self.t0
        busy, ours = self._busy() - self.busy0, self._ours() - self.ours0
        other = max(0.0, busy - ours)
        return {"other_cpu_s": round(other, 2), "other_cores": round(other / wall, 3),
                "our_cores": round(ours / wall, 3)}


async def wait_idle(pid: int | None, max_cores: float, max_wait: float, window: float = 2.0) -> float:
    """Wait until processes other than ours use at most max_cores over a `window`-second sample (the
    load average lags by a minute); give up after max_wait. Returns the seconds waited."""
    t0 = time.monotonic()
    announced = False
    while True:
        noise = CpuNoise(pid)
        noise.start()
        await asyncio.sleep(window)
        other = noise.stop()["other_cores"]
        if other <= max_cores or time.monotonic() - t0 > max_wait:
            return time.monotonic() - t0
        if not announced:
            print(f"  other processes busy ({other:.2f} cores): waiting", flush=True)
            announced = True


# ---------------------------------------------------------------- one streaming request

async def stream_request(client, url: str, body: dict, timeout: float, chat: bool = True) -> dict:
    """POST a streaming request; time it and check how the stream ended.

    Returns ttft/e2e (s), decode_tps, tokens (usage, else None), chunks (non-empty content deltas),
    finish_reason, done ([DONE] seen), error (None if the stream was well-formed and HTTP 200).
    """
    import httpx

    rec: dict = {"ttft": None, "e2e": None, "decode_tps": None, "tokens": None, "chunks": 0,
                 "finish_reason": None, "done": False, "error": None}
    t0 = time.perf_counter()
    t_first = t_last = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    rec["error"] = f"HTTP {r.status_code}: {text[:300]}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if rec["done"]:
                        rec["error"] = f"data after [DONE]: {data[:200]}"
                        continue
                    if data == "[DONE]":
                        rec["done"] = True
                        continue
                    ev = json.loads(data)
                    if "error" in ev:
                        rec["error"] = f"error event: {json.dumps(ev)[:300]}"
                    for ch in ev.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        if piece:
                            t_last = time.perf_counter()
                            if t_first is None:
                                t_first = t_last
                            rec["chunks"] += 1
                        if ch.get("finish_reason"):
                            rec["finish_reason"] = ch["finish_reason"]
                    usage = ev.get("usage")
                    if usage:
                        rec["tokens"] = usage.get("completion_tokens")
    except TimeoutError:
        rec["error"] = f"timeout after {timeout:.0f} s"
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e"] = time.perf_counter() - t0
    if t_first is not None:
        rec["ttft"] = t_first - t0
        n = rec["tokens"] if rec["tokens"] is not None else rec["chunks"]
        if n > 1 and t_last > t_first:
            rec["decode_tps"] = (n - 1) / (t_last - t_first)
    return rec


# ---------------------------------------------------------------- the benchmark

def pct(xs: list[float | None], q: float) -> float | None:
    """Percentile of the non-None values: the median for q=50, else nearest rank."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    if q == 50:
        return statistics.median(xs)
    return xs[max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))]


def request_body(kind: str, prompt: str, max_tokens: int, model_id: str | None) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens,
            "stream": True}
    if kind == "hotstart":
        body.update(model=model_id, ignore_eos=True, stream_options={"include_usage": True})
    else:  # transformers serve: no stream_options / ignore_eos (422); usage comes in its final chunk
        body["generation_config"] = json.dumps({"max_new_tokens": max_tokens, "min_new_tokens": max_tokens,
                                                "do_sample": False})
    return body


async def run_round(client, endpoint: str, kind: str, prompts: list[str], max_tokens: int,
                    model_id: str | None, timeout: float, pid: int | None) -> dict:
    """C concurrent streams (one per prompt); the round's figures, CPU noise and raw records."""
    noise = CpuNoise(pid)
    noise.start()
    t0 = time.perf_counter()
    bodies = [request_body(kind, p, max_tokens, model_id) for p in prompts]
    recs = await asyncio.gather(*(stream_request(client, endpoint, b, timeout) for b in bodies))
    wall = time.perf_counter() - t0
    cpu = noise.stop()
    tokens = sum((x["tokens"] if x["tokens"] is not None else x["chunks"]) for x in recs)
    ttfts = [x["ttft"] for x in recs]
    return {"wall_s": wall, "tokens": tokens, "total_tps": tokens / wall,
            "ttft_p50": pct(ttfts, 50), "ttft_p90": pct(ttfts, 90),
            "decode_tps_p50": pct([x["decode_tps"] for x in recs], 50),
            "errors": [x["error"] for x in recs if x["error"]],
            "usage_reported": all(x["tokens"] is not None for x in recs),
            "all_full_length": all(x["tokens"] == max_tokens for x in recs), **cpu, "requests": recs}


async def bench_server(kind: str, url: str, levels: list[int], rounds: int, max_tokens: int,
                       timeout: float, pid: int | None = None, noise_cores: float = 0.25,
                       retries: int = 3, max_wait: float = 600) -> dict:
    """Run every level on one server. Each round starts once other processes are idle (wait_idle); a
    round during which they used more than noise_cores cores anyway is run again (at most `retries` more
    times); the last try is kept, flagged noisy if it still was."""
    import httpx

    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as client:
        model_id = None
        if kind == "hotstart":
            model_id = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        endpoint = url + "/v1/chat/completions"
        warm = await stream_request(client, endpoint, request_body(kind, "Hello!", max_tokens, model_id), timeout)
        if warm["error"]:
            raise RuntimeError(f"{kind}: warm-up failed: {warm['error']}")
        out: dict = {"warmup": warm, "levels": {}}
        for c in levels:
            per_round = []
            for r in range(rounds):
                prompts = [PROMPTS[(r * c + i) % len(PROMPTS)] for i in range(c)]
                for attempt in range(retries + 1):
                    await wait_idle(pid, noise_cores, max_wait)
                    summary = await run_round(client, endpoint, kind, prompts, max_tokens, model_id, timeout, pid)
                    summary.update(noisy=summary["other_cores"] > noise_cores, attempt=attempt + 1)
                    again = summary["noisy"] and attempt < retries
                    m = summary
                    print(f"  {kind:15s} C={c:<3d} round {r + 1}/{rounds}: {m['total_tps']:7.1f} tok/s total, "
                          f"TTFT p50 {m['ttft_p50'] or float('nan'):6.2f} s, errors {len(m['errors'])}, "
                          f"other processes {m['other_cores']:.2f} cores{' (noisy: again)' if again else ''}",
                          flush=True)
                    if not again:
                        break
                per_round.append(summary)
            med = {k: statistics.median(x[k] for x in per_round if x[k] is not None)
                   for k in ("total_tps", "ttft_p50", "ttft_p90", "decode_tps_p50")}
            med["errors"] = sum(len(x["errors"]) for x in per_round)
            med["all_full_length"] = all(x["all_full_length"] for x in per_round)
            med["noisy_rounds"] = sum(x["noisy"] for x in per_round)
            med["other_cores_max"] = max(x["other_cores"] for x in per_round)
            out["levels"][str(c)] = {"median": med, "rounds": per_round}
        return out


def print_table(results: dict, levels: list[int], base: str = "hotstart") -> list[str]:
    lines = ["| streams | server | TTFT p50 (s) | TTFT p90 (s) | decode tok/s per stream (p50) | total tok/s |",
             "|---:|---|---:|---:|---:|---:|"]
    for c in levels:
        for name, res in results.items():
            m = res["levels"][str(c)]["median"]
            lines.append(f"| {c} | {name} | {m['ttft_p50']:.2f} | {m['ttft_p90']:.2f} | "
                         f"{m['decode_tps_p50']:.1f} | {m['total_tps']:.1f} |")
        b = results.get(base)
        for name, res in results.items():
            if name == base or b is None:
                continue
            mb, mp = b["levels"][str(c)]["median"], res["levels"][str(c)]["median"]
            r = {k: mb[k] / mp[k] for k in ("ttft_p50", "ttft_p90", "decode_tps_p50", "total_tps")}
            lines.append(f"| {c} | **{base}/{name}** | {r['ttft_p50']:.2f}x | {r['ttft_p90']:.2f}x | "
                         f"{r['decode_tps_p50']:.2f}x | **{r['total_tps']:.2f}x** |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: hotstart's default model)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto",
                    help="--dtype for both servers (auto: each resolves the checkpoint's bf16 on CPUs with "
                         "AVX512-BF16, as here; hotstart falls back to float32 elsewhere)")
    ap.add_argument("--servers", default="hotstart,transformers", help="which to run, in order")
    ap.add_argument("--peer-cb", action="store_true", help="also run `transformers serve --continuous-batching`")
    ap.add_argument("--hotstart-args", default="", help="extra `hotstart serve` arguments (one string)")
    ap.add_argument("--peer-args", default="", help="extra `transformers serve` arguments (one string)")
    ap.add_argument("--timeout", type=float, default=1800, help="per-request limit in seconds")
    ap.add_argument("--max-load", type=float, default=1.5, help="wait for 1-min load average below this")
    ap.add_argument("--max-wait", type=float, default=600,
                    help="longest wait for a quiet machine (s), before each server and each round")
    ap.add_argument("--omp-threads", type=int, default=None,
                    help="OMP_NUM_THREADS for both servers (default: unset, torch uses every core)")
    ap.add_argument("--noise-cores", type=float, default=0.25,
                    help="a round during which other processes used more CPU than this (cores) is noisy")
    ap.add_argument("--retries", type=int, default=3, help="reruns of a noisy round")
    ap.add_argument("--out", default="serve_bench.json", help="JSON results")
    args = ap.parse_args(argv)

    levels = [int(x) for x in args.concurrency.split(",") if x]
    if args.omp_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.omp_threads)  # inherited by both servers
    model = args.model
    if model is None:
        from hotstart.boot.default_model import ensure_default_model

        model = str(ensure_default_model(quiet=True))
    servers = [s for s in args.servers.split(",") if s] + (["transformers-cb"] if args.peer_cb else [])

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    results: dict = {}
    env_info: dict = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    for kind in servers:
        quiet = wait_quiet(args.max_load, args.max_wait)
        print(f"{kind}: starting (load average {quiet['load1_at_start']})", flush=True)
        t0 = time.monotonic()
        if kind == "hotstart":
            srv = hotstart_server(model, args.dtype, args.hotstart_args.split(), max(levels))
        elif kind in ("transformers", "transformers-cb"):
            srv = peer_server(model, args.dtype, args.peer_args.split(), cb=kind == "transformers-cb")
        else:
            raise SystemExit(f"unknown server {kind!r}")
        try:
            print(f"{kind}: healthy after {time.monotonic() - t0:.1f} s at {srv.url}", flush=True)
            res = asyncio.run(bench_server(kind, srv.url, levels, args.rounds, args.max_tokens, args.timeout,
                                           srv.pid, args.noise_cores, args.retries, args.max_wait))
        except BaseException:
            print(last_lines(srv), file=sys.stderr)
            raise
        finally:
            srv.stop()
        m = re.search(r"on (?:cpu|cuda\S*) (float32|bfloat16|float16)", "".join(srv.lines))
        cfg = json.loads((Path(model) / "config.json").read_text())
        cfg_dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        dtype = m.group(1) if m else (cfg_dtype if args.dtype == "auto" else args.dtype)
        res.update(argv=srv.argv, ready_s=srv.t_health, dtype=dtype, **quiet,
                   load1_at_end=round(os.getloadavg()[0], 2))
        print(f"{kind}: ran in {dtype}", flush=True)
        results[kind] = res

    table = print_table(results, levels)
    print("\n".join(table))
    verdict = None  # against the default peer, else the first one run
    c = str(max(levels))
    peers = [k for k in results if k != "hotstart"] if "hotstart" in results else []
    for peer in peers:
        med = {k: results[k]["levels"][c]["median"]["total_tps"] for k in ("hotstart", peer)}
        ratio = med["hotstart"] / med[peer]
        if peer == "transformers" or verdict is None:
            verdict = {"peer": peer, "streams": int(c), "ratio": ratio, "met": ratio >= 2.0}
        print(f"goal >= 2x {peer} total tok/s at {c} streams: {ratio:.2f}x -> {'met' if ratio >= 2 else 'NOT met'}")
    for name, res in results.items():
        for c, lv in res["levels"].items():
            m = lv["median"]
            if m["errors"] or not m["all_full_length"] or m["noisy_rounds"]:
                print(f"warning: {name} C={c}: {m['errors']} errors, all full length: {m['all_full_length']}, "
                      f"{m['noisy_rounds']} noisy rounds (other processes up to {m['other_cores_max']:.2f} cores)")
    try:
        import torch
        import transformers

        env_info.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    Path(args.out).write_text(json.dumps({"env": env_info, "model": model, "args": vars(args), "goal": verdict,
                                          "table": table, "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
