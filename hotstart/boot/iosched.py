"""One I/O schedule per start: the bytes the imports need first, then the weights.

On a cold start the forkserver's `import torch` and the API process's web stack page their libraries in
by demand paging: small reads, one at a time. Behind a weight prefetch that keeps the disk queue full of
16 MiB reads, each of those waits its turn, and the imports the prefetch was meant to overlap end up
serialised behind it. So, at t=0:

1. ImportPrefetch reads what the imports will read (boot/manifest.py: recorded by an earlier start of
   this environment), every file's runs submitted at once (posix_fadvise WILLNEED: no copy), several
   files in flight: the disk reads them at full queue depth in a fraction of a second, in import order,
   and the imports then run from the page cache.
2. The weight prefetcher starts once that is done (or after GATE_TIMEOUT_S), and until the imports are
   over its reads go in the idle I/O class (ioprio_set; the mq-deadline and BFQ schedulers dispatch
   them only when no other read waits), so a page the manifest missed is not queued behind them.

Threads here do I/O only (os calls and ctypes syscalls), as in boot/prefetch.py.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hotstart.boot import manifest
from hotstart.boot.populate import Fadvise
from hotstart.residency import PAGE_SIZE, FileMap

GATE_TIMEOUT_S = 3.0  # the weights wait at most this long for the import prefetch
THREADS = 4  # files in flight at once
CHUNK = 8 << 20  # one WILLNEED call (the kernel cuts bigger ones at the device's readahead cap)
SMALL = 1 << 20  # whole files up to this size are queued and not waited for (three syscalls each)

# ioprio_set(2): no wrapper in os. Classes: 1 realtime, 2 best effort (the default), 3 idle.
IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE = 2, 3
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


def set_io_class(klass: int, level: int = 4, tid: int = 0) -> bool:
    """The I/O priority class of thread TID (0: the calling one). False where unsupported."""
    if _SYS_IOPRIO_SET is None:
        return False
    value = (klass << 13) | (0 if klass == IOPRIO_CLASS_IDLE else level)
    return _libc.syscall(_SYS_IOPRIO_SET, 1, tid, value) == 0  # 1: IOPRIO_WHO_PROCESS (a thread id)


class ImportPrefetch:
    """Reads the runs of MANIFESTS' entries into the page cache (see the module docstring); `done` is
    set once every entry is resident or failed. A manifest that is missing or stale is listed in
    `to_record` once loading is done (the role's process records it after its imports)."""

    def __init__(self, manifests: dict[str, Path], threads: int = THREADS):
        self.manifests, self.threads = manifests, threads
        self.done = threading.Event()
        self.to_record: list[str] = []
        self._loaded = threading.Event()
        self._lock = threading.Lock()
        self._entries: list[manifest.Entry] = []
        self._next = 0
        self._alive = 0
        self.bytes_listed = self.bytes_read = self.errors = 0
        self.t_start = self.t_end = None  # time.time()

    def start(self) -> ImportPrefetch:
        self.t_start = time.time()
        self._alive = self.threads
        threading.Thread(target=self._run, args=(True,), name="hotstart-iosched-0", daemon=True).start()
        for i in range(1, self.threads):
            name = f"hotstart-iosched-{i}"
            threading.Thread(target=self._run, args=(False,), name=name, daemon=True).start()
        return self

    def stats(self) -> dict:
        with self._lock:
            end = self.t_end or time.time()
            return {"state": "done" if self.done.is_set() else "running", "bytes_listed": self.bytes_listed,
                    "bytes_queued": self.bytes_read, "files": len(self._entries), "errors": self.errors,
                    "elapsed_s": round(end - self.t_start, 4) if self.t_start else 0.0,
                    "to_record": list(self.to_record)}

    def _load(self) -> None:
        entries: list[manifest.Entry] = []
        for role, path in self.manifests.items():
            fresh, stale = manifest.load(path)
            entries += fresh
            if stale:
                self.to_record.append(role)
        with self._lock:
            self._entries = entries
            self.bytes_listed = sum(e.nbytes for e in entries)

    def _claim(self) -> manifest.Entry | None:
        with self._lock:
            if self._next >= len(self._entries):
                return None
            self._next += 1
            return self._entries[self._next - 1]

    def _read(self, e: manifest.Entry, pop: Fadvise) -> None:
        fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC)
        fmap = None
        if e.runs is None and e.size <= SMALL:  # a module file: queued, read by the time it is imported
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                self._progress(e.size)
            finally:
                os.close(fd)
            return
        try:
            size = os.fstat(fd).st_size
            runs = [(0, size)] if e.runs is None else [(a, min(n, size - a)) for a, n in e.runs if a < size]
            runs = [(a - a % PAGE_SIZE, n + a % PAGE_SIZE) for a, n in runs if n > 0]
            if not runs:
                return
            fmap = FileMap(fd, size)
            pop.populate(fd, fmap, runs, self._progress)
        finally:
            if fmap is not None:
                fmap.close()
            os.close(fd)

    def _progress(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def _run(self, leader: bool) -> None:
        try:
            if leader:
                self._load()
                self._loaded.set()
            elif not self._loaded.wait(GATE_TIMEOUT_S):
                return
            pop = Fadvise(max(PAGE_SIZE, max((e.size for e in self._entries), default=0)), CHUNK)
            while (e := self._claim()) is not None:
                try:
                    self._read(e, pop)
                except OSError:
                    with self._lock:
                        self.errors += 1
        except Exception:  # noqa: BLE001 - never escape a daemon thread (its excepthook would import)
            with self._lock:
                self.errors += 1
        finally:
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
                if last:
                    self.t_end = time.time()
            if last:
                self.done.set()


def start_import_prefetch(home: Path, forkserver: bool) -> ImportPrefetch:
    """At t=0 of `serve`: the API process's manifest, and the forkserver's if one is importing now."""
    where = manifest.folder(home)
    roles = {"forkserver": where / "forkserver.json"} if forkserver else {}
    roles["api"] = where / "api.json"
    return ImportPrefetch(roles).start()


def start_after(gate: threading.Event, timeout: float, start: Callable[[], object]) -> None:
    """Call START (I/O threads' start) once GATE is set or TIMEOUT passed, from a daemon thread."""
    def run() -> None:
        gate.wait(timeout)
        start()

    threading.Thread(target=run, name="hotstart-iosched-gate", daemon=True).start()
