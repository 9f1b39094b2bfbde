"""Swap time (issue 24): one `hotstart serve A B --max-loaded-models 1`, requests alternating between the two
models, so each one loads its model (evicting the other) before it answers.

    python benchmarks/swap.py MODEL_A MODEL_B [--rounds 5] [--out swap.json] [-- SERVE FLAGS...]

Per request: the time to the first streamed token of a short completion. "swap" is a request for the
unloaded model, "loaded" the same request again at once (the floor). Medians printed, every sample in
--out. The weights are page-cached after the first round (read once by each model's first load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

from hotstart.bench.process import Server


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.serve = argv[cut + 1:]  # more `hotstart serve` flags
    argv = [sys.executable, "-m", "hotstart", "serve", f"a={args.a}", f"b={args.b}", "--port", "0",
            "--max-loaded-models", "1", "--keep-alive", "-1", *args.serve]
    srv = Server.launch(argv, tag="hotstart swap")
    samples: dict[str, list[float]] = {"swap": [], "loaded": []}
    try:
        deadline = time.perf_counter() + 300
        url = srv.wait_url(deadline)
        srv.wait_healthy(deadline)
        first_token_s(url, "a")  # the first loads read the files; later rounds swap page-cached models
        first_token_s(url, "b")
        for _ in range(args.rounds):
            for model in ("a", "b"):
                samples["swap"].append(first_token_s(url, model))
                samples["loaded"].append(first_token_s(url, model))
    finally:
        srv.stop()
    for k, v in samples.items():
        print(f"{k:7s} median {statistics.median(v):.3f} s  (min {min(v):.3f}, max {max(v):.3f}, n={len(v)})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": argv, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
