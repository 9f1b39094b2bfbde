"""The API process's handle on the engine process: requests out, token outputs back (zmq over ipc).

Each server instance uses its own private socket folder (no fixed ports or names). The engine may
be forked before the event loop runs; its messages wait in zmq until the client binds. When the
engine dies, every in-flight request fails at once, /health turns 503, and a new engine is forked
from the warm forkserver (new socket names, so nothing stale reaches it). When the forkserver itself
dies (an OOM kill of the process tree), a fresh forkserver is started and the engine with it; the
socket stays bound and clients see 503 until it is ready. Deaths in a tight loop end the server.
An engine forked by a zygote reports the same events; a zygote that dies (or does not fork) before the
first READY is replaced by a local forkserver as if there had been none, whatever --no-restart says.
With tensor parallelism the engine is a group of ranks (the API process talks to rank 0): the death of
any rank of the current generation is the engine's death; the rest of the group is stopped and all
ranks are forked again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig
from hotstart.forkserver.client import EngineLauncher
from hotstart.messages import (
    RANK_LEFT,
    AbortRequest,
    EngineExited,
    EngineFailed,
    EngineReady,
    EngineRequest,
    EngineSpawned,
    EngineStats,
    FastPathStatus,
    ForkserverExited,
    SamplingParams,
    ServerInfo,
    Shutdown,
    Span,
    StepOutputs,
    TokenOutput,
    encoder,
    from_engine_decoder,
)

log = logging.getLogger("hotstart")
DIRECT_POLL_S = 0.1  # exit check of a directly spawned engine (no forkserver socket to watch)
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 5  # more deaths than this within the window: give up (a crash loop)
ZYGOTE_FORK_TIMEOUT_S = 10.0  # a zygote forks in ms; one that has not forked by then is abandoned


class EngineDeadError(Exception):
    """The engine process died while a request was in flight."""


class EngineClient:
    def __init__(self, launcher: EngineLauncher, cfg: EngineConfig, timeline: Timeline,
                 auto_restart: bool = True):
        self.launcher, self.cfg, self.timeline = launcher, cfg, timeline
        self.auto_restart = auto_restart
        self.status = "starting"  # "starting", an engine startup phase, "ready", "restarting", "failed: ..."
        self.ready = False
        self.info: EngineReady | None = None
        self.server_info: ServerInfo | None = None
        self.stats = EngineStats()
        self.fast_path: FastPathStatus | None = None  # what is built behind READY (engine/fastpath.py)
        self.fatal: str | None = None
        self.restarts = 0
        self.recovery_seconds: list[float] = []  # death -> replacement ready, per restart
        self.on_fatal: Callable[[str], None] | None = None
        self.on_ready: Callable[[], None] | None = None
        self._died_at: float | None = None
        self._deaths: list[float] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._push = self._pull = None
        self._reader_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._reader_fd: int | None = None
        self._closing = False

    # --- lifecycle --------------------------------------------------------------------------
    def spawn(self, new_generation: bool = False) -> None:
        """Ask for the engine process now (sync; callable before the event loop exists)."""
        self.launcher.spawn(self.cfg, new_generation, world_size=self.cfg.tensor_parallel_size)

    async def start(self) -> None:
        """Bind the sockets and start listening (inside the event loop)."""
        self._ctx = zmq.asyncio.Context()
        self._bind()
        self._watch_launcher()
        self._on_launcher_event()
        if self.launcher.zygote_pid is not None:
            asyncio.get_running_loop().call_later(ZYGOTE_FORK_TIMEOUT_S, self._check_zygote_forked)

    def _check_zygote_forked(self) -> None:
        if (self.launcher.zygote_pid is not None and not self.launcher.engine_pids and not self._closing
                and not self.fatal):
            self.launcher.abandon_zygote(f"forked no engine within {ZYGOTE_FORK_TIMEOUT_S:.0f} s")
            self._on_launcher_event()

    def _watch_launcher(self) -> None:
        fd = self.launcher.fileno()
        if fd is not None:
            self._reader_fd = fd
            asyncio.get_running_loop().add_reader(fd, self._on_launcher_event)
        elif self._watch_task is None:
            self._watch_task = asyncio.ensure_future(self._watch_direct())

    def _unwatch_launcher(self) -> None:
        if self._reader_fd is not None:
            asyncio.get_running_loop().remove_reader(self._reader_fd)  # tolerates an fd closed already
            self._reader_fd = None

    def _bind(self) -> None:
        addresses = self.launcher.addresses()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(addresses.requests)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(addresses.outputs)
        self._reader_task = asyncio.ensure_future(self._read_outputs(self._pull))

    async def _watch_direct(self) -> None:
        while not self._closing:
            self._on_launcher_event()
            await asyncio.sleep(DIRECT_POLL_S)

    def _on_launcher_event(self) -> None:
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
            elif self._closing:
                continue
            elif isinstance(ev, EngineExited) and ev.generation == self.launcher.generation:
                # any rank: a group without one of its ranks cannot run (the other exits of the group in
                # this batch are of a generation replaced meanwhile)
                tp = self.cfg.tensor_parallel_size
                what = f"engine rank {ev.rank} of {tp} exited" if tp > 1 else "engine process exited"
                self._engine_died(f"{what} (code {ev.code})", forkserver_dead=False)
            elif isinstance(ev, ForkserverExited):
                code = "" if ev.code is None else f" (code {ev.code})"
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
        self._fail_requests(what)
        now = time.time()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        if not (self.auto_restart and (was_ready or self._died_at is not None)):
            return self._fail(what)  # died during startup: a replacement would only die the same way
        if len(self._deaths) > MAX_RESTARTS_IN_WINDOW:
            return self._fail(
                f"{what}; {len(self._deaths)} engine deaths within {RESTART_WINDOW_S:.0f} s, giving up"
            )
        self._died_at = self._died_at or now
        self.restarts += 1
        self.status = "restarting"
        self.fast_path = None  # the replacement builds its own
        self._replace(forkserver_dead)

    def _replace(self, forkserver_dead: bool) -> None:
        """A new engine generation (and a fresh forkserver if it died), on new sockets."""
        for s in (self._push, self._pull):
            s.close(linger=0)
        if self._reader_task is not None:
            self._reader_task.cancel()
        if forkserver_dead and self.launcher.use_forkserver:
            self._unwatch_launcher()
            self.launcher.restart_server()
            self._watch_launcher()
        elif self.cfg.tensor_parallel_size > 1:
            self.launcher.stop_engine()  # the ranks still alive of the dead generation
        self.spawn(new_generation=True)
        self._bind()

    def _fail_requests(self, message: str) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(message))
        self._queues.clear()

    def _fail(self, message: str) -> None:
        self.fatal = message
        self.status = f"failed: {message}"
        self.ready = False
        self._fail_requests(message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    async def _read_outputs(self, sock) -> None:
        while True:
            try:
                raw = await sock.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                self._dispatch(from_engine_decoder.decode(raw))
            except msgspec.DecodeError as e:  # a broken engine: replace it rather than guess
                log.error("hotstart: undecodable message from the engine (%s); replacing the engine", e)
                self.launcher.kill_engine()
                return
            except Exception as e:  # noqa: BLE001 - one bad message must not stop every stream
                log.error("hotstart: error handling an engine message: %s: %s", type(e).__name__, e)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            self.stats = msg.stats
            for out in msg.outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
        elif isinstance(msg, Span):
            if self._died_at is None:  # a replacement engine's phases are not part of startup
                self.timeline.record(msg)
            if not self.ready:  # after READY, spans are the fast path being built behind
                self.status = msg.name
        elif isinstance(msg, FastPathStatus):
            self.fast_path = msg
        elif isinstance(msg, EngineReady):
            self.info, self.ready, self.status = msg, True, "ready"
            if self._died_at is not None:
                took = time.time() - self._died_at
                self.recovery_seconds.append(took)
                self._died_at = None
                log.info("hotstart: engine replaced in %.2f s", took)
                return
            self.timeline.mark("engine ready", "engine")
            if self.on_ready is not None:
                self.on_ready()
        elif isinstance(msg, EngineFailed):
            self._fail(msg.message)

    def begin_shutdown(self) -> None:
        """The server is stopping: engine or forkserver exits from now on are expected, not failures."""
        self._closing = True

    async def close(self, timeout: float = 3.0) -> None:
        """Stop the engine (Shutdown message, then the launcher's bounded stop) and free sockets."""
        self._closing = True
        self._unwatch_launcher()
        for rid, q in list(self._queues.items()):
            q.put_nowait(TokenOutput(rid, [], "abort"))
        if self._push is not None:
            try:
                await asyncio.wait_for(self._push.send(encoder.encode(Shutdown())), 0.2)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
        for task in (self._reader_task, self._watch_task):
            if task is not None:
                task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.launcher.shutdown, timeout)
        for s in (self._push, self._pull):
            if s is not None:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # --- requests ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenOutput]:
        """Yield TokenOutputs (token deltas, each naming its choice) until every choice has carried a
        finish_reason, or one output says "error" / "abort". Closing the iterator early aborts the request
        in the engine (its KV blocks are freed)."""
        if not self.ready:
            raise EngineDeadError(self.fatal or f"engine not ready ({self.status})")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        finished = False
        open_choices = set(range(params.n))
        try:
            await self._push.send(encoder.encode(EngineRequest(request_id, list(prompt_token_ids), params)))
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                if out.finish_reason is not None:
                    open_choices.discard(out.index)
                finished = not open_choices or out.finish_reason in ("error", "abort")
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.ready:
                await self.abort(request_id)

    async def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort REQUEST_ID in the engine (only its choice INDEX if given; that one reports nothing more)."""
        if index is None:
            self._queues.pop(request_id, None)
        if self._push is not None and not self._closing:
            try:
                await self._push.send(encoder.encode(AbortRequest([request_id], index)))
            except zmq.ZMQError:
                pass

    async def abort_choice(self, request_id: str, index: int) -> None:
        await self.abort(request_id, index)
