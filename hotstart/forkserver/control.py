"""`hotstart zygote start|stop|status` (torch-free): run this user's zygote, ask it how it is, stop it.

`start` spawns `python -m hotstart.forkserver.zygote` in its own session (output to its log file in
the runtime folder) and waits until it answers; `stop` asks it to stop (it stops every engine it
forked: servers using it fall back to a local forkserver) and waits until the process and its socket
are gone; `status` prints its pid, age, CPU time, memory and kept models, or says none runs. A socket
left by a killed zygote is removed by any of the three (a live zygote holds the lock file).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from hotstart.errors import HotstartError
from hotstart.forkserver.runtime import Identity, Paths, connect, ensure_private_dir, mismatch, paths
from hotstart.procs import alive

START_TIMEOUT_S = 120.0
KEEP_READ_BPS = 50e6  # the slowest storage worth waiting for while --keep reads the files in
STOP_TIMEOUT_S = 10.0
QUERY_TIMEOUT_S = 5.0
SUN_PATH_MAX = 107


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _lock_free(p: Paths) -> bool:
    """True if no zygote holds the lock (none runs or starts)."""
    try:
        fd = os.open(p.lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _clean_stale(p: Paths) -> bool:
    """Remove a dead zygote's socket file; True if there was one."""
    if os.path.lexists(p.sock) and _lock_free(p):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p.sock)
            return True
    return False


def query(p: Paths, stop: bool = False, timeout: float = QUERY_TIMEOUT_S):
    """(ServerInfo, ZygoteStatus) of the zygote at P, or (None, why not)."""
    from hotstart.framing import FrameReader, send  # noqa: PLC0415
    from hotstart.messages import FromForkserver, ZygoteQuery, ZygoteStatus  # noqa: PLC0415

    sock, info, why = connect(p.sock, timeout)
    if sock is None:
        return None, why
    try:
        send(sock, ZygoteQuery(stop=stop))
        reader, deadline = FrameReader(FromForkserver), time.monotonic() + timeout
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(1 << 16)
            if not chunk:
                return None, "it closed the connection"
            for msg in reader.feed(chunk):
                if isinstance(msg, ZygoteStatus):
                    return info, msg
    except OSError as e:
        return None, f"no status: {e.strerror or e}"
    finally:
        sock.close()


def _argv(p: Paths, keep: list, watch: bool) -> list[str]:
    return [sys.executable, "-m", "hotstart.forkserver.zygote", "--socket", p.sock, "--lock", p.lock,
            "--cwd", os.getcwd(), "--keep-json", json.dumps(keep), *([] if watch else ["--no-watch"])]


def spawn(p: Paths, keep: list, detach: bool = True, env: dict | None = None,
          watch: bool = True) -> subprocess.Popen:
    """Start the zygote process for P. DETACH: it outlives us (else it dies with us). WATCH: it restarts
    when the hotstart or torch files it runs change."""
    from hotstart.procs import die_with_parent  # noqa: PLC0415

    if len(p.sock.encode()) > SUN_PATH_MAX:
        raise HotstartError(f"socket path {p.sock} is too long for a Unix socket (set HOTSTART_RUNTIME_DIR)")
    fd = os.open(p.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(_argv(p, keep, watch), stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                                env=env, start_new_session=True,
                                preexec_fn=None if detach else (lambda: die_with_parent(signal.SIGTERM)))  # noqa: PLW1509
    finally:
        os.close(fd)


def _log_tail(p: Paths) -> str:
    try:
        with open(p.log, errors="replace") as f:
            lines = [line.strip() for line in f.readlines()[-20:] if line.strip()]
    except OSError:
        return "see its log"
    errors = [line for line in lines if "error" in line.lower() or "hotstart: zygote" in line]
    return (errors or lines or ["no output"])[-1]


def wait_ready(p: Paths, proc: subprocess.Popen, timeout: float = START_TIMEOUT_S):
    """The ServerInfo of the zygote PROC once it answers; HotstartError if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock, info, _ = connect(p.sock, 1.0)
        if sock is not None:
            sock.close()
            if info.pid == proc.pid:
                return info
        if proc.poll() is not None:
            raise HotstartError(f"the zygote exited with code {proc.returncode}: {_log_tail(p)} "
                                f"(log: {p.log})")
        time.sleep(0.05)
    proc.kill()
    raise HotstartError(f"the zygote did not answer within {timeout:.0f} s (log: {p.log})")


def _resolve_keep(models: list[str]) -> list:
    from hotstart.boot.resolve import resolve_model  # noqa: PLC0415
    from hotstart.model.files import sidecar_files, weight_files  # noqa: PLC0415

    out = []
    for m in models:
        r = resolve_model(m, None)
        out.append([str(r.path), [str(f) for f in weight_files(r.path) + sidecar_files(r.path)]])
    return out


def _print_status(p: Paths, info, st) -> None:
    print(f"hotstart zygote: running, pid {st.pid}, up {_age(time.time() - st.started)}; hotstart "
          f"{info.hotstart_version}, torch {info.torch_version}, {info.python}")
    print(f"  cpu {st.cpu_seconds:.2f} s, rss {_mb(st.rss_bytes)} (anon {_mb(st.rss_anon_bytes)}, "
          f"file {_mb(st.rss_file_bytes)}); {st.clients} server(s), {st.engines} engine(s)")
    for k in st.kept:
        pct = 100 * k.bytes_resident / k.bytes_total if k.bytes_total else 0
        print(f"  kept {k.path}: {_mb(k.bytes_total)} in {k.files} files, {_mb(k.bytes_resident)} resident "
              f"({pct:.0f}%), {_mb(k.bytes_locked)} locked" + (f"; {k.note}" if k.note else ""))
    if st.stale:
        print(f"  stale: {st.stale} changed since it started (servers bypass it; it restarts once idle)")
    print(f"  socket {p.sock}, log {p.log}")


def cmd_status(args) -> int:  # noqa: ARG001
    p = paths()
    info, st = query(p)
    if info is None:
        removed = _clean_stale(p)
        why = "" if st == "none running" else f" ({st})"
        removed = "; stale socket removed" if removed else ""
        print(f"hotstart zygote: not running{why}{removed}; socket {p.sock}")
        return 3
    _print_status(p, info, st)
    return 0


def cmd_stop(args) -> int:  # noqa: ARG001
    p = paths()
    info, st = query(p, stop=True)
    if info is None:
        removed = _clean_stale(p)
        print(f"hotstart zygote: not running{' (stale socket removed)' if removed else ''}")
        return 0
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while alive(st.pid) and time.monotonic() < deadline:  # the zygote's parent (not us) reaps it
        time.sleep(0.02)
    if alive(st.pid):
        os.kill(st.pid, signal.SIGKILL)
    _clean_stale(p)
    extra = f" and {st.engines} engine(s) of {st.clients} server(s)" if st.engines else ""
    print(f"hotstart zygote: stopped pid {st.pid}{extra}")
    return 0


def cmd_start(args) -> int:
    p = paths()
    problem = ensure_private_dir(p.dir)
    if problem is not None:
        raise HotstartError(f"runtime folder not usable: {problem} (or set HOTSTART_RUNTIME_DIR)")
    keep = _resolve_keep(args.keep or [])
    info, st = query(p)
    if info is not None:
        why = mismatch(info, Identity.here())
        if why is not None:
            raise HotstartError(f"a zygote is running (pid {info.pid}) that serve would not use: {why}; "
                                "`hotstart zygote stop` it first")
        if sorted(k.path for k in st.kept) != sorted(path for path, _ in keep):
            raise HotstartError(f"a zygote is running (pid {info.pid}) with other --keep models; "
                                "`hotstart zygote stop` it first")
        print(f"hotstart zygote: already running, pid {info.pid}; socket {p.sock}")
        return 0
    if not _lock_free(p):
        raise HotstartError(f"a zygote is starting or not answering (it holds {p.lock}); see {p.log}")
    _clean_stale(p)
    watch = not args.no_watch
    if args.foreground:
        os.execv(sys.executable, _argv(p, keep, watch))
    t = time.monotonic()
    proc = spawn(p, keep, watch=watch)
    kept_bytes = sum(os.path.getsize(f) for _, files in keep for f in files)
    info = wait_ready(p, proc, START_TIMEOUT_S + kept_bytes / KEEP_READ_BPS)  # --keep reads it all first
    _, st = query(p)
    print(f"hotstart zygote: started, pid {info.pid}, ready in {time.monotonic() - t:.2f} s "
          f"(torch {info.torch_version}); socket {p.sock}, log {p.log}")
    for k in getattr(st, "kept", []):
        print(f"  kept {k.path}: {_mb(k.bytes_locked)} of {_mb(k.bytes_total)} locked"
              + (f"; {k.note}" if k.note else ""))
    return 0


def run_zygote_command(args) -> int:
    return {"start": cmd_start, "stop": cmd_stop, "status": cmd_status}[args.zygote_command](args)


@contextlib.contextmanager
def bench_zygote(targets):
    """For `hotstart bench startup`: every hotstart config gets a private runtime folder, so a user's
    own zygote never takes part; the configs with the `zygote` variant share one where a zygote is
    started here, once, before the runs, and stopped after them."""
    wants = [t for t in targets if "zygote" in re.split(r"[:+ ]", t.label)]
    empty, zdir = tempfile.mkdtemp(prefix="hotstart-run-"), tempfile.mkdtemp(prefix="hotstart-zrun-")
    for t in targets:
        t.env["HOTSTART_RUNTIME_DIR"] = zdir if t in wants else empty
    proc = None
    try:
        if wants:
            p = paths(zdir)
            proc = spawn(p, [], detach=False, env={**os.environ, "HOTSTART_RUNTIME_DIR": zdir})
            info = wait_ready(p, proc)
            labels = ", ".join(t.label for t in wants)
            print(
                f"hotstart bench startup: zygote pid {info.pid} started for {labels}",
                file=sys.stderr,
                flush=True,
            )
        yield
    finally:
        if proc is not None:
            from hotstart.procs import terminate_then_kill  # noqa: PLC0415

            terminate_then_kill([proc], STOP_TIMEOUT_S)
        shutil.rmtree(empty, ignore_errors=True)
        shutil.rmtree(zdir, ignore_errors=True)
