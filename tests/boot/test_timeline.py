"""The startup timeline: ordering, JSON, log lines, Chrome trace, PNG (layout, critical path)."""

import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hotstart.boot.timeline import Timeline, from_chrome_trace
from hotstart.boot.timeline_png import build_figure, critical_path, render_png


def _sample() -> Timeline:
    t0 = time.time()
    tl = Timeline(t0)
    tl.add("resolve model", t0 + 0.00, t0 + 0.02)
    tl.add("prefetch", t0 + 0.02, t0 + 1.10, detail="269 MB, 1.30 GB/s")
    tl.add("torch import", t0 + 0.05, t0 + 1.05, process="engine")
    tl.add("weights loaded", t0 + 1.05, t0 + 1.23, process="engine", detail="269 MB, 1.50 GB/s")
    tl.add("tokenizer loaded", t0 + 0.10, t0 + 0.40)
    tl.add("ready", t0 + 1.30, t0 + 1.30)
    return tl


def test_phase_mark_and_order():
    tl = Timeline(time.time())
    with tl.phase("outer", detail="x") as ev:
        time.sleep(0.01)
        with tl.phase("inner", process="engine"):
            time.sleep(0.01)
        ev.detail = "set inside"
    tl.mark("ready")
    names = [e.name for e in tl.events]
    assert names == ["outer", "inner", "ready"]  # by start time, although "inner" ended first
    outer, inner, ready = tl.events
    assert outer.start <= inner.start <= inner.end <= outer.end <= ready.start == ready.end
    assert outer.duration >= 0.02 and outer.detail == "set inside" and inner.process == "engine"


def test_phase_recorded_on_exception():
    tl = Timeline(time.time())
    try:
        with tl.phase("boom"):
            raise RuntimeError
    except RuntimeError:
        pass
    assert [e.name for e in tl.events] == ["boom"]


def test_thread_safe_add():
    tl = Timeline(time.time())

    def worker(k):
        for i in range(500):
            tl.mark(f"{k}-{i}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tl.events) == 2000


def test_json_round_trip_and_merge():
    tl = _sample()
    js = tl.to_json()
    assert json.loads(json.dumps(js)) == js
    assert [p["name"] for p in js["phases"]][:3] == ["resolve model", "prefetch", "torch import"]
    w = next(p for p in js["phases"] if p["name"] == "weights loaded")
    assert w["process"] == "engine" and abs(w["start_s"] - 1.05) < 1e-6 and abs(w["duration_s"] - 0.18) < 1e-6
    assert Timeline.from_json(js).to_json() == js
    # An engine-side timeline with the same t0, merged into the API's.
    api, eng = Timeline(tl.t0), Timeline(tl.t0)
    eng.add("kv allocated", tl.t0 + 1.3, tl.t0 + 1.4, process="engine")
    api.merge(eng.to_json())
    assert api.to_json()["phases"] == eng.to_json()["phases"]


def test_log_line():
    tl = _sample()
    ev = next(e for e in tl.events if e.name == "weights loaded")
    line = tl.log_line(ev)
    assert line.startswith("hotstart: [   1.23 s] engine  weights loaded")
    assert "0.18 s" in line and line.endswith("(269 MB, 1.50 GB/s)")
    mark = tl.log_line(tl.events[-1])
    assert "ready" in mark and mark.rstrip().endswith("ready")  # an instant has no duration


def test_chrome_trace(tmp_path):
    out = tmp_path / "trace.json"
    _sample().write_chrome_trace(out)
    trace = json.loads(out.read_text())["traceEvents"]
    xs = [e for e in trace if e["ph"] == "X"]
    assert len(xs) == 5 and all(e["dur"] > 0 and e["ts"] >= 0 for e in xs)
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["api", "engine"]
    w = next(e for e in xs if e["name"] == "weights loaded")
    assert names[w["pid"]] == "engine" and abs(w["ts"] - 1.05e6) < 1 and abs(w["dur"] - 0.18e6) < 1
    assert any(e["ph"] == "i" and e["name"] == "ready" for e in trace)
    back = from_chrome_trace(json.loads(out.read_text()))  # what `hotstart timeline` may be given
    want = _sample().to_json()["phases"]
    assert [(p["name"], p["process"]) for p in back["phases"]] == [(p["name"], p["process"]) for p in want]
    assert all(abs(a["start_s"] - b["start_s"]) < 1e-5 and abs(a["duration_s"] - b["duration_s"]) < 1e-5
               for a, b in zip(back["phases"], want))


def test_render_png(tmp_path):
    out = tmp_path / "startup.png"
    render_png(_sample().to_json(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tl = _sample()
    tl.write_chrome_trace(tmp_path / "trace.json")
    render_png(json.loads((tmp_path / "trace.json").read_text()), tmp_path / "from_trace.png")
    assert (tmp_path / "from_trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    render_png({"t0": 0.0, "phases": []}, tmp_path / "empty.png")  # nothing recorded: still draws
    assert (tmp_path / "empty.png").stat().st_size > 0


# A real `hotstart serve` startup (default model, this machine), then a crowded one: a dozen phases
# of 2 ms, marks 1-10 ms apart, a second lane, a phase after "engine ready", a long name and detail.
REAL = [("forkserver launched", "api", 0.0, 0.0246), ("model resolved", "api", 0.0773, 0.0782),
        ("engine config sent", "api", 0.0911, 0.1098),
        ("forkserver up (torch + engine imported)", "forkserver", 0.0992, 2.3932),
        ("prefetch started", "api", 0.1391, 0.2386), ("web stack imported", "api", 0.3254, 1.1567),
        ("tokenizer loaded", "api", 1.1568, 1.5172), ("socket bound", "api", 1.5806, 1.5807),
        ("engine forked", "forkserver", 2.3951, 2.4037), ("engine config", "engine", 2.4103, 2.4152),
        ("weights loaded", "engine", 2.4155, 2.5959), ("KV cache allocated", "engine", 2.5959, 2.6062),
        ("engine ready", "engine", 2.6065, 2.6065), ("first request served", "api", 7.0232, 7.0232)]
CROWDED = REAL[:-1] + [(f"step {i}", "api", 0.03 + i * 0.004, 0.032 + i * 0.004) for i in range(12)] + [
    ("prefetch", "api", 0.1, 3.0), ("ready", "api", 2.607, 2.607), ("compile decode", "engine", 2.61, 9.5),
    ("compile prefill (a rather long phase name for its bar)", "compile", 2.62, 2.9),
    ("first request served", "api", 2.62, 2.62), ("$odd$ mark", "api", 2.63, 2.63),
    ("graphs captured", "engine", 9.5, 9.52)]


def _timeline(rows: list[tuple[str, str, float, float]], detail: str = "") -> dict:
    return {"t0": 0.0, "phases": sorted(({"name": n, "process": proc, "start_s": s, "end_s": e,
                                          "duration_s": e - s, "detail": detail} for n, proc, s, e in rows),
                                         key=lambda p: p["start_s"])}


def _drawn_texts(fig) -> list:
    """Every text the figure draws: its own labels and table, legend, axis label, tick labels in view."""
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi] + ax.get_yticklabels()
    legend = [t for lg in fig.legends for t in lg.get_texts()]
    return [t for t in [*fig.texts, *ax.texts, *ticks, *legend, ax.xaxis.label] if t.get_text().strip()]


@pytest.mark.parametrize("rows", [REAL, CROWDED], ids=["real", "crowded"])
def test_png_labels_do_not_overlap(rows):
    tl = _timeline(rows, detail="a long detail, " * 20)
    fig = build_figure(tl)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.canvas.get_width_height()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _drawn_texts(fig)]
    clash = [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2)
             if min(ba.x1, bb.x1) - max(ba.x0, bb.x0) > 0.5 and min(ba.y1, bb.y1) - max(ba.y0, bb.y0) > 0.5]
    assert clash == []
    outside = [a for a, b in boxes if b.x0 < 0 or b.y0 < 0 or b.x1 > width or b.y1 > height]
    assert outside == []
    texts = {t for t, _ in boxes}
    n = len(tl["phases"])
    assert {str(i) for i in range(1, n + 1)} <= texts  # every phase has its number (table and chart)
    assert {p["name"] for p in tl["phases"]} <= texts  # and its name in the table
    assert sum(t.startswith("first request served ") for t in texts) == 1  # the mark's label
    title = fig.texts[0].get_text()
    assert "engine ready 2.61 s" in title and "first request served" in title


def test_critical_path():
    tl = _timeline([("a", "api", 0.0, 1.0), ("b", "forkserver", 0.5, 2.0), ("c", "api", 1.0, 1.5),
                    ("d", "engine", 2.0, 3.0), ("e", "api", 2.2, 2.4), ("engine ready", "engine", 3.0, 3.0),
                    ("first request served", "api", 4.0, 4.0), ("late", "api", 4.5, 5.0)])
    names = lambda path: [p["name"] for p in path]  # noqa: E731
    # b ended last before d started; nothing ended before b started (a ends at 1.0 > 0.5).
    assert names(critical_path(tl["phases"])) == ["b", "d", "engine ready", "first request served"]
    no_answer = [p for p in tl["phases"] if p["name"] != "first request served"]
    assert names(critical_path(no_answer)) == ["b", "d", "engine ready"]
    no_marks = [p for p in no_answer if p["name"] != "engine ready"]
    assert names(critical_path(no_marks)) == ["b", "d", "late"]  # from what ended last
    assert critical_path([]) == []
    assert names(critical_path(_timeline(REAL)["phases"])) == [
        "forkserver launched", "model resolved", "forkserver up (torch + engine imported)", "engine forked",
        "engine config", "weights loaded", "KV cache allocated", "engine ready", "first request served"]


def test_png_marks_the_critical_path():
    fig = build_figure(_timeline(REAL))
    on_path = {"forkserver launched", "weights loaded", "first request served"}
    bold = {t.get_text() for t in fig.texts if t.get_fontweight() == "bold"}
    assert on_path <= bold and "tokenizer loaded" not in bold  # bold rows in the table
    outlines = sorted({round(p.get_linewidth(), 1) for p in fig.axes[0].patches})
    assert outlines[-1] >= 2 and outlines[0] < 1  # thick outlines on the path, thin elsewhere
    assert any("critical path" in t.get_text() for lg in fig.legends for t in lg.get_texts())


def test_timeline_without_matplotlib(tmp_path):
    trace = tmp_path / "trace.json"
    _sample().write_chrome_trace(trace)
    code = ("import sys; sys.modules['matplotlib'] = None; from hotstart.cli import main; "
            f"sys.exit(main(['timeline', {str(trace)!r}, '-o', {str(tmp_path / 'x.png')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 2, out.stderr
    assert out.stderr == "hotstart: error: drawing a timeline needs matplotlib (pip install matplotlib)\n"
    assert out.stdout == "" and not (tmp_path / "x.png").exists()
