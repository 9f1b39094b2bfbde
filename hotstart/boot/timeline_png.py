"""Drawing of a startup timeline as a PNG (`hotstart timeline`). Matplotlib (Agg, no pyplot) is imported
inside render_png: a plain install has no matplotlib, and the server never draws."""

from __future__ import annotations

from hotstart.boot.timeline import from_chrome_trace
from hotstart.errors import HotstartError


def _lanes(phases: list[dict]) -> list[list[dict]]:
    """Pack overlapping phases of one process into sub-rows (greedy by start)."""
    rows: list[list[dict]] = []
    for p in sorted(phases, key=lambda p: p["start_s"]):
        for row in rows:
            if row[-1]["end_s"] <= p["start_s"]:
                row.append(p)
                break
        else:
            rows.append([p])
    return rows


def render_png(timeline_json: dict, out_path) -> None:
    """Draw a Gantt chart of `to_json()` output (or of a Chrome trace from write_chrome_trace): one
    lane per process (sub-rows where phases overlap), bars labelled with name and duration, marks as
    dashed lines. Imports matplotlib (Agg, no pyplot) here: CLI use only."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError:
        raise HotstartError("drawing a timeline needs matplotlib (pip install matplotlib)") from None

    if isinstance(timeline_json, list) or "traceEvents" in timeline_json:
        timeline_json = from_chrome_trace(timeline_json)  # a --startup-trace file
    phases = timeline_json.get("phases", [])
    procs = list(dict.fromkeys(p["process"] for p in phases))
    bars = [p for p in phases if p["end_s"] > p["start_s"]]
    marks = [p for p in phases if p["end_s"] <= p["start_s"]]
    rows = [(proc, row) for proc in procs for row in _lanes([p for p in bars if p["process"] == proc])
            or [[]]]
    end = max([p["end_s"] for p in phases] + [0.01])

    fig = Figure(figsize=(12, 1.2 + 0.6 * len(rows)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = {proc: f"C{i % 10}" for i, proc in enumerate(procs)}
    for y, (proc, row) in enumerate(rows):
        for p in row:
            ax.barh(y, p["duration_s"], left=p["start_s"], height=0.7, color=colors[proc], alpha=0.8,
                    edgecolor="black", linewidth=0.5)
            label = f"{p['name']} {p['duration_s']:.2f}s"
            if p["duration_s"] > end * 0.011 * len(label):  # fits inside the bar
                ax.text(p["start_s"] + p["duration_s"] / 2, y, label, va="center", ha="center", fontsize=7)
            else:  # above the bar's start, so it cannot cover the next bar in the row
                ax.text(p["start_s"], y - 0.36, label, va="bottom", ha="left", fontsize=6)
    for m in marks:
        ax.axvline(m["start_s"], color="grey", linestyle="--", linewidth=0.8)
        ax.text(m["start_s"], 0.98, f" {m['name']} {m['start_s']:.2f}s", fontsize=7, rotation=90,
                va="top", ha="right", transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(rows)), [proc for proc, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.08)
    ax.set_xlabel("seconds since launch")
    ax.set_title("hotstart startup timeline")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)
