"""How many prefetch threads read at once: chosen while reading, by what the storage gives.

A fixed count is right on one host and wrong on the next (2 threads saturated one VM's disk; another's
gave 1.34 GB/s with 2 and 1.85 GB/s with 4). So the prefetcher starts `start` threads and this
controller climbs while the read rate climbs: every step it measures the rate over MEASURE_S (after
SETTLE_S for the change to take hold) and keeps a count that reads faster than the best count by GAIN;
a probe that does not pay goes back to the best count and holds there for HOLD_S before probing again
(each measurement of the best count replaces its rate: the disk's rate drifts, and a probe is judged
against the rate of now).
While the imports page their libraries in (boot/iosched.py's idle phase) the count is capped at
`start`: more reads in flight would queue their page faults behind ours. Intervals in which the
readers waited for the loader (the window ahead of it is full) are not disk-bound and do not count.

Pure bookkeeping (no I/O, no imports): `observe(now, bytes_read, waited, importing) -> threads`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SETTLE_S = 0.15
MEASURE_S = 0.35
HOLD_S = 2.0
GAIN = 1.08  # one more thread must read this much faster to be kept


@dataclass
class ThreadTuner:
    start: int
    most: int
    threads: int = 0
    best_rate: float = 0.0
    best_threads: int = 0
    trace: list = field(default_factory=list)  # (seconds since the first observation, threads, GB/s)
    _t0: float | None = None
    _since: float = 0.0  # when the current count took effect
    _mark: tuple[float, int] | None = None  # (time, bytes) where the current measurement began
    _hold_until: float = 0.0

    def __post_init__(self) -> None:
        self.threads = self.best_threads = max(1, min(self.start, self.most))

    @property
    def adaptive(self) -> bool:
        return self.most > self.start

    def observe(self, now: float, bytes_read: int, waited: bool, importing: bool) -> int:
        """The thread count to run with now, given the bytes read so far and whether any reader waited
        for the loader since the last call."""
        if self._t0 is None:
            self._t0 = self._since = now
        if not self.adaptive:
            return self.threads
        if importing:
            return self._set(now, min(self.threads, self.start))
        if waited or self._mark is None or now - self._since < SETTLE_S:
            self._mark = None if waited else self._mark
            if self._mark is None and now - self._since >= SETTLE_S:
                self._mark = (now, bytes_read)
            return self.threads
        t, b = self._mark
        if now - t < MEASURE_S:
            return self.threads
        rate = (bytes_read - b) / (now - t)
        self.trace.append((round(now - self._t0, 3), self.threads, round(rate / 1e9, 3)))
        if self.threads == self.best_threads and rate <= self.best_rate * GAIN:
            self.best_rate = rate  # the best count, measured again: the disk's rate now
        elif rate > self.best_rate * GAIN:  # more threads read faster: keep them, and try one more
            self.best_rate, self.best_threads = rate, self.threads
            return self._set(now, min(self.threads + 1, self.most))
        else:  # a probe that did not pay: back to the best count, for a while
            self._hold_until = now + HOLD_S
            return self._set(now, self.best_threads)
        if now >= self._hold_until and self.threads < self.most:  # probe one more now and then
            self._hold_until = now + HOLD_S
            return self._set(now, self.threads + 1)
        self._mark = (now, bytes_read)
        return self.threads

    def _set(self, now: float, threads: int) -> int:
        if threads != self.threads:
            self.threads, self._since, self._mark = threads, now, None
        return self.threads
