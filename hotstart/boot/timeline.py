"""The startup timeline: every phase of every process, as data.

Each process keeps a Timeline with the same t0 (time.time() at launch, handed to child processes),
so their events line up; a child sends `to_json()` to the API process, which `merge()`s it. The
timeline is printed as log lines, served as JSON and written as a Chrome/Perfetto trace; the CLI draws
it as a PNG (hotstart/boot/timeline_png.py, never imported by the server).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from hotstart.messages import Span


class Timeline:
    """Thread-safe collection of startup spans (phases and marks) relative to a common launch time `t0`."""

    def __init__(self, t0: float, on_event: Callable[[Span], None] | None = None):
        self.t0 = t0
        self.on_event = on_event  # called with each recorded event (the serve command logs it)
        self._events: list[Span] = []
        self._lock = threading.Lock()

    def record(self, ev: Span) -> Span:
        """Record a span made elsewhere (another process's phase)."""
        with self._lock:
            self._events.append(ev)
        if self.on_event is not None:
            self.on_event(ev)
        return ev

    def add(self, name: str, start: float, end: float, process: str = "api", detail: str = "") -> Span:
        """Record a phase with absolute start/end times (time.time())."""
        return self.record(Span(name, start, end, process, detail))

    @contextmanager
    def phase(self, name: str, process: str = "api", detail: str = "") -> Iterator[Span]:
        """Time the block as a phase. The yielded Span's `detail` may be set inside the block."""
        ev = Span(name, time.time(), 0.0, process, detail)
        try:
            yield ev
        finally:
            ev.end = time.time()
            self.record(ev)

    def mark(self, name: str, process: str = "api", detail: str = "") -> Span:
        """Record an instant (e.g. "ready")."""
        now = time.time()
        return self.add(name, now, now, process, detail)

    @property
    def events(self) -> list[Span]:
        """All events ordered by start time (ties keep insertion order)."""
        with self._lock:
            return sorted(self._events, key=lambda e: e.start)

    def to_json(self) -> dict:
        """{"t0": ..., "phases": [{"name", "process", "start_s", "end_s", "duration_s", "detail"}]},
        times in seconds relative to t0."""
        return {"t0": self.t0, "phases": [{
            "name": e.name, "process": e.process,
            "start_s": round(e.start - self.t0, 6), "end_s": round(e.end - self.t0, 6),
            "duration_s": round(e.duration, 6), "detail": e.detail,
        } for e in self.events]}

    def merge(self, timeline_json: dict) -> None:
        """Add the phases of another process's `to_json()` (its own t0 is honoured)."""
        t0 = timeline_json.get("t0", self.t0)
        for p in timeline_json.get("phases", []):
            self.add(p["name"], t0 + p["start_s"], t0 + p["end_s"], p.get("process", "api"),
                     p.get("detail", ""))

    @classmethod
    def from_json(cls, timeline_json: dict) -> "Timeline":
        tl = cls(timeline_json["t0"])
        tl.merge(timeline_json)
        return tl

    def log_line(self, event: Span) -> str:
        """e.g. 'hotstart: [  1.23 s] engine  weights loaded        0.84 s  (269 MB, 0.32 GB/s)';
        the bracket is when the phase ended, relative to t0."""
        line = f"hotstart: [{event.end - self.t0:7.2f} s] {event.process:<7} {event.name:<22}"
        if event.end > event.start:
            line += f" {event.duration:6.2f} s"
        if event.detail:
            line += f"  ({event.detail})"
        return line

    def write_chrome_trace(self, path) -> None:
        """Chrome/Perfetto trace-event JSON: one pid per process (named by metadata events),
        phases as "X" complete events and marks as "i" instants, in microseconds from t0."""
        pids: dict[str, int] = {}
        trace = []
        for e in self.events:
            if e.process not in pids:
                pids[e.process] = pid = len(pids) + 1
                trace.append({"name": "process_name", "ph": "M", "pid": pid, "tid": pid,
                              "args": {"name": e.process}})
                trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": pid,
                              "args": {"name": e.process}})
            pid = pids[e.process]
            ev = {"name": e.name, "cat": "startup", "pid": pid, "tid": pid,
                  "ts": round((e.start - self.t0) * 1e6, 1), "args": {"detail": e.detail}}
            if e.end > e.start:
                ev.update(ph="X", dur=round(e.duration * 1e6, 1))
            else:
                ev.update(ph="i", s="p")
            trace.append(ev)
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f, indent=1)


def from_chrome_trace(trace: dict | list) -> dict:
    """Turn a trace written by write_chrome_trace (or any trace-event JSON) back into to_json() form,
    times relative to the trace's zero."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    names = {e.get("pid"): e.get("args", {}).get("name", str(e.get("pid")))
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    phases = []
    for e in events:
        if e.get("ph") not in ("X", "i", "I"):
            continue
        start = e.get("ts", 0) / 1e6
        dur = e.get("dur", 0) / 1e6 if e["ph"] == "X" else 0.0
        phases.append({"name": e.get("name", "?"), "process": names.get(e.get("pid"), str(e.get("pid"))),
                       "start_s": start, "end_s": start + dur, "duration_s": dur,
                       "detail": e.get("args", {}).get("detail", "")})
    return {"t0": 0.0, "phases": sorted(phases, key=lambda p: p["start_s"])}
