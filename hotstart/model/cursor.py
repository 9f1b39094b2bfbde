"""LoadCursor: how far the engine's weight loader has got, shared with the API process's prefetcher.

A small file in a private temp dir (mode 0700, unique per server instance: no fixed shared-memory
names), mmapped by both processes. The loader stores a monotonic global byte offset: sum of the sizes
of the earlier files in the load order + offset in the current file. -1 means "loader not started".
Layout: 8-byte magic, then one aligned int64 per tensor-parallel rank (at least 7 slots, 64 bytes;
slots of no rank hold INT64_MAX). Each rank's loader is the single writer of its slot; the position
is the minimum over the slots: the slowest rank's, so the prefetcher never skips bytes a rank still
needs. Values are stored and loaded through a memoryview cast to int64, i.e. aligned 8-byte memcpys,
single untorn stores/loads on x86-64 and aarch64, so the reader needs no lock.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile

SIZE = 64
MAGIC = b"HSCURSR1"
_POS = 1  # index of rank 0's int64 slot (right after the magic)
NO_RANK = (1 << 63) - 1


class LoadCursor:
    """Shared loader position. `create()` in the API process, `open(path)` in the engine process."""

    def __init__(self, path: str, owner: bool, rank: int = 0):
        self.path = path
        self._owner = owner
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < SIZE or size % 8:
                raise ValueError(f"{path} is not a hotstart load cursor")
            self._mm = mmap.mmap(fd, size)  # MAP_SHARED: stores are seen by the other process
        finally:
            os.close(fd)
        if self._mm[:8] != MAGIC:
            self._mm.close()
            raise ValueError(f"{path} is not a hotstart load cursor")
        self._slots = memoryview(self._mm).cast("q")
        self._mine = _POS + rank  # the slot this side writes
        if not _POS <= self._mine < len(self._slots) or self._slots[self._mine] == NO_RANK:
            self._slots.release()
            self._mm.close()
            raise ValueError(f"{path}: no slot for rank {rank}")
        self._written = self._slots[self._mine]
        self._last = self._min()

    @classmethod
    def create(cls, dir: str | None = None, ranks: int = 1) -> "LoadCursor":
        """Create a fresh cursor at -1 for RANKS loaders in a new private temp directory; the caller owns
        (unlinks) it."""
        d = tempfile.mkdtemp(prefix="hotstart-cursor-", dir=dir)
        path = os.path.join(d, "load-cursor")
        slots = [-1] * ranks + [NO_RANK] * max(0, SIZE // 8 - 1 - ranks)
        # The file is complete (magic + slots) before anyone can learn its path.
        with open(path, "wb") as f:
            f.write(MAGIC + b"".join(v.to_bytes(8, "little", signed=True) for v in slots))
        return cls(path, owner=True)

    @classmethod
    def open(cls, path: str, rank: int = 0) -> "LoadCursor":
        """Attach to a cursor created by another process (the engine side: the loader of RANK)."""
        return cls(path, owner=False, rank=rank)

    def advance(self, offset: int) -> None:
        """Publish this loader's global byte offset. Monotonic: a value below the slot's is ignored."""
        if self._slots is not None and offset > max(self._written, self._slots[self._mine]):
            self._slots[self._mine] = offset
            self._written = offset

    def _min(self) -> int:
        return min(v for v in self._slots[_POS:])

    def position(self) -> int:
        """The slowest loader's global byte offset, -1 before every one started. After close(), the
        last value seen."""
        try:
            self._last = self._min()
        except (TypeError, ValueError):
            pass  # closed (possibly by another thread just now): keep the last value
        return self._last

    def close(self) -> None:
        """Unmap (idempotent). The owner also removes the file and its directory."""
        if self._slots is not None:
            self._slots.release()
            self._slots = None
            self._mm.close()
        if self._owner:
            self._owner = False
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    def unlink(self) -> None:
        """Remove the backing file now (the mappings stay valid until closed)."""
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    def __enter__(self) -> "LoadCursor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
