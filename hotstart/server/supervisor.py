"""EngineSupervisor: the life of one engine process as the API process sees it (torch-free).

It watches the launcher (forkserver socket, or a poll of a directly spawned engine) and decides what a
death means: when the engine dies, every in-flight request fails at once, /health turns 503, and a new
engine is forked from the warm forkserver (new socket names, so nothing stale reaches it). When the
forkserver itself dies (an OOM kill of the process tree), a fresh forkserver is started and the engine
with it; clients see 503 until it is ready. Deaths in a tight loop end the server (fatal).
An engine forked by a zygote reports the same events; a zygote that dies (or does not fork) before the
first READY is replaced by a local forkserver as if there had been none, whatever --no-restart says.
With tensor parallelism the engine is a group of ranks (the API process talks to rank 0): the death of
any rank of the current generation is the engine's death; the rest of the group is stopped and all
ranks are forked again.

The transport (server/engine_client.py) owns the sockets and the request queues; it tells the
supervisor what the engine says (spans, READY, FAILED) and the supervisor tells it to fail its requests
or to bind new sockets. One supervisor per engine: a server may hold several.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig
from hotstart.forkserver.client import EngineLauncher
from hotstart.messages import RANK_LEFT, EngineExited, EngineSpawned, ForkserverExited, ServerInfo, Span
from hotstart.server.memory import exit_cause

log = logging.getLogger("hotstart")
DIRECT_POLL_S = 0.1  # exit check of a directly spawned engine (no forkserver socket to watch)
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 5  # more deaths than this within the window: give up (a crash loop)
ZYGOTE_FORK_TIMEOUT_S = 10.0  # a zygote forks in ms; one that has not forked by then is abandoned


class Transport(Protocol):
    """What the supervisor asks of the transport of its engine."""

    def fail_requests(self, message: str) -> None:
        """Every request in flight ends with EngineDeadError(MESSAGE)."""

    def unbind(self) -> None:
        """Close the sockets of the dead engine."""

    def bind(self) -> None:
        """Bind the launcher's current addresses (those of the engine generation just asked for)."""


class EngineSupervisor:
    """One engine's launcher events, restart policy, recovery timing and fatal state."""

    def __init__(self, launcher: EngineLauncher, cfg: EngineConfig, timeline: Timeline, transport: Transport,
                 auto_restart: bool = True) -> None:
        self.launcher, self.cfg, self.timeline, self.transport = launcher, cfg, timeline, transport
        self.auto_restart = auto_restart
        self.status = "starting"  # "starting", an engine startup phase, "ready", "restarting", "failed: ..."
        self.ready = False
        self.fatal: str | None = None
        self.server_info: ServerInfo | None = None
        self.restarts = 0
        self.recovery_seconds: list[float] = []  # death -> replacement ready, per restart
        self.on_fatal: Callable[[str], None] | None = None
        self.on_ready: Callable[[], None] | None = None
        self.on_replace: Callable[[], None] | None = None  # a new generation is being started
        self.closing = False
        self._died_at: float | None = None
        self._deaths: list[float] = []
        self._watch_task: asyncio.Task | None = None
        self._reader_fd: int | None = None

    @property
    def restarting(self) -> bool:
        """A replacement engine is starting (its phases are not part of startup)."""
        return self._died_at is not None

    def spawn(self, new_generation: bool = False) -> None:
        """Ask for the engine process now (sync; callable before the event loop exists)."""
        self.launcher.spawn(self.cfg, new_generation, world_size=self.cfg.tensor_parallel_size)

    def start(self) -> None:
        """Watch the launcher (inside the event loop)."""
        self._watch_launcher()
        self.on_launcher_event()
        if self.launcher.zygote_pid is not None:
            asyncio.get_running_loop().call_later(ZYGOTE_FORK_TIMEOUT_S, self._check_zygote_forked)

    def stop(self) -> None:
        """Stop watching (the server is closing)."""
        self.closing = True
        self._unwatch_launcher()
        if self._watch_task is not None:
            self._watch_task.cancel()

    def _check_zygote_forked(self) -> None:
        if (self.launcher.zygote_pid is not None and not self.launcher.engine_pids and not self.closing
                and not self.fatal):
            self.launcher.abandon_zygote(f"forked no engine within {ZYGOTE_FORK_TIMEOUT_S:.0f} s")
            self.on_launcher_event()

    def _watch_launcher(self) -> None:
        fd = self.launcher.fileno()
        if fd is not None:
            self._reader_fd = fd
            asyncio.get_running_loop().add_reader(fd, self.on_launcher_event)
        elif self._watch_task is None:
            self._watch_task = asyncio.ensure_future(self._watch_direct())

    def _unwatch_launcher(self) -> None:
        if self._reader_fd is not None:
            asyncio.get_running_loop().remove_reader(self._reader_fd)  # tolerates an fd closed already
            self._reader_fd = None

    async def _watch_direct(self) -> None:
        while not self.closing:
            self.on_launcher_event()
            await asyncio.sleep(DIRECT_POLL_S)

    # --- what the launcher reports ----------------------------------------------------------
    def on_launcher_event(self) -> None:
        events = self.launcher.poll_events()
        # a group's death is told by its cause: ranks that followed another rank out come last
        events.sort(key=lambda ev: isinstance(ev, EngineExited) and ev.code == RANK_LEFT)
        for ev in events:
            if isinstance(ev, ServerInfo):
                if self.server_info is None:  # a replacement forkserver is not part of startup
                    self.timeline.record(ev.preload)
                self.server_info = ev
            elif isinstance(ev, EngineSpawned):
                if self._died_at is None:
                    self.timeline.record(ev.fork)
            elif self.closing:
                continue
            elif isinstance(ev, EngineExited) and ev.generation == self.launcher.generation:
                # any rank: a group without one of its ranks cannot run (the other exits of the group in
                # this batch are of a generation replaced meanwhile)
                tp = self.cfg.tensor_parallel_size
                what = f"engine rank {ev.rank} of {tp} exited" if tp > 1 else "engine process exited"
                cause = exit_cause(ev.code, ev.pid)  # a SIGKILL: the OOM killer?
                self._engine_died(f"{what} (code {ev.code}){cause}", forkserver_dead=False)
            elif isinstance(ev, ForkserverExited):
                code = "" if ev.code is None else f" (code {ev.code}){exit_cause(ev.code)}"
                self._engine_died(f"{self.launcher.last_lost} exited{code}", forkserver_dead=True)

    def _engine_died(self, what: str, forkserver_dead: bool) -> None:
        if self.fatal:
            return
        was_ready, self.ready = self.ready, False
        if (forkserver_dead and self.launcher.last_lost == "zygote" and not was_ready
                and self._died_at is None):  # still starting: carry on without the zygote
            log.warning("hotstart: %s during startup; starting a local forkserver", what)
            self.timeline.mark("zygote lost", "api", what)
            return self._replace(forkserver_dead=True)
        log.error("hotstart: %s", what)
        self.transport.fail_requests(what)
        now = time.time()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        if not (self.auto_restart and (was_ready or self._died_at is not None)):
            return self.fail(what)  # died during startup: a replacement would only die the same way
        if len(self._deaths) > MAX_RESTARTS_IN_WINDOW:
            return self.fail(
                f"{what}; {len(self._deaths)} engine deaths within {RESTART_WINDOW_S:.0f} s, giving up"
            )
        self._died_at = self._died_at or now
        self.restarts += 1
        self.status = "restarting"
        if self.on_replace is not None:
            self.on_replace()
        self._replace(forkserver_dead)

    def _replace(self, forkserver_dead: bool) -> None:
        """A new engine generation (and a fresh forkserver if it died), on new sockets."""
        self.transport.unbind()
        if forkserver_dead and self.launcher.use_forkserver:
            self._unwatch_launcher()
            self.launcher.restart_server()
            self._watch_launcher()
        elif self.cfg.tensor_parallel_size > 1:
            self.launcher.stop_engine()  # the ranks still alive of the dead generation
        self.spawn(new_generation=True)
        self.transport.bind()

    def fail(self, message: str) -> None:
        """The engine is gone for good: requests fail, the server is told (on_fatal)."""
        self.fatal = message
        self.status = f"failed: {message}"
        self.ready = False
        self.transport.fail_requests(message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    # --- what the engine reports (through the transport) ------------------------------------
    def engine_span(self, span: Span) -> None:
        if self._died_at is None:  # a replacement engine's phases are not part of startup
            self.timeline.record(span)
        if not self.ready:  # after READY, spans are the fast path being built behind
            self.status = span.name

    def engine_ready(self) -> None:
        self.ready, self.status = True, "ready"
        if self._died_at is not None:
            took = time.time() - self._died_at
            self.recovery_seconds.append(took)
            self._died_at = None
            log.info("hotstart: engine replaced in %.2f s", took)
            return
        self.timeline.mark("engine ready", "engine")
        if self.on_ready is not None:
            self.on_ready()

    def engine_broken(self, why: str) -> None:
        """The engine sent something undecodable: replace it rather than guess."""
        log.error("hotstart: undecodable message from the engine (%s); replacing the engine", why)
        self.launcher.kill_engine()
