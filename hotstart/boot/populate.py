"""How a prefetch thread brings pages of a file into the page cache: the `--prefetch-method` strategies.

Every prefetch thread owns one populator. `populate(fd, fmap, runs, progress)` takes the runs
[(offset, length), ...] of one block that mincore found missing, brings them into the page cache and
returns once they are resident. Every method is synchronous per block, so at most threads x block
bytes are in flight, as with preadv: the disk queue never grows deep in front of other readers (a
cold `import torch` faulting its libraries in), and the cursor window keeps its meaning.

- preadv: os.preadv into the thread's buffer. The kernel copies every byte into user space (CPU).
- readahead / fadvise: readahead(2) (ctypes: os has no wrapper) / posix_fadvise(POSIX_FADV_WILLNEED).
  Both are the same kernel path (readahead(2) calls vfs_fadvise(WILLNEED)): they allocate the pages,
  queue the reads and return before the data arrives, and one call submits at most the device's
  max(read_ahead_kb, max_sectors_kb) (the kernel's max(ra_pages, io_pages): 8 MiB here) - a bigger
  call is silently cut there, which is why "WILLNEED covered ~3 MB per call" once. So calls go in
  chunks of that cap (`chunk_bytes`), then the thread waits: a 1-byte pread of the run's last page
  sleeps until that page's read completes (the reads complete roughly in order), then mincore shows
  what is still missing and the thread waits on the first missing page, until none is. No data is
  copied but those single bytes; a page nobody queued is read by the 1-byte pread's own readahead.
- madvise: on the FileMap's shared read-only mapping, MADV_WILLNEED (for a file mapping this is the
  same vfs_fadvise submission), MADV_POPULATE_READ (Linux >= 5.14: faults the pages in, i.e. waits for
  them, and maps them into this process's page tables: no copy, but page-table work), then
  MADV_DONTNEED on the range (drops those page-table entries again; the page cache keeps the pages,
  and the API process's RSS does not grow by the weights). Where POPULATE_READ is refused (EINVAL:
  old kernel) it waits like fadvise does.

Threads call these: no imports, nothing but os/ctypes calls and bytes work; errors are raised as
OSError to the Prefetcher, which records them and skips the file.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from hotstart.residency import LOW_BIT, PAGE_SIZE, FileMap, pages

METHODS = ("preadv", "readahead", "fadvise", "madvise")
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)

_libc = ctypes.CDLL(None, use_errno=True)  # its own handle: argtypes set here do not leak elsewhere
try:
    _readahead = _libc.readahead
    _readahead.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_size_t]
    _readahead.restype = ctypes.c_ssize_t
except AttributeError:  # a libc without it: the readahead method submits with posix_fadvise instead
    _readahead = None


class Preadv:
    """Reads the runs into a buffer of the thread's (allocated once): the kernel copies every byte."""

    name, zero_copy = "preadv", False

    def __init__(self, block_bytes: int, chunk_bytes: int):
        self._mv = memoryview(bytearray(block_bytes))

    def populate(self, fd: int, fmap: FileMap, runs, progress) -> None:
        for start, length in runs:
            done = 0
            while done < length:
                r = os.preadv(fd, [self._mv[done:length]], start + done)
                if r == 0:
                    raise OSError(errno.EIO, f"unexpected end of file at byte {start + done} (truncated?)")
                done += r
                progress(r)  # progress is visible per read, not per block


class _ZeroCopy:
    """Queues the runs' reads (`_submit`), then waits until mincore says they are resident."""

    name, zero_copy = "", True

    def __init__(self, block_bytes: int, chunk_bytes: int):
        self._chunk = max(PAGE_SIZE, chunk_bytes // PAGE_SIZE * PAGE_SIZE)
        self._vec = (ctypes.c_ubyte * pages(block_bytes))()
        self._byte = memoryview(bytearray(1))

    def populate(self, fd: int, fmap: FileMap, runs, progress) -> None:
        for start, length in runs:  # everything of the block in flight before the first wait
            self._submit(fd, fmap, start, length)
        for start, length in runs:
            self._wait(fd, fmap, start, length)
            progress(length)

    def _submit(self, fd: int, fmap: FileMap, start: int, length: int) -> None:
        raise NotImplementedError

    def _wait(self, fd: int, fmap: FileMap, start: int, length: int) -> None:
        """Return once every page of the run is resident. Each round sleeps in a 1-byte pread on one
        missing page (first the last one); a round that leaves its page missing means this file's
        pages do not stay in the page cache (e.g. a direct-I/O FUSE mount): give up with an error."""
        target = start + (length - 1) // PAGE_SIZE * PAGE_SIZE
        while True:
            if os.preadv(fd, [self._byte], target) == 0:
                raise OSError(errno.EIO, f"unexpected end of file at byte {target} (truncated?)")
            n = fmap.query(start, length, self._vec)
            v = bytes(self._vec)[:n].translate(LOW_BIT)
            i = v.find(0)
            if i == -1:
                return
            missing = start + i * PAGE_SIZE
            if missing == target:
                raise OSError(
                    errno.EIO, f"page at byte {target} does not stay in the page cache after a read"
                )
            target = missing


def _willneed(fd: int, start: int, length: int, chunk: int) -> None:
    end = start + length
    for off in range(start, end, chunk):
        os.posix_fadvise(fd, off, min(chunk, end - off), os.POSIX_FADV_WILLNEED)


class Fadvise(_ZeroCopy):
    name = "fadvise"

    def _submit(self, fd: int, fmap: FileMap, start: int, length: int) -> None:
        _willneed(fd, start, length, self._chunk)


class Readahead(_ZeroCopy):
    name = "readahead"

    def _submit(self, fd: int, fmap: FileMap, start: int, length: int) -> None:
        if _readahead is None:
            return _willneed(fd, start, length, self._chunk)
        end = start + length
        for off in range(start, end, self._chunk):
            if _readahead(fd, off, min(self._chunk, end - off)) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"readahead: {os.strerror(err)}")


class Madvise(_ZeroCopy):
    name = "madvise"

    def __init__(self, block_bytes: int, chunk_bytes: int):
        super().__init__(block_bytes, chunk_bytes)
        self._populate_ok = True

    def _submit(self, fd: int, fmap: FileMap, start: int, length: int) -> None:
        end = start + length
        for off in range(start, end, self._chunk):  # WILLNEED on a file mapping: the fadvise path, same cap
            fmap.advise(off, min(self._chunk, end - off), MADV_WILLNEED)

    def _wait(self, fd: int, fmap: FileMap, start: int, length: int) -> None:
        err = fmap.advise(start, length, MADV_POPULATE_READ) if self._populate_ok else errno.EINVAL
        if err == errno.EINVAL:  # kernel < 5.14: wait as fadvise does
            self._populate_ok = False
            super()._wait(fd, fmap, start, length)
        elif err == errno.EFAULT:
            raise OSError(
                errno.EIO, f"bytes {start}-{start + length} are past the end of the file (truncated?)"
            )
        elif err:
            raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")
        fmap.advise(start, length, MADV_DONTNEED)  # unmap: the page cache keeps the pages


_CLASSES = {"preadv": Preadv, "readahead": Readahead, "fadvise": Fadvise, "madvise": Madvise}


def populator(method: str, block_bytes: int, chunk_bytes: int):
    """A populator of METHOD (one of METHODS) for one thread, with buffers for blocks of BLOCK_BYTES."""
    try:
        cls = _CLASSES[method]
    except KeyError:
        raise ValueError(f"prefetch method must be one of {', '.join(METHODS)}, got {method!r}") from None
    return cls(block_bytes, chunk_bytes)
