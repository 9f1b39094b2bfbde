"""The zygote: a forkserver that outlives the servers it forks engines for (`hotstart zygote start`).

    python -m hotstart.forkserver.zygote --socket PATH --lock PATH --cwd DIR [--keep-json JSON] [--no-watch]

It takes the lock (one zygote per runtime.paths() key), imports torch and the engine once (and never
runs a torch op, so forking it stays safe), keeps the --keep models resident (keep.py), then listens
on a 0600 Unix socket. Each connection speaks the forkserver's protocol (hotstart.messages): ServerInfo
first, carrying what a client compares (runtime.mismatch); EngineContext (environment, working folder,
and three descriptors: lifeline, stdout, stderr); SpawnEngine, validated before any fork (SpawnRefused
otherwise); StopEngine; StopServer, which here ends only that connection's engines; ZygoteQuery for
`status` and `stop`. Every peer must run as our uid (SO_PEERCRED). An engine dies with the zygote
(PR_SET_PDEATHSIG), with its connection, and with its API process (EOF on the lifeline, read by a
daemon thread that does nothing else). Idle, the zygote blocks in select without a timeout (SIGCHLD
wakes it). When the hotstart or torch files it runs change on disk it says so (clients then bypass
it) and re-executes itself once idle, so an edit-restart loop gets a fresh one; --no-watch (`zygote start
--no-watch`) keeps it through such changes (servers still refuse one of another version).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import msgspec  # noqa: E402

from hotstart.forkserver import keep as keeping  # noqa: E402
from hotstart.forkserver.checks import changed, stamps, validate  # noqa: E402
from hotstart.forkserver.runtime import hotstart_dir, import_env, peer_problem  # noqa: E402
from hotstart.forkserver.server import ForkServer  # noqa: E402
from hotstart.forkserver.server import preload as preload_engine  # noqa: E402
from hotstart.messages import (  # noqa: E402
    EngineContext,
    KeptModel,
    Span,
    SpawnEngine,
    SpawnRefused,
    StopServer,
    ZygoteQuery,
    ZygoteStatus,
)

MAX_FDS = 8


def log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", file=sys.stderr, flush=True)


def _lifeline(fd: int) -> None:
    """The engine's watch on its API process: nothing is ever written to the pipe, so read() returns
    only at EOF, when the last write end (the API process's) is closed."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os._exit(1)


@dataclass
class _Context:
    env: dict[str, str]
    cwd: str
    fds: list[int]  # lifeline, stdout, stderr

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


class Zygote(ForkServer):
    process = "zygote"

    def __init__(self, preload: Span, worker, listener: socket.socket, sock_path: str, lock_fd: int,
                 kept: list[keeping.Kept], watch: bool = True) -> None:
        """WATCH: note changes to the files it runs (checks.stamps) and restart once idle; False: never."""
        super().__init__(preload, worker)
        self.listener, self.sock_path, self.lock_fd, self.kept = listener, sock_path, lock_fd, kept
        self.sock_ino = os.stat(sock_path).st_ino
        self.contexts: dict[socket.socket, _Context] = {}
        self.fds_in: dict[socket.socket, list[int]] = {}  # received, not yet claimed by an EngineContext
        self.stamps = stamps() if watch else {}
        self.reexec = False
        self.wake_r, self.wake_w = socket.socketpair()
        for s in (self.wake_r, self.wake_w):
            s.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())  # SIGCHLD / SIGTERM wake the select below
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        torch = sys.modules["torch"]
        self.info = msgspec.structs.replace(
            self.info, uid=os.getuid(), started=T_START,
            hotstart_path=hotstart_dir(), torch_path=os.path.dirname(torch.__file__), import_env=import_env())

    def stale(self) -> str:
        """The first watched file that changed since the zygote started ("" if none)."""
        return changed(self.stamps)

    # ---- hooks of ForkServer -----------------------------------------------------------------
    def _serving(self) -> bool:
        return True  # until stopped

    def _wait(self) -> list:
        return select.select([self.listener, self.wake_r, *self.readers], [], [])[0]

    def _on_other(self, fd) -> None:
        if fd is self.wake_r:
            try:
                while self.wake_r.recv(256):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
        elif fd is self.listener:
            self._accept()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log(f"hotstart: zygote: accept failed: {e.strerror}")
                return
            problem = peer_problem(conn)
            if problem is not None:
                log(f"hotstart: zygote: refused a connection: {problem}")
                conn.close()
                continue
            self.info = msgspec.structs.replace(self.info, stale=self.stale())
            self.add_connection(conn)

    def _recv(self, conn: socket.socket) -> bytes:
        data, fds, flags, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
        if fds:
            self.fds_in.setdefault(conn, []).extend(fds)
        if flags & socket.MSG_CTRUNC:
            log("hotstart: zygote: dropping a client that sent too many descriptors")
            return b""
        return data

    def _drop(self, conn: socket.socket) -> None:
        super()._drop(conn)
        ctx = self.contexts.pop(conn, None)
        if ctx is not None:
            ctx.close()
        for fd in self.fds_in.pop(conn, []):
            os.close(fd)
        if not self.readers and not self.children and (changed := self.stale()):
            log(f"hotstart: zygote: {changed} changed since the start; restarting to load it")
            self.reexec = self.stopping = True

    def _on_message(self, conn: socket.socket, msg) -> None:
        if isinstance(msg, EngineContext):
            fds = self.fds_in.pop(conn, [])
            if conn in self.contexts or len(fds) != 3 or not stat.S_ISFIFO(os.fstat(fds[0]).st_mode):
                log("hotstart: zygote: dropping a client whose EngineContext came without its 3 descriptors")
                _Context({}, "", fds).close()
                return self._drop(conn)
            self.contexts[conn] = _Context(msg.env, msg.cwd, fds)
        elif isinstance(msg, SpawnEngine):
            uid = os.getuid()
            reason = "no EngineContext came first" if conn not in self.contexts else validate(msg, uid)
            if reason is not None:
                log(f"hotstart: zygote: refused to fork generation {msg.generation}: {reason}")
                self._send(conn, SpawnRefused(msg.generation, reason))
                return
            self._spawn(conn, msg)
            pids = [p for p, c in self.children.items() if c.conn is conn and c.generation == msg.generation]
            log(f"hotstart: zygote: forked generation {msg.generation} ({msg.config.model_path}): {pids}")
        elif isinstance(msg, StopServer):  # a server is done: only its engines stop
            self._drop(conn)
        elif isinstance(msg, ZygoteQuery):
            self._send(conn, self.status())
            if msg.stop:
                log("hotstart: zygote: stopping (hotstart zygote stop)")
                self.stopping = True
        else:
            super()._on_message(conn, msg)

    def _child_setup(self, conn: socket.socket) -> None:
        ctx = self.contexts[conn]
        for other in self.contexts.values():
            if other is not ctx:
                other.close()
        for fds in self.fds_in.values():
            for fd in fds:
                os.close(fd)
        signal.set_wakeup_fd(-1)
        for s in (self.listener, self.wake_r, self.wake_w):
            s.close()
        os.close(self.lock_fd)
        for k in self.kept:
            k.unmap()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        lifeline, out, err = ctx.fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(ctx.env)
        try:
            os.chdir(ctx.cwd)
        except OSError:
            pass
        threading.Thread(target=_lifeline, args=(lifeline,), name="lifeline", daemon=True).start()

    # ---- status and exit ---------------------------------------------------------------------
    def status(self) -> ZygoteStatus:
        mem = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                        mem[key] = int(value.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        t = os.times()
        kept = [KeptModel(k.path, len(k.files), k.bytes_total, k.resident(), k.bytes_locked, k.note)
                for k in self.kept]
        return ZygoteStatus(os.getpid(), T_START, mem.get("VmRSS", 0), mem.get("RssAnon", 0),
                            mem.get("RssFile", 0) + mem.get("RssShmem", 0), t.user + t.system,
                            len(self.contexts), len(self.children), kept, self.stale())

    def close(self) -> None:
        """Remove the socket (if it is still ours), then release the lock."""
        try:
            if os.stat(self.sock_path).st_ino == self.sock_ino:
                os.unlink(self.sock_path)
        except OSError:
            pass
        self.listener.close()
        os.close(self.lock_fd)


def _take_lock(path: str) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _listen(path: str) -> socket.socket:
    """Bind PATH (mode 0600). We hold the lock, so a socket already there is a dead zygote's."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(64)
    s.setblocking(False)
    return s


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m hotstart.forkserver.zygote")
    p.add_argument("--socket", required=True)
    p.add_argument("--lock", required=True)
    p.add_argument("--cwd", default="/", help="the folder to re-execute in (hotstart is imported from there)")
    p.add_argument("--keep-json", default="[]", help='[["model folder", ["file", ...]], ...]')
    p.add_argument("--no-watch", action="store_true", help="never restart for changed hotstart / torch files")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a daemon: `hotstart zygote stop` or SIGTERM ends it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    lock_fd = _take_lock(args.lock)
    if lock_fd is None:
        log(f"hotstart: zygote: another zygote holds {args.lock}; exiting")
        os._exit(3)
    worker = preload_engine()

    preload = Span("zygote up (torch + engine imported)", T_START, time.time(), "zygote")
    kept = keeping.keep([(m, fs) for m, fs in json.loads(args.keep_json)], log)
    try:
        listener = _listen(args.socket)
    except OSError as e:
        log(f"hotstart: zygote: cannot listen on {args.socket}: {e.strerror or e}")
        os._exit(1)
    zygote = Zygote(preload, worker, listener, args.socket, lock_fd, kept, watch=not args.no_watch)
    os.chdir("/")  # hold no folder of anyone's
    torch_version = zygote.info.torch_version
    log(f"hotstart: zygote: pid {os.getpid()} ready in {time.time() - T_START:.2f} s (torch {torch_version}) "
        f"on {args.socket}")
    try:
        zygote.run()
    finally:
        zygote.close()
    if zygote.reexec:
        try:
            os.chdir(args.cwd)
            os.execv(sys.executable, [sys.executable, "-m", "hotstart.forkserver.zygote", *argv])
        except OSError as e:
            log(f"hotstart: zygote: cannot restart: {e.strerror or e}")
    log("hotstart: zygote: stopped")
    os._exit(0)  # skip torch's slow interpreter teardown


if __name__ == "__main__":
    main()
