"""LoadCursor: how far the engine's weight loader has got, shared with the API process's prefetcher.

A 64-byte file in a private temp dir (mode 0700, unique per server instance: no fixed shared-memory
names), mmapped by both processes. The loader (single writer) stores a monotonic global byte offset:
sum of the sizes of the earlier files in the load order + offset in the current file. -1 means
"loader not started". Layout: 8-byte magic, then one aligned int64. The value is stored and loaded
through a memoryview cast to int64, i.e. one aligned 8-byte memcpy, which is a single untorn
store/load on x86-64 and aarch64, so the reader needs no lock.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile

SIZE = 64
MAGIC = b"HSCURSR1"
_POS = 1  # index of the int64 slot after the magic


class LoadCursor:
    """Shared loader position. `create()` in the API process, `open(path)` in the engine process."""

    def __init__(self, path: str, owner: bool):
        self.path = path
        self._owner = owner
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, SIZE)  # MAP_SHARED: stores are seen by the other process
        finally:
            os.close(fd)
        if self._mm[:8] != MAGIC:
            self._mm.close()
            raise ValueError(f"{path} is not a hotstart load cursor")
        self._slots = memoryview(self._mm).cast("q")
        self._last = self._slots[_POS]

    @classmethod
    def create(cls, dir: str | None = None) -> "LoadCursor":
        """Create a fresh cursor at -1 in a new private temp directory; the caller owns (unlinks) it."""
        d = tempfile.mkdtemp(prefix="hotstart-cursor-", dir=dir)
        path = os.path.join(d, "load-cursor")
        # The file is complete (magic + -1) before anyone can learn its path.
        with open(path, "wb") as f:
            f.write(MAGIC + (-1).to_bytes(8, "little", signed=True) + bytes(SIZE - 16))
        return cls(path, owner=True)

    @classmethod
    def open(cls, path: str) -> "LoadCursor":
        """Attach to a cursor created by another process (the engine side)."""
        return cls(path, owner=False)

    def advance(self, offset: int) -> None:
        """Publish the loader's global byte offset. Monotonic: a smaller value is ignored."""
        if offset > self._last and self._slots is not None:
            self._slots[_POS] = offset
            self._last = offset

    def position(self) -> int:
        """The loader's global byte offset, -1 before it starts. After close(), the last value seen."""
        try:
            self._last = self._slots[_POS]
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
