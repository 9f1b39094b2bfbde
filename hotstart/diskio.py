"""Writing under $HOTSTART_HOME safely when the disk is full or read-only (stdlib only, every process).

What hotstart caches there (converted default model, compile cache, import manifests, s3:// downloads)
is written to a temporary name beside the target, fsynced, renamed into place, and the folder fsynced:
a crash or a full disk never leaves a file under the final name that a later start would trust, and a
failed write removes its temporary file. Readers still verify what they read (sizes, a complete zip).

`check_home()` runs once in the API process before anything is started: a $HOTSTART_HOME that is
read-only, not a folder, or nearly full gets one warning line, and HOME_ENV tells every process started
afterwards (forkserver, engine, compile worker: they inherit the environment) to skip its cache writes
quietly. What is cached already still serves; nothing stops serving for want of a cache.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

HOME_ENV = "HOTSTART_HOME_UNWRITABLE"  # set (to the reason) by check_home(); inherited by children
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


def temp_name(path: Path) -> Path:
    """Where PATH is written before it is published: hidden, beside it, named by this process."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


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


def check_home(home: Path) -> str | None:
    """Once per server start, in the API process: one warning line if HOME cannot take cache writes (and
    HOME_ENV set for the processes started after); the reason, or None."""
    why = home_problem(home)
    if why is not None:
        os.environ[HOME_ENV] = why
        print(
            f"hotstart: WARNING: $HOTSTART_HOME ({home}) {why}: nothing is cached this run (compile cache, "
            "import manifests, models to convert or download); what is cached already serves",
            file=sys.stderr,
            flush=True,
        )
    else:
        os.environ.pop(HOME_ENV, None)
    return why


def home_writable() -> bool:
    """False when this server's check_home() found $HOTSTART_HOME unusable (write nothing there then)."""
    return not os.environ.get(HOME_ENV)
