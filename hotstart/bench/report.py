"""Reports of `hotstart bench startup`: progress lines, the summary table (markdown), the PNG.

Pure Python until write_png, which imports matplotlib (only after every run has finished).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from hotstart.bench.floor import IMPORTS_ALONE
from hotstart.bench.report_read import read_table

COST_GOAL = 1.15  # the start's own cost (t_first - t_repeat) against the floor: the goal's column


def progress_line(rec: dict, rnd: int, runs: int, width: int) -> str:
    """One line per finished run or floor measurement."""
    head = f"[{'warm-up' if rnd < 0 else f'{rnd + 1}/{runs}'} {rec['mode']:>7}]"
    res = " ".join(f"{k} {v:.1f}%" for k, v in rec.get("residency", {}).items())
    if "what" in rec:  # a floor measurement
        extra = f"  {rec['gbps']:.2f} GB/s" if "gbps" in rec else ""
        return (
            f"{head} {'floor: ' + rec['what']:<{width + 8}} {rec['seconds'] or 0:7.2f} s{extra}"
            f"  resident: {res}"
        )
    if rec["ok"]:
        what = (
            f"health {rec['t_health']:6.2f} s  first {rec['t_first']:6.2f} s  repeat "
            f"{rec.get('t_repeat', 0):5.2f} s"
            f"  answer {rec['answer'][:48]!r}"
        )
    else:
        what = f"FAILED: {rec.get('error', '?')}"
    if rec.get("vllm_cache_added"):
        what += f"  (compiled: +{rec['vllm_cache_added']} files in vLLM's cache)"
    left = rec.get("stop", {}).get("leftover")
    line = f"{head} {rec['config']:<{width + 8}} {what}  resident: {res}" + (
        f"  LEFTOVER {left}" if left else ""
    )
    err = (rec.get("stderr_tail") or "").splitlines()[-3:]
    return line + "".join(f"\n      | {e}" for e in err)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def answers(data: dict) -> dict:
    """Per config: how many runs, and each distinct answer with its count (warm-up runs included;
    a wrong answer of a failed run too)."""
    out: dict = {}
    for r in data["runs"]:
        a = out.setdefault(r["config"], {"runs": 0, "answers": {}})
        a["runs"] += 1
        if r.get("answer") is not None:
            a["answers"][r["answer"]] = a["answers"].get(r["answer"], 0) + 1
    return out


FLOOR_PARTS = ("import_torch", "read_weights")


def _round_floors(data: dict, mode: str) -> dict[int, float]:
    """Round -> max(import, read) of that round (both measured and ok)."""
    per: dict[int, dict] = {}
    for f in data["floor"]:
        if f["mode"] == mode and f["ok"] and not f["warmup"] and f["what"] in FLOOR_PARTS:
            per.setdefault(f["round"], {})[f["what"]] = f["seconds"]
    return {rnd: max(v.values()) for rnd, v in per.items() if len(v) == 2}


def summarize(data: dict) -> list[dict]:
    """Rows per (mode, config) and floor rows, from the measured (non-warm-up) runs."""
    rows: list[dict] = []
    configs = [c["label"] for c in data["meta"]["configs"]]
    peer_labels = [
        c["label"] for c in data["meta"]["configs"] if c["kind"] == "peer" and not c.get("first_start")
    ]
    for mode in data["meta"]["modes"]:
        fl = {w: _stats([f["seconds"] for f in data["floor"] if f["mode"] == mode and f["what"] == w
                         and f["ok"] and not f["warmup"]]) for w in ("import_torch", "read_weights")}
        floor = max((s["median"] for s in fl.values() if s), default=None)
        by_round = _round_floors(data, mode)
        mode_rows = []
        for label in configs:
            runs = [r for r in data["runs"] if r["mode"] == mode and r["config"] == label and not r["warmup"]
                    and not r.get("interrupted")]
            if not runs and label != configs[0]:
                continue  # e.g. the vLLM first start outside its mode
            ok = [r for r in runs if r["ok"]]
            costs = [r for r in ok if "t_repeat" in r]
            ratios = [
                (r["t_first"] - r["t_repeat"]) / by_round[r["round"]]
                for r in costs
                if by_round.get(r["round"])
            ]
            mode_rows.append({
                "mode": mode, "config": label, "n": len(runs), "ok": len(ok),
                "health": _stats([r["t_health"] for r in ok]), "first": _stats([r["t_first"] for r in ok]),
                "repeat": _stats([r["t_repeat"] for r in costs]),
                "start_cost": _stats([r["t_first"] - r["t_repeat"] for r in costs]),
                "cost_x_floor": statistics.median(ratios) if ratios else None,
                "errors": sorted({r.get("error", "") for r in runs if not r["ok"]}),
                "leftover": sum(len(r.get("stop", {}).get("leftover", [])) for r in runs)})
        med = {r["config"]: r["first"].get("median") for r in mode_rows}
        for row in mode_rows:
            m = row["first"].get("median")
            row["x_first_config"] = _ratio(m, med.get(configs[0]))
            row["x_floor"] = _ratio(m, floor)
            row["x_peers"] = {p: _ratio(m, med.get(p)) for p in peer_labels}
        rows += mode_rows
        for what, s in fl.items():
            if s:
                gb = [
                    f["gbps"]
                    for f in data["floor"]
                    if f["mode"] == mode and f["what"] == what and not f["warmup"] and "gbps" in f
                ]
                name = "floor: import torch" if what == "import_torch" else \
                    "floor: read weights" + (f" ({statistics.median(gb):.2f} GB/s)" if gb else "")
                rows.append(
                    {
                        "mode": mode,
                        "config": name,
                        "n": s["n"],
                        "ok": s["n"],
                        "health": {},
                        "first": s,
                        "floor_part": what,
                    }
                )
        for what, (phase, _) in IMPORTS_ALONE.items():
            s = _stats([f["seconds"] for f in data["floor"] if f["mode"] == mode and f["what"] == what
                        and f["ok"] and not f["warmup"]])
            if s:
                rows.append({"mode": mode, "config": f"alone: {phase} ({what})", "n": s["n"], "ok": s["n"],
                             "health": {}, "first": s, "floor_part": what})
        if floor is not None:
            rows.append({"mode": mode, "config": "floor = max(import, read)", "n": 0, "ok": 0, "health": {},
                         "first": {"median": floor}, "floor_part": "max"})
        if all(fl.values()):  # what a start that overlaps nothing would pay at least
            rows.append({"mode": mode, "config": "import + read", "n": 0, "ok": 0, "health": {},
                         "first": {"median": sum(s["median"] for s in fl.values())}, "floor_part": "sum"})
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _f(x, fmt="{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def vllm_cache_line(meta: dict, runs: list[dict] = ()) -> str:
    """"vLLM compile cache warm: yes/no (N files ...)", and which vLLM runs compiled anyway: its cache is
    keyed by the model's path and the config, so a new model folder compiles once (a warm-up absorbs it)."""
    c = meta.get("vllm_compile_cache")
    if not c:
        return ""
    line = (f"vLLM compile cache warm: {'yes' if c['warm'] else 'no'} ({c['files']} files in {c['path']}; "
            "kept: never evicted)")
    grew = [
        f"{r['config']} {'warm-up' if r['warmup'] else 'run'} "
        f"{r['round'] if r['warmup'] else r['round'] + 1} "
        f"{r['mode']} (+{r['vllm_cache_added']} files)"
        for r in runs
        if r.get("vllm_cache_added")
    ]
    return line + (
        "; runs that compiled anyway (no entry for this model path yet): " + ", ".join(grew) if grew else ""
    )


def format_table(rows: list[dict], data: dict | None = None) -> str:
    """Two markdown tables. Seconds from launch: health = /health 200, first = first verified completion,
    repeat = the same request sent again right after (its own compute, warm), start cost = first - repeat
    (median of the per-run differences). Ratios: start cost / floor (median of per-round ratios, the
    floor max(import, read) of the same round), and median first against the first config, the floor
    and each peer."""
    meta = (data or {}).get("meta", {})
    peer_labels = [
        c["label"] for c in meta.get("configs", []) if c["kind"] == "peer" and not c.get("first_start")
    ]
    cache = vllm_cache_line(meta, (data or {}).get("runs", []))
    lines = [cache, ""] if cache else []
    lines += ["Seconds from launch:", "",
              ("| mode | config | ok | health med | min | max | sd | first med | min | max | sd | repeat med "
               "| start cost med |"), "|" + "---|" * 13]
    for r in rows:
        h, f = r["health"], r["first"]
        ok = f"{r['ok']}/{r['n']}" if "floor_part" not in r else ""
        lines.append(
            "| "
            + " | ".join(
                [
                    r["mode"],
                    r["config"],
                    ok,
                    _f(h.get("median")),
                    _f(h.get("min")),
                    _f(h.get("max")),
                    _f(h.get("stdev")),
                    _f(f.get("median")),
                    _f(f.get("min")),
                    _f(f.get("max")),
                    _f(f.get("stdev")),
                    _f(r.get("repeat", {}).get("median")),
                    _f(r.get("start_cost", {}).get("median")),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Ratios (start cost = first - repeat; floor = max(import, read) of the same round):",
        "",
        f"| mode | config | start cost / floor | <= {COST_GOAL}x | first / first config | first / floor | "
        + "".join(f"first / {p} | " for p in peer_labels).rstrip(),
        "|" + "---|" * (6 + len(peer_labels)),
    ]
    for r in rows:
        if "floor_part" in r:
            continue
        cx = r.get("cost_x_floor")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["mode"],
                    r["config"],
                    _f(cx, "{:.2f}x"),
                    "" if cx is None else ("yes" if cx <= COST_GOAL else "no"),
                    _f(r.get("x_first_config"), "{:.2f}x"),
                    _f(r.get("x_floor"), "{:.2f}x"),
                    *(_f(r["x_peers"].get(p), "{:.2f}x") for p in peer_labels),
                ]
            )
            + " |"
        )
    if data is not None:
        lines += import_table(data)
        lines += read_table(data)
        lines += ["", "Answers (every run, warm-up included):", ""]
        for label, a in answers(data).items():
            given = "; ".join(f"{text!r} x{n}" for text, n in a["answers"].items()) or "none"
            lines.append(f"- {label} ({a['runs']} runs): {given}")
    failed = [r for r in rows if r.get("errors")]
    for r in failed:
        lines.append(f"\nFAILED {r['mode']} / {r['config']}: {r['n'] - r['ok']} of {r['n']} runs: "
                     + "; ".join(e for e in r["errors"] if e))
    if any(r.get("leftover") for r in rows):
        lines.append("\nWARNING: processes were left behind: " + ", ".join(
            f"{r['config']} ({r['leftover']})" for r in rows if r.get("leftover")))
    return "\n".join(lines)


def phase_seconds(run: dict, prefix: str) -> float | None:
    """How long the first phase named PREFIX... of RUN's /startup timeline took."""
    for p in (run.get("timeline") or {}).get("phases") or []:
        if str(p.get("name", "")).startswith(prefix) and p.get("end_s") is not None:
            return float(p["end_s"]) - float(p["start_s"])
    return None


def import_table(data: dict) -> list[str]:
    """Each hotstart config's two imports in its starts (from the timelines) against the same imports
    alone after the same eviction (the floor rounds): an I/O schedule that starves them shows here."""
    labels = [c["label"] for c in data["meta"]["configs"] if c["kind"] == "hotstart"]
    head = " | ".join(f"{p} s | alone s | x alone" for p, _ in IMPORTS_ALONE.values())
    lines = ["", "Imports, in the start (timeline) vs alone (same eviction, fresh interpreter), medians:", "",
             f"| mode | config | {head} |", "|" + "---|" * (2 + 3 * len(IMPORTS_ALONE))]
    any_row = False
    for mode in data["meta"]["modes"]:
        alone = {w: _stats([f["seconds"] for f in data["floor"] if f["mode"] == mode and f["what"] == w
                            and f["ok"] and not f["warmup"]]).get("median") for w in IMPORTS_ALONE}
        for label in labels:
            runs = [r for r in data["runs"] if r["mode"] == mode and r["config"] == label and r["ok"]
                    and not r["warmup"]]
            cells = []
            for what, (phase, _) in IMPORTS_ALONE.items():
                took = [s for s in (phase_seconds(r, phase) for r in runs) if s is not None]
                m = statistics.median(took) if took else None
                cells += [_f(m), _f(alone[what]), _f(_ratio(m, alone[what]), "{:.2f}x")]
            if any(c for c in cells):
                any_row = True
                lines.append(f"| {mode} | {label} | " + " | ".join(cells) + " |")
    return lines if any_row else []


def median_run(data: dict, mode: str, label: str) -> dict | None:
    """The ok measured run of (mode, config) with the median t_first (the lower one for an even count)."""
    ok = sorted((r for r in data["runs"] if r["mode"] == mode and r["config"] == label and r["ok"]
                 and not r["warmup"]), key=lambda r: r["t_first"])
    return ok[(len(ok) - 1) // 2] if ok else None


def timeline_phases(run: dict) -> list[tuple[str, str, float, float]]:
    """(name, process, start, end) in seconds since launch, from a run's /startup timeline."""
    tl = run.get("timeline") or {}
    offset = (tl.get("t0") or run.get("wall_launch", 0)) - run.get("wall_launch", 0)
    out = [("interpreter + CLI import", "api", 0.0, offset)] if offset > 0 else []
    for p in tl.get("phases") or []:
        try:
            start = offset + float(p["start_s"])
            end = offset + float(p["end_s"] if p.get("end_s") is not None else p["start_s"])
            out.append((str(p["name"]), str(p.get("process", "?")), start, end))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def write_reports(data: dict, out: Path) -> str:
    """Write table.md and startup.png into OUT; return the table text."""
    rows = summarize(data)
    text = format_table(rows, data)
    (out / "table.md").write_text(text + "\n")
    if any(r["first"] for r in rows):
        write_png(data, rows, out / "startup.png")
    return text


def write_png(data: dict, rows: list[dict], path: Path) -> None:
    """Left: median t_first per config and mode, whiskers min-max, t_health ticks, floor hatched.
    Right: the phases of hotstart's median run per mode (its /startup timeline), on the same clock."""
    import matplotlib  # noqa: PLC0415 - heavy, after all runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    modes = data["meta"]["modes"]
    hot = next((c["label"] for c in data["meta"]["configs"] if c["kind"] == "hotstart"), None)
    runs = {m: median_run(data, m, hot) for m in modes} if hot else {}
    gantt = [m for m in modes if runs.get(m) and runs[m].get("timeline")]
    fig = plt.figure(figsize=(12, max(3.6, 2.6 * max(1, len(gantt)))), dpi=80)
    grid = fig.add_gridspec(max(1, len(gantt)), 2, width_ratios=[1, 1.25])
    ax = fig.add_subplot(grid[:, 0])
    labels = [c["label"] for c in data["meta"]["configs"]] + ["floor"]
    colors = plt.get_cmap("tab10")
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        for i, mode in enumerate(modes):
            pick = "floor = max(import, read)" if label == "floor" else label
            r = next((r for r in rows if r["mode"] == mode and r["config"] == pick), None)
            f = (r or {}).get("first") or {}
            if not f:
                continue
            x = i + (j - (len(labels) - 1) / 2) * width
            err = [[f["median"] - f.get("min", f["median"])], [f.get("max", f["median"]) - f["median"]]]
            ax.bar(x, f["median"], width * 0.9, yerr=err, capsize=3, color=colors(j % 10),
                   hatch="//" if label == "floor" else None, label=label if i == 0 or label not in
                   ax.get_legend_handles_labels()[1] else None)
            h = r.get("health", {}).get("median")
            if h:
                ax.plot([x - width * 0.45, x + width * 0.45], [h, h], color="black", lw=1)
            ax.text(x, f["median"], f"{f['median']:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(modes)), [f"cold: {m}" for m in modes])
    ax.set_ylabel("seconds to first completion")
    ax.set_title(f"{Path(data['meta']['model']).name}: median, min-max; tick = /health 200", fontsize=9)
    ax.legend(fontsize=7)
    for k, mode in enumerate(gantt):
        _gantt(fig.add_subplot(grid[k, 1]), runs[mode], f"{hot}, cold {mode}: median run")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _gantt(ax, run: dict, title: str) -> None:
    phases = timeline_phases(run)
    procs = list(dict.fromkeys(p[1] for p in phases))
    cmap = {p: f"C{i % 10}" for i, p in enumerate(procs)}
    for y, (name, proc, start, end) in enumerate(phases):
        ax.barh(y, max(end - start, 0.005), left=start, color=cmap[proc], height=0.7)
        ax.text(end + 0.02, y, f"{name} ({end - start:.2f})", va="center", fontsize=6)
    for t, style in ((run.get("t_health"), "--"), (run.get("t_first"), "-")):
        if t:
            ax.axvline(t, color="black", ls=style, lw=0.8)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since launch (dashed: /health 200, solid: first completion)", fontsize=7)
    ax.set_title(title + "; colour = process: " + ", ".join(procs), fontsize=8)
    right = max([run.get("t_first") or 0] + [p[3] for p in phases])
    ax.set_xlim(0, right * 1.35 + 0.1)
