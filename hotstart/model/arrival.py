"""Weight files that are still arriving (downloaded from object storage while the engine loads them).

A file NAME being downloaded is NAME.partial (created at its full size, filled by parallel ranged
writes) beside NAME.arrival, a small state file that the downloader maps shared and the loader maps
read-only. When every byte is in, the downloader fsyncs the data and renames NAME.partial to NAME, so
a folder's complete files are exactly those under their final names.

NAME.arrival, little-endian:
  0   8 bytes  magic b"HSARRIV1"
  8   int64    size of the object (bytes)
  16  int64    chunk size (bytes)
  24  int64    watermark: bytes [0, watermark) of NAME.partial are written (a contiguous prefix)
  32  int64    state: 0 downloading, 1 complete (renamed), 2 failed
  40  int64    heartbeat: time.time_ns() of the writer's last sign of life
  48  int64    writer pid
  64  64 bytes ETag (utf-8, zero-padded)
  128 896 bytes error message when failed (utf-8, zero-padded)
  1024 one byte per chunk: 1 = written and fsynced (what a resumed download may keep)
int64 fields are aligned 8-byte stores and loads (single untorn accesses on x86-64 and aarch64), and
the writer stores the watermark only after the bytes below it are written (so the page cache holds
them for any process that maps NAME.partial), so readers need no lock.

The loader opens a weight file through open_arrived(): at once when it exists, else as soon as its
header has arrived, with a wait(end) to call before touching bytes below END. Waits are bounded: a
writer whose heartbeat stops (its process died) or that records a failure ends the wait with a
WeightsError carrying its message. Torch-free: the API process writes these, the engine reads them.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hotstart.diskio import temp_name
from hotstart.errors import WeightsError

MAGIC = b"HSARRIV1"
HEADER = 1024
ETAG_AT, ETAG_LEN = 64, 64
ERROR_AT, ERROR_LEN = 128, HEADER - 128
SIZE, CHUNK, WATERMARK, STATE, HEARTBEAT, PID = range(1, 7)  # int64 slots
DOWNLOADING, COMPLETE, FAILED = 0, 1, 2
HEARTBEAT_STALE_S = float(os.environ.get("HOTSTART_ARRIVAL_STALE_S", "30"))  # writer presumed dead after this
POLL_MIN_S, POLL_MAX_S = 0.001, 0.02

T = TypeVar("T")


def partial_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.partial")


def arrival_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.arrival")


def arriving(path: str | os.PathLike) -> bool:
    """True if PATH does not exist yet but is being downloaded (its .partial and .arrival exist)."""
    return partial_path(path).is_file() and arrival_path(path).is_file()


class ArrivalState:
    """One NAME.arrival mapped shared; `writer` maps it writable (the downloader), else read-only."""

    def __init__(self, path: str | os.PathLike, writer: bool = False):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR if writer else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                raise ValueError(f"{self.path} is not an arrival file")
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writer else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if self._mm[:8] != MAGIC:
            self._mm.close()
            raise ValueError(f"{self.path} is not an arrival file")
        self._q = memoryview(self._mm)[:HEADER].cast("q")
        self.chunks = size - HEADER

    @classmethod
    def create(cls, path: str | os.PathLike, size: int, chunk: int, etag: str) -> ArrivalState:
        """A fresh state file (nothing written), written whole to a temp name then renamed into place."""
        nchunks = max(1, -(-size // chunk))
        head = bytearray(HEADER)
        head[:8] = MAGIC
        struct.pack_into("<qqqqqq", head, 8, size, chunk, 0, DOWNLOADING, time.time_ns(), os.getpid())
        head[ETAG_AT : ETAG_AT + ETAG_LEN] = etag.encode()[:ETAG_LEN].ljust(ETAG_LEN, b"\0")
        tmp = temp_name(Path(path))  # host-pid-random: pods sharing the cache volume never collide
        with open(tmp, "wb") as f:
            f.write(bytes(head) + bytes(nchunks))
        os.replace(tmp, path)
        return cls(path, writer=True)

    def get(self, slot: int) -> int:
        return self._q[slot]

    def set(self, slot: int, value: int) -> None:
        self._q[slot] = value

    @property
    def etag(self) -> str:
        return bytes(self._mm[ETAG_AT : ETAG_AT + ETAG_LEN]).rstrip(b"\0").decode(errors="replace")

    @property
    def error(self) -> str:
        return bytes(self._mm[ERROR_AT : ERROR_AT + ERROR_LEN]).rstrip(b"\0").decode(errors="replace")

    def fail(self, message: str) -> None:
        """Record MESSAGE, then the failed state (in that order: a reader that sees FAILED has it)."""
        raw = message.encode()[: ERROR_LEN - 1]
        self._mm[ERROR_AT : ERROR_AT + ERROR_LEN] = raw.ljust(ERROR_LEN, b"\0")
        self.set(STATE, FAILED)

    def durable(self, i: int) -> bool:
        return self._mm[HEADER + i] == 1

    def mark_durable(self, indices) -> None:
        for i in indices:
            self._mm[HEADER + i] = 1
        self._mm.flush()

    def forget(self) -> None:
        """Clear every durable mark: a later download keeps nothing of this one."""
        self._mm[HEADER:] = bytes(self.chunks)
        self._mm.flush()

    def beat(self) -> None:
        self.set(HEARTBEAT, time.time_ns())

    def close(self) -> None:
        if self._q is not None:
            self._q.release()
            self._q = None
            self._mm.close()


def _wait(state: ArrivalState, final: Path, end: int, what: str) -> None:
    """Until bytes [0, END) of FINAL's download are in (or it is complete); WeightsError if it fails."""
    poll = POLL_MIN_S
    while True:
        if state.get(WATERMARK) >= end or state.get(STATE) == COMPLETE:
            return
        if state.get(STATE) == FAILED:
            raise WeightsError(state.error or f"{final}: download failed")
        age = time.time() - state.get(HEARTBEAT) / 1e9
        if age > HEARTBEAT_STALE_S:
            raise WeightsError(
                f"{final}: its download stopped {age:.0f} s ago (the downloading process "
                f"{state.get(PID)} is gone?) while waiting for {what}"
            )
        time.sleep(poll)
        poll = min(POLL_MAX_S, poll * 2)


def open_arrived(path: str | os.PathLike, opener: Callable[[Path], T]) -> tuple[T, Callable[[int], None]]:
    """(OPENER(file), wait): the weight file PATH opened once it can be read, and wait(end), which
    returns once its bytes [0, end) are there. A complete file opens at once and wait does nothing; a
    file being downloaded opens as NAME.partial when its header (the safetensors length prefix and
    JSON) has arrived. Anything else is OPENER's to report (e.g. a missing file)."""
    final = Path(path)
    if final.exists() or not arrival_path(final).is_file():
        return opener(final), _no_wait
    try:
        state = ArrivalState(arrival_path(final))
    except (OSError, ValueError):  # renamed and cleaned up meanwhile: complete
        return opener(final), _no_wait
    try:
        _wait(state, final, 8, "its header")
        partial = partial_path(final)
        if state.get(STATE) != COMPLETE:
            try:
                with open(partial, "rb") as f:
                    head = f.read(8)
                header_end = 8 + struct.unpack("<Q", head)[0] if len(head) == 8 else 8
            except FileNotFoundError:  # renamed just now: complete
                header_end = 8
            _wait(state, final, min(header_end, state.get(SIZE)), "its header")
        try:
            opened = opener(partial) if state.get(STATE) != COMPLETE and partial.exists() else opener(final)
        except WeightsError:
            if not final.exists():
                raise
            opened = opener(final)  # renamed between the check and the open
    except BaseException:
        state.close()
        raise

    def wait(end: int) -> None:
        if state._q is not None:
            _wait(state, final, end, f"byte {end}")
            if state.get(STATE) == COMPLETE:
                state.close()

    return opened, wait


def _no_wait(end: int) -> None:  # noqa: ARG001 - the complete file's wait
    return None
