"""Weight prefetch into the OS page cache, run by the API process while the engine starts.

Daemon threads claim blocks in load order (files in list order, bytes sequentially within a file).
Before each block, mincore says which pages are already cached; only the missing runs are brought
in, by the plan's method (populate.py: preadv copies into a per-thread buffer; readahead, fadvise and
madvise queue the reads in the kernel and wait for them without copying), so a warm start reads ~0
bytes. With a LoadCursor, the prefetcher never reads what the loader has passed and stays at most
`window_bytes` ahead of it (and `plan.ahead_bytes`, the RAM guard's bound, ahead of its position or
of byte 0 before it starts), so it neither races the loader for the disk nor floods RAM.

Rules this module keeps (see docs/design.md): threads do I/O only and never import (everything is
imported here at top level); nothing they do can raise into the caller (errors are recorded in
stats); nothing waits on them without a timeout, and as daemons a hung read cannot block exit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hotstart.boot.iosched import IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE, set_io_class
from hotstart.boot.populate import populator
from hotstart.boot.storage import PrefetchPlan
from hotstart.boot.tuner import ThreadTuner
from hotstart.model.cursor import LoadCursor
from hotstart.residency import LOW_BIT, PAGE_SIZE, FileMap, pages

# Resident gaps shorter than this inside a block are read through rather than splitting the read:
# copying a cached page costs far less than another syscall and a break in the disk's stream.
MERGE_GAP = 1 << 20
# Bounded sleep while ahead of the loader (or while another thread opens a file, or while parked by
# the tuner): short enough to follow a loader reading from cache, long enough not to keep taking the GIL
# from the main thread.
POLL_S = 0.02
TUNE_EVERY_S = 0.05  # how often the thread count is reconsidered (boot/tuner.py)
_WAIT = object()


class _File:
    __slots__ = ("path", "size", "base", "fd", "fmap", "state", "inflight")

    def __init__(self, path: str, size: int, base: int, state: str):
        self.path, self.size, self.base = path, size, base
        self.fd, self.fmap, self.inflight = -1, None, 0
        self.state = state  # new | opening | open | failed | closed


class Prefetcher:
    """Reads `files` into the page cache following `plan`; see the module docstring.

    `files` must be in the order the engine loads them, and global offsets (as published on `cursor`)
    are the sum of the sizes of the earlier files plus the offset within the current one.
    """

    def __init__(self, files: list[Path], plan: PrefetchPlan, cursor: LoadCursor | None = None,
                 window_bytes: int | None = None, idle_io_until: Callable[[], bool] | None = None):
        self.plan = plan
        # Until this returns True (the imports are over: boot/iosched.py), the threads read in the idle I/O
        # class, so a library page an import faults in is not queued behind them.
        self._idle_io_until = idle_io_until
        self._cursor = cursor
        self._window = plan.window_bytes if window_bytes is None else window_bytes
        # Block: a whole number of pages, and no larger than the window (else it could never be claimed).
        block = min(plan.block_bytes, self._window) if cursor is not None else plan.block_bytes
        self._block = max(PAGE_SIZE, block // PAGE_SIZE * PAGE_SIZE)
        self._ahead = plan.ahead_bytes
        # threads reading at once: plan.threads at first, up to plan.max_threads as the storage allows
        self._tuner = ThreadTuner(plan.threads, max(plan.threads, plan.max_threads))
        self._active = self._tuner.threads
        self._waited = False  # a reader waited for the loader since the tuner last looked
        self._tuned_at = 0.0
        populator(plan.method, PAGE_SIZE, plan.chunk_bytes)  # an unknown method fails here, in the caller
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._threads: list[threading.Thread] = []
        self._alive = 0
        self._state = "disabled" if not plan.enabled else "idle"
        self._t_start = self._t_end = None
        self._read = self._skip_resident = self._skip_passed = 0
        self._files_done = self._errors = 0
        self._first_error: str | None = None
        self._files: list[_File] = []
        base = 0
        for p in files:  # sizes now, in the caller's thread, so offsets match the loader's
            path = os.fspath(p)
            try:
                st = os.stat(path)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                self._files.append(_File(path, st.st_size, base, "new"))
                base += st.st_size
            except OSError as e:
                self._files.append(_File(path, 0, base, "failed"))
                self._record_error(path, e)
        self._total = base
        self._next = 0  # global offset of the next byte to claim
        self._fi = 0  # index of the file being claimed
        self._to_close: list = []

    # ---- public API -------------------------------------------------------------------------------

    def start(self) -> "Prefetcher":
        """Launch the daemon threads (no-op if the plan is disabled or already started)."""
        with self._lock:
            if self._state != "idle":
                return self
            self._state = "running"
            self._t_start = time.monotonic()
            self._alive = n = self._tuner.most
        for i in range(n):
            t = threading.Thread(target=self._run, args=(i,), name=f"hotstart-prefetch-{i}", daemon=True)
            try:
                t.start()
            except RuntimeError as e:  # can't start a thread (limits): run with fewer, or none
                with self._lock:
                    self._record_error("prefetch", e)
                    self._alive -= n - i
                    if self._alive == 0:
                        self._state, self._t_end = "stopped", time.monotonic()
                        self._finished.set()
                break
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Ask the threads to exit after their current block. Does not wait; see wait()."""
        self._stop.set()

    def wait(self, timeout: float | None) -> bool:
        """True once all threads have exited (or nothing was started); False on timeout."""
        with self._lock:
            if self._state in ("idle", "disabled"):
                return True
        return self._finished.wait(timeout)

    def stats(self) -> dict:
        """Progress snapshot; safe to call from any thread at any time (never blocks on I/O)."""
        with self._lock:
            end = self._t_end or time.monotonic()
            elapsed = end - self._t_start if self._t_start is not None else 0.0
            return {
                "state": self._state, "reason": self.plan.reason,
                "bytes_total": self._total, "bytes_read": self._read,
                "bytes_skipped_resident": self._skip_resident, "bytes_skipped_passed": self._skip_passed,
                "files_total": len(self._files), "files_done": self._files_done,
                "errors": self._errors, "first_error": self._first_error,
                "elapsed_s": round(elapsed, 6),
                "gbps": round(self._read / elapsed / 1e9, 3) if elapsed else 0.0,
                "frontier": self._next, "threads": self._active, "threads_max": self._tuner.most,
                "threads_trace": list(self._tuner.trace), "block_bytes": self._block,
                "window_bytes": self._window, "ahead_bytes": self._ahead, "method": self.plan.method,
                "loader_position": self._cursor.position() if self._cursor is not None else -1,
            }

    # ---- worker ------------------------------------------------------------------------------------

    def _record_error(self, path: str, e: BaseException) -> None:
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        self._errors += 1
        if self._first_error is None:
            self._first_error = f"{path}: {msg}"

    def _claim(self):
        """Next unit of work, under the lock: (file, offset, length), ("open", file), _WAIT or None."""
        pos = self._cursor.position() if self._cursor is not None else -1
        while self._fi < len(self._files):
            f = self._files[self._fi]
            end = f.base + f.size
            if pos > self._next:  # the loader has passed this: never read behind it
                target = min(pos, end)
                if target < end:
                    target -= (target - f.base) % PAGE_SIZE
                if target > self._next:
                    self._skip_passed += target - self._next
                    self._next = target
            if f.state == "failed" or self._next >= end:
                self._next = max(self._next, end)
                if f.state == "new":  # never opened: empty, or the loader passed it
                    f.state = "closed"
                    self._files_done += 1
                elif self._closable(f):
                    self._detach(f)
                self._fi += 1
                continue
            n = min(self._block, end - self._next)
            if pos >= 0 and self._next + n > pos + self._window:
                self._waited = True
                return _WAIT  # far enough ahead of the loader
            if self._ahead is not None and self._next + n > max(pos, 0) + self._ahead:
                # the RAM guard's bound: wait for the loader (nothing to wait for without a cursor)
                self._waited = True
                return _WAIT if self._cursor is not None else None
            if f.state == "new":
                f.state = "opening"
                return ("open", f)
            if f.state == "opening":
                return _WAIT
            off = self._next - f.base
            self._next += n
            f.inflight += 1
            return f, off, n
        return None

    def _closable(self, f: _File) -> bool:
        """Under the lock: no thread uses or will use f's descriptor any more."""
        return f.fd >= 0 and f.inflight == 0 and (f.state == "failed" or self._next >= f.base + f.size)

    def _detach(self, f: _File) -> None:
        """Under the lock: hand f's descriptor to _to_close; closed outside the lock (close may block)."""
        self._to_close.append((f.fd, f.fmap))
        f.fd, f.fmap = -1, None
        if f.state != "failed" and self._next >= f.base + f.size:
            f.state = "closed"
            self._files_done += 1

    def _close_detached(self) -> None:
        with self._lock:
            todo, self._to_close = self._to_close, []
        for fd, fmap in todo:
            if fmap is not None:
                fmap.close()
            try:
                os.close(fd)
            except OSError:
                pass

    def _open(self, f: _File) -> None:
        fd, fmap = -1, None
        try:
            fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC)
            size = os.fstat(fd).st_size
            if size < f.size:
                raise OSError(errno.EIO, f"file shrank from {f.size} to {size} bytes since planning")
            fmap = FileMap(fd, f.size)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            with self._lock:
                f.state = "failed"
                self._record_error(f.path, e)
            return
        with self._lock:
            f.fd, f.fmap, f.state = fd, fmap, "open"
            if self._closable(f):  # the loader jumped past it while we opened it
                self._detach(f)

    def _progress(self, nbytes: int) -> None:
        with self._lock:
            self._read += nbytes

    def _read_block(self, f: _File, off: int, n: int, pop, vec) -> None:
        """Bring the non-resident pages of [off, off+n) of f into the page cache, in runs."""
        npages = f.fmap.query(off, n, vec)
        v = bytes(vec)[:npages].translate(LOW_BIT)  # 0/1 per page of this block
        runs = []
        i = v.find(0)
        while i != -1:
            j = v.find(1, i)
            j = npages if j == -1 else j
            while j < npages:  # swallow short resident gaps into this run
                k = v.find(0, j)
                if k == -1 or (k - j) * PAGE_SIZE > MERGE_GAP:
                    break
                j = v.find(1, k)
                j = npages if j == -1 else j
            runs.append((off + i * PAGE_SIZE, min(j * PAGE_SIZE, n) - i * PAGE_SIZE))
            i = v.find(0, j) if j < npages else -1
        if runs:
            pop.populate(f.fd, f.fmap, runs, self._progress)
        with self._lock:
            self._skip_resident += n - sum(length for _, length in runs)

    def _tune(self, importing: bool) -> None:
        """Under the lock: let the tuner set how many threads read (the others park)."""
        now = time.monotonic()
        if now - self._tuned_at >= TUNE_EVERY_S:
            self._tuned_at = now
            self._active = self._tuner.observe(now, self._read, self._waited, importing)
            self._waited = False

    def _run(self, index: int) -> None:
        try:
            pop = populator(
                self.plan.method, self._block, self.plan.chunk_bytes
            )  # buffers for the thread's life
            vec = (ctypes.c_ubyte * pages(self._block))()
            idle_io = self._idle_io_until is not None and not self._idle_io_until()
            if idle_io:
                idle_io = set_io_class(IOPRIO_CLASS_IDLE)
            while not self._stop.is_set():
                if idle_io and self._idle_io_until():
                    set_io_class(IOPRIO_CLASS_BE)
                    idle_io = False
                with self._lock:
                    self._tune(idle_io)
                    if index >= self._active:  # parked by the tuner: more readers would not read faster
                        work = _WAIT if self._fi < len(self._files) else None
                    else:
                        work = self._claim()
                self._close_detached()
                if work is None:
                    break
                if work is _WAIT:
                    self._stop.wait(POLL_S)
                    continue
                if work[0] == "open":
                    self._open(work[1])
                    continue
                f, off, n = work
                try:
                    self._read_block(f, off, n, pop, vec)
                except Exception as e:  # noqa: BLE001 - best effort: record, skip the file, never raise
                    with self._lock:
                        if f.state != "failed":
                            f.state = "failed"
                            self._record_error(f.path, e)
                finally:
                    with self._lock:
                        f.inflight -= 1
                        if self._closable(f):
                            self._detach(f)
                    self._close_detached()
        except Exception as e:  # noqa: BLE001 - a bug must not escape a daemon thread (excepthook would import)
            with self._lock:
                self._record_error("prefetch", e)
        finally:
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
                if last:
                    for f in self._files:  # stopped early: release what is still open
                        if f.fd >= 0:
                            self._detach(f)
                    self._state = "stopped" if self._fi < len(self._files) else "done"
                    self._t_end = time.monotonic()
            self._close_detached()
            if last:
                self._finished.set()
