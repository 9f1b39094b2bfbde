"""The server's processes as the soak sees them (`hotstart bench soak`): the tree of the API process (and
of a zygote) with each process's role, and their RSS and descriptors for the sampler."""

from __future__ import annotations

from hotstart.bench.procgroup import processes
from hotstart.procs import alive


def server_processes(pid: int | None, extra: list[int]) -> dict[int, tuple[object, str]]:
    """pid -> (psutil.Process, role) for the server tree (api, forkserver, engine, engine child) and the
    trees of EXTRA pids (a zygote: zygote, engine, engine child)."""
    import psutil

    out: dict[int, tuple[object, str]] = {}
    for root_pid, root_role in ([(pid, "api")] if pid else []) + [(p, "zygote") for p in extra]:
        try:
            procs = processes(root_pid)
        except psutil.NoSuchProcess:
            continue
        roles = {root_pid: root_role}
        for p in procs[1:]:  # each after its parent: its role is known
            try:
                if not alive(p.pid):  # a killed engine not reaped yet: gone
                    continue
                cmd, parent = " ".join(p.cmdline()), p.ppid()
            except psutil.Error:
                continue
            up = roles.get(parent)
            if "hotstart.forkserver" in cmd and up == "api":
                roles[p.pid] = "forkserver"
            elif up in ("forkserver", "zygote") or "hotstart.engine.worker" in cmd:
                roles[p.pid] = "engine"
            else:
                roles[p.pid] = "engine child" if up in ("engine", "engine child") else "child"
        out.update({p.pid: (p, roles[p.pid]) for p in procs if p.pid in roles})
    return out


def snapshot(pid: int | None, extra: list[int]) -> dict[int, dict]:
    """pid -> {role, rss_mb, fds} of every process of the server (those that vanish meanwhile skipped)."""
    import psutil

    out = {}
    for p_pid, (p, role) in server_processes(pid, extra).items():
        try:
            with p.oneshot():
                out[p_pid] = {
                    "role": role,
                    "rss_mb": round(p.memory_info().rss / 2**20, 1),
                    "fds": p.num_fds(),
                }
        except psutil.Error:
            pass
    return out
