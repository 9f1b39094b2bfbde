"""What the general sampler costs: decode steps of N sequences with plain sampling against the same
sequences with penalties / biases / min_p, in one EngineCore, interleaved rounds, medians.

    python benchmarks/sampling_overhead.py [--model DIR] [--streams 16] [--rounds 5] [--steps 20]

Each round starts N fresh requests of each kind (temperature 0.8, seeded), prefills them, then times
STEPS decode steps; kinds alternate within a round so drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "bias+min_p": {"logit_bias": {5: -100.0, 6: 5.0}, "min_p": 0.05, "min_tokens": 8},
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", default="off", help="the engine's fast path (off: the plain eager path)")
    args = p.parse_args()
    from hotstart.boot.default_model import ensure_default_model
    from hotstart.config import EngineConfig
    from hotstart.engine.core import EngineCore
    from hotstart.messages import EngineRequest, SamplingParams
    from hotstart.model.files import weight_files

    model = Path(args.model) if args.model else ensure_default_model(quiet=True)
    cfg = EngineConfig(model_path=str(model), weight_files=tuple(map(str, weight_files(model))),
                       max_model_len=1024, max_num_seqs=args.streams, compile=args.compile)
    core = EngineCore.build(cfg)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for rnd in range(args.rounds + 1):  # round 0: warm-up
        for kind, extra in KINDS.items():
            for i in range(args.streams):
                params = SamplingParams(max_tokens=args.steps + 2, temperature=0.8, seed=i, ignore_eos=True, **extra)
                core.add_request(EngineRequest(f"{kind}-{rnd}-{i}", list(range(100 + i, 140 + i)), params))
            core.step()  # prefill
            t = time.perf_counter()
            for _ in range(args.steps):
                core.step()
            if rnd:
                times[kind].append((time.perf_counter() - t) / args.steps)
            while core.has_work():
                core.step()
    plain = statistics.median(times["plain"])
    out = {k: {"step_ms_median": round(statistics.median(v) * 1000, 2), "min": round(min(v) * 1000, 2),
               "x_plain": round(statistics.median(v) / plain, 3)} for k, v in times.items()}
    print(json.dumps({"streams": args.streams, "rounds": args.rounds, "steps": args.steps, "kinds": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
