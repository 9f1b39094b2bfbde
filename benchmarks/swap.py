"""Swaps and the prefix cache that survives (issues 24, 44): every goal of issue 44 in one interleaved run.

    python benchmarks/swap.py A B C [--big BIG] [--rounds 3] [--system-tokens 2000]
        [--variants 'default;flat=HOTSTART_LOAD_NICE=0,HOTSTART_LOAD_THREADS=0;cold=--no-prefetch']
        [--restart hotstart,llamacpp]
        [--out swap.json] [-- SERVE FLAGS...]

One `hotstart serve a=A b=B c=C [d=BIG] --max-loaded-models 2 --pin c --keep-alive -1` per round and
variant (a variant: VAR=value environment words and more serve flags; variants interleave in each round),
its KV blocks in a private folder. Per round, after one warm-up load of each model (tokenizer, page cache):
  swap            first token of a 4-token streamed completion for the unloaded one of a / b (the other is
                  evicted); `loaded` the same request again (the floor); the swap's timeline from /startup
                  (evictions, fork, weights, engine ready, first request served)
  swap 7B         the same for d (--big), page-cached after its warm-up
  beside stream   c streams one long completion; after a quiet window, b and a are swapped in (first token
                  of each), then another quiet window: c's longest gap between tokens while a model loads,
                  and its tokens/s while loading / in the quiet windows
  prefix          a chat request with a --system-tokens system prompt never seen (cold prefill), the same
                  prompt again with another question (warm prefix cache), then after an unload and a load of
                  the model (prefix read back from disk), and after a restart of the server (a new server,
                  the model loaded, then the request): TTFT of each, each once the model's fast path is
                  built (/startup), so that all four run on the path it serves on for good
--restart K,...: once per round, a fresh server of A (hotstart, vllm, llamacpp from `make peers`) timed from
launch to its first chat answer (the alternative to swapping). Medians are printed, every sample in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

import httpx

from hotstart.bench.process import Server
from hotstart.bench.servers import fast_path_built, hotstart_spec, peer_spec

QUIET_S = 1.5
PHASES = ("engine forked", "weights loaded", "KV cache allocated", "engine ready", "model serving",
          "first step", "first request served")
GOALS = {"swap": ("<=", 0.3), "beside stream": ("<=", 0.3), "swap 7B": ("<=", 1.5), "gap ms": ("<=", 100),
         "rate ratio": (">=", 0.8), "unload / warm": ("<=", 1.3), "unload / cold": ("<=", 0.25),
         "restart / warm": ("<=", 1.3), "restart / cold": ("<=", 0.25)}


_CLIENT: list[httpx.Client] = []  # one for the run: a new client costs ~20 ms (its TLS context) per request


def first_token(url: str, model: str, messages: list | None = None) -> float:
    """Seconds from sending a streamed request to its first token (a chunk with text or logprobs)."""
    if not _CLIENT:
        _CLIENT.append(httpx.Client(timeout=600))
    chat = messages is not None
    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True,
            **({"messages": messages, "logprobs": True} if chat else
               {"prompt": "The capital of France is", "logprobs": 1})}
    t = time.perf_counter()
    with _CLIENT[0].stream("POST", f"{url}/v1/{'chat/' if chat else ''}completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                if c.get("logprobs") or (c.get("delta", {}).get("content") if chat else c.get("text")):
                    return time.perf_counter() - t
    raise RuntimeError(f"{model}: no token in the stream")


class Streamer(threading.Thread):
    """One long streamed completion of MODEL (as long as its context allows); the arrival time of every
    token (halt.set() hangs up)."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.times, self.error = url, model, [], None
        self.halt = threading.Event()
        card = httpx.get(f"{url}/v1/models/{model}", timeout=30).json()
        self.max_tokens = card["max_model_len"] - 16

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"text"' in line:
                        self.times.append(time.perf_counter())
                    elif '"error"' in line:
                        self.error = line[:300]
                    if self.halt.is_set():
                        return
        except (httpx.HTTPError, OSError) as e:
            self.error = self.error or f"{type(e).__name__}: {e}"


def window(times: list[float], start: float, end: float) -> tuple[int, float]:
    """(tokens in [START, END], the longest gap between two of them)."""
    inside = [t for t in times if start <= t <= end]
    return len(inside), max((b - a for a, b in zip(inside, inside[1:])), default=0.0)


def system_prompt(url: str, model: str, tokens: int, seed: int) -> str:
    """Random words until /tokenize counts TOKENS (a prompt no earlier round has seen)."""
    rng, words = random.Random(seed), []
    while True:
        words += [rng.choice(("alpha", "river", "stone", "quiet", "market", "seven", "blue", "north"))
                  for _ in range(max(16, tokens // 8))]
        text = " ".join(words)
        n = httpx.post(url + "/tokenize", json={"model": model, "prompt": text}, timeout=60).json()["count"]
        if n >= tokens:
            return text


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def timeline(url: str, model: str) -> dict[str, float]:
    """The last load of MODEL: seconds from its request to each phase's end (room: the evictions)."""
    entry = httpx.get(url + "/startup", timeout=30).json()["models"][model]
    room = entry.get("room_seconds") or 0.0
    out = {"room (evictions)": room}
    for span in entry.get("phases", []):
        if span["name"] in PHASES:
            out[span["name"]] = room + span["end_s"]
            if span["name"] == "first step":
                out["first step begins"] = room + span["start_s"]
    return out


def settle(url: str, model: str, timeout: float = 300.0) -> None:
    """Until MODEL's fast path is built: the prefix TTFTs compare the path it serves on for good."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = httpx.get(url + "/startup", timeout=30).json()["models"][model]
        if fast_path_built(entry.get("fast_path") or {}):
            return
        time.sleep(0.5)


def launch(args, env: dict, flags: list[str], models: list[str]) -> Server:
    argv = [sys.executable, "-m", "hotstart", "serve", *models, "--port", "0", "--max-loaded-models", "2",
            "--pin", "c", "--keep-alive", "-1", *args.serve, *flags]
    srv = Server.launch(argv, tag="hotstart swap", env={**os.environ, **env})
    deadline = time.perf_counter() + 600
    srv.wait_url(deadline)
    srv.wait_healthy(deadline)
    return srv


def one_round(args, env: dict, flags: list[str], models: list[str], r: int, s: dict[str, list],
              salt: int = 0) -> None:
    srv = launch(args, env, flags, models)
    url = srv.url
    try:
        for m in ("a", "b", *(["d"] if args.big else [])):
            first_token(url, m)  # warm-up: tokenizer, page cache
        for m in ("a", "b"):
            s["swap"].append(first_token(url, m))
            s["timeline"].append(timeline(url, m))
            s["loaded"].append(first_token(url, m))
        if args.big:
            s["swap 7B"].append(first_token(url, "d"))
        stream = Streamer(url, "c")
        stream.start()
        while len(stream.times) < 3 and stream.is_alive():
            time.sleep(0.05)
        quiet = [(time.perf_counter(), time.perf_counter() + QUIET_S)]
        time.sleep(QUIET_S)
        loads = []
        for m in ("b", "a"):
            t = time.perf_counter()
            s["beside stream"].append(first_token(url, m))
            loads.append((t, time.perf_counter()))
        quiet.append((time.perf_counter(), time.perf_counter() + QUIET_S))
        time.sleep(QUIET_S)
        stream.halt.set()
        stream.join(30)
        n_load, gaps = zip(*(window(stream.times, a, b) for a, b in loads))
        n_quiet = [window(stream.times, a, b)[0] for a, b in quiet]
        rate_load = sum(n_load) / sum(b - a for a, b in loads)
        rate_quiet = sum(n_quiet) / sum(b - a for a, b in quiet)
        s["gap ms"].append(1000 * max(gaps))
        s["rate ratio"].append(rate_load / rate_quiet if rate_quiet else float("nan"))
        if stream.error:
            s["errors"].append(stream.error)
        # a prompt no earlier round or variant has seen (their blocks share the store's folder)
        system = system_prompt(url, "a", args.system_tokens, seed=100000 * salt + 1000 * r + len(s["cold"]))
        settle(url, "a")
        s["cold"].append(first_token(url, "a", chat(system, "Summarise it.")))
        s["warm"].append(first_token(url, "a", chat(system, "Which word comes first?")))
        httpx.post(f"{url}/v1/models/a/unload", json={}, timeout=60).raise_for_status()
        httpx.post(f"{url}/v1/models/a/load", json={}, timeout=600).raise_for_status()
        settle(url, "a")
        s["after unload"].append(first_token(url, "a", chat(system, "How many words are there?")))
    finally:
        srv.stop()
    srv = launch(args, env, flags, models)
    try:
        httpx.post(f"{srv.url}/v1/models/a/load", json={}, timeout=600).raise_for_status()
        settle(srv.url, "a")
        s["after restart"].append(first_token(srv.url, "a", chat(system, "Which word comes last?")))
    finally:
        srv.stop()
    for k in ("unload", "restart"):
        s[f"{k} / warm"].append(s[f"after {k}"][-1] / s["warm"][-1])
        s[f"{k} / cold"].append(s[f"after {k}"][-1] / s["cold"][-1])


def restart_s(kind: str, model: str) -> float:
    """Launch a fresh server of MODEL (hotstart or a peer) -> its first chat answer, in seconds."""
    spec = hotstart_spec(model, "auto", []) if kind == "hotstart" else peer_spec(kind, model, "float32", [])
    srv = Server.launch(spec.argv, env={**os.environ, **spec.env}, tag=spec.name, url=spec.url)
    try:
        srv.wait_url(srv.t_launch + 600)
        return srv.ask("The capital of France is", 8, None, srv.t_launch + 600)[1]
    finally:
        srv.stop()


def report(samples: dict[str, dict[str, list]]) -> None:
    for variant, s in samples.items():
        print(f"--- {variant}")
        for k, v in s.items():
            if k in ("timeline", "errors") or not v:
                continue
            goal = GOALS.get(k)
            med = statistics.median(v)
            mark = "" if goal is None else f"  goal {goal[0]} {goal[1]}: " + (
                "met" if (med <= goal[1] if goal[0] == "<=" else med >= goal[1]) else "MISSED")
            print(f"{k:16s} median {med:8.3f}  (min {min(v):.3f}, max {max(v):.3f}, n={len(v)}){mark}")
        ends = {}  # phase -> its median end, seconds after the swap's request
        for p in {p for t in s["timeline"] for p in t}:
            ends[p] = statistics.median(t[p] for t in s["timeline"] if p in t)
        for p, end in sorted(ends.items(), key=lambda kv: kv[1]):
            print(f"  swap timeline: {p:22s} ends {end:.3f} s after the request")
        print(f"  stream errors: {s['errors'] or 'none'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("c")
    p.add_argument("--big", default=None, metavar="MODEL")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--variants", default="default",
                   help="NAME[=VAR=value,--flag,...];... (server environments and more serve flags)")
    p.add_argument("--restart", default="", help="comma-separated: hotstart,vllm,llamacpp")
    p.add_argument("--out", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.serve = argv[cut + 1:]  # more `hotstart serve` flags
    models = [f"a={args.a}", f"b={args.b}", f"c={args.c}", *([f"d={args.big}"] if args.big else [])]
    variants = {}  # name -> (environment, more serve flags)
    for item in args.variants.split(";"):
        name, _, words = item.partition("=")
        words = [w.strip() for w in words.split(",") if w.strip()]
        variants[name.strip()] = (dict(w.split("=", 1) for w in words if not w.startswith("--")),
                                  [w for w in words if w.startswith("--")])
    keys = ("swap", "loaded", "swap 7B", "beside stream", "gap ms", "rate ratio", "cold", "warm",
            "after unload", "after restart", "unload / warm", "unload / cold", "restart / warm",
            "restart / cold", "timeline", "errors")
    samples = {v: {k: [] for k in keys} for v in variants}
    restarts: dict[str, list[float]] = {k: [] for k in args.restart.split(",") if k}
    kv = tempfile.mkdtemp(prefix="hotstart-swap-kv-")  # blocks of this run only
    try:
        for r in range(args.rounds):
            for i, (name, (env, flags)) in enumerate(variants.items()):
                one_round(args, {"HOTSTART_KV_DIR": kv, **env}, flags, models, r, samples[name], salt=i)
            for k in restarts:
                restarts[k].append(restart_s(k, args.a))
    finally:
        shutil.rmtree(kv, ignore_errors=True)
    report(samples)
    for k, v in restarts.items():
        print(f"restart {k}: median {statistics.median(v):.3f} s (n={len(v)})")
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv, "samples": samples, "restarts": restarts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
