"""`hotstart bench step`: the decode step in one EngineCore (no HTTP): its profile, the sampler's
cost and the grammar's cost, on one core built once (engine_setup.build_core; parts in step_parts.py).

Run it alone on the machine: it is a timing. The profile's tokens/s is also given as a fraction of
the memory roofline (roofline.py: weights / batch + KV x context, over the measured bandwidth).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hotstart.bench import roofline
from hotstart.errors import HotstartError

PARTS = ("profile", "sampling", "grammar", "blocks")


def _parts(value: str) -> list[str]:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise HotstartError(f"--parts {value!r}: give some of {', '.join(PARTS)}")
    return parts


def report(res: dict) -> list[str]:
    lines = [f"model {res['model']} ({res['dtype']}, fast path {res['fast_path']}), core built in "
             f"{res['build_s']:.1f} s" + (f", packed in {res['pack_s']:.2f} s" if res.get("pack_s") else "")]
    if p := res.get("profile"):
        frac = p.get("roofline_fraction")
        head = (f"profile: {p['streams']} streams x {p['context']}-token context, {p['threads']} threads: "
                f"{p['step_ms']:.2f} ms per decode step = {p['tokens_per_s']:.1f} tok/s")
        head += f" ({frac:.1%} of the roofline)" if frac is not None else ""
        head += (f"; torch ops {p['in_torch_ops_ms']:.2f} ms (profiled; {p['profiled_step_ms']:.2f} ms per "
                 f"step under the profiler), outside ops {p['outside_ops_ms']:.2f} ms")
        lines += ["", head, "",
                  "| op | calls/step | self ms/step | share |", "|---|---:|---:|---:|"]
        lines += [f"| {r['op']} | {r['calls_per_step']:.0f} | {r['self_ms_per_step']:.3f} | "
                  f"{r['self_ms_per_step'] / p['step_ms']:.1%} |" for r in p["top"]]
    if s := res.get("sampling"):
        lines += ["", f"sampling: {s['streams']} streams, {s['rounds']} rounds x {s['steps']} steps",
                  "| kind | ms per decode step (median) | min | x plain |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['step_ms_median']:.2f} | {v['step_ms_min']:.2f} | {v['x_plain']:.3f} |"
                  for k, v in s["kinds"].items()]
    if b := res.get("blocks"):
        lines += ["", f"blocks: {b['streams']} streams x {b['context']}-token context, {b['steps']} steps, "
                      "wall time per decode step (no profiler)", "| block | ms per step |", "|---|---:|"]
        lines += [f"| {r['block']} | {r['ms_per_step']:.2f} |" for r in b["rows"]]
    if g := res.get("grammar"):
        lines += ["", f"grammar: {g['streams']} streams, {g['rounds']} rounds x {g['steps']} steps",
                  "| ms per decode step | median | min |", "|---|---:|---:|",
                  f"| unconstrained | {g['plain_step_ms']['median']:.2f} | {g['plain_step_ms']['min']:.2f} |",
                  f"| all constrained | {g['constrained_step_ms']['median']:.2f} | "
                  f"{g['constrained_step_ms']['min']:.2f} |",
                  f"| overhead | {g['overhead_pct_median']:+.1f} % | {g['overhead_pct_min']:+.1f} % |"]
    return lines


def run_step_bench(args) -> int:
    """Entry point of `hotstart bench step`."""
    from hotstart.bench import step_parts
    from hotstart.bench.engine_setup import build_core

    parts = _parts(args.parts)
    for flag in ("streams", "context", "steps", "rounds"):
        if getattr(args, flag) < 1:
            raise HotstartError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    max_len = args.context + 2 * args.steps + 64
    bw = roofline.bandwidth(args.bandwidth, args.device) if "profile" in parts else None
    bc = build_core(args.model, args.dtype, args.fast_path, args.streams, max_len, args.device)
    res: dict = {"model": str(bc.model_dir), "dtype": bc.dtype, "fast_path": bc.fast_path,
                 "build_s": bc.build_s, "pack_s": bc.pack_s, "cpus": os.cpu_count(),
                 "load1_before": round(os.getloadavg()[0], 2), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    for part in parts:
        if part == "profile":
            p = step_parts.profile(bc, args.streams, args.context, args.steps, args.top)
            mb = roofline.model_bytes(bc.model_dir, bc.dtype)
            p["roofline"] = {"bandwidth": bw, "weights_bytes": mb.weights,
                             "kv_bytes_per_token": mb.kv_per_token}
            # timed steps attend context + 5 warm-up steps + on average half the timed ones
            p["roofline_fraction"] = roofline.fraction(p["tokens_per_s"], mb, args.streams,
                                                       args.context + 5 + args.steps / 2,
                                                       bw and bw["bandwidth_gbs"])
            res["profile"] = p
        elif part == "blocks":
            res["blocks"] = step_parts.blocks(bc, args.streams, args.context, args.steps)
        elif part == "sampling":
            res["sampling"] = step_parts.sampling(bc, args.streams, args.context, args.steps, args.rounds)
        else:
            res["grammar"] = step_parts.grammar(bc, args.streams, args.context, args.steps, args.rounds)
        print(f"hotstart bench step: {part} done", file=sys.stderr, flush=True)
    res["load1_after"] = round(os.getloadavg()[0], 2)
    print("\n".join(report(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0
