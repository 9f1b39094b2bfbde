"""A real memory cgroup for a test's server (root only): cgroup v2 where its memory controller can be
enabled, else the v1 memory hierarchy (docs/security.md, "Memory and containers")."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")


def _v2_root() -> Path | None:
    """A cgroup2 mount whose root offers the memory controller."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        head, _, tail = line.partition(" - ")
        if tail.split()[:1] == ["cgroup2"]:
            root = Path(head.split()[4])
            try:
                if "memory" in (root / "cgroup.controllers").read_text().split():
                    return root
            except OSError:
                continue
    return None


class MemoryCgroup:
    """A fresh cgroup limited to LIMIT bytes: `prefix` is a command that joins it and execs the rest;
    `oom_kills()` its OOM-kill count; `remove()` once its processes are gone."""

    def __init__(self, limit: int) -> None:
        name = f"hotstart-test-{uuid.uuid4().hex[:8]}"
        v2 = _v2_root()
        if v2 is not None:
            (v2 / "cgroup.subtree_control").write_text("+memory")
            self.path, self.version = v2 / name, 2
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            self.path, self.version = V1 / name, 1
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.prefix = ("sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh")

    def oom_kills(self) -> int:
        text = (self.path / ("memory.events" if self.version == 2 else "memory.oom_control")).read_text()
        counts = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
        return int(counts.get("oom_kill", 0))

    def remove(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def memory_cgroup(limit: int) -> tuple[MemoryCgroup | None, str]:
    """(the cgroup, "") or (None, why none can be made here)."""
    if os.geteuid() != 0:
        return None, "memory cgroups need root"
    if _v2_root() is None and not (V1 / "memory.limit_in_bytes").exists():
        return None, "no cgroup v2 memory controller and no cgroup v1 memory hierarchy"
    try:
        return MemoryCgroup(limit), ""
    except OSError as e:
        return None, f"cannot make a memory cgroup: {e}"
