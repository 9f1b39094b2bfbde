"""The startup timeline drawn as a PNG (`hotstart timeline`): a Gantt chart above a numbered table.

Top to bottom: the title (when the engine was ready and the first request served); a strip of mark
labels, each a flag on its mark's line, stacked in levels so that no label overlaps another and no
line runs through one; the chart, one lane per process (sub-rows where its phases overlap) -- a bar
wide enough for it carries "N name duration", a narrower one its number N above it, pushed sideways
off its neighbours and tied to the bar by a leader line; the legend; a table of every phase and mark
by number (process, name, start, duration, detail). The critical path (see critical_path) has thick
outlines on the chart and bold rows in the table. Every text is measured before it is placed.

Matplotlib (Agg, no pyplot) is imported by build_figure: a plain install has no matplotlib, and the
server never draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hotstart.boot.timeline import from_chrome_trace
from hotstart.errors import HotstartError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

END_MARKS = ("first request served", "engine ready")  # where the critical path ends, by preference
MARK_COLORS = {"first request served": "crimson", "engine ready": "forestgreen"}
DPI, WIDTH_IN = 110, 12.0
ROW_PX = 56  # one lane; the bar takes BAR_H of it, the rest holds the numbers of narrow bars
BAR_H = 0.5
LEVEL_PX = 17  # one level of mark labels
LABEL_PT, TABLE_PT = 7.5, 8.0
GAP_PX = 5  # least room between two labels
THICK, THIN = 2.2, 0.4  # bar outlines: on the critical path, elsewhere


def critical_path(phases: list[dict]) -> list[dict]:
    """What the last mark waited for: walking back from "first request served" (else "engine ready",
    else the event that ended last), at each step the phase (or mark) that ended last before the
    current one started. In time order, the end mark last; [] for an empty timeline."""
    if not phases:
        return []
    marks = [p for p in phases if p["end_s"] <= p["start_s"]]
    cur = next((m for name in END_MARKS for m in marks if m["name"] == name), None)
    cur = cur or max(phases, key=lambda p: p["end_s"])
    path = [cur]
    while True:
        t = cur["start_s"]
        before = [p for p in phases if p["end_s"] <= t + 1e-9 and p["start_s"] < t]
        if not before:
            return path[::-1]
        # Ties go to a mark ("engine ready" ends with the KV cache), then to the longer phase.
        cur = max(before, key=lambda p: (p["end_s"], p["end_s"] <= p["start_s"], p["duration_s"]))
        path.append(cur)


def spread(wanted: list[tuple[float, float]], lo: float, hi: float, gap: float) -> list[float]:
    """1-D label placement: (wanted centre, width) pairs, sorted by centre, to centres in the same
    order with at least `gap` between neighbours, inside [lo, hi] where they fit, each as near its
    wanted centre as its neighbours allow."""
    lefts: list[float] = []
    for i, (want, w) in enumerate(wanted):  # push right, off the previous label
        left = max(want - w / 2, lo)
        if i:
            left = max(left, lefts[-1] + wanted[i - 1][1] + gap)
        lefts.append(left)
    nxt = hi + gap
    for i in range(len(lefts) - 1, -1, -1):  # then pull back left of `hi`, off the next label
        lefts[i] = min(lefts[i], nxt - gap - wanted[i][1])
        nxt = lefts[i]
    return [left + w / 2 for left, (_, w) in zip(lefts, wanted)]


def place_flags(xs: list[float], widths: list[float], lo: float, hi: float,
                gap: float) -> list[tuple[float, int]]:
    """Labels for marks at xs (sorted), each a flag on a line that rises from the chart to its level:
    (left edge, level) per mark. A flag ends at its line (or starts there where it would cross `lo`),
    at the lowest level where it clears the flags of that level by `gap` and no line runs through
    another flag; where no level avoids that, only the first condition holds."""
    placed: list[tuple[float, float, int, float]] = []  # left, right, level, x

    def fits(left: float, right: float, level: int, x: float, strict: bool) -> bool:
        for l2, r2, lv2, x2 in placed:
            if lv2 == level and left < r2 + gap and l2 < right + gap:
                return False
            if strict and ((lv2 < level and l2 < x < r2) or (lv2 > level and left < x2 < right)):
                return False
        return True

    for x, w in zip(xs, widths):
        sides = [(a, a + w) for a in (x - w, x) if lo <= a and a + w <= hi]  # ending at x, else starting
        if not sides:  # wider than the room on either side: centred, kept inside
            a = min(max(lo, x - w / 2), hi - w)
            sides = [(a, a + w)]
        choice = next((c for strict in (True, False) for level in range(len(placed) + 1) for c in
                       ((left, right, level) for left, right in sides) if fits(*c, x, strict)))
        placed.append((*choice, x))
    return [(left, level) for left, _, level, _ in placed]


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


def _secs(x: float) -> str:
    if x >= 0.995:
        return f"{x:.2f} s"
    if x >= 0.001:
        return f"{x * 1e3:.0f} ms"
    return f"{x * 1e6:.0f} µs"


def _cut(text: str, max_px: float, width: Callable[[str], float]) -> str:
    """TEXT, or its longest prefix + "…" no wider than max_px."""
    if width(text) <= max_px:
        return text
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if width(text[:mid] + "…") <= max_px else (lo, mid - 1)
    return text[:lo].rstrip() + "…" if lo else ""


def build_figure(timeline_json: dict | list) -> Figure:
    """The figure for `to_json()` output or a Chrome trace (a --startup-trace file)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.colors import to_rgba  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
        from matplotlib.font_manager import FontProperties  # noqa: PLC0415
        from matplotlib.lines import Line2D  # noqa: PLC0415
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError:
        raise HotstartError("drawing a timeline needs matplotlib (pip install matplotlib)") from None

    if isinstance(timeline_json, list) or "traceEvents" in timeline_json:
        timeline_json = from_chrome_trace(timeline_json)
    phases = sorted(timeline_json.get("phases", []), key=lambda p: p["start_s"])
    number = {id(p): str(i) for i, p in enumerate(phases, 1)}
    on_path = {id(p) for p in critical_path(phases)}
    procs = list(dict.fromkeys(p["process"] for p in phases))
    colors = {proc: f"C{i % 10}" for i, proc in enumerate(procs)}
    marks = [p for p in phases if p["end_s"] <= p["start_s"]]
    bars = [p for p in phases if p["end_s"] > p["start_s"]]
    rows = [(proc, k, lane) for proc in procs
            for k, lane in enumerate(_lanes([p for p in bars if p["process"] == proc]) or [[]])]
    x0 = min([0.0] + [p["start_s"] for p in phases])
    x1 = max([p["end_s"] for p in phases] + [0.01]) * 1.04

    fig = Figure(figsize=(WIDTH_IN, 4), dpi=DPI)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fonts: dict = {}

    def width(s: str, size: float = LABEL_PT, bold: bool = False) -> float:
        font = fonts.get((size, bold)) or fonts.setdefault((size, bold), FontProperties(
            size=size, weight="bold" if bold else "normal"))
        return renderer.get_text_width_height_descent(s, font, ismath=False)[0]

    # Across (pixels): fixed first, since every placement depends on the seconds per pixel.
    fig_w = WIDTH_IN * DPI
    left_px = max([width(p, TABLE_PT) for p in procs] + [40]) + 30
    ax_w = fig_w - left_px - 0.35 * DPI
    spp = (x1 - x0) / ax_w  # seconds per pixel

    texts = [f"{m['name']} {m['start_s']:.2f} s" for m in marks]
    key = [m["name"] in MARK_COLORS for m in marks]
    flags = place_flags([m["start_s"] for m in marks],
                        [(width(t, bold=b) + 4) * spp for t, b in zip(texts, key)], x0, x1, GAP_PX * spp)

    # Down (pixels from the top).
    title_px = 34
    strip_px = (max(lv for _, lv in flags) + 1) * LEVEL_PX + 8 if marks else 4
    chart_px = round((max(1, len(rows)) + 0.25) * ROW_PX)  # + room above row 0 for its numbers
    axis_px, row_px = 46, 19
    first = {m["name"]: m["start_s"] for m in reversed(marks)}  # the first of each name
    legend = [Patch(facecolor=to_rgba(colors[p], 0.55), edgecolor="black", linewidth=THIN, label=p)
              for p in procs]
    legend.append(Patch(facecolor="white", edgecolor="black", linewidth=THICK,
                        label="critical path (bold in the table)"))
    legend += [Line2D([], [], color=c, linestyle="--", label=n) for n, c in MARK_COLORS.items() if n in first]
    if not all(key):
        legend.append(Line2D([], [], color="grey", linestyle="--", label="other marks"))
    entry_w = sorted((width(h.get_label(), TABLE_PT) + 50 for h in legend), reverse=True)  # + handle, spacing
    legend_cols = next(c for c in range(len(legend), 0, -1) if sum(entry_w[:c]) <= fig_w - 40 or c == 1)
    legend_px = 16 + 18 * -(-len(legend) // legend_cols)
    table_px = (len(phases) + 1) * row_px + 12
    fig_h = title_px + strip_px + chart_px + axis_px + legend_px + table_px
    fig.set_size_inches(WIDTH_IN, fig_h / DPI)
    chart_top = title_px + strip_px
    ax = fig.add_axes((left_px / fig_w, 1 - (chart_top + chart_px) / fig_h, ax_w / fig_w, chart_px / fig_h))
    ax.set_xlim(x0, x1)
    ax.set_ylim(max(1, len(rows)) - 0.5, -0.75)  # row 0 at the top
    ax.set_xlabel("seconds since launch")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)

    # Bars; inside each, the longest of "N name duration" / "N name" that fits, else N above it.
    for y, (proc, _, lane) in enumerate(rows):
        above = []
        for p in lane:
            crit = id(p) in on_path
            ax.barh(y, max(p["duration_s"], 2 * spp), left=p["start_s"], height=BAR_H, zorder=2,
                    facecolor=to_rgba(colors[proc], 0.55), edgecolor="black",
                    linewidth=THICK if crit else THIN)
            n = number[id(p)]
            fit = [t for t in (f"{n}  {p['name']}  {_secs(p['duration_s'])}", f"{n}  {p['name']}")
                   if width(t, bold=crit) + 10 <= p["duration_s"] / spp]
            if fit:
                ax.text(p["start_s"] + p["duration_s"] / 2, y, fit[0], ha="center", va="center", zorder=3,
                        fontsize=LABEL_PT, fontweight="bold" if crit else "normal", parse_math=False)
            else:
                above.append(p)
        wanted = [(p["start_s"] + max(p["duration_s"], 2 * spp) / 2,
                   (width(number[id(p)], bold=True) + 6) * spp) for p in above]
        y_text = y - BAR_H / 2 - 0.14
        for p, (want, _), cx in zip(above, wanted, spread(wanted, x0, x1, GAP_PX * spp)):
            ax.plot([cx, want], [y_text, y - BAR_H / 2], color="dimgrey", linewidth=0.6, zorder=2.5)
            ax.text(cx, y_text, number[id(p)], ha="center", va="bottom", fontsize=LABEL_PT, fontweight="bold",
                    zorder=3, parse_math=False,
                    bbox={"boxstyle": "square,pad=0.12", "fc": "white", "ec": colors[proc], "lw": 0.8})
    firsts = [y for y, (_, k, _) in enumerate(rows) if k == 0]
    ax.set_yticks(firsts, [rows[y][0] for y in firsts], fontsize=TABLE_PT)
    for y in firsts[1:]:
        ax.axhline(y - 0.5, color="lightgrey", linewidth=0.8)

    # Marks: a dashed line across the chart, rising into the strip above to its flag.
    xaxis = ax.get_xaxis_transform()  # x in seconds, y in axes fractions (1 = top of the chart)
    for m, text, bold, (left, level) in zip(marks, texts, key, flags):
        color = MARK_COLORS.get(m["name"], "grey")
        ax.axvline(m["start_s"], color=color, linestyle="--", linewidth=1.2, zorder=1.5)
        y_flag = 1 + (4 + level * LEVEL_PX) / chart_px
        ax.plot([m["start_s"]] * 2, [1, y_flag + 11 / chart_px], color=color, linewidth=0.8, transform=xaxis,
                clip_on=False)
        ax.text(left + 2 * spp, y_flag, text, ha="left", va="bottom", fontsize=LABEL_PT, color=color,
                fontweight="bold" if bold else "normal", transform=xaxis, parse_math=False)

    said = [f"{n} {first[n]:.2f} s" for n in reversed(END_MARKS) if n in first]
    fig.text(0.5, 1 - 8 / fig_h, "hotstart startup timeline" + (": " + ", ".join(said) if said else ""),
             ha="center", va="top", fontsize=12, parse_math=False)
    if not phases:
        ax.text(0.5, 0.5, "no phases recorded", ha="center", va="center", transform=ax.transAxes)

    fig.legend(handles=legend, loc="center", ncol=legend_cols, frameon=False, fontsize=TABLE_PT,
               bbox_to_anchor=(0.5, 1 - (chart_top + chart_px + axis_px + legend_px / 2) / fig_h))

    _table(fig, phases, number, on_path, width, fig_h - table_px, row_px)
    return fig


def _table(fig: Figure, phases: list[dict], number: dict, on_path: set, width: Callable, top_px: float,
           row_px: float) -> None:
    """Every phase and mark by number, in columns as wide as their widest cell; a name is cut to 40% of
    the width, a detail to what is left."""
    fig_w, fig_h = fig.get_figwidth() * DPI, fig.get_figheight() * DPI
    head = ["#", "process", "phase", "start", "duration", "detail"]
    rows = [[number[id(p)], p["process"], _cut(p["name"], 0.4 * fig_w, lambda s: width(s, TABLE_PT, True)),
             f"{p['start_s']:.3f} s", _secs(p["duration_s"]) if p["end_s"] > p["start_s"] else "mark",
             p.get("detail") or ""] for p in phases]
    right = {0, 3, 4}  # right-aligned columns
    x, xs = 20.0, []
    for c in range(5):
        w = max(width(r[c], TABLE_PT, True) for r in [head, *rows])
        xs.append(x + w if c in right else x)
        x += w + 16
    xs.append(x)
    for i, (row, bold) in enumerate(zip([head, *rows], [True] + [id(p) in on_path for p in phases])):
        row[5] = _cut(row[5], fig_w - x - 20, lambda s, bold=bold: width(s, TABLE_PT, bold))
        y = 1 - (top_px + (i + 0.5) * row_px) / fig_h
        for c, s in enumerate(row):
            if s:
                fig.text(xs[c] / fig_w, y, s, ha="right" if c in right else "left", va="center",
                         fontsize=TABLE_PT, fontweight="bold" if bold else "normal", parse_math=False)


def render_png(timeline_json: dict | list, out_path) -> None:
    """Draw `to_json()` output (or a Chrome trace written by --startup-trace) to a PNG."""
    build_figure(timeline_json).savefig(out_path)
