"""The forkserver process: import torch and the engine once, then fork engines on request.

Protocol (hotstart.messages, framed by hotstart.framing), per connection:
  server -> client  ServerInfo (first, once the preload is done), then EngineSpawned / EngineExited
  client -> server  SpawnEngine (fork WORLD_SIZE ranks), StopEngine (terminate a generation), StopServer
The server forks only from its single main thread, before any torch op ran, so the children are safe.
The engines of a connection are terminated when it closes; the server exits with its last connection.
It dies with the API process (PR_SET_PDEATHSIG), and so do the engines it forks. The zygote
(hotstart.forkserver.zygote) is a ForkServer that outlives its connections; it overrides the hooks
marked below.
"""

from __future__ import annotations

import time

T_START = time.time()

import gc  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from hotstart import __version__  # noqa: E402
from hotstart.framing import FrameError, FrameReader, send  # noqa: E402
from hotstart.messages import (  # noqa: E402
    EngineExited,
    EngineSpawned,
    ServerInfo,
    Span,
    SpawnEngine,
    StopEngine,
    StopServer,
    ToForkserver,
)
from hotstart.procs import collector_paused, die_with_parent, terminate_then_kill  # noqa: E402

KILL_GRACE_S = 2.0
SEND_TIMEOUT_S = 5.0  # a client that reads nothing for this long while we write to it is dropped
SELECT_S = 0.1  # also the reaping period while idle


@dataclass
class _Child:
    conn: socket.socket
    generation: int
    rank: int


class ForkServer:
    """Serves connections (one socketpair from the API process; a zygote serves many)."""

    process = "forkserver"  # the timeline's name for this process

    def __init__(self, preload: Span, worker) -> None:
        self.worker = worker  # hotstart.engine.worker, imported by the caller (the preload)
        self.children: dict[int, _Child] = {}
        self.readers: dict[socket.socket, FrameReader] = {}
        torch_version = str(getattr(sys.modules.get("torch"), "__version__", ""))
        self.info = ServerInfo(os.getpid(), preload, __version__, sys.executable, torch_version)
        self.stopping = False
        self.manifest = None  # boot/manifest.py: where to record what the preload read (main() sets it)
        self.warm: list[tuple[str, tuple[str, ...]]] = []  # models an engine was forked for (_warm_caches)

    # ---- connections -------------------------------------------------------------------------
    def add_connection(self, conn: socket.socket) -> bool:
        conn.setblocking(True)
        self.readers[conn] = FrameReader(ToForkserver)
        return self._send(conn, self.info)

    def _send(self, conn: socket.socket, msg) -> bool:
        try:
            send(conn, msg, SEND_TIMEOUT_S)
            return True
        except OSError:
            self._drop(conn)
            return False

    def _drop(self, conn: socket.socket) -> None:
        """The client went away: its engines go too."""
        if self.readers.pop(conn, None) is None:
            return
        self._terminate([pid for pid, c in self.children.items() if c.conn is conn])
        conn.close()

    # ---- engines -----------------------------------------------------------------------------
    def _spawn(self, conn: socket.socket, msg) -> None:
        sys.stdout.flush()  # or the child would write our buffered output a second time
        sys.stderr.flush()
        # what the preload built (torch and the engine's modules: ~170K objects) is frozen (preload()): an
        # engine's first full collection traversed it all, 0.1 s on its critical path (and a copy-on-write
        # fault for each page of objects it wrote to). What this server built since joins it, its garbage
        # collected first (a long-lived zygote forks many times: none of it kept for good; ~0.1 ms)
        gc.collect()
        gc.freeze()
        for rank in range(msg.world_size):
            start = time.time()
            pid = os.fork()
            if pid == 0:
                self._child(conn, msg, rank)  # never returns
            self.children[pid] = _Child(conn, msg.generation, rank)
            fork = Span(f"engine forked (rank {rank})" if msg.world_size > 1 else "engine forked",
                        start, time.time(), self.process, f"pid {pid}")
            if not self._send(conn, EngineSpawned(msg.generation, rank, pid, fork)):
                return
        self.warm.append((msg.config.model_path, tuple(msg.config.weight_files)))

    def _child(self, conn: socket.socket, msg, rank: int) -> None:
        code = 1
        try:
            for c in self.readers:  # the engine holds no connection of the server's
                c.close()
            die_with_parent(signal.SIGKILL)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            self._child_setup(conn)
            code = self.worker.run_engine(msg.config, msg.addresses, rank, msg.world_size)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _terminate(self, pids: list[int]) -> None:
        terminate_then_kill(pids, KILL_GRACE_S)
        self._reap()

    def _reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by terminate_then_kill
                done, status = pid, 0
            if done:
                child = self.children.pop(pid, None)
                if child is None:  # reaped meanwhile: a failed send below dropped its connection and reaped
                    continue
                code = os.waitstatus_to_exitcode(status) if status else 0
                if child.conn in self.readers:
                    self._send(child.conn, EngineExited(child.generation, child.rank, pid, code))

    def _on_message(self, conn: socket.socket, msg) -> None:
        if isinstance(msg, SpawnEngine):
            self._spawn(conn, msg)
        elif isinstance(msg, StopEngine):
            self._terminate(
                [p for p, c in self.children.items() if c.conn is conn and c.generation == msg.generation]
            )
        elif isinstance(msg, StopServer):
            self.stopping = True

    # ---- hooks (the zygote overrides them) ---------------------------------------------------
    def _child_setup(self, conn: socket.socket) -> None:
        """In the forked engine, before it runs: whatever the connection asked for (nothing here)."""

    def _serving(self) -> bool:
        return bool(self.readers)

    def _wait(self) -> list:
        return select.select(list(self.readers), [], [], SELECT_S)[0]

    def _on_other(self, fd) -> None:
        """FD is ready but is no connection (a zygote's listening socket, its signal pipe)."""

    def _recv(self, conn: socket.socket) -> bytes:
        return conn.recv(1 << 16)

    def _record_manifest(self) -> None:
        """Once, while idle (never before a fork): what the preload read, for the next cold start's
        I/O schedule (boot/manifest.py), if the one on disk is missing or stale."""
        from hotstart.boot import manifest  # noqa: PLC0415 - stdlib only

        path, self.manifest = self.manifest, None
        try:
            if manifest.load(path)[1]:
                manifest.record(path)
        except OSError as e:  # a read-only or full $HOTSTART_HOME: the next start reads no manifest
            print(f"hotstart: forkserver: could not record {path}: {e.strerror or e}", file=sys.stderr)

    def _warm_caches(self) -> None:
        """While idle (never before a fork): what every engine of a model computes at its start and keeps
        per version of the files, computed here once for each model an engine was forked for, so that the
        next engine forked for it (a many-models swap back to it) inherits it: a GGUF's header
        (gguf_file.lean_header, ~16 ms on the default model) and the prefix cache's snapshot key
        (model/kv_files.py: a GGUF's first 4 MiB hashed, ~4 ms). Stdlib only, no torch op. What fails
        here is the engine's to report."""
        from hotstart.gguf_file import is_gguf, lean_header  # noqa: PLC0415 - stdlib only
        from hotstart.model import kv_files  # noqa: PLC0415

        models, self.warm = self.warm, []
        for path, files in dict.fromkeys(models):
            try:
                if len(files) == 1 and is_gguf(files[0]):  # as model/loader.py tells one
                    lean_header(files[0])
                if files:
                    kv_files.snapshot_key(path, list(files))
            except Exception:  # noqa: BLE001, S112 - the engine computes it again and says what is wrong
                continue

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until stopped, signalled, or the last connection closes; then stop every engine."""
        def on_term(signum, frame):  # noqa: ARG001
            self.stopping = True

        signal.signal(signal.SIGTERM, on_term)
        try:
            while not self.stopping and self._serving():
                ready = self._wait()
                self._reap()
                if not ready and self.manifest is not None:
                    self._record_manifest()
                if not ready and self.warm:
                    self._warm_caches()
                for conn in ready:
                    if conn not in self.readers:  # another fd, or dropped while handling an earlier one
                        self._on_other(conn)
                        continue
                    try:
                        chunk = self._recv(conn)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        self._drop(conn)
                        continue
                    try:
                        msgs = self.readers[conn].feed(chunk)
                    except FrameError as e:
                        print(
                            f"hotstart: forkserver: dropping a client that sent a bad frame: {e}",
                            file=sys.stderr,
                        )
                        self._drop(conn)
                        continue
                    for msg in msgs:
                        self._on_message(conn, msg)
        finally:
            self._terminate(list(self.children))


def preload():
    """Import torch and the whole engine (the collector paused: procs.collector_paused); the engine's
    worker module."""
    with collector_paused():
        from hotstart.engine import worker  # noqa: PLC0415 - the preload
    return worker


def main() -> None:
    # Before the heavy preload: if the API process dies while torch imports, so do we.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the API process, which stops us
    die_with_parent(signal.SIGKILL)
    conn = socket.socket(fileno=int(sys.argv[1]))
    worker = preload()

    server = ForkServer(
        Span("forkserver up (torch + engine imported)", T_START, time.time(), "forkserver"), worker
    )
    if os.environ.get("HOTSTART_IMPORT_PREFETCH", "1") != "0":
        from hotstart.boot.manifest import folder  # noqa: PLC0415 - stdlib only
        from hotstart.system import hotstart_home  # noqa: PLC0415

        server.manifest = folder(hotstart_home()) / "forkserver.json"
    if server.add_connection(conn):  # else: the API process went away while we imported torch
        server.run()
    os._exit(0)  # skip torch's slow interpreter teardown
