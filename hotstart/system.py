"""Facts about this machine and this user's hotstart folders (torch-free, stdlib only), and the one reader
of the memory this process tree may use (available_memory(): cgroup v1 / v2 limits, else MemAvailable)."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path


def hotstart_home() -> Path:
    """$HOTSTART_HOME (default ~/.cache/hotstart): converted models, compile caches, runtime files."""
    return Path(os.environ.get("HOTSTART_HOME") or Path.home() / ".cache" / "hotstart")


def mem_available(meminfo: str | None = None) -> int | None:
    """MemAvailable in bytes from /proc/meminfo text (read if not given); None if unknown."""
    try:
        if meminfo is None:
            with open("/proc/meminfo") as f:
                meminfo = f.read()
    except OSError:
        return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) >= 2 and parts[1].isdigit() else None
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo), empty where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def native_cpu_dtypes() -> set[str]:
    """The half-precision dtypes this CPU multiplies natively (bf16: AVX512-BF16 or AMX; fp16: AVX512-FP16
    or AMX-FP16), by torch's names."""
    flags = cpu_flags()
    native = set()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        native.add("bfloat16")
    if "avx512_fp16" in flags or "amx_fp16" in flags:
        native.add("float16")
    return native


# ---- memory: the one reader of what this process tree may use ------------------------------------
# A limit at or above the host's RAM constrains nothing (cgroup v1 writes "no limit" as 2^63 - 4096).
UNLIMITED = 1 << 62


@dataclass(frozen=True)
class CgroupLimit:
    """One cgroup with a memory limit: its folder, its version (1 or 2), the limit in bytes, and the file
    its usage is read from (None: an ancestor's limit seen from this cgroup's v1 memory.stat, whose usage
    is this cgroup's own)."""

    folder: str
    version: int
    limit: int
    name: str  # the cgroup's path as /proc/self/cgroup names it (for messages)

    def working_set(self) -> int | None:
        """Bytes the cgroup holds that the kernel cannot simply drop: its usage minus its inactive page
        cache (what Kubernetes evicts by and docker stats shows)."""
        usage = _read_int(os.path.join(self.folder, "memory.current" if self.version == 2
                                       else "memory.usage_in_bytes"))
        if usage is None:
            return None
        stat = _read_stat(os.path.join(self.folder, "memory.stat"))
        inactive = stat.get("inactive_file" if self.version == 2 else "total_inactive_file", 0)
        return max(0, usage - inactive)

    def describe(self) -> str:
        file = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return f"cgroup v{self.version} {self.name} {file} = {_gib(self.limit)}"


@dataclass(frozen=True)
class MemoryLimit:
    """The memory limits over this process, found once (memory_limit()): every memory cgroup with a
    limit below the host's RAM, from this process's own up its ancestors, v2 and v1 alike."""

    cgroups: tuple[CgroupLimit, ...] = ()  # smallest limit first
    host_total: int | None = None  # MemTotal
    own: tuple[tuple[int, str], ...] = ()  # (version, folder) of this process's own memory cgroups

    def oom_folders(self) -> list[tuple[int, str]]:
        """Where an OOM kill of this process tree is counted: the cgroup whose limit binds, else its own."""
        if self.cgroups:
            return [(self.cgroups[0].version, self.cgroups[0].folder)]
        return list(self.own)

    @property
    def limit(self) -> int | None:
        """The smallest limit (None: none; the host's RAM is the bound)."""
        return min((c.limit for c in self.cgroups), default=None)

    @property
    def total(self) -> int | None:
        """The RAM this process tree may ever use: the smallest cgroup limit, else MemTotal."""
        return self.limit if self.limit is not None else self.host_total

    def available(self, meminfo: str | None = None) -> tuple[int | None, str]:
        """(bytes available now, what that figure is): MemAvailable, lowered to each cgroup's limit minus
        its working set. None: nothing is known."""
        best, source = mem_available(meminfo), "MemAvailable"
        for c in self.cgroups:
            used = c.working_set()
            left = max(0, c.limit - (used or 0))
            if best is None or left < best:
                best, source = left, (f"cgroup {c.name}'s room (v{c.version} limit {_gib(c.limit)} - working "
                                      f"set {_gib(used or 0)})")
        if best is None:
            return None, "unknown (no /proc/meminfo, no cgroup limit)"
        if self.cgroups and source == "MemAvailable":
            c = self.cgroups[0]
            source = f"MemAvailable (under cgroup {c.name}'s limit {_gib(c.limit)})"
        return best, source


def _read_int(path: str) -> int | None:
    """An integer file (a cgroup's limit or usage); "max" (no limit) is UNLIMITED; None if unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def _read_stat(path: str) -> dict[str, int]:
    """A cgroup's memory.stat as {key: value}."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return out


def _own_cgroups(proc: str) -> dict[str, str]:
    """{"v2": path, "memory": path} from PROC/self/cgroup ("0::/a/b" for v2, "4:memory:/a" for v1)."""
    out: dict[str, str] = {}
    try:
        with open(os.path.join(proc, "self", "cgroup"), encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    out["v2"] = parts[2]
                elif "memory" in parts[1].split(","):
                    out["memory"] = parts[2]
    except OSError:
        pass
    return out


def _mounts(proc: str) -> list[tuple[str, str, str, str]]:
    """(fstype, mount root, mount point, super options) of PROC/self/mountinfo's cgroup mounts."""
    out = []
    try:
        with open(os.path.join(proc, "self", "mountinfo"), encoding="utf-8", errors="replace") as f:
            for line in f:
                head, _, tail = line.partition(" - ")
                fields, rest = head.split(), tail.split()
                if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                    out.append((rest[0], _unescape(fields[3]), _unescape(fields[4]), rest[2]))
    except OSError:
        pass
    return out


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _folders(mount_point: str, mount_root: str, path: str) -> list[tuple[str, str]]:
    """(folder, cgroup path) of this cgroup and its ancestors up to the mount point, the cgroup's first.
    PATH is /proc/self/cgroup's, relative to the hierarchy's root; MOUNT_ROOT is the part of the hierarchy
    mounted (a container often sees only its own cgroup, mounted as its root: then PATH lies outside it
    and the mount point is the cgroup)."""
    root = mount_root.rstrip("/")
    rel = path[len(root):].strip("/") if path == root or path.startswith(root + "/") else ""
    if rel and not os.path.isdir(os.path.join(mount_point, rel)):
        rel = ""
    parts = rel.split("/") if rel else []
    out = []
    while True:
        name = root + "/" + "/".join(parts) if parts else root or "/"
        out.append((os.path.join(mount_point, *parts), name))
        if not parts:
            return out
        parts.pop()


def read_memory_limit(proc: str = "/proc") -> MemoryLimit:
    """Every memory cgroup limit over this process (uncached; memory_limit() is the cached one). PROC:
    where /proc is (tests point it at a folder of their own)."""
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            total = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")), None)
    except (OSError, ValueError, IndexError):
        total = None
    bound = min(total or UNLIMITED, UNLIMITED)
    own = _own_cgroups(proc)
    found: list[CgroupLimit] = []
    leaves: list[tuple[int, str]] = []
    for fstype, root, point, options in _mounts(proc):
        if fstype == "cgroup2" and "v2" in own:
            version, path, file = 2, own["v2"], "memory.max"
        elif fstype == "cgroup" and "memory" in options.split(",") and "memory" in own:
            version, path, file = 1, own["memory"], "memory.limit_in_bytes"
        else:
            continue
        folders = _folders(point, root, path)
        leaves.append((version, folders[0][0]))
        for folder, name in folders:
            limit = _read_int(os.path.join(folder, file))
            if limit is not None and limit < bound:
                found.append(CgroupLimit(folder, version, limit, name))
        if version == 1:  # an ancestor above the mount (outside a container's view) may still limit it
            limit = _read_stat(os.path.join(folders[0][0], "memory.stat")).get("hierarchical_memory_limit")
            if limit is not None and limit < min([bound] + [c.limit for c in found if c.version == 1]):
                found.append(CgroupLimit(folders[0][0], 1, limit, f"{folders[0][1]} (an ancestor's)"))
    found.sort(key=lambda c: c.limit)
    return MemoryLimit(tuple(found), total, tuple(leaves))


@functools.cache
def memory_limit() -> MemoryLimit:
    """The memory limits over this process, read once (a limit changed later is seen by the next start)."""
    return read_memory_limit()


def available_memory_detail() -> tuple[int | None, str]:
    """(available_memory(), what that figure is: "MemAvailable", or which cgroup's room)."""
    return memory_limit().available()


def available_memory() -> int | None:
    """Bytes this process tree may still take now: MemAvailable, lowered to each limiting cgroup's limit
    minus its working set (its usage minus its inactive page cache); None where nothing is known. The one
    figure every memory budget reads (the KV cache, the prepacked weights, the many-models budget, the
    --min-free-memory guard, the weight prefetch, a zygote's --keep): a container's limit, not the node's
    RAM."""
    return available_memory_detail()[0]


def memory_report() -> dict:
    """What /startup shows: the limit, where it comes from, the total and what is available now."""
    m = memory_limit()
    available, source = available_memory_detail()
    return {"limit_bytes": m.limit, "total_bytes": m.total, "available_bytes": available, "source": source,
            "cgroups": [c.describe() for c in m.cgroups]}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
