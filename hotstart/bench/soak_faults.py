"""The soak's fault injection (`hotstart bench soak --fault-every`): on schedule, one engine (at random) is
SIGKILLed or SIGSTOPped; a frozen one is left to the server's watchdog for --freeze-for seconds, then
resumed (SIGCONT) if it is still there. Whatever is still stopped when the run ends is resumed."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import time
from collections.abc import Callable

from hotstart.bench.soak_procs import server_processes
from hotstart.procs import alive

FAULT_MARGIN_S = 5.0  # no fault this close to the end of the run (its recovery must be seen)


class Injector:
    """The faults of one soak: `faults` records each (t, kind, pid, target, note), `stopped` the pids
    SIGSTOPped here and not yet resumed. NOW: seconds since the clients started."""

    def __init__(self, args, pid: int | None, extra: list[int], rng: random.Random, now: Callable[[], float]):
        self.args, self.pid, self.extra, self.rng, self.now = args, pid, extra, rng, now
        self.faults: list[dict] = []
        self.stopped: set[int] = set()

    async def run(self) -> None:
        """Every --fault-every seconds: kill or freeze one engine (a freeze lasts until the engine is gone
        or --freeze-for seconds passed, then it is resumed). None later than FAULT_MARGIN_S (plus the
        freeze) before the clients stop: its recovery must be seen."""
        for i in itertools.count():
            kind = self.args.fault if self.args.fault != "both" else ("kill", "freeze")[i % 2]
            at = (i + 1) * self.args.fault_every
            if at > self.args.duration - FAULT_MARGIN_S - (self.args.freeze_for if kind == "freeze" else 0):
                return
            await asyncio.sleep(max(0.0, at - self.now()))
            engines = [
                p for p, (_, role) in server_processes(self.pid, self.extra).items() if role == "engine"
            ]
            fault = {"t": round(self.now(), 3), "kind": kind, "pid": None, "target": "engine", "note": ""}
            if not engines:
                self.faults.append({**fault, "note": "no engine process found"})
                continue
            target = self.rng.choice(sorted(engines))
            fault["pid"] = target
            try:
                os.kill(target, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            except ProcessLookupError:
                self.faults.append({**fault, "note": "gone before the signal"})
                continue
            self.faults.append(fault)
            if kind == "freeze":
                self.stopped.add(target)
                t_end = time.monotonic() + self.args.freeze_for
                while time.monotonic() < t_end and alive(target):
                    await asyncio.sleep(0.1)
                fault["note"] = (
                    f"resumed (SIGCONT) after {self.args.freeze_for:g} s"
                    if self.resume(target)
                    else f"gone after {self.now() - fault['t']:.1f} s (killed by the watchdog)"
                )

    def resume_all(self) -> list[int]:
        """SIGCONT whatever is still stopped here; the pids resumed."""
        return sorted(p for p in list(self.stopped) if self.resume(p))

    def resume(self, pid: int) -> bool:
        """SIGCONT PID if it is still there (True then); forget it either way."""
        self.stopped.discard(pid)
        if not alive(pid):
            return False
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True
