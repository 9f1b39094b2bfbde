"""Memory pressure (torch-free, stdlib + the gate's response helpers): new work is held back while the
machine runs out of memory, and an engine death by SIGKILL is explained.

- `MemoryGuard` (server/gate.py asks it before every POST): while the available memory
  (system.available_memory(): a cgroup's limit minus its working set, else MemAvailable; read at most every
  SAMPLE_S) is below --min-free-memory, a new request waits up to WAIT_S for memory to come back, then
  gets 503 in OpenAI's error shape with Retry-After. Requests in flight are untouched; the
  engine's KV blocks are committed as they are first used (engine/block_manager.py), so refusing new work
  is what keeps the OOM killer off the engine.
- `exit_cause(code, pid)`: for an engine killed by SIGKILL, what killed it as far as this process can
  tell: the kernel's OOM message for that pid (/dev/kmsg, where readable), the cgroup's oom_kill counter
  (memory.events on cgroup v2, memory.oom_control on v1), else the available memory before the death.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from hotstart.errors import RequestError
from hotstart.system import available_memory, memory_limit

SAMPLE_S = 0.5  # available memory is read at most this often (/proc/meminfo and cgroup files: ~50 us)
WAIT_S = 1.0  # a request under pressure waits this long for memory before its 503
POLL_S = 0.25
RETRY_AFTER_S = 2
AUTO_FRACTION, AUTO_CAP = 0.05, 1 << 30  # --min-free-memory auto: 5% of the RAM, at most 1 GiB
KMSG_MAX_RECORDS = 100_000  # bounds the kernel-log scan (the ring buffer holds far fewer)


def mem_total() -> int | None:
    """The RAM this server may use: its cgroup's limit, else MemTotal (system.memory_limit())."""
    return memory_limit().total


def min_free_bytes(text: str, total: int | None = None) -> int:
    """--min-free-memory (flags.memory_amount's text) in bytes; 0: no check. Percentages and `auto` are
    of the RAM this server may use (a cgroup's limit, else MemTotal; no check where it is unknown)."""
    text = text.strip().lower()
    if text == "auto" or text.endswith("%"):
        total = mem_total() if total is None else total
        if not total:
            return 0
        if text == "auto":
            return min(int(total * AUTO_FRACTION), AUTO_CAP)
        return int(total * float(text[:-1]) / 100)
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    number = text.rstrip("ib").rstrip("kmgt") or "0"
    unit = text.rstrip("ib")[-1:]
    return int(float(number) * units.get(unit, 1))


class Sampler:
    """The available memory (system.available_memory()), read at most every SAMPLE_S; `last` keeps the
    latest reading and its time (what an OOM death is reported with)."""

    def __init__(self, read=available_memory, every: float = SAMPLE_S) -> None:
        self.read, self.every = read, every
        self.last: tuple[int | None, float] = (None, 0.0)  # (bytes, time.monotonic())

    def available(self) -> int | None:
        value, at = self.last
        now = time.monotonic()
        if now - at >= self.every:
            value = self.read()
            self.last = (value, now)
        return value


SAMPLER = Sampler()


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / (1 << 20):.0f} MiB"


class MemoryGuard:
    """Admission against the available memory: `await admit()` is None (go on) or the 503 to answer."""

    def __init__(self, min_free: int, sampler: Sampler = SAMPLER, wait_s: float = WAIT_S) -> None:
        self.min_free, self.sampler, self.wait_s = min_free, sampler, wait_s
        self.refused = 0

    def short(self) -> int | None:
        """The available memory if it is below the threshold, else None (unknown counts as enough)."""
        free = self.sampler.available()
        return free if free is not None and free < self.min_free else None

    async def admit(self) -> RequestError | None:
        """None (go on), or the 503 to answer once memory stayed short for wait_s."""
        free = self.short()
        if free is None:
            return None
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            free = self.short()
            if free is None:
                return None
        self.refused += 1
        return RequestError(503, f"the server is low on memory ({_mib(free)} available, --min-free-memory "
                            f"{_mib(self.min_free)}): retry the request shortly", code="insufficient_memory",
                            retry_after=RETRY_AFTER_S)


def memory_guard(flag: str) -> MemoryGuard | None:
    """The guard --min-free-memory FLAG asks for (None: no check)."""
    need = min_free_bytes(flag)
    return MemoryGuard(need) if need > 0 else None


# ---- why an engine was SIGKILLed -------------------------------------------------------------------
def _cgroup_files() -> list[str]:
    """Where this process's cgroup counts OOM kills: v2 memory.events, v1 memory.oom_control."""
    return [os.path.join(folder, "memory.events" if version == 2 else "memory.oom_control")
            for version, folder in memory_limit().oom_folders()]


def oom_kills() -> int | None:
    """The cgroup's count of processes killed by an OOM killer, or None if it cannot be read."""
    for path in _cgroup_files():
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


_OOM_BASELINE: list[int | None] = []  # the counter when the server started (prime())


def prime() -> None:
    """Read the baseline of the OOM-kill counter and the available memory (the server calls it at start)."""
    if not _OOM_BASELINE:
        _OOM_BASELINE.append(oom_kills())
    SAMPLER.available()


def kernel_oom_line(pid: int, path: str = "/dev/kmsg") -> str | None:
    """The kernel's "Killed process PID" message (an OOM kill), where the kernel log is readable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        for _ in range(KMSG_MAX_RECORDS):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten while reading; go on with the next
                continue
            if not record:
                break
            text = record.decode(errors="replace").partition(";")[2].strip()
            if f"Killed process {pid} " in text:
                found = text.splitlines()[0][:200]
    finally:
        os.close(fd)
    return found


def exit_cause(code: int | None, pid: int | None = None) -> str:
    """What likely sent the kill, for the log line: empty unless CODE (a negative signal) is SIGKILL."""
    if code != -signal.SIGKILL:
        return ""
    line = kernel_oom_line(pid) if pid else None
    if line:
        return f": killed by the OOM killer (kernel: {line})"
    kills = oom_kills()
    base = _OOM_BASELINE[0] if _OOM_BASELINE else None
    if kills is not None and base is not None and kills > base:
        return f": killed by the OOM killer (the cgroup's oom_kill count went from {base} to {kills})"
    before, at = SAMPLER.last
    ago = f" {time.monotonic() - at:.0f} s before" if before is not None else ""
    return (
        f": killed by SIGKILL (possibly the OOM killer: available memory was {_mib(before)}{ago}, "
        f"{_mib(available_memory())} now)"
    )
