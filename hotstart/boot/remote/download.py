"""Parallel ranged GETs of the weight files into NAME.partial, in the engine's load order, for any store.

Daemon threads claim chunks in order (files in load order, chunks in file order), so the bytes the
loader needs next are the ones in flight; each thread GETs its chunk through the source (source.py: S3
pins the listed ETag with If-Match, a hub the commit in the URL), checks its length, writes it with
pwrite, and advances the file's watermark (hotstart/model/arrival.py) once every chunk below it is
written. Chunk 0 of each file is checked against the listing (the safetensors header must describe
exactly the listed size) before anyone can read it. A file with a listed digest (the hubs') is hashed as
it arrives (verify.py) and its watermark stops one byte short of its end until the digest matches. A
finished (and verified) file is fsynced and put into place by the layout (a rename; for the Hugging Face
cache a blob and its snapshot link).

A housekeeping thread beats the heartbeats, prints the progress line, and every CHECKPOINT_S fsyncs
the written chunks and marks them durable in the arrival file: what a restarted download keeps.
Rules this module keeps (docs/design.md): threads do I/O only (the clients are imported by the caller,
on the main thread), nothing they do raises into the caller (a failure is recorded, written into the
arrival files for the engine to report, and ends the download), and every wait is bounded.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hotstart.boot.remote.progress import progress_line, thread_cpu_seconds
from hotstart.boot.remote.snapshot import RemoteObject, header_size_check
from hotstart.boot.remote.source import StoreError
from hotstart.boot.remote.verify import Verifier, digest_of
from hotstart.errors import HotstartError
from hotstart.messages import Span
from hotstart.model import arrival
from hotstart.model.arrival import COMPLETE, DOWNLOADING, HEARTBEAT, PID, SIZE, STATE, WATERMARK, ArrivalState

CHUNK_BYTES = int(float(os.environ.get("HOTSTART_S3_CHUNK_MB", "16")) * (1 << 20))
THREADS = int(os.environ.get("HOTSTART_S3_THREADS", "8"))
SHORT_READ_RETRIES = 3
CHECKPOINT_S = float(os.environ.get("HOTSTART_S3_CHECKPOINT_S", "5"))  # how often chunks are made durable
TICK_S = 0.5
PROGRESS_EVERY_S = 1.0


class _File:
    def __init__(self, obj: RemoteObject, path: Path, state: ArrivalState, fd: int):
        self.obj, self.path, self.state, self.fd = obj, path, state, fd
        self.nchunks = max(1, -(-obj.size // CHUNK_BYTES))
        self.done = [state.durable(i) for i in range(self.nchunks)]  # written (durable or not)
        self.resumed = sum(self.done)
        self.left = self.nchunks - self.resumed
        self.low = 0  # first chunk not written: the watermark is low * CHUNK_BYTES
        self.digest = digest_of(obj)
        self.hashed = 0  # bytes fed to the digest (verify.py)
        self.verified = self.digest is None
        self.placed = False
        self.t_start = self.t_end = 0.0
        self._advance()

    def _advance(self) -> None:
        while self.low < self.nchunks and self.done[self.low]:
            self.low += 1
        mark = min(self.obj.size, self.low * CHUNK_BYTES)
        if not self.verified and self.obj.size:  # the last byte waits for the digest
            mark = min(mark, self.obj.size - 1)
        self.state.set(WATERMARK, mark)


def prepare(snap: Path, obj: RemoteObject) -> _File:
    """NAME.partial at full size and NAME.arrival, keeping the durable chunks of an earlier attempt at
    the same object (same size, ETag and chunk size)."""
    final = snap / obj.name
    part, arr = arrival.partial_path(final), arrival.arrival_path(final)
    state = None
    if part.is_file() and arr.is_file():
        try:
            state = ArrivalState(arr, writer=True)
            kept = (state.get(SIZE), state.get(arrival.CHUNK), state.etag)
            same = kept == (obj.size, CHUNK_BYTES, obj.etag[:64])
            if not same or os.stat(part).st_size != obj.size:
                state.close()
                state = None
        except (OSError, ValueError):
            state = None
    if state is None:
        state = ArrivalState.create(arr, obj.size, CHUNK_BYTES, obj.etag[:64])
    state.set(PID, os.getpid())
    state.beat()
    state.set(STATE, DOWNLOADING)
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, obj.size)
    return _File(obj, final, state, fd)


class Downloader:
    """Downloads FILES (prepared) from SOURCE (source.py) with THREADS threads into LAYOUT's places; see
    the module docstring."""

    def __init__(self, source, layout, files: list[_File], on_done: Callable[[], None],
                 threads: int = THREADS):
        self.source, self.layout = source, layout
        self.files = files
        self.on_done = on_done  # called once every file is in place (writes the completion mark)
        self.on_span: Callable[[Span], None] | None = None
        self.on_exit: Callable[[], None] | None = None  # after the end, however it ended (the lock)
        self.progress_to = sys.stderr
        self._threads_n = max(1, threads)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._claim = [(fi, ci) for fi, f in enumerate(files) for ci in range(f.nchunks) if not f.done[ci]]
        self._claim.reverse()  # pop() from the end = the next in load order
        self.total = sum(f.obj.size for f in files)
        self.resumed = sum(min(f.obj.size, f.resumed * CHUNK_BYTES) for f in files)
        self.written = 0
        self.error: str | None = None
        self.state = "running"
        self.t_start = time.monotonic()
        self.t_end: float | None = None
        self.t0_wall = time.time()
        self._tids: list[int] = []
        self._alive = 0
        self.checkpoints = 0
        self.verifier = Verifier(files, self._lock, CHUNK_BYTES, self._verified, self._mismatch)

    # ---- public ---------------------------------------------------------------------------------

    def start(self) -> Downloader:
        workers = self._threads_n if self._claim else 0
        self._alive = workers + (1 if self.verifier.files else 0) + 1  # + this call, below
        for f in self.files:  # resumed whole in an earlier run but not placed (no digest): place it now
            if f.left == 0 and f.digest is None:
                self._guarded(f, self._complete)
        for i in range(workers):
            threading.Thread(target=self._work, name=f"hotstart-dl-{i}", daemon=True).start()
        if self.verifier.files:
            threading.Thread(target=self._verify, name="hotstart-dl-verify", daemon=True).start()
        threading.Thread(target=self._housekeep, name="hotstart-dl-progress", daemon=True).start()
        self._exit()
        return self

    def stop(self) -> None:
        """Stop after the chunks in flight (what is written stays, for the next start to resume)."""
        self._stop.set()
        self.verifier.stop()

    def wait(self, timeout: float | None) -> bool:
        return self._finished.wait(timeout)

    def stats(self) -> dict:
        with self._lock:
            elapsed = (self.t_end or time.monotonic()) - self.t_start
            done = self.resumed + self.written
            rate = self.written / elapsed if elapsed > 0 else 0.0
            left = self.total - done
            return {
                "state": self.state,
                "url": self.source.url,
                "endpoint": self.source.endpoint,
                "bytes_total": self.total,
                "bytes_done": done,
                "bytes_resumed": self.resumed,
                "bytes_verified": sum(f.hashed for f in self.files if f.digest is not None),
                "files_total": len(self.files),
                "files_done": sum(f.placed for f in self.files),
                "elapsed_s": round(elapsed, 3),
                "rate_mbps": round(rate / 1e6, 1),
                "eta_s": round(left / rate, 1) if rate > 0 and left > 0 else (0.0 if left <= 0 else None),
                "threads": self._threads_n,
                "chunk_bytes": CHUNK_BYTES,
                "cpu_s": round(self.cpu_seconds(), 3),
                "error": self.error,
            }

    def cpu_seconds(self) -> float:
        """CPU time of the download and verify threads and of obstore's runtime threads."""
        return thread_cpu_seconds(self._tids)

    # ---- threads --------------------------------------------------------------------------------

    def _fail(self, message: str, bad: _File | None = None) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error, self.state = message, "failed"
        self._stop.set()
        self.verifier.stop()
        with self._lock:  # under the lock: _complete closes a finished file's state under it
            for f in self.files:
                if f.state._q is not None and not f.placed:
                    if f is bad:  # its bytes are not to be trusted: nothing of it is kept for a resume
                        f.state.forget()
                    f.state.fail(message)
        if bad is not None:
            try:
                os.unlink(arrival.partial_path(bad.path))
            except OSError:
                pass

    def _fetch(self, f: _File, start: int, end: int):
        for attempt in range(SHORT_READ_RETRIES + 1):
            buf = self.source.get_range(f.obj, start, end)
            if len(buf) == end - start:
                return buf
            if attempt == SHORT_READ_RETRIES:
                raise HotstartError(
                    f"{self.source.url}/{f.obj.name}: bytes {start}-{end - 1} came back as "
                    f"{len(buf)} bytes {SHORT_READ_RETRIES + 1} times (a truncated object?)"
                )
            time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def _chunk(self, fi: int, ci: int) -> None:
        f = self.files[fi]
        start = ci * CHUNK_BYTES
        end = min(f.obj.size, start + CHUNK_BYTES)
        with self._lock:
            if not f.t_start:
                f.t_start = time.time()
        buf = self._fetch(f, start, end)
        if ci == 0 and header_size_check(self.source.url, f.obj, buf) is None:
            n = int.from_bytes(bytes(buf[:8]), "little")
            header_size_check(self.source.url, f.obj, self._fetch(f, 0, 8 + n))
        view = memoryview(buf)
        off = 0
        while off < len(view):
            off += os.pwrite(f.fd, view[off:], start + off)
        with self._lock:
            f.done[ci] = True
            f.left -= 1
            self.written += end - start
            f._advance()  # the watermark moves only past written bytes
            last = f.left == 0 and f.verified
        self.verifier.poke()
        if last:
            self._complete(f)

    def _verified(self, f: _File) -> None:
        with self._lock:
            f.verified = True
            f._advance()
        self._guarded(f, self._complete)

    def _mismatch(self, f: _File, text: str) -> None:
        self._fail(f"{self.source.url}/{f.obj.name}: the downloaded bytes do not match the listed digest "
                   f"({text}); nothing of it was kept", f)

    def _guarded(self, f: _File, step: Callable[[_File], None]) -> None:
        try:
            step(f)
        except OSError as e:
            self._fail(f"{f.path}: cannot put the download in place: {e.strerror or e}")

    def _complete(self, f: _File) -> None:
        with self._lock:
            if f.fd < 0:  # completed already
                return
            fd, f.fd = f.fd, -1
        os.fsync(fd)
        os.close(fd)
        self.layout.place(f.obj, arrival.partial_path(f.path))
        with self._lock:
            f.placed = True
            f.state.set(STATE, COMPLETE)
            f.state.close()
        try:
            os.unlink(arrival.arrival_path(f.path))
        except OSError:
            pass
        f.t_end = time.time()
        took = f.t_end - (f.t_start or f.t_end)
        self._span(
            f"downloaded {f.obj.name}",
            f.t_start or f.t_end,
            f.t_end,
            f"{f.obj.size / 1e6:.0f} MB, {f.obj.size / max(took, 1e-9) / 1e9:.2f} GB/s"
            + (", verified" if f.digest is not None else ""),
        )

    def _span(self, name: str, start: float, end: float, detail: str) -> None:
        if self.on_span is not None:
            try:
                self.on_span(Span(name, start, end, "download", detail))
            except Exception:  # noqa: BLE001, S110 - a progress report never breaks the download
                pass

    def _verify(self) -> None:
        with self._lock:
            self._tids.append(threading.get_native_id())
        try:
            self.verifier.run()
        except OSError as e:
            self._fail(f"cannot read back the download to verify it: {e.strerror or e}")
        except Exception as e:  # noqa: BLE001 - a bug must not escape a daemon thread
            self._fail(f"download check failed: {type(e).__name__}: {e}")
        finally:
            self._exit()

    def _work(self) -> None:
        with self._lock:
            self._tids.append(threading.get_native_id())
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not self._claim:
                        break
                    fi, ci = self._claim.pop()
                try:
                    self._chunk(fi, ci)
                except HotstartError as e:
                    integrity = not isinstance(e, StoreError) or self.source.integrity_error(e)
                    self._fail(str(e), self.files[fi] if integrity else None)
                except OSError as e:
                    self._fail(f"{self.files[fi].path}: cannot write: {e.strerror or e}")
        except Exception as e:  # noqa: BLE001 - a bug must not escape a daemon thread
            self._fail(f"download failed: {type(e).__name__}: {e}")
        finally:
            self._exit()

    def _exit(self) -> None:
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            ok = self.error is None and all(f.placed for f in self.files)
            if self.state == "running":
                self.state = "done" if ok else "stopped"
            self.t_end = time.monotonic()
        if ok:
            try:
                self.on_done()
            except OSError as e:
                self._fail(f"cannot write the download's completion mark: {e.strerror or e}")
            total = sum(f.obj.size for f in self.files)
            self._span(
                "weights downloaded",
                self.t0_wall,
                time.time(),
                f"{total / 1e6:.0f} MB, {self.written / 1e6:.0f} MB fetched, "
                f"{self.written / max(self.t_end - self.t_start, 1e-9) / 1e9:.2f} GB/s, "
                f"{self.cpu_seconds():.2f} CPU-s",
            )
        if self.on_exit is not None:
            self.on_exit()
        self._finished.set()

    def _checkpoint(self) -> None:
        for f in self.files:
            with self._lock:
                if f.fd < 0:
                    continue
                fresh = [i for i in range(f.nchunks) if f.done[i] and not f.state.durable(i)]
                fd = os.dup(f.fd)
            try:
                if fresh:
                    os.fdatasync(fd)
                    f.state.mark_durable(fresh)
            except (OSError, ValueError, TypeError):
                pass  # closed meanwhile (complete): nothing to keep
            finally:
                os.close(fd)
        self.checkpoints += 1

    def _housekeep(self) -> None:
        last_cp = last_line = time.monotonic()
        while not self._finished.wait(TICK_S):
            now = time.monotonic()
            with self._lock:
                for f in self.files:
                    if f.state._q is not None and not f.placed:
                        f.state.set(HEARTBEAT, time.time_ns())
            if self._stop.is_set() or now - last_cp >= CHECKPOINT_S:
                self._checkpoint()
                last_cp = now
            if now - last_line >= PROGRESS_EVERY_S and self.state == "running":
                last_line = now
                self._print_progress()
        if self.state != "done":
            self._checkpoint()

    def _print_progress(self) -> None:
        if self.progress_to is None or not self.written:
            return
        try:
            self.progress_to.write(progress_line(self.source.url, self.stats()) + "\n")
            self.progress_to.flush()
        except (OSError, ValueError):
            pass
