"""Writing under $HOTSTART_HOME safely when the disk is full or read-only (stdlib only, every process).

What hotstart caches there (converted default model, compile cache, import manifests, s3:// downloads)
is written to a temporary name beside the target, fsynced, renamed into place, and the folder fsynced:
a crash or a full disk never leaves a file under the final name that a later start would trust, and a
failed write removes its temporary file. Readers still verify what they read (sizes, a complete zip).

`check_home()` runs once in the API process before anything is started: a $HOTSTART_HOME that is
read-only, not a folder, or nearly full gets one warning line, and HOME_ENV tells every process started
afterwards (forkserver, engine, compile worker: they inherit the environment) to skip its cache writes
quietly. What is cached already still serves; nothing stops serving for want of a cache.

An untrusted $HOTSTART_HOME (hotstart/trust.py: not ours, or writable by others) is treated as
unwritable, and nothing native is loaded from it. Native artifacts (the CPU kernels' library, compiled
graphs) are published with their sha256 beside them (publish_recorded), which trust.open_verified checks
before they are loaded. Temporary names carry host, pid and a random tag, so pods sharing a cache volume
never write each other's files, and only a dead writer's leftovers are swept.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

HOME_ENV = "HOTSTART_HOME_UNWRITABLE"  # set (to the reason) by check_home(); inherited by children
STALE_TEMP_S = 3600.0  # another host's temporary file this old belongs to a writer that died
_TEMP = re.compile(r"\..+\.(?P<host>[\w-]+)-(?P<pid>\d+)-[0-9a-f]{8}\.tmp(\.\w+)?")
MIN_FREE_BYTES = 64 << 20  # less free space than this under $HOTSTART_HOME counts as full
DISK_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.ENOTDIR,
        errno.EFBIG,
        errno.EEXIST,
    }
)


def is_disk_error(exc: BaseException) -> bool:
    """A write that failed for want of space or permission (not a bug): worth one line, not a traceback."""
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return True
    return "No space left on device" in str(exc) or "Read-only file system" in str(exc)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", os.uname().nodename)[:64] or "host"


def temp_name(path: Path, ext: str = "") -> Path:
    """Where PATH is written before it is published: hidden, beside it, unique across the hosts (pods)
    sharing the folder: .NAME.HOST-PID-RANDOM.tmp[EXT]."""
    path = Path(path)
    return path.with_name(f".{path.name}.{_host()}-{os.getpid()}-{secrets.token_hex(4)}.tmp{ext}")


def stale_temp(path: Path, max_age_s: float = STALE_TEMP_S) -> bool:
    """Whether PATH is a temp_name() whose writer is gone: on this host, a pid no longer alive; from
    another host (a pod sharing the volume), older than MAX_AGE_S."""
    from hotstart.procs import alive  # noqa: PLC0415 - stdlib only; only when sweeping

    m = _TEMP.fullmatch(Path(path).name)
    if m is None:
        return False
    if m["host"] == _host():
        return not alive(int(m["pid"]))
    try:
        return time.time() - os.lstat(path).st_mtime > max_age_s
    except OSError:
        return False


def remove_stale_temps(folder: Path) -> None:
    """Sweep FOLDER of the temporary files of writers that died mid-write (stale_temp)."""
    for f in Path(folder).glob(".*.tmp*"):
        if stale_temp(f):
            f.unlink(missing_ok=True)


def publish(tmp: Path, path: Path) -> None:
    """TMP (written completely) becomes PATH: fsync, rename, fsync the folder. TMP is removed on failure."""
    try:
        _fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes | Callable[[Path], None]) -> None:
    """Write DATA (bytes, or a function writing the file it is given) to PATH atomically (see publish)."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        if callable(data):
            data(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    publish(tmp, path)


def fsync_tree(folder: Path) -> None:
    """Every file in FOLDER (not recursive) and FOLDER itself on disk: before FOLDER is renamed into place."""
    for p in Path(folder).iterdir():
        if p.is_file():
            _fsync_file(p)
    fsync_dir(Path(folder))


def home_problem(home: Path) -> str | None:
    """Why HOME cannot take cache writes (read-only, not a folder, nearly full), or None."""
    probe = Path(home)
    while not probe.exists():  # the first start: the nearest folder that exists is where it is created
        if probe.parent == probe:
            return None
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return f"cannot be examined ({e.strerror or e})"
    if st.f_flag & os.ST_RDONLY:
        return "is on a read-only filesystem"
    if not os.access(probe, os.W_OK | os.X_OK):
        return "is not writable by this user"
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        return f"is full ({free / (1 << 20):.1f} MiB free)"
    return None


def publish_recorded(tmp: Path, path: Path) -> None:
    """publish(TMP, PATH), then its sha256 as PATH.sha256 (atomically): what trust.open_verified checks."""
    from hotstart.trust import record_path, sha256_of  # noqa: PLC0415 - stdlib only

    fd = os.open(tmp, os.O_RDONLY)
    try:
        digest = sha256_of(fd)
    finally:
        os.close(fd)
    publish(tmp, path)
    write_atomic(record_path(path), f"{digest}  {Path(path).name}\n".encode())


def check_home(home: Path) -> str | None:
    """Once per server start, in the API process: one warning line if HOME cannot take cache writes (and
    HOME_ENV set for the processes started after); the reason, or None."""
    from hotstart.trust import make_private_dir, trust_problem  # noqa: PLC0415 - stdlib only

    why = home_problem(home)
    untrusted = None
    if why is None:
        try:
            make_private_dir(home)  # the first start: 0700, as trust_problem wants it
        except OSError:
            pass
        untrusted = trust_problem(home)
        why = f"is not trusted ({untrusted})" if untrusted else None
    if why is not None:
        os.environ[HOME_ENV] = why
        served = "what is cached already serves"
        if untrusted:
            served = ("nothing is loaded from it but models (no CPU kernels, no compiled graphs): make it a "
                      "folder of yours that no one else may write")
        print(
            f"hotstart: WARNING: $HOTSTART_HOME ({home}) {why}: nothing is cached this run (compile cache, "
            f"import manifests, models to convert or download); {served}",
            file=sys.stderr,
            flush=True,
        )
    else:
        os.environ.pop(HOME_ENV, None)
    return why


def home_writable() -> bool:
    """False when this server's check_home() found $HOTSTART_HOME unusable (write nothing there then)."""
    return not os.environ.get(HOME_ENV)
