"""Page-cache residency of files: mincore(2) on a read-only mapping, and eviction.

Torch-free and import-light (ctypes + os): used by the prefetcher in the API process and by the
benchmark harness to make a cold start reproducible. Mapping a file does not read it; mincore only
asks the kernel which of its pages are in the page cache.
"""

from __future__ import annotations

import ctypes
import mmap
import os

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

# CDLL(None) resolves symbols in the running process, which links libc; this avoids
# ctypes.util.find_library (it may spawn a subprocess). CDLL calls release the GIL.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value

# mincore sets bit 0 per page; the other bits are reserved, so normalise every byte to 0/1.
LOW_BIT = bytes(i & 1 for i in range(256))


def madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) on [address, address+length) of any mapping of this process: 0, or the errno. Never
    raises; the GIL is released for the call (a populate may take a while)."""
    return 0 if _libc.madvise(address, length, advice) == 0 else ctypes.get_errno()


def pages(nbytes: int) -> int:
    """Number of pages covering `nbytes`."""
    return (nbytes + PAGE_SIZE - 1) // PAGE_SIZE


class FileMap:
    """A PROT_READ, MAP_SHARED mapping of `size` bytes of an open fd, for residency queries only.

    The mapping is never dereferenced (madvise populates it inside the kernel, which reports a page
    past a truncated end as EFAULT), so a file truncated after mapping cannot raise SIGBUS here.
    Safe to query from any thread (no imports, no allocation beyond the caller's buffer).
    """

    def __init__(self, fd: int, size: int):
        self.size = size
        self._addr = None
        if size > 0:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap: {os.strerror(err)}")
            self._addr = addr

    def query(self, offset: int, length: int, out) -> int:
        """Fill `out` (a writable buffer, e.g. ctypes ubyte array) with the raw mincore vector for
        [offset, offset+length); `offset` must be page aligned. Returns the number of pages written."""
        length = min(length, self.size - offset)
        if length <= 0 or self._addr is None:
            return 0
        n = pages(length)
        if _libc.mincore(self._addr + offset, length, out) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        return n

    def advise(self, offset: int, length: int, advice: int) -> int:
        """madvise(2) on [offset, offset+length) of the mapping (`offset` page aligned): 0, or the errno.
        Never raises; with MADV_POPULATE_READ it touches the file (SIGBUS-free: errors come back as
        EFAULT), so only the prefetcher's populate methods use it."""
        length = min(length, self.size - offset)
        if length <= 0 or self._addr is None:
            return 0
        return madvise(self._addr + offset, length, advice)

    def vector(self, offset: int = 0, length: int | None = None) -> bytes:
        """Per-page residency (one byte 0/1 per page) of [offset, offset+length)."""
        length = self.size - offset if length is None else length
        buf = (ctypes.c_ubyte * max(1, pages(max(0, length))))()
        n = self.query(offset, length, buf)
        return bytes(buf)[:n].translate(LOW_BIT)

    def close(self) -> None:
        if self._addr is not None:
            _libc.munmap(self._addr, self.size)
            self._addr = None

    def __enter__(self) -> "FileMap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resident_map(path: str | os.PathLike, offset: int = 0, length: int | None = None) -> bytearray:
    """Per-page residency vector of the file at `path` (of its bytes [offset, offset+length), `offset` page
    aligned; default: all of it): one byte per page, 1 if in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with FileMap(fd, os.fstat(fd).st_size) as fm:
            return bytearray(fm.vector(offset, length))
    finally:
        os.close(fd)


def resident_bytes(path: str | os.PathLike) -> tuple[int, int]:
    """(resident, total) bytes of the file at `path`; resident counts whole pages, capped at total."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with FileMap(fd, size) as fm:
            vec = fm.vector()
    finally:
        os.close(fd)
    resident = vec.count(1) * PAGE_SIZE
    if vec and vec[-1] and size % PAGE_SIZE:
        resident -= PAGE_SIZE - size % PAGE_SIZE  # the last page is partial
    return resident, size


def evict(path: str | os.PathLike, sync: bool = True) -> None:
    """Drop the file's pages from the page cache (posix_fadvise DONTNEED; no root needed).

    Dirty pages are not dropped by DONTNEED, so a file just written is synced first (`sync`);
    on a clean read-only file that costs nothing.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if sync:
            try:
                os.fdatasync(fd)
            except OSError:
                pass  # e.g. a read-only or special filesystem: nothing dirty to flush anyway
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
