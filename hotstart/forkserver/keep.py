"""`hotstart zygote start --keep MODEL`: keep a model's files resident while the zygote lives.

Each weight file and sidecar is mapped read-only (MAP_SHARED: the page cache's own pages, no copy) and
mlock'ed, which reads it in once and keeps its pages from being reclaimed under other processes'
memory pressure. The RAM guard is the prefetcher's (hotstart.boot.storage): never lock more than
DEFAULT_RAM_FRACTION of the available memory (system.available_memory(): a cgroup's room, else
MemAvailable). Where mlock is refused (RLIMIT_MEMLOCK, `ulimit -l`) the files stay mapped and are read
in (MADV_POPULATE_READ) but may be evicted, and the log line says so.
Torch-free (ctypes + os); runs in the zygote's main thread before it listens.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
from dataclasses import dataclass, field

from hotstart.boot.storage import DEFAULT_RAM_FRACTION
from hotstart.residency import resident_bytes
from hotstart.system import available_memory

MADV_POPULATE_READ = 22  # Linux >= 5.14; older kernels: MADV_WILLNEED
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = _libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.restype = _libc.mlock.restype = _libc.madvise.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / (1 << 20):.0f} MiB"


def mlock(addr: int, size: int) -> int:
    """0, or the errno of a refused mlock (a seam for tests)."""
    return 0 if _libc.mlock(addr, size) == 0 else ctypes.get_errno()


@dataclass
class Kept:
    path: str
    files: list[str]
    bytes_total: int = 0
    bytes_locked: int = 0
    note: str = ""
    maps: list[tuple[int, int]] = field(default_factory=list)  # (address, size)

    def resident(self) -> int:
        total = 0
        for f in self.files:
            try:
                total += resident_bytes(f)[0]
            except OSError:
                pass
        return total

    def unmap(self) -> None:
        for addr, size in self.maps:
            _libc.munmap(addr, size)
        self.maps = []


def _map(path: str) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap {path}: {os.strerror(err)}")
        return addr, size
    finally:
        os.close(fd)  # the mapping keeps the file


def keep(models: list[tuple[str, list[str]]], log, available: int | None = None,
         fraction: float = DEFAULT_RAM_FRACTION) -> list[Kept]:
    """Map and lock MODELS ([(folder, files)]) in order while the RAM guard allows; LOG(line) says what
    was not locked and why. AVAILABLE: bytes (default: system.available_memory() now)."""
    available = available_memory() if available is None else available
    budget = int(available * fraction) if available else 0
    out, locked_total, refused = [], 0, ""
    for path, files in models:
        k = Kept(path, list(files))
        out.append(k)
        try:
            sizes = [os.stat(f).st_size for f in files]
        except OSError as e:
            k.note = f"not kept: {e.filename}: {e.strerror}"
            log(f"hotstart: zygote: {path}: {k.note}")
            continue
        k.bytes_total = sum(sizes)
        if not available:
            k.note = "not kept: MemAvailable unknown (no /proc/meminfo), so the RAM guard cannot hold"
            log(f"hotstart: zygote: {path}: {k.note}")
            continue
        if locked_total + k.bytes_total > budget:
            k.note = (f"not kept: {_gb(k.bytes_total)} would exceed {fraction:.0%} of MemAvailable "
                      f"({_gb(available or 0)}) with {_gb(locked_total)} already locked")
            log(f"hotstart: zygote: {path}: {k.note}")
            continue
        for f in files:
            try:
                addr, size = _map(f)
            except OSError as e:
                k.note = f"not kept: {e}"
                break
            if not size:
                continue
            k.maps.append((addr, size))
            err = mlock(addr, size) if not refused else -1
            if err == 0:
                k.bytes_locked += size
                continue
            if err > 0:  # refused once: the rest is only read in (each try would read the file again)
                refused = (f"mlock: {os.strerror(err)}; RLIMIT_MEMLOCK is {_memlock_limit()}, raise it with "
                           "`ulimit -l` or LimitMEMLOCK=")
            k.note = (f"not locked ({refused}): mapped and read in, but its pages may be evicted under "
                      "memory pressure")
            if _libc.madvise(addr, size, MADV_POPULATE_READ) != 0:
                _libc.madvise(addr, size, mmap.MADV_WILLNEED)
        locked_total += k.bytes_locked
        if k.note:
            log(f"hotstart: zygote: {path}: {k.note}")
    return out
