"""Swap time (issue 24): one `hotstart serve A B --max-loaded-models 1`, requests alternating between the two
models, so each one loads its model (evicting the other) before it answers.

    python benchmarks/swap.py MODEL_A MODEL_B [--rounds 5] [--restart hotstart,vllm,llamacpp] [--gap MODEL_C]
                              [--out swap.json] [-- SERVE FLAGS...]

Per request: the time to the first streamed token of a short completion. "swap" is a request for the
unloaded model, "loaded" the same request again at once (the floor). Medians printed, every sample in
--out. The weights are page-cached after the first round (read once by each model's first load).

--restart K,...: the alternative a user has without swapping: start a fresh server of MODEL_A (a
`hotstart serve`, and the peers `make peers` set up: vllm, llamacpp) and time launch -> first answer of
a short chat completion, once per round, interleaved with the swaps (warm: the files are page-cached).

--gap MODEL_C: serve a, b and c with --max-loaded-models 2 instead; c streams a long completion
throughout while a and b swap in and out of the other slot; reports the longest gap between two of c's
tokens during the swaps (goal: no error, no gap over 150 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import httpx

from hotstart.bench.process import Server
from hotstart.bench.servers import hotstart_spec, peer_spec


def first_token_s(url: str, model: str) -> float:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "stream": True}
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                return time.perf_counter() - t
    raise RuntimeError(f"{model}: no token in the stream")


def restart_s(kind: str, model: str) -> float:
    """Launch a fresh server of MODEL (hotstart or a peer) -> its first chat answer, in seconds."""
    spec = hotstart_spec(model, "auto", []) if kind == "hotstart" else peer_spec(kind, model, "float32", [])
    srv = Server.launch(spec.argv, env={**os.environ, **spec.env}, tag=spec.name, url=spec.url)
    try:
        srv.wait_url(srv.t_launch + 600)  # hotstart's `--port 0`: read from its output
        _, t = srv.ask("The capital of France is", 8, None, srv.t_launch + 600)
        return t
    finally:
        srv.stop()


class Streamer(threading.Thread):
    """One long streamed completion of MODEL; the arrival time of every token."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.times: list[float] = []
        self.error: str | None = None
        self.stop_asked = False

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 1800, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"text"' in line:
                        self.times.append(time.perf_counter())
                    elif '"error"' in line:
                        self.error = line[:300]
        except (httpx.HTTPError, OSError) as e:
            if not self.error and not self.stop_asked:
                self.error = f"{type(e).__name__}: {e}"


def max_gap(times: list[float], start: float, end: float) -> float:
    inside = [t for t in times if start <= t <= end]
    return max((b - a for a, b in zip(inside, inside[1:], strict=False)), default=float("nan"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--restart", default="", help="comma-separated: hotstart,vllm,llamacpp")
    p.add_argument("--gap", default=None, metavar="MODEL_C")
    p.add_argument("--out", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.serve = argv[cut + 1:]  # more `hotstart serve` flags
    restarts = [k for k in args.restart.split(",") if k]
    models = [f"a={args.a}", f"b={args.b}", *([f"c={args.gap}"] if args.gap else [])]
    argv = [sys.executable, "-m", "hotstart", "serve", *models, "--port", "0",
            "--max-loaded-models", "2" if args.gap else "1", "--keep-alive", "-1", *args.serve]
    srv = Server.launch(argv, tag="hotstart swap")
    samples: dict[str, list[float]] = {"swap": [], "loaded": [], **{f"restart {k}": [] for k in restarts}}
    streamer = None
    try:
        deadline = time.perf_counter() + 300
        url = srv.wait_url(deadline)
        srv.wait_healthy(deadline)
        if args.gap:
            first_token_s(url, "c")
            streamer = Streamer(url, "c")
            streamer.start()
        first_token_s(url, "a")  # the first loads read the files; later rounds swap page-cached models
        first_token_s(url, "b")
        t_swaps = time.perf_counter()
        for _ in range(args.rounds):
            for model in ("a", "b"):
                samples["swap"].append(first_token_s(url, model))
                samples["loaded"].append(first_token_s(url, model))
            for k in restarts:  # the server under test idles meanwhile
                samples[f"restart {k}"].append(restart_s(k, args.a))
        t_end = time.perf_counter()
        if streamer is not None:
            time.sleep(0.5)
            gap = max_gap(streamer.times, t_swaps, t_end)
            ok = streamer.is_alive() and streamer.error is None
            print(f"c's stream during {args.rounds * 2} swaps: {len(streamer.times)} tokens, longest gap "
                  f"{gap * 1000:.0f} ms, {'no error' if ok else f'ERROR: {streamer.error}'}")
            samples["gap_ms"] = [gap * 1000]
    finally:
        if streamer is not None:
            streamer.stop_asked = True
        srv.stop()
    for k, v in samples.items():
        if v and k != "gap_ms":
            print(f"{k:18s} median {statistics.median(v):.3f} s  (min {min(v):.3f}, max {max(v):.3f}, "
                  f"n={len(v)})")
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": argv, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
