"""The API process's side of the forkserver (torch-free): start engines as early as possible.

With pre-spawn (the default) the API process starts the warm forkserver at t=0; it imports torch and
the engine while the API process resolves the model, prefetches weights and imports its web stack,
then forks the engine the moment it has both the preload done and the engine config. Without it
(--no-prespawn, or where os.fork is missing) the engine is spawned directly as a fresh interpreter.
Either way the caller sees the same typed events (hotstart.messages): ServerInfo, EngineSpawned,
EngineExited, ForkserverExited. A crashed engine is replaced by a fork from the still-warm server in
milliseconds; a dead forkserver is replaced by a fresh one (restart_server).

With --zygote auto (the default) start() first looks for this user's zygote (hotstart.forkserver.runtime:
a stat, or a connect() and one read within a few ms); if one matches, its connection replaces the
forkserver's socketpair (same protocol, same events) and no forkserver is started. A zygote that dies
or refuses a spawn reads as ForkserverExited; restart_server() then starts a local forkserver.

Only stdlib modules are imported at module level: the forkserver's launch is the t=0 step of every
start, and nothing may come before it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from hotstart.procs import terminate_then_kill

if TYPE_CHECKING:
    from hotstart.config import EngineConfig
    from hotstart.messages import EngineAddresses

STOP_GRACE_S = 3.0
SEND_TIMEOUT_S = 2.0  # a message of ours waits this long at most for a forkserver that stopped reading



def current_generation(events: list, generation: int, engine_pids: dict[int, int]) -> list:
    """EVENTS less the spawns and exits of other engine generations; ENGINE_PIDS (rank -> pid) follows the
    spawns and exits of GENERATION."""
    from hotstart.messages import EngineExited, EngineSpawned  # msgspec: only after the t=0 launch

    out = []
    for ev in events:
        if isinstance(ev, (EngineSpawned, EngineExited)) and ev.generation != generation:
            continue
        if isinstance(ev, EngineSpawned):
            engine_pids[ev.rank] = ev.pid
        elif isinstance(ev, EngineExited):
            engine_pids.pop(ev.rank, None)
        out.append(ev)
    return out

class EngineLauncher:
    """Owns the forkserver (or the directly spawned engine) and reports process events."""

    def __init__(self, use_forkserver: bool = True, zygote: str = "off"):
        self.use_forkserver = use_forkserver and hasattr(os, "fork")
        self.zygote = zygote if self.use_forkserver else "off"  # "auto": use a matching zygote if one runs
        self.zygote_pid: int | None = None  # the zygote in use (None: a local forkserver, or none)
        self.zygote_lost = False  # the zygote in use died or refused: its replacement is local
        self.spans: list[tuple[str, float, float, str]] = []  # (name, start, end, detail) for the timeline
        self._lifeline: int | None = None  # write end of the pipe whose EOF ends the zygote's engines
        self.last_lost = "forkserver"  # what the latest ForkserverExited was: "forkserver" or "zygote"
        # Private folder for the engine's zmq ipc sockets: unique per server, so two run side by side.
        self.ipc_dir = tempfile.mkdtemp(prefix="hotstart-ipc-")
        self.generation = 0  # bumped per engine: a replacement never sees its predecessor's sockets
        self.server: subprocess.Popen | None = None
        self.direct: dict[int, subprocess.Popen] = {}  # rank -> directly spawned engine process
        self.engine_pids: dict[int, int] = {}  # rank -> pid of the current generation
        self.server_restarts = 0
        self.started_at: float | None = None
        self._sock: socket.socket | None = None
        self._reader = None
        self._pending: list = []  # events made here (direct spawn), handed out by poll_events

    @property
    def engine_pid(self) -> int | None:
        """Rank 0's pid (the process the API talks to)."""
        return self.engine_pids.get(0)

    def start(self) -> None:
        """Use a matching zygote, else start the forkserver (no-op without pre-spawn)."""
        if not self.use_forkserver:
            return
        if self.zygote == "auto" and not self.zygote_lost and self._use_zygote():
            return
        ours, theirs = socket.socketpair()
        self.started_at = time.time()
        self.server = subprocess.Popen(
            [sys.executable, "-m", "hotstart.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        )
        theirs.close()
        ours.setblocking(False)
        self._sock, self._reader = ours, None

    def _use_zygote(self) -> bool:
        from hotstart.forkserver.runtime import probe, send_context  # noqa: PLC0415 - stdlib only

        found = probe()
        if found.sock is not None:
            try:
                self._lifeline = send_context(found.sock)
            except OSError as e:
                found.sock.close()
                found.sock, found.note = None, f"it did not take the engine context ({e.strerror or e})"
        if found.sock is None:  # (no Span here: msgspec is not imported before the forkserver's launch)
            self.spans.append(("zygote not used", found.start, found.end, found.note))
            return False
        self.spans.append(("zygote used", found.start, time.time(), found.note))
        found.sock.setblocking(False)
        self._sock, self._reader, self.zygote_pid = found.sock, None, found.info.pid
        return True

    def restart_server(self) -> None:
        """Replace a dead forkserver with a fresh one (it imports torch again: seconds, not ms)."""
        self._close_server(grace=0.5)
        self.server_restarts += 1
        self.start()

    def addresses(self) -> EngineAddresses:
        """zmq addresses of the current engine generation."""
        from hotstart.messages import EngineAddresses  # noqa: PLC0415 - not needed for the t=0 step

        g = self.generation
        return EngineAddresses(f"ipc://{self.ipc_dir}/in-{g}", f"ipc://{self.ipc_dir}/out-{g}")

    def spawn(self, cfg: EngineConfig, new_generation: bool = False, world_size: int | None = None) -> None:
        """Ask for an engine of WORLD_SIZE ranks (default: cfg.tensor_parallel_size). With the forkserver
        this returns at once (it forks when its preload is done)."""
        import msgspec  # noqa: PLC0415

        from hotstart.messages import EngineSpawned, Span, SpawnEngine  # noqa: PLC0415

        if new_generation:
            self.generation += 1
        self.engine_pids = {}
        addresses = self.addresses()
        world_size = world_size or cfg.tensor_parallel_size
        if self._sock is not None:
            from hotstart.framing import send  # noqa: PLC0415

            try:
                send(self._sock, SpawnEngine(self.generation, cfg, addresses, world_size), SEND_TIMEOUT_S)
            except OSError:  # the server is gone (a stopped zygote): poll_events reports its EOF
                pass
            return
        payload = msgspec.json.encode(cfg).decode()
        for rank in range(world_size):
            start = time.time()
            ranks = [str(rank), str(world_size)] if world_size > 1 else []
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hotstart.engine.worker",
                    payload,
                    addresses.requests,
                    addresses.outputs,
                    *ranks,
                ],
                stdin=subprocess.DEVNULL,
            )
            self.direct[rank] = proc
            self.engine_pids[rank] = proc.pid
            name = f"engine spawned (rank {rank})" if world_size > 1 else "engine spawned"
            span = Span(name, start, time.time(), "api", f"pid {proc.pid}")
            self._pending.append(EngineSpawned(self.generation, rank, proc.pid, span))

    def fileno(self) -> int | None:
        """Readable when forkserver events arrive (for an event loop's add_reader)."""
        return self._sock.fileno() if self._sock is not None else None

    def poll_events(self, all_generations: bool = False) -> list:
        """Non-blocking: the events that arrived since the last call, typed (see the module docstring).
        Events of earlier engine generations are dropped here, unless ALL_GENERATIONS (several engines
        share this launcher: frontend/shared_launcher.py routes them by generation)."""
        from hotstart.framing import FrameError, FrameReader  # noqa: PLC0415
        from hotstart.messages import (  # noqa: PLC0415
            EngineExited,
            ForkserverExited,
            FromForkserver,
            SpawnRefused,
        )

        events, self._pending = self._pending, []
        if self._sock is not None:
            if self._reader is None:
                self._reader = FrameReader(FromForkserver)
            while True:
                try:
                    chunk = self._sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    chunk = b""
                try:
                    events += self._reader.feed(chunk) if chunk else []
                except FrameError as e:
                    print(
                        f"hotstart: forkserver sent a bad frame ({e}); treating it as dead", file=sys.stderr
                    )
                    chunk = b""
                refused = [ev for ev in events if isinstance(ev, SpawnRefused)]
                if refused:  # a zygote that refuses our config is of no use: go local
                    print(f"hotstart: the zygote refused the engine ({refused[0].reason}); starting a local "
                          "forkserver", file=sys.stderr)
                    events = [ev for ev in events if not isinstance(ev, SpawnRefused)]
                    chunk = b""
                if not chunk:
                    self.last_lost = "zygote" if self.zygote_pid is not None else "forkserver"
                    events.append(ForkserverExited(self.server.poll() if self.server is not None else None))
                    self._close_server(grace=0.5)
                    break
        for rank, proc in list(self.direct.items()):
            if proc.poll() is not None:
                events.append(EngineExited(self.generation, rank, proc.pid, proc.returncode))
                del self.direct[rank]
        if all_generations:
            return events
        return current_generation(events, self.generation, self.engine_pids)

    def send(self, msg) -> bool:
        """Send MSG (SpawnEngine, StopEngine) to the forkserver; False if there is none or it is gone
        (poll_events then reports its EOF)."""
        if self._sock is None:
            return False
        from hotstart.framing import send  # noqa: PLC0415

        try:
            send(self._sock, msg, SEND_TIMEOUT_S)
            return True
        except OSError:
            return False

    def abandon_server(self, reason: str) -> None:
        """Stop using the forkserver or zygote (it did not answer in time): a forkserver is SIGKILLed, a
        zygote (others may use it) only left. The next poll_events reports ForkserverExited, and
        restart_server() starts a local forkserver."""
        if self._sock is None:
            return
        from hotstart.messages import ForkserverExited  # noqa: PLC0415

        self.last_lost = "zygote" if self.zygote_pid is not None else "forkserver"
        pid = self.zygote_pid or (self.server.pid if self.server is not None else "?")
        print(f"hotstart: the {self.last_lost} (pid {pid}) {reason}; starting a local forkserver",
              file=sys.stderr)
        self._close_server(grace=0)
        self._pending.append(ForkserverExited(None))

    def stop_engine(self) -> None:
        """Stop every rank of the current generation (one rank died: the group goes with it)."""
        if self._sock is not None:
            from hotstart.framing import send  # noqa: PLC0415
            from hotstart.messages import StopEngine  # noqa: PLC0415

            try:
                send(self._sock, StopEngine(self.generation), SEND_TIMEOUT_S)
            except OSError:  # the server is gone: poll_events reports it
                pass
        elif self.direct:
            terminate_then_kill(list(self.direct.values()), STOP_GRACE_S)
            self.direct = {}

    def kill_engine(self) -> None:
        """SIGKILL every rank of the current engine (its exit events follow as usual)."""
        for pid in self.engine_pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop_server(self) -> None:
        """Ask the forkserver to stop (it terminates its engines); shutdown() waits for it."""
        if self._sock is not None:
            from hotstart.framing import send  # noqa: PLC0415
            from hotstart.messages import StopServer  # noqa: PLC0415

            try:
                send(self._sock, StopServer(), SEND_TIMEOUT_S)
            except OSError:
                pass

    def _close_server(self, grace: float) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)  # EOF: every engine the zygote forked for us exits
            self._lifeline = None
        if self.zygote_pid is not None:
            self.zygote_pid, self.zygote_lost = None, True
        if self._sock is not None:
            try:
                self._sock.close()  # EOF: the forkserver terminates its engines and exits
            except OSError:
                pass
            self._sock, self._reader = None, None
        if self.server is not None:
            terminate_then_kill([self.server], grace)
            self.server = None

    def shutdown(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop the forkserver (it stops its engines) or the direct engine; SIGKILL past TIMEOUT.
        Idempotent. A forkserver still importing torch dies at once (SIGTERM's default action).
        A zygote's engines are not our children: they are stopped by the zygote and by closing their
        lifeline, and waited for here by pid."""
        engines = []
        if self.zygote_pid is not None:
            try:
                self.poll_events()  # EngineSpawned not read yet: learn the pids to wait for
            except Exception:  # noqa: BLE001 - shutting down: best effort
                pass
            engines = list(self.engine_pids.values())
        self.stop_server()
        procs = [p for p in (self.server, *self.direct.values()) if p is not None]
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self.server, self.direct = None, {}
        self.zygote_pid = None
        if terminate_then_kill(procs + engines, timeout):
            self.kill_engine()  # the forkserver was SIGKILLed before it could stop its engines
        self.engine_pids = {}
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
