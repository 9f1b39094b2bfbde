"""`hotstart bench startup`'s weight-read table: how fast each cold start read its weights, against the
floor's reader (4 threads x 16 MiB preadv, bench/floor.py) in the same round, so a reader slower than
the disk shows as a number.

A start's read rate is the weights' bytes over the time from "prefetch started" (the first weight read
the start asks for) to the end of "weights loaded" (the engine has every byte resident): the bytes the
start needed, over the time it took to have them, whoever read them (the prefetcher ahead, the loader
behind). The prefetcher's own rate and its thread count (boot/tuner.py: where it ended) are beside it.
"""

from __future__ import annotations

import statistics

COLD_MODES = ("all", "weights")


def _phase(run: dict, name: str) -> dict | None:
    for p in (run.get("timeline") or {}).get("phases") or []:
        if str(p.get("name", "")).startswith(name):
            return p
    return None


def start_read(run: dict) -> dict | None:
    """{gbps, prefetch_gbps, threads} of one run's weight read, or None where its timeline lacks it."""
    began, loaded = _phase(run, "prefetch started"), _phase(run, "weights loaded")
    pf = (run.get("timeline") or {}).get("prefetch") or {}
    total = pf.get("bytes_total")
    if not (began and loaded and total):
        return None
    took = float(loaded["end_s"]) - float(began["start_s"])
    if took <= 0:
        return None
    return {"gbps": total / took / 1e9, "prefetch_gbps": pf.get("gbps"),
            "threads": pf.get("threads"), "threads_max": pf.get("threads_max")}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return fmt.format(x) if x is not None else ""


def read_table(data: dict) -> list[str]:
    """Per cold mode and hotstart config: the start's read GB/s, the prefetcher's, its final threads, the
    floor reader's GB/s of the same rounds and the ratio (medians over runs); [] without cold runs."""
    labels = [c["label"] for c in data["meta"]["configs"] if c["kind"] == "hotstart"]
    lines = ["", "Weight read, in the start vs the floor's reader (cold modes, medians over runs):", "",
             "| mode | config | start GB/s | prefetch GB/s | threads (end / most) | floor read GB/s "
             "| start / floor |", "|---|---|---|---|---|---|---|"]
    rows = 0
    for mode in (m for m in data["meta"]["modes"] if m in COLD_MODES):
        floor = {f["round"]: f.get("gbps") for f in data["floor"]
                 if f["mode"] == mode and f["what"] == "read_weights" and f["ok"] and not f["warmup"]}
        for label in labels:
            reads, ratios = [], []
            for r in data["runs"]:
                if r["mode"] != mode or r["config"] != label or not r["ok"] or r["warmup"]:
                    continue
                got = start_read(r)
                if got is None:
                    continue
                reads.append(got)
                if floor.get(r["round"]):
                    ratios.append(got["gbps"] / floor[r["round"]])
            if not reads:
                continue
            rows += 1
            threads = [f"{g['threads']}/{g['threads_max']}" for g in reads if g.get("threads") is not None]
            lines.append(
                f"| {mode} | {label} | {_f(_median([g['gbps'] for g in reads]))} "
                f"| {_f(_median([g['prefetch_gbps'] for g in reads if g.get('prefetch_gbps')]))} "
                f"| {', '.join(threads)} | {_f(_median([v for v in floor.values() if v]))} "
                f"| {_f(_median(ratios), '{:.2f}x')} |")
    return lines if rows else []
