"""Offline batch inference through the Python API (issue 28): hotstart's `LLM` against vLLM's, same model,
same script, one interleaved run.

    python benchmarks/offline.py [MODEL] [--rounds 3] [--prompts 1000] [--tokens 64] [--out offline.json]

Each round starts a fresh Python process per target that runs the same code with `from <pkg> import LLM,
SamplingParams` (pkg = hotstart, or vllm from the venv `make peers` set up, with the environment its
command line in commands.env names), and reports:
  import_s  `import <pkg>` (wall clock from the process's first line)
  first_s   from before the import to the first `generate` result (one prompt, 8 tokens, greedy): what a
            script waits for before its first answer
  batch     --prompts different prompts (a numbered sentence each, ~20-30 tokens), --tokens tokens each,
            ignore_eos, greedy, in one `generate` call: output tokens/s
Medians of rounds; ratios hotstart / vLLM (tokens/s: > 1 is faster; times: < 1 is sooner). The model's
files are page-cached by the first round (warm starts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hotstart.bench.peers import known_peer, split_command  # noqa: E402

# Runs in the target's interpreter: argv = pkg model prompts tokens max_model_len
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
pkg, model = sys.argv[1], sys.argv[2]
n, tokens, max_len = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
mod = __import__(pkg)
t_import = time.perf_counter()
llm = mod.LLM(model=model, max_model_len=max_len, dtype="float32")
t_ready = time.perf_counter()
first = llm.generate(["The capital of France is"], mod.SamplingParams(max_tokens=8, temperature=0),
                     use_tqdm=False)
t_first = time.perf_counter()
prompts = [f"Request {i}: write a short story about a {('red', 'blue', 'green', 'old')[i % 4]} {i}-sided die "
           f"found on a train." for i in range(n)]
params = mod.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
dt = time.perf_counter() - t
out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
print("RESULT " + json.dumps({"import_s": t_import - t0, "ready_s": t_ready - t0, "first_s": t_first - t0,
                              "first_text": first[0].outputs[0].text, "batch_s": dt, "out_tokens": out_tokens,
                              "tok_s": out_tokens / dt}), flush=True)
"""


def targets(model: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """label -> (environment, argv prefix running CHILD)."""
    env = {"PYTHONPATH": str(REPO), "PYTHONSAFEPATH": "1"}
    out = {"hotstart": (env, [sys.executable, "-c", CHILD, "hotstart"])}
    _, cmd = known_peer("vllm")
    venv_env, words = split_command(cmd, "VLLM_PEER")
    python = str(Path(words[0]).parent / "python")
    out["vLLM"] = (venv_env, [python, "-c", CHILD, "vllm"])
    return out


def run_one(env: dict[str, str], argv: list[str], timeout: float) -> dict:
    t = time.perf_counter()
    p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "wall_s": wall}
    raise RuntimeError(f"{argv[0]} exited {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "model", nargs="?", default=str(Path.home() / ".cache/hotstart/bench-models/SmolLM2-135M-Instruct")
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tgts = targets(args.model)
    res: dict[str, list[dict]] = {k: [] for k in tgts}
    for r in range(args.rounds):
        for label, (env, argv) in tgts.items():
            one = run_one(
                env,
                [*argv, args.model, str(args.prompts), str(args.tokens), str(args.max_model_len)],
                args.timeout,
            )
            res[label].append(one)
            print(
                f"round {r + 1} {label}: import {one['import_s']:.2f} s, first answer {one['first_s']:.2f} s "
                f"({one['first_text']!r}), batch {one['tok_s']:.1f} tok/s ({one['out_tokens']} tokens in "
                f"{one['batch_s']:.1f} s)",
                flush=True,
            )
    med = {
        k: {m: statistics.median(x[m] for x in v) for m in ("import_s", "first_s", "tok_s")}
        for k, v in res.items()
    }
    print(
        f"\nload average {os.getloadavg()[0]:.2f}; medians of {args.rounds} rounds, {args.prompts} prompts x "
        f"{args.tokens} tokens"
    )
    print("| target | import (s) | import -> first result (s) | batch output tok/s |\n|---|---|---|---|")
    for k, m in med.items():
        print(f"| {k} | {m['import_s']:.2f} | {m['first_s']:.2f} | {m['tok_s']:.1f} |")
    h, v = med["hotstart"], med["vLLM"]
    print(
        f"hotstart / vLLM: first result {h['first_s'] / v['first_s']:.2f}x, "
        f"batch tok/s {h['tok_s'] / v['tok_s']:.2f}x"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": res, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
