"""Where a user's zygote listens, and whether one that answers may be used (torch-free, stdlib only).

The runtime folder is $HOTSTART_RUNTIME_DIR, else $XDG_RUNTIME_DIR/hotstart, else /tmp/hotstart-$UID.
Nothing in it is trusted unless it is a real folder (no symlink) owned by this user with no access for
anyone else (0700). One zygote per interpreter and hotstart checkout (KEY): zygote-KEY.sock (0600),
zygote-KEY.lock (flock'ed by the live zygote for its lifetime) and zygote-KEY.log (its output).

probe() is the first step of `hotstart serve`, before the forkserver would be launched: without a
zygote it costs a stat; with one, a connect() and one ServerInfo read within ANSWER_S. A zygote is used
only if the peer's uid (SO_PEERCRED) is ours and it matches this process (mismatch()).
"""

from __future__ import annotations

import binascii
import os
import re
import socket
import struct
import sys
import time

# An idle zygote answers in ~1 ms; this bounds what a busy or stopped one can cost (HOTSTART_ZYGOTE_ANSWER_MS)
ANSWER_S = 0.1
# Read at import time by torch and the libraries it loads (thread pools, allocators, dynamo) or by
# the interpreter: a zygote whose values differ would run engines configured differently. Variables
# read later (CUDA_VISIBLE_DEVICES, at CUDA init in the engine) are applied in the engine instead.
IMPORT_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH_")
IMPORT_ENV_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME")
LAZY_ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


class Paths:
    """A runtime folder and one zygote's files in it. (Plain classes here, not dataclasses: this module
    is imported before the forkserver's launch, and every millisecond there is on every start.)"""

    __slots__ = ("dir", "sock", "lock", "log")

    def __init__(self, dir: str, sock: str, lock: str, log: str):  # noqa: A002
        self.dir, self.sock, self.lock, self.log = dir, sock, lock, log


def hotstart_dir() -> str:
    import hotstart  # noqa: PLC0415 - already imported: we are part of it

    return os.path.dirname(os.path.abspath(hotstart.__file__))


def runtime_dir() -> str:
    explicit = os.environ.get("HOTSTART_RUNTIME_DIR")
    if explicit:
        return os.path.abspath(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "hotstart")
    return f"/tmp/hotstart-{os.getuid()}"


def paths(run_dir: str | None = None) -> Paths:
    """This interpreter's zygote files (KEY: the interpreter and the hotstart folder it imports)."""
    d = run_dir or runtime_dir()
    key = "%08x" % binascii.crc32(("%s\0%s" % (sys.executable, hotstart_dir())).encode())
    base = os.path.join(d, f"zygote-{key}")
    return Paths(d, base + ".sock", base + ".lock", base + ".log")


def check_private_dir(path: str, uid: int | None = None) -> str | None:
    """None if PATH is a folder owned by UID (default: ours) that no one else may enter; else why not."""
    from hotstart.trust import ownership_problem  # noqa: PLC0415 - stdlib only

    return ownership_problem(path, 0o077, uid=uid, root_ok=False)


def ensure_private_dir(path: str) -> str | None:
    """Create PATH (mode 0700) if missing; None if it is private, else why not."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot create {path}: {e.strerror}"
    return check_private_dir(path)


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def peer_problem(sock: socket.socket, uid: int | None = None) -> str | None:
    """None if the peer runs as UID (default: ours); else why it must not be talked to."""
    uid = os.getuid() if uid is None else uid
    try:
        pid, peer_uid, _ = peer_cred(sock)
    except OSError as e:
        return f"cannot read the peer's credentials: {e.strerror}"
    return None if peer_uid == uid else f"peer pid {pid} runs as uid {peer_uid}, not {uid}"


MANY_MODELS_SPINCOUNT = "2000"


def share_cores_between_engines(environ=None) -> bool:
    """A many-models server's engines share the cores: its forkserver (and so every engine) gets
    GOMP_SPINCOUNT=2000 unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set. OpenMP threads that finish a
    parallel region spin ~300,000 rounds for the next one by default: two engines' teams on the same cores
    (one streaming while another loads and takes its first request) spun against each other, a stream's
    gaps reached 250 ms and a swap beside it took 1 s. With 2,000 rounds an idle thread yields at once:
    gaps <= 64 ms, swaps 0.24-0.39 s beside a stream; one engine alone decodes 9 % slower at 1 stream and
    the same at 16 (OMP_WAIT_POLICY=PASSIVE: 37 % slower at 1 stream). docs/serving.md has the runs. It is
    read when torch loads, hence set before the forkserver starts. True where it was set."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = MANY_MODELS_SPINCOUNT
    return True


def import_env(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k not in LAZY_ENV_NAMES
            and (k.startswith(IMPORT_ENV_PREFIXES) or k in IMPORT_ENV_NAMES)}


def torch_on_disk() -> tuple[str, str]:
    """(folder, version) of the torch this process would import, without importing it."""
    import importlib.util  # noqa: PLC0415 - loaded by the interpreter's own start already

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "", ""
    folder = os.path.dirname(spec.origin)
    try:
        with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        m = None
    return folder, m.group(1) if m else ""


class Identity:
    """What a usable zygote must match: this process's user, hotstart, interpreter and torch."""

    def __init__(self, uid: int, hotstart_version: str, hotstart_path: str, python: str, torch_path: str,
                 torch_version: str, import_env: dict[str, str]):
        self.uid, self.hotstart_version, self.hotstart_path, self.python = (
            uid,
            hotstart_version,
            hotstart_path,
            python,
        )
        self.torch_path, self.torch_version, self.import_env = torch_path, torch_version, import_env

    @classmethod
    def here(cls) -> Identity:
        from hotstart import __version__  # noqa: PLC0415

        torch_path, torch_version = torch_on_disk()
        return cls(os.getuid(), __version__, hotstart_dir(), sys.executable, torch_path, torch_version,
                   import_env())


def mismatch(info, want: Identity) -> str | None:
    """Why the zygote that sent INFO (a ServerInfo) must not fork our engines; None if it may."""
    if info.uid != want.uid:
        return f"it runs as uid {info.uid}"
    if info.hotstart_version != want.hotstart_version:
        return f"version mismatch (zygote: hotstart {info.hotstart_version}, this: {want.hotstart_version})"
    if info.python != want.python:
        return f"another interpreter ({info.python})"
    if info.hotstart_path != want.hotstart_path:
        return f"another hotstart checkout ({info.hotstart_path})"
    if (info.torch_path, info.torch_version) != (want.torch_path, want.torch_version):
        return (f"another torch (zygote: {info.torch_version} in {info.torch_path}; "
                f"this: {want.torch_version or '?'} in {want.torch_path or '?'})")
    if info.stale:
        return f"stale: {info.stale} changed since it started (it restarts itself once idle)"
    if info.import_env != want.import_env:
        keys = sorted(k for k in {*info.import_env, *want.import_env}
                      if info.import_env.get(k) != want.import_env.get(k))
        return f"import-time environment differs ({', '.join(keys)})"
    return None


class Probe:
    """The outcome of looking for a zygote: SOCK and INFO when one may be used, NOTE either way."""

    def __init__(self, start: float, end: float, note: str, sock: socket.socket | None = None, info=None):
        self.start, self.end, self.note, self.sock, self.info = start, end, note, sock, info


def connect(path: str, timeout: float) -> tuple[socket.socket | None, object, str]:
    """Connect to the zygote at PATH and read its ServerInfo within TIMEOUT: (sock, info, "") or
    (None, None, why not). Checks the peer's uid before reading anything."""
    if not os.path.lexists(path):
        return None, None, "none running"
    from hotstart.framing import FrameError, FrameReader  # noqa: PLC0415 - only once a zygote may be there
    from hotstart.messages import FromForkserver, ServerInfo  # noqa: PLC0415

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout  # what the zygote takes, not our imports
    try:
        s.connect(path)
    except FileNotFoundError:
        s.close()
        return None, None, "none running"
    except ConnectionRefusedError:
        s.close()
        return None, None, "none running (stale socket)"
    except (OSError, ValueError) as e:
        s.close()
        return None, None, f"cannot connect to {path}: {getattr(e, 'strerror', None) or e}"
    problem = peer_problem(s)
    if problem is not None:
        s.close()
        return None, None, problem
    reader = FrameReader(FromForkserver)
    try:
        while True:
            s.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = s.recv(1 << 16)
            if not chunk:
                raise OSError("it closed the connection")
            msgs = reader.feed(chunk)
            if msgs:
                break
    except TimeoutError:
        s.close()
        return None, None, f"no answer within {timeout * 1000:.0f} ms"
    except (OSError, FrameError) as e:
        s.close()
        return None, None, f"bad answer: {getattr(e, 'strerror', None) or e}"
    if not isinstance(msgs[0], ServerInfo):
        s.close()
        return None, None, f"bad answer: {type(msgs[0]).__name__} first"
    return s, msgs[0], ""


def answer_timeout() -> float:
    try:
        return max(0.001, float(os.environ["HOTSTART_ZYGOTE_ANSWER_MS"]) / 1000)
    except (KeyError, ValueError):
        return ANSWER_S


def probe(timeout: float | None = None) -> Probe:
    """Look for a usable zygote of this user, hotstart, interpreter and torch (see the module docstring)."""
    timeout = answer_timeout() if timeout is None else timeout
    start = time.time()
    p = paths()
    problem = check_private_dir(p.dir)
    if problem is not None:
        note = "none running" if not os.path.lexists(p.dir) else f"runtime folder not trusted: {problem}"
        return Probe(start, time.time(), note)
    if os.path.lexists(p.sock):
        import hotstart.framing  # noqa: F401, PLC0415 - what reading an answer needs, imported before timing it
    asked = time.time()
    sock, info, note = connect(p.sock, timeout)
    if sock is not None:
        answered = time.time() - asked
        why = mismatch(info, Identity.here())
        if why is not None:
            sock.close()
            sock, info, note = None, None, why
        else:
            note = (
                f"pid {info.pid}, up {time.time() - info.started:.0f} s, answered in {answered * 1000:.1f} ms"
            )
    return Probe(start, time.time(), note, sock, info)


def _stream(fd: int) -> tuple[int, bool]:
    try:
        os.fstat(fd)
        return fd, False
    except OSError:  # closed in this process: the engine writes to /dev/null instead
        return os.open(os.devnull, os.O_WRONLY), True


def send_context(sock: socket.socket) -> int:
    """Send EngineContext with [lifeline, stdout, stderr]; returns the lifeline's write end (keep it
    open while the engines should live; closing it, or dying, ends them)."""
    from hotstart.framing import frame  # noqa: PLC0415
    from hotstart.messages import EngineContext  # noqa: PLC0415

    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    r, w = os.pipe()  # both ends close-on-exec: no child of ours inherits the write end
    streams = [_stream(1), _stream(2)]
    try:
        data = frame(EngineContext(dict(os.environ), cwd))
        sent = socket.send_fds(sock, [data], [r] + [fd for fd, _ in streams])
        if sent < len(data):
            sock.sendall(data[sent:])
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
        for fd, opened in streams:
            if opened:
                os.close(fd)
    return w
