"""`hotstart bench over-time`: what a server delivers in its first minutes since launch, under a steady load.

    hotstart bench over-time [--model DIR] [--servers hotstart-cold,hotstart-warm,vllm]
        [--streams 16] [--duration 120] [--window 5] [--max-tokens 128] [--hotstart-args "..."] [--out DIR]

For each server, one after the other: launch it and at once start --streams client loops, each sending
streamed greedy chat requests forced to --max-tokens (hotstart/bench/servers.py says how, per server)
back to back; a request that fails (not listening yet, 503 while starting) is retried 50 ms later.
Every content delta's time is recorded; tokens/s per --window seconds from launch to --duration is
the curve, with the server's first answer (first content delta) and /health 200 marked. At --duration
the clients are cancelled (the tokens a request got until then count) and the server's process group
is stopped. (llama.cpp's /v1/models, its health check, waits behind the model lock that the streams
hold, so under this load its health time is usually not seen: its first answer is.)

Servers:
  hotstart-cold  `hotstart serve MODEL` with a private, empty HOTSTART_HOME (made here, removed at the
                 end): no compiled graphs yet, so it serves eager and compiles behind (--compile auto).
                 The model folder is passed explicitly: the default model lives in the real
                 HOTSTART_HOME/models, which this run does not use.
  hotstart-warm  the same, after a priming start on that home that waits until /startup's fast_path
                 says the compile is no longer "compiling" (--prime-timeout): every graph is cached.
  vllm           vLLM from commands.env with its compile cache as it is (warm after the first start);
  vllm-cold      vLLM with an empty VLLM_CACHE_ROOT (a first-ever start: it compiles before serving).
  llamacpp, transformers   the other peers, for reference.
Outputs in --out: over_time.json (per server: windows, first answer, health, compile done, per-request
records with token times) and over_time.png (tokens/s against seconds since launch, one line each).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from hotstart.bench import peers
from hotstart.bench import servers as sv
from hotstart.bench.args_serving import OVER_TIME_KINDS as KINDS
from hotstart.bench.process import Server, free_port
from hotstart.bench.streams import stream_request, wait_quiet
from hotstart.errors import HotstartError

RETRY_S = 0.05
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


def windows(requests: list[dict], duration: float, window: float) -> list[dict]:
    """Tokens/s per window [k*window, (k+1)*window) since launch. A request's deltas each count
    tokens/chunks tokens when it reported usage (else 1 each)."""
    n = max(1, int(round(duration / window)))
    counts = [0.0] * n
    for r in requests:
        times = r["times"]
        weight = (r["tokens"] / len(times)) if r.get("tokens") and times else 1.0
        for t in times:
            k = int(t // window)
            if 0 <= k < n:
                counts[k] += weight
    return [{"t0": k * window, "t1": (k + 1) * window, "tps": counts[k] / window} for k in range(n)]


async def _poll(srv: Server, t0: float, until: float, state: dict) -> None:
    """/health 200 (or /v1/models where /health is 404) and, for hotstart, when the compile finished."""
    while time.perf_counter() < until:
        await asyncio.sleep(0.1 if state.get("health_s") is None else 1.0)
        if state.get("health_s") is None:
            status = await asyncio.to_thread(_status, srv, state.get("health_path", "/health"))
            if status == 404 and state.get("health_path", "/health") == "/health":
                state["health_path"] = "/v1/models"
            elif status == 200:
                state["health_s"] = time.perf_counter() - t0
        elif state.get("kind") == "hotstart" and state.get("compile_done_s") is None:
            fast = ((await asyncio.to_thread(srv.get_json, "/startup", 2.0)) or {}).get("fast_path")
            if sv.fast_path_built(fast):
                state.update(compile_done_s=time.perf_counter() - t0, fast_path=fast)


def _status(srv: Server, path: str) -> int | None:
    try:
        return srv._request("GET", path, None, 2.0)[0]
    except Exception:  # noqa: BLE001 - not listening yet
        return None


async def load(srv: Server, spec: sv.Spec, args, eog: list[int], t0: float) -> tuple[list[dict], dict]:
    """--streams client loops from launch to t0 + duration; (request records, health/compile state)."""
    import httpx

    until = t0 + args.duration
    state: dict = {"kind": spec.kind}
    records: list[dict] = []
    model_id: list = []

    async def client(i: int, http) -> None:
        k = 0
        while time.perf_counter() < until:
            try:
                if not model_id and not spec.kind.startswith("transformers"):
                    model_id.append((await http.get(srv.url + "/v1/models")).json()["data"][0]["id"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                await asyncio.sleep(RETRY_S)
                continue
            body = sv.request_body(spec.kind, PROMPTS[(i + k * args.streams) % len(PROMPTS)], args.max_tokens,
                                   model_id[0] if model_id else None, eog)
            # On record before it is sent: a request still streaming at the deadline is cancelled, and the
            # tokens it got so far count too.
            times: list[float] = []
            rec = {"stream": i, "sent": time.perf_counter() - t0, "times": times,
                   "error": "cut at --duration", "tokens": None}
            records.append(rec)
            rec.update(await stream_request(http, srv.url + "/v1/chat/completions", body, args.duration,
                                            times=times), times=times)
            k += 1
            if rec["error"] and not rec["times"]:
                await asyncio.sleep(RETRY_S)

    limits = httpx.Limits(max_connections=args.streams + 4, max_keepalive_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.duration, connect=5), limits=limits) as http:
        tasks = [asyncio.create_task(client(i, http)) for i in range(args.streams)]
        poll = asyncio.create_task(_poll(srv, t0, until, state))
        await asyncio.wait(tasks, timeout=max(0.0, until - time.perf_counter()))
        for t in [*tasks, poll]:
            t.cancel()
        await asyncio.gather(*tasks, poll, return_exceptions=True)
    for r in records:
        r["times"] = [round(t - t0, 4) for t in r["times"]]
    return records, state


def spec_for(kind: str, args, model: str, home: str) -> sv.Spec:
    if kind.startswith("hotstart"):
        # a fixed port, so the clients can knock from launch on (with --port 0 the URL is known late)
        spec = sv.hotstart_spec(model, args.dtype, args.hotstart_args.split(), args.streams, home=home,
                                port=free_port())
        spec.name = kind
        return spec
    spec = sv.peer_spec(kind.removesuffix("-cold"), model, args.dtype, args.peer_args.split())
    spec.name = {"vllm": "vLLM (compile cache warm)", "vllm-cold": "vLLM (first start: empty cache)"}.get(
        kind, spec.name)
    return spec


def prime(spec: sv.Spec, timeout: float) -> dict:
    """Start hotstart on its home and wait until its compile is no longer under way (cache complete)."""
    srv = Server.launch(spec.argv, env={**os.environ, **spec.env}, tag="prime", url=spec.url)
    t0 = time.perf_counter()
    try:
        srv.wait_healthy(t0 + timeout)
        while time.perf_counter() < t0 + timeout:
            fast = (srv.get_json("/startup") or {}).get("fast_path")
            if sv.fast_path_built(fast):
                return {"primed_s": round(time.perf_counter() - t0, 1), "compile": fast.get("compile")}
            time.sleep(1.0)
        return {"primed_s": None, "compile": "still compiling at --prime-timeout"}
    finally:
        srv.stop()


def run_one(kind: str, args, model: str, home: str, eog: list[int]) -> dict:
    extra = {}
    if kind == "hotstart-warm":
        extra["prime"] = prime(spec_for(kind, args, model, home), args.prime_timeout)
        print(f"{kind}: primed the compile cache: {extra['prime']}", flush=True)
    quiet = wait_quiet(args.max_load, args.max_wait)
    spec = spec_for(kind, args, model, home)
    with contextlib.ExitStack() as stack:  # vllm-cold: an empty VLLM_CACHE_ROOT, removed after the stop
        fresh = stack.enter_context(peers.vllm_first_start()) if kind == "vllm-cold" else {}
        srv = Server.launch(spec.argv, env={**os.environ, **spec.env, **fresh}, tag=kind, url=spec.url)
        try:
            records, state = asyncio.run(load(srv, spec, args, eog, srv.t_launch))
        finally:
            stop = srv.stop()
    answered = [r for r in records if r["times"]]
    first = min((r["times"][0] for r in answered), default=None)
    weights = spec.weights.replace("auto", sv.served_dtype(spec.kind, srv.output, model))
    out = {"name": spec.name, "kind": spec.kind, "argv": srv.argv, "env": spec.env, "weights": weights,
           "first_answer_s": first, **{k: v for k, v in state.items() if k != "kind"}, **quiet, **extra,
           "windows": windows(records, args.duration, args.window), "requests_answered": len(answered),
           "requests_failed": sum(1 for r in records if r["error"] and not r["times"]
                                  and r["error"] != "cut at --duration"),
           "requests_cut": sum(1 for r in records if r["error"] == "cut at --duration"), "stop": stop,
           "requests": records}
    curve = " ".join(f"{w['tps']:.0f}" for w in out["windows"])
    print(f"{kind}: first answer {first if first is None else round(first, 2)} s, "
          f"health {state.get('health_s')}, tok/s per {args.window:.0f} s: {curve}", flush=True)
    if not answered:
        print("".join(srv.lines[-40:]), file=sys.stderr)
    return out


def draw(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5), dpi=90)
    for i, r in enumerate(results.values()):
        color = f"C{i % 10}"
        xs = [(w["t0"] + w["t1"]) / 2 for w in r["windows"]]
        ax.plot(xs, [w["tps"] for w in r["windows"]], marker="o", ms=3, color=color,
                label=f"{r['name']} ({r['weights']})")
        if r["first_answer_s"] is not None:
            ax.axvline(r["first_answer_s"], color=color, ls=":", lw=1)
            ax.annotate(f"first answer {r['first_answer_s']:.1f} s", (r["first_answer_s"], 0), rotation=90,
                        xytext=(3, 5), textcoords="offset points", fontsize=7, color=color, va="bottom")
        if r.get("compile_done_s"):
            ax.axvline(r["compile_done_s"], color=color, ls="--", lw=0.8)
    ax.set_xlabel(f"seconds since launch ({args.window:.0f} s windows; dotted: first answer, "
                  "dashed: compile done)")
    ax.set_ylabel(f"output tokens/s ({args.streams} streams, {args.max_tokens} tokens each)")
    ax.set_xlim(0, args.duration)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"Throughput since launch, {Path(args.model_resolved).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_over_time_bench(args) -> int:
    """Entry point of `hotstart bench over-time`."""
    kinds = [k for k in args.servers.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise HotstartError(f"--servers: unknown server {k!r} (known: {', '.join(KINDS)})")
    if "hotstart-cold" in kinds and "hotstart-warm" in kinds and kinds.index("hotstart-warm") < kinds.index(
            "hotstart-cold"):
        raise HotstartError("--servers: hotstart-cold must come before hotstart-warm "
                            "(one HOTSTART_HOME for both)")
    if args.streams < 1 or args.duration <= 0 or args.window <= 0 or args.max_tokens < 1:
        raise HotstartError("bench over-time: --streams, --duration, --window and --max-tokens must be > 0")
    model = args.model
    if model is None:
        from hotstart.boot.default_model import find_gguf

        model = str(find_gguf())
    args.model_resolved = model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    home = tempfile.mkdtemp(prefix="hotstart-home-")  # empty compile cache, shared by cold -> prime -> warm
    eog = sv.eog_ids(model)
    results: dict = {}
    try:
        for kind in kinds:
            results[kind] = run_one(kind, args, model, home, eog)
            data = {"model": model, "args": {k: v for k, v in vars(args).items() if not callable(v)},
                    "hotstart_home": home, "results": results}
            (out / "over_time.json").write_text(json.dumps(data, indent=1))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if results:
        draw(results, out / "over_time.png", args)
    print(f"wrote {out / 'over_time.json'} and {out / 'over_time.png'}")
    return 0

