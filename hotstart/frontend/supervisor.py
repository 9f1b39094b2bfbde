"""EngineSupervisor: the life of one engine process as the API process sees it (torch-free).

It watches the launcher (forkserver socket, or a poll of a directly spawned engine) and decides what a
death means: when the engine dies, every in-flight request fails at once, /health turns 503, and a new
engine is forked from the warm forkserver (new socket names, so nothing stale reaches it). When the
forkserver itself dies (an OOM kill of the process tree), a fresh forkserver is started and the engine
with it; clients see 503 until it is ready. Deaths in a tight loop (more than 5 within 60 s) do not end
the server: it backs off (frontend/crashes.py: /health and requests 503 with Retry-After, /live 200) and
starts the engine again after a delay that grows while the loop goes on. Every death logs the requests
in flight; one in flight at two deaths in a row is refused when retried (a poison request). A death
before the first READY (the engine cannot start) and --no-restart still end the server.
An engine forked by a zygote reports the same events; a zygote that dies (or does not fork) before the
first READY is replaced by a local forkserver as if there had been none, whatever --no-restart says.
With tensor parallelism the engine is a group of ranks (the API process talks to rank 0): the death of
any rank of the current generation is the engine's death; the rest of the group is stopped and all
ranks are forked again.

Liveness (check_liveness, a few times a second): an engine that stops making progress without dying
(SIGSTOP, a hang holding the GIL, a rank frozen under tensor parallelism) stops beating
(hotstart/heartbeat.py). After --engine-heartbeat-timeout seconds of silence from any rank (60 s
before the engine's READY: a fresh interpreter imports torch, a cold weight read may hold the GIL),
or a step longer than --engine-step-timeout, every rank is SIGKILLed and the death takes the crash path
above. Every wait on the forkserver is bounded too: one that forks nothing within FORK_TIMEOUT_S of
being asked (PRELOAD_TIMEOUT_S while it still imports torch) is killed (a zygote: left) and replaced.

The transport (frontend/engine_client.py) owns the sockets and the request queues; it tells the
supervisor what the engine says (spans, READY, FAILED) and the supervisor tells it to fail its requests
or to bind new sockets. One supervisor per engine: a server may hold several.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from hotstart import heartbeat
from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig
from hotstart.forkserver.client import EngineLauncher
from hotstart.frontend.crashes import CrashLog
from hotstart.frontend.memory import exit_cause
from hotstart.messages import RANK_LEFT, EngineExited, EngineSpawned, ForkserverExited, ServerInfo, Span

log = logging.getLogger("hotstart")
DIRECT_POLL_S = 0.1  # exit check of a directly spawned engine (no forkserver socket to watch)
FORK_TIMEOUT_S = 10.0  # a forkserver or zygote that preloaded forks in ms: one silent this long is replaced
PRELOAD_TIMEOUT_S = 180.0  # a fresh forkserver's torch + engine import, cold, on a loaded machine
STARTUP_SILENCE_S = 60.0  # the heartbeat limit until READY (at least --engine-heartbeat-timeout)
CHECK_S = 0.25  # liveness checks' period (at most; a fifth of the heartbeat timeout if that is shorter)
# An engine that cannot start sends its reason (EngineFailed, on the output socket) and then exits; the
# exit comes on the launcher's socket and may be read first. This long, the reason may still overtake it.
EXIT_REASON_GRACE_S = 1.0


class Transport(Protocol):
    """What the supervisor asks of the transport of its engine."""

    def fail_requests(self, message: str) -> None:
        """Every request in flight ends with EngineDeadError(MESSAGE)."""

    def unbind(self) -> None:
        """Close the sockets of the dead engine."""

    def bind(self) -> None:
        """Bind the launcher's current addresses (those of the engine generation just asked for)."""

    def in_flight(self) -> dict:
        """{request id: (prompt token ids, SamplingParams)} of the requests in flight."""


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
        self.crashes = CrashLog(cfg.engine_restart_backoff)  # deaths, backoff, poison requests
        self._died_at: float | None = None
        self._retry: asyncio.TimerHandle | None = None  # the engine's start after a backoff
        self._watch_task: asyncio.Task | None = None
        self._liveness_task: asyncio.Task | None = None
        self._reader_fd: int | None = None
        self._server_up_at: float | None = None  # when the forkserver in use sent ServerInfo (preload done)
        self._asked_at = time.monotonic()  # when the current generation was asked for
        self._beats: dict[int, tuple[int, int | None, float]] = {}  # rank -> (pid, beat count, changed at)
        self._beats_generation = -1

    @property
    def restarting(self) -> bool:
        """A replacement engine is starting (its phases are not part of startup)."""
        return self._died_at is not None

    def spawn(self, new_generation: bool = False) -> None:
        """Ask for the engine process now (sync; callable before the event loop exists)."""
        self._asked_at = time.monotonic()
        self.launcher.spawn(self.cfg, new_generation, world_size=self.cfg.tensor_parallel_size)

    def start(self) -> None:
        """Watch the launcher and the engine's liveness (inside the event loop)."""
        self._watch_launcher()
        self.on_launcher_event()
        self._liveness_task = asyncio.ensure_future(self._watch_liveness())

    @property
    def retry_after(self) -> float | None:
        """Seconds until the engine starts again while the server backs off from a crash loop, else None."""
        return self.crashes.retry_after(time.monotonic())

    def stop(self) -> None:
        """Stop watching (the server is closing)."""
        self.closing = True
        if self._retry is not None:
            self._retry.cancel()
        self._unwatch_launcher()
        for task in (self._watch_task, self._liveness_task):
            if task is not None:
                task.cancel()

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

    # --- liveness ---------------------------------------------------------------------------
    async def _watch_liveness(self) -> None:
        timeout = self.cfg.engine_heartbeat_timeout
        every = max(0.01, min(CHECK_S, timeout / 5)) if timeout > 0 else CHECK_S
        while not self.closing and not self.fatal:
            await asyncio.sleep(every)
            try:
                self.check_liveness(time.monotonic())
            except Exception as e:  # noqa: BLE001 - the watchdog must outlive a bug in one check
                log.error("hotstart: engine liveness check failed: %s: %s", type(e).__name__, e)

    def check_liveness(self, now: float) -> None:
        """Kill and replace a silent engine, or a forkserver that does not fork (see the module docstring)."""
        if self.closing or self.fatal or self._retry is not None:  # backing off: no engine is asked for
            return
        pids = dict(self.launcher.engine_pids)
        if not pids:
            return self._check_forkserver(now)
        if self.launcher.generation != self._beats_generation:
            self._beats_generation, self._beats = self.launcher.generation, {}
        timeout, step_timeout = self.cfg.engine_heartbeat_timeout, self.cfg.engine_step_timeout
        if timeout <= 0 and step_timeout <= 0:
            return
        requests = self.launcher.addresses().requests
        for rank, pid in sorted(pids.items()):
            record = heartbeat.read(heartbeat.path(requests, rank))
            count, step_s = record if record is not None else (None, 0.0)
            seen = self._beats.get(rank)
            if seen is None or seen[0] != pid or count != seen[1]:
                self._beats[rank] = seen = (pid, count, now)
            tp = self.cfg.tensor_parallel_size
            who = f"engine rank {rank} of {tp} (pid {pid})" if tp > 1 else f"engine pid {pid}"
            limit = timeout if self.ready and count is not None else max(timeout, STARTUP_SILENCE_S)
            if timeout > 0 and now - seen[2] > limit:
                return self._engine_unresponsive(f"{who} sent no heartbeat for {now - seen[2]:.1f} s")
            if 0 < step_timeout < step_s:
                return self._engine_unresponsive(
                    f"{who} has been in one step for {step_s:.1f} s (--engine-step-timeout {step_timeout:g})")

    def _check_forkserver(self, now: float) -> None:
        """No rank of the current generation forked yet: bounded by FORK_TIMEOUT_S once the forkserver
        is up (a zygote is), by PRELOAD_TIMEOUT_S before."""
        up = self._server_up_at is not None or self.launcher.zygote_pid is not None
        limit = FORK_TIMEOUT_S if up else PRELOAD_TIMEOUT_S
        if now - max(self._asked_at, self._server_up_at or 0.0) <= limit or not self.launcher.use_forkserver:
            return
        self._asked_at = now  # one replacement per limit
        did = "forked no engine" if up else "did not finish its preload"
        self.launcher.abandon_server(f"{did} within {limit:.0f} s")
        self.on_launcher_event()  # ForkserverExited: the forkserver-death path

    def _engine_unresponsive(self, what: str) -> None:
        """A rank is silent or stuck: SIGKILL every rank (a stopped process dies too), then the death path."""
        self.launcher.kill_engine()
        self._engine_died(what, forkserver_dead=False, killed=True)

    # --- what the launcher reports ----------------------------------------------------------
    def on_launcher_event(self) -> None:
        events = self.launcher.poll_events()
        # a group's death is told by its cause: ranks that followed another rank out come last
        events.sort(key=lambda ev: isinstance(ev, EngineExited) and ev.code == RANK_LEFT)
        for ev in events:
            if isinstance(ev, ServerInfo):
                self._server_up_at = time.monotonic()
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

    def _engine_died(self, what: str, forkserver_dead: bool, killed: bool = False) -> None:
        """WHAT ended the engine (KILLED: the supervisor killed it, see check_liveness): report and fail its
        requests, then replace it, back off (a crash loop), or give up (no restart)."""
        if self.fatal or self._retry is not None:  # backing off: its exit was counted already
            return
        was_ready, self.ready = self.ready, False
        if (forkserver_dead and self.launcher.last_lost == "zygote" and not was_ready
                and self._died_at is None):  # still starting: carry on without the zygote
            log.warning("hotstart: %s during startup; starting a local forkserver", what)
            self.timeline.mark("zygote lost", "api", what)
            return self._replace(forkserver_dead=True)
        # died during startup: a replacement would only die the same way
        restart = self.auto_restart and (was_ready or self._died_at is not None)
        now = time.monotonic()
        report = self.crashes.record(what, self.transport.in_flight(), now)
        loop = restart and self.crashes.crash_loop()
        outcome = (": killed, restarting" if restart and not loop else ": killed") if killed else ""
        log.error("hotstart: %s%s", what, outcome)
        log.error(report)
        self.transport.fail_requests(what)
        if not restart:
            return self._fail_unless_told_why(what, wait=not killed)
        self._died_at = self._died_at or time.time()
        self.restarts += 1
        if self.on_replace is not None:
            self.on_replace()
        if loop:
            return self._back_off(what, forkserver_dead, killed, now)
        self.status = "restarting"
        self._replace(forkserver_dead, killed)

    def _back_off(self, what: str, forkserver_dead: bool, killed: bool, now: float) -> None:
        """A crash loop: the dead engine's sockets and stragglers go now, the next engine after a delay."""
        delay = self.crashes.backoff(now)
        self.status = (f"backoff: a crash loop ({self.crashes.deaths} engine deaths, the last: {what}); "
                       f"the engine starts again in {delay:.0f} s")
        log.error("hotstart: engine crash loop: backing off, the engine starts again in %.0f s (requests get "
                  "503 with Retry-After meanwhile)", delay)
        self.transport.unbind()
        if self.cfg.tensor_parallel_size > 1 or killed:
            self.launcher.stop_engine()

        def retry() -> None:
            self._retry = None
            self.crashes.backoff_until = None
            if self.closing or self.fatal:
                return
            self.status = "restarting"
            log.info("hotstart: backoff over: starting the engine again")
            self._replace(forkserver_dead, killed=False, unbound=True)

        try:
            self._retry = asyncio.get_running_loop().call_later(delay, retry)
        except RuntimeError:  # no event loop (a caller outside the server): nothing to wait on
            retry()

    def _replace(self, forkserver_dead: bool, killed: bool = False, unbound: bool = False) -> None:
        """A new engine generation (and a fresh forkserver if it died), on new sockets."""
        if not unbound:
            self.transport.unbind()
        if forkserver_dead and self.launcher.use_forkserver:
            self._unwatch_launcher()
            self._server_up_at = None
            self.launcher.restart_server()
            self._watch_launcher()
        elif self.cfg.tensor_parallel_size > 1 or killed:
            self.launcher.stop_engine()  # the dead generation's ranks still alive, or unreaped
        heartbeat.remove(self.launcher.addresses().requests, self.cfg.tensor_parallel_size)
        self.spawn(new_generation=True)
        self.transport.bind()

    def _fail_unless_told_why(self, what: str, wait: bool) -> None:
        """Fail with WHAT (an exit code), unless the engine's own reason arrives within the grace."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if not wait or loop is None:
            return self.fail(what)
        loop.call_later(EXIT_REASON_GRACE_S, self._fail_if_still_running, what)

    def _fail_if_still_running(self, what: str) -> None:
        if self.fatal is None and not self.closing:
            self.fail(what)

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
        self.crashes.ready(time.monotonic())
        if self._died_at is not None:
            took = time.time() - self._died_at
            self.recovery_seconds.append(took)
            self._died_at = None
            log.info("hotstart: engine replaced in %.2f s", took)
            return
        self.timeline.mark("engine ready", "engine")
        if self.on_ready is not None:
            self.on_ready()

    def engine_failed(self, message: str) -> None:
        """The engine could not start (EngineFailed). A replacement's failure is a death like the others
        (the server backs off if it repeats); the first engine's ends the server."""
        if self._died_at is not None and self.auto_restart and not self.closing:
            return self._engine_died(message, forkserver_dead=False)
        self.fail(message)

    def engine_broken(self, why: str) -> None:
        """The engine sent something undecodable: replace it rather than guess."""
        log.error("hotstart: undecodable message from the engine (%s); replacing the engine", why)
        self.launcher.kill_engine()
