"""The startup timeline: ordering, JSON, log lines, Chrome trace, PNG."""

import json
import threading
import time

from hotstart.boot.timeline import Timeline, from_chrome_trace
from hotstart.boot.timeline_png import render_png


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
