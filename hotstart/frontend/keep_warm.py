"""An unloaded model's files stay page-cached where memory allows, so that loading it again reads nothing
from disk (torch-free).

Every INTERVAL_S, the weight files of each unloaded model that has served before (the most recently used
first) are checked for pages that left the page cache (mincore), and those are read back by the load's
own reader (boot/prefetch.py: mincore-guided, in the idle I/O class, daemon threads doing reads only)
while what is free after them stays above RESERVE of the machine's memory. Under memory pressure the
kernel drops them again; they are read back once there is room.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hotstart.boot.prefetch import Prefetcher
from hotstart.boot.storage import plan_for
from hotstart.errors import HotstartError
from hotstart.frontend.memory import mem_total
from hotstart.frontend.router import ModelRouter, State
from hotstart.model.files import weight_files
from hotstart.residency import resident_bytes

log = logging.getLogger("hotstart")
INTERVAL_S = 30.0
RESERVE = 0.25  # of MemTotal: left free after a read-back


class KeepWarm:
    def __init__(self, router: ModelRouter, free_memory: Callable[[], int | None],
                 interval: float = INTERVAL_S) -> None:
        self.router, self.free_memory, self.interval = router, free_memory, interval
        self.prefetchers: list[Prefetcher] = []
        self.read_back = 0  # bytes found missing and read back, in all

    async def run(self) -> None:
        """Check every INTERVAL_S (a task for the server's lifetime; the checks run off the loop)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            try:
                await loop.run_in_executor(None, self.check)
            except Exception as e:  # noqa: BLE001 - a cache: the next check tries again
                log.warning("hotstart: WARNING: keeping unloaded models page-cached: %s", e)

    def check(self) -> list[Prefetcher]:
        """Start reading back what left the page cache of the unloaded models' files, as far as memory
        allows; returns the readers started (daemon threads)."""
        self.prefetchers = [p for p in self.prefetchers if not p.wait(0)]
        if self.prefetchers:  # the last read-back is still under way
            return []
        free, total = self.free_memory(), mem_total()
        if free is None or total is None:
            return []
        unloaded = sorted((r for r in self.router.records.values()
                           if r.state is State.UNLOADED and r.loads > 0), key=lambda r: -r.last_used)
        started = []
        for rec in unloaded:
            try:
                files = weight_files(rec.path)
                missing = sum(t - r for r, t in map(resident_bytes, files))
            except (OSError, ValueError, HotstartError) as e:  # a broken folder: its load says why
                log.debug("hotstart: keep-warm %s: %s", rec.name, e)
                continue
            if not missing:
                continue
            if free - missing < RESERVE * total:
                break
            plan = plan_for(files)
            if not plan.enabled:
                continue
            started.append(Prefetcher(files, plan, idle_io_until=lambda: False).start())
            free -= missing
            self.read_back += missing
        self.prefetchers += started
        return started
