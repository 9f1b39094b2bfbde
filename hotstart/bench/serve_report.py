"""Tables of `hotstart bench serve`: per level (prompt length x concurrency) and target, the medians of
its rounds under vLLM's metric names, then each target against the baseline."""

from __future__ import annotations

import statistics

from hotstart.bench.metrics import median_of_runs


def summarize(runs: list[dict], targets: list[str], levels: list[tuple[int, int]]) -> list[dict]:
    """One row per (target, input length, concurrency): medians of its kept (not warm-up) runs."""
    rows = []
    for n, c in levels:
        for label in targets:
            mine = [r for r in runs if r["target"] == label and r["input_len"] == n and r["concurrency"] == c]
            if not mine:
                continue
            row = {"target": label, "input_len": n, "concurrency": c,
                   **median_of_runs(r["metrics"] for r in mine)}
            fr = [r["roofline_fraction"] for r in mine if r.get("roofline_fraction") is not None]
            row["roofline_fraction"] = statistics.median(fr) if fr else None
            row["noisy_rounds"] = sum(1 for r in mine if r.get("noisy"))
            loads = [r["load1"] for r in mine]
            row["load1_range"] = [min(loads), max(loads)]
            rows.append(row)
    return rows


def ratios(summary: list[dict], baseline: str) -> list[dict]:
    """Each other target over BASELINE per level: output tok/s (> 1 is faster), TTFT and TPOT medians
    (< 1 is faster)."""
    base = {(r["input_len"], r["concurrency"]): r for r in summary if r["target"] == baseline}
    out = []
    for r in summary:
        b = base.get((r["input_len"], r["concurrency"]))
        if r["target"] == baseline or b is None:
            continue
        out.append({"target": r["target"], "baseline": baseline, "input_len": r["input_len"],
                    "concurrency": r["concurrency"],
                    "output_throughput": _ratio(r["output_throughput"], b["output_throughput"]),
                    "ttft_median": _ratio(r["ttft_ms"].get("median"), b["ttft_ms"].get("median")),
                    "tpot_median": _ratio(r["tpot_ms"].get("median"), b["tpot_ms"].get("median"))})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _lat(stats: dict) -> str:
    return " / ".join(_f(stats.get(k)) for k in ("mean", "median", "p99"))


def tables(data: dict) -> list[str]:
    meta, summary = data["meta"], data["summary"]
    served = {t["label"]: t.get("weights") or "?" for t in meta["targets"]}
    bw = meta.get("bandwidth") or {}
    lines = [f"Model {meta['model']}; {meta['endpoint']}, random prompts, {meta['output_len']} output tokens "
             f"(ignore_eos), {meta['rounds']} rounds, medians of rounds; load average "
             f"{meta['load1_start']} at the start; roofline "
             + (f"{bw['bandwidth_gbs']:.1f} GB/s ({bw['source']})" if bw else "unknown"), "",
             "| input | conc. | target | serves | req/s | output tok/s | total tok/s | roofline | "
             "TTFT mean / median / p99 (ms) | TPOT mean / median / p99 (ms) | ITL mean / median / p99 (ms) | "
             "E2E median (ms) | ok / failed | noisy |",
             "|---:|---:|---|---|---:|---:|---:|---:|---|---|---|---:|---|---:|"]
    for r in summary:
        lines.append(
            f"| {r['input_len']} | {r['concurrency']} | {r['target']} | {served.get(r['target'], '?')} | "
            f"{_f(r['request_throughput'], '{:.2f}')} | {_f(r['output_throughput'])} | "
            f"{_f(r['total_token_throughput'])} | {_f(r['roofline_fraction'], '{:.1%}')} | "
            f"{_lat(r['ttft_ms'])} | {_lat(r['tpot_ms'])} | {_lat(r['itl_ms'])} | "
            f"{_f(r['e2el_ms'].get('median'))} | {r['completed']} / {r['failed']} | {r['noisy_rounds']} |")
    if data.get("ratios"):
        b = data["ratios"][0]["baseline"]
        lines += ["", f"| input | conc. | target | output tok/s / {b} | TTFT median / {b} | "
                      f"TPOT median / {b} |", "|---:|---:|---|---:|---:|---:|"]
        for q in data["ratios"]:
            lines.append(f"| {q['input_len']} | {q['concurrency']} | {q['target']} | "
                         f"{_f(q['output_throughput'], '{:.2f}x')} | {_f(q['ttft_median'], '{:.2f}x')} | "
                         f"{_f(q['tpot_median'], '{:.2f}x')} |")
    return lines


def progress_line(rec: dict, rounds: int, width: int) -> str:
    m = rec["metrics"]
    frac = rec.get("roofline_fraction")
    return (f"  round {rec['round']}/{rounds} {rec['target']:{width}s} in={rec['input_len']:<5d} "
            f"C={rec['concurrency']:<3d} {m['output_throughput']:8.1f} out tok/s"
            + (f" ({frac:.0%} roofline)" if frac is not None else "")
            + f", TTFT median {_f(m['ttft_ms']['median'])} ms, TPOT median {_f(m['tpot_ms']['median'])} ms, "
            f"{m['completed']} ok / {m['failed']} failed, other processes {rec['other_cores']:.2f} cores"
            + (" (noisy: again)" if rec.get("again") else ""))
