"""What kind of storage holds the weights, and how (or whether) to prefetch them from it.

`detect()` reads /proc/self/mountinfo and /sys; the parsing and policy are pure functions over text
and numbers so tests can feed fake inputs. Defaults are measured: see docs/prefetch.md and
benchmarks/prefetch_sweep.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Iterable

from hotstart.boot.populate import METHODS
from hotstart.system import available_memory, mem_available  # noqa: F401 - mem_available re-exported

MiB = 1 << 20
GiB = 1 << 30

NETWORK_FSTYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "virtiofs", "9p", "glusterfs", "beegfs",
    "gpfs", "afs", "ncpfs", "orangefs", "pvfs2", "wekafs", "panfs", "ocfs2", "gfs2", "davfs", "sshfs",
})
MEMORY_FSTYPES = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})

# Measured on the dev machine (virtio disk, 2 cores): see docs/prefetch.md. A local read starts with 2
# threads (one read in flight while the other thread does its mincore/bookkeeping) and the tuner
# (boot/tuner.py) adds threads, up to LOCAL_MAX_THREADS, while the read rate grows with them: on one VM
# 2 saturated the disk, on another 4 read 1.4x faster.
LOCAL_THREADS = 2
LOCAL_MAX_THREADS = 8
LOCAL_BLOCK_MIB = 16
# High-latency storage needs many reads in flight; 8 to start (buffers: 8 x 16 MiB), 32 at most.
NETWORK_THREADS = 8
NETWORK_MAX_THREADS = 32
# Seeks kill a spinning disk: one sequential reader.
ROTATIONAL_THREADS = 1
DEFAULT_WINDOW_MIB = 1024
DEFAULT_RAM_FRACTION = 0.5
# `--prefetch-method auto` on local, rotational and unknown storage: the zero-copy method that measured
# fastest beside `import torch` with the least CPU (3 GB: 2.58 GB/s, 0.23 CPU-s/GB; docs/prefetch.md).
AUTO_METHOD = "fadvise"
# Network filesystems implement readahead their own way (NFS rsize, FUSE max_readahead): explicit
# reads are the known-good answer there, and it is not measured on these machines.
AUTO_NETWORK_METHOD = "preadv"
# Bytes per readahead/WILLNEED call where the device's cap is unknown (the kernel's default
# read_ahead_kb): a call above the cap is cut silently, one below it only costs another syscall.
FALLBACK_CHUNK = 128 << 10


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str
    majmin: str  # "254:0"


@dataclass(frozen=True)
class StorageInfo:
    kind: str  # "rotational" | "network" | "local" | "memory" | "unknown"
    fstype: str
    device: str
    note: str = ""
    ra_bytes: int = 0  # most bytes one readahead(2)/WILLNEED call queues on this device (0: unknown)


@dataclass(frozen=True)
class PrefetchOverrides:
    """User flags; any field left None keeps the policy's choice."""
    enabled: bool | None = None  # False: never prefetch; True: prefetch even where policy would not
    threads: int | None = None
    block_mib: int | None = None
    window_mib: int | None = None
    ram_fraction: float = DEFAULT_RAM_FRACTION
    method: str = "auto"  # auto | one of populate.METHODS


@dataclass(frozen=True)
class PrefetchPlan:
    enabled: bool
    threads: int
    block_bytes: int
    reason: str
    window_bytes: int = DEFAULT_WINDOW_MIB * MiB
    method: str = "preadv"  # one of populate.METHODS
    chunk_bytes: int = FALLBACK_CHUNK  # per readahead/WILLNEED call (zero-copy methods)
    ahead_bytes: int | None = None  # most bytes read ahead of the loader's position (0 before it starts)
    max_threads: int = 0  # the tuner may add threads up to this many while the read rate grows (0: fixed)


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)  # mountinfo writes " " as \040


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse /proc/self/mountinfo text (proc(5)) in mount order."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 3:
            continue
        mounts.append(Mount(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]), fields[2]))
    return mounts


def find_mount(mounts: Iterable[Mount], path: str) -> Mount | None:
    """The mount holding absolute `path`: longest mount-point prefix; the later of equal ones wins
    (it shadows the earlier)."""
    best = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if mp == "/" or path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = m
    return best


def block_device(majmin: str, sys_root: str = "/sys") -> tuple[str, bool | None, bool]:
    """(disk name, rotational flag or None, is virtio) for a device number, resolving a partition to
    its disk through /sys/dev/block."""
    dev = os.path.realpath(os.path.join(sys_root, "dev", "block", majmin))
    if not os.path.isdir(dev):
        return "", None, False
    if os.path.exists(os.path.join(dev, "partition")):
        dev = os.path.dirname(dev)
    try:
        with open(os.path.join(dev, "queue", "rotational")) as f:
            rotational = f.read().strip() == "1"
    except OSError:
        rotational = None
    return os.path.basename(dev), rotational, "/virtio" in dev


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def readahead_bytes(majmin: str, sys_root: str = "/sys") -> int:
    """Most bytes one readahead(2) / POSIX_FADV_WILLNEED call queues on device MAJMIN: the kernel cuts
    each call at max(ra_pages, io_pages), i.e. max(read_ahead_kb, max_sectors_kb); 0 if unknown.
    Block devices (a partition resolved to its disk) have both in queue/; others (NFS, FUSE) have
    read_ahead_kb in /sys/class/bdi/MAJMIN."""
    dev = os.path.realpath(os.path.join(sys_root, "dev", "block", majmin))
    if os.path.isdir(dev):
        if os.path.exists(os.path.join(dev, "partition")):
            dev = os.path.dirname(dev)
        kbs = [_read_int(os.path.join(dev, "queue", n)) for n in ("read_ahead_kb", "max_sectors_kb")]
    else:
        kbs = [_read_int(os.path.join(sys_root, "class", "bdi", majmin, "read_ahead_kb"))]
    return max((k for k in kbs if k), default=0) * 1024


def classify(mount: Mount | None, sys_root: str = "/sys") -> StorageInfo:
    """Storage kind for a mount (pure apart from reading `sys_root`)."""
    if mount is None:
        return StorageInfo("unknown", "", "")
    fs = mount.fstype
    if fs in MEMORY_FSTYPES:
        return StorageInfo("memory", fs, mount.source)
    if fs in NETWORK_FSTYPES or fs.startswith("fuse.") or fs.startswith("nfs"):
        return StorageInfo("network", fs, mount.source)
    name, rotational, virtio = block_device(mount.majmin, sys_root)
    device = name or mount.source
    if rotational and virtio:
        # virtio-blk reports rotational=1 whatever backs it (it is so on the dev machine, an SSD-backed
        # VM disk); the host schedules the I/O, so the local policy applies.
        return StorageInfo("local", fs, device, "virtio disk reports rotational=1; treated as local")
    if rotational:
        return StorageInfo("rotational", fs, device)
    return StorageInfo("local", fs, device)


def detect(path: str | os.PathLike, mountinfo: str | None = None, sys_root: str = "/sys") -> StorageInfo:
    """Storage kind of the filesystem holding `path`. Never raises: unknown inputs give "unknown"."""
    try:
        if mountinfo is None:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        mount = find_mount(parse_mountinfo(mountinfo), os.path.realpath(path))
        info = classify(mount, sys_root)
        return replace(info, ra_bytes=readahead_bytes(mount.majmin, sys_root)) if mount else info
    except OSError:
        return StorageInfo("unknown", "", "")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def choose_method(requested: str, info: StorageInfo) -> str:
    """The populate method for `--prefetch-method REQUESTED` on storage INFO (the `auto` policy)."""
    if requested == "auto":
        return AUTO_NETWORK_METHOD if info.kind == "network" else AUTO_METHOD
    if requested not in METHODS:
        raise ValueError(f"prefetch method must be auto or one of {', '.join(METHODS)}, got {requested!r}")
    return requested


def plan(info: StorageInfo, total_bytes: int, mem_available: int | None,  # noqa: F811 - the figure
         overrides: PrefetchOverrides | None = None) -> PrefetchPlan:
    """Choose whether and how to prefetch `total_bytes` of weights from storage `info`.

    RAM guard: weights larger than MemAvailable are not prefetched (the page cache cannot hold them:
    pages read early would be evicted before the loader maps them); weights larger than
    `ram_fraction` of it are prefetched at most that many bytes ahead of the loader's position (from
    byte 0 before it starts): the head start during `import torch`, then the loader's window."""
    o = overrides or PrefetchOverrides()
    if o.threads is not None and o.threads < 1:
        raise ValueError(f"prefetch threads must be >= 1, got {o.threads}")
    if o.block_mib is not None and o.block_mib < 1:
        raise ValueError(f"prefetch block size must be >= 1 MiB, got {o.block_mib}")
    if o.window_mib is not None and o.window_mib < 1:
        raise ValueError(f"prefetch window must be >= 1 MiB, got {o.window_mib}")
    if not 0 < o.ram_fraction <= 1:
        raise ValueError(f"prefetch RAM fraction must be in (0, 1], got {o.ram_fraction}")

    threads = {"rotational": ROTATIONAL_THREADS, "network": NETWORK_THREADS}.get(info.kind, LOCAL_THREADS)
    most = {"rotational": ROTATIONAL_THREADS, "network": NETWORK_MAX_THREADS}.get(info.kind,
                                                                                 LOCAL_MAX_THREADS)
    threads, most = (o.threads, o.threads) if o.threads else (threads, most)  # a given count is kept
    block = (o.block_mib or LOCAL_BLOCK_MIB) * MiB
    window = (o.window_mib or DEFAULT_WINDOW_MIB) * MiB
    method = choose_method(o.method, info)
    chunk = min(block, info.ra_bytes or FALLBACK_CHUNK)
    where = f"{info.kind} storage ({info.fstype or '?'} on {info.device or '?'})"
    count = f"{threads}-{most} threads (tuned while reading)" if most > threads else f"{threads} threads"
    how = f"{count} x {block // MiB} MiB, {method}"

    def made(enabled: bool, reason: str, ahead: int | None = None) -> PrefetchPlan:
        return PrefetchPlan(enabled, threads, block, reason, window, method, chunk, ahead, most)

    if o.enabled is False:
        return made(False, "disabled by flag")
    if total_bytes <= 0:
        return made(False, "nothing to prefetch")
    if o.enabled:
        return made(True, f"forced by flag; {where}: {how}")
    if info.kind == "memory":
        return made(False, f"already in RAM ({info.fstype})")
    if mem_available is not None:
        if total_bytes > mem_available:
            return made(
                False,
                f"weights ({_gb(total_bytes)}) exceed MemAvailable ({_gb(mem_available)}): the "
                "page cache cannot hold them, prefetched pages would be evicted before use",
            )
        budget = max(block, int(mem_available * o.ram_fraction) // block * block)
        if total_bytes > budget:
            return made(
                True,
                f"{where}: {how}; at most {_gb(budget)} ahead of the loader (weights "
                f"{_gb(total_bytes)} > {o.ram_fraction:.0%} of MemAvailable {_gb(mem_available)})",
                budget,
            )
    return made(True, f"{where}: {how}")


def plan_for(files: Iterable[str | os.PathLike], overrides: PrefetchOverrides | None = None) -> PrefetchPlan:
    """Convenience for the serve command: detect the storage of the first file, size the files, read the
    available memory (system.available_memory(): a cgroup's room, else MemAvailable), and plan."""
    files = list(files)
    total = 0
    for f in files:
        try:
            total += os.stat(f).st_size
        except OSError:
            pass  # the loader reports missing files; prefetch is best effort
    info = detect(files[0]) if files else StorageInfo("unknown", "", "")
    return plan(info, total, available_memory(), overrides)
