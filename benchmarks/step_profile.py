"""Where a decode step's time goes: torch.profiler over STEPS decode steps of N sequences in one
EngineCore (the engine's own code path: scheduler, metadata, forward, sampler), as a table of ops by
self CPU time plus what is left for Python between ops.

    python benchmarks/step_profile.py [--model DIR] [--streams 16] [--context 128] [--steps 20]
        [--packed] [--top 15] [--json out.json]

--packed packs the linear weights for oneDNN first, as `--compile eager-only|auto` does behind READY.
Run it alone on the machine: it is a timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--packed", action="store_true", help="pack the linear weights for oneDNN first")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hotstart.boot.default_model import ensure_default_model
    from hotstart.config import EngineConfig
    from hotstart.engine.core import EngineCore
    from hotstart.messages import EngineRequest, SamplingParams
    from hotstart.model import packed
    from hotstart.model.files import weight_files
    from hotstart.model.layers import Linear

    model = Path(args.model) if args.model else ensure_default_model(quiet=True)
    cfg = EngineConfig(model_path=str(model), weight_files=tuple(map(str, weight_files(model))),
                       max_model_len=args.context + 2 * args.steps + 64, max_num_seqs=args.streams, compile="off")
    core = EngineCore.build(cfg)
    if args.packed:
        net = core.runner.model
        for m in net.modules():
            if isinstance(m, Linear):
                m.packed = packed.pack(m.weight)
        net.lm_head_packed = packed.pack(net.output_weight())
    for i in range(args.streams):
        params = SamplingParams(max_tokens=2 * args.steps + 12, temperature=0.0, ignore_eos=True)
        core.add_request(EngineRequest(f"p{i}", [(7 * i + j) % 1000 + 10 for j in range(args.context)], params))
    while core.scheduler.waiting or any(s.num_generated == 0 for s in core.scheduler.running):
        core.step()  # prefill (chunked or not)
    for _ in range(5):
        core.step()  # warm: first-use costs out of the way
    t = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    wall_ms = (time.perf_counter() - t) * 1000 / args.steps  # unprofiled: the profiler adds ~20 us per op
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            core.step()
    profiled_ms = (time.perf_counter() - t) * 1000 / args.steps
    rows = []
    for e in prof.key_averages():
        rows.append({"op": e.key, "calls_per_step": e.count / args.steps,
                     "self_ms_per_step": e.self_cpu_time_total / 1000 / args.steps})
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    in_ops = sum(r["self_ms_per_step"] for r in rows)
    out = {"streams": args.streams, "context": args.context, "packed": args.packed, "threads": torch.get_num_threads(),
           "step_ms": round(wall_ms, 2), "profiled_step_ms": round(profiled_ms, 2),
           "in_torch_ops_ms": round(in_ops, 2),
           "outside_ops_ms": round(wall_ms - in_ops, 2), "top": rows[: args.top]}
    print(f"{args.streams} streams x {args.context}-token context, {'packed' if args.packed else 'plain'} weights, "
          f"{out['threads']} threads: {wall_ms:.2f} ms per decode step ({profiled_ms:.2f} under the profiler); "
          f"self time of torch ops {in_ops:.2f} ms (profiled), the rest (Python: scheduler, metadata, sampler, "
          f"op dispatch) {wall_ms - in_ops:.2f} ms")
    print("| op | calls/step | self ms/step | share |\n|---|---:|---:|---:|")
    for r in rows[: args.top]:
        print(f"| {r['op']} | {r['calls_per_step']:.0f} | {r['self_ms_per_step']:.3f} | "
              f"{r['self_ms_per_step'] / wall_ms:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
