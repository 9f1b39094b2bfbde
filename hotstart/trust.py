"""Whether what hotstart loads from disk is ours (stdlib only, every process).

$HOTSTART_HOME holds native code that engines load: the CPU kernels' library (model/cpu_kernels.py,
dlopen'ed) and compiled layer graphs (engine/fastpath/cache.py). Anyone who may write there runs code in
every engine. So the home is trusted only when it is ours (or root's) and writable by no one else
(trust_problem; the zygote's runtime folder is checked the same way, stricter: forkserver/runtime.py), and
each artifact is loaded only through open_verified: the file and its folder pass the same check and its
bytes hash to the sha256 recorded when it was published (diskio.publish_recorded). diskio.check_home warns
once about an untrusted home and treats it as unwritable.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

OTHERS_WRITE = 0o022  # mode bits that let someone else replace what a folder or a file holds


def ownership_problem(path: Path | str, mask: int = OTHERS_WRITE, *, folder: bool = True,
                      uid: int | None = None, root_ok: bool = True) -> str | None:
    """None if PATH, not a symlink, is a folder (FOLDER) or a regular file owned by UID (default: ours;
    or root, with ROOT_OK) with none of MASK's mode bits set; else why not."""
    uid = os.getuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if folder and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if not folder and not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != uid and not (root_ok and st.st_uid == 0):
        return f"{path} is owned by uid {st.st_uid}, not {uid}"
    if st.st_mode & mask:
        needs = f"{0o777 & ~mask:o}" if mask & 0o044 else "no write access for group or others"
        return f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}, needs {needs})"
    return None


def trust_problem(home: Path) -> str | None:
    """Why native code under HOME must not be loaded (None: it may, or HOME does not exist yet): HOME
    must be ours or root's and writable by no one else; a symlink counts by its target, and the link
    itself must be ours or root's."""
    home = Path(home)
    try:
        st = os.lstat(home)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{home}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (os.getuid(), 0):
            return f"{home} is a symlink owned by uid {st.st_uid}"
        home = Path(os.path.realpath(home))
    return ownership_problem(home)


def make_private_dir(path: Path) -> None:
    """mkdir -p PATH, each folder it creates mode 0700 (what trust_problem wants)."""
    path = Path(path)
    if path.is_dir():
        return
    if not path.parent.is_dir():
        make_private_dir(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def record_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".sha256")


def sha256_of(fd: int) -> str:
    import hashlib  # noqa: PLC0415 - the zygote probe imports this module at t=0: only when hashing

    h, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def open_verified(path: Path, home: Path) -> int:
    """A read-only fd of PATH if it may be loaded: a regular file of ours (or root's), in such a folder,
    under HOME trusted (trust_problem), none writable by anyone else, and its bytes hash to its record
    (publish_recorded). Raises PermissionError with the reason otherwise. Load through /proc/self/fd/FD:
    the bytes hashed are the bytes loaded, whatever happens to the name meanwhile."""
    path = Path(path)
    why = trust_problem(home) or ownership_problem(path.parent) or ownership_problem(path, folder=False)
    if why is None:
        try:
            recorded = record_path(path).read_text().split()[0]
        except (OSError, IndexError, UnicodeDecodeError):
            why = f"{path} has no recorded hash"
    if why is not None:
        raise PermissionError(why)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if sha256_of(fd) != recorded:
            raise PermissionError(f"{path} does not match its recorded hash")
    except BaseException:
        os.close(fd)
        raise
    return fd


def verified_problem(path: Path, home: Path) -> str | None:
    """None if open_verified(PATH, HOME) passes; else why not."""
    try:
        os.close(open_verified(path, home))
    except PermissionError as e:
        return str(e) if e.errno is None else f"{path}: {e.strerror}"
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None


def discard_recorded(path: Path) -> None:
    """Remove PATH and its record (an artifact that failed to load would fail every start the same way)."""
    for p in (Path(path), record_path(path)):
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass
