"""The API process's handle on the engine process: requests out, token outputs back (zmq over ipc).

Each server instance uses its own private socket folder (no fixed ports or names). The engine may
be forked before the event loop runs; its messages wait in zmq until the client binds. When the
engine process dies, every in-flight request fails at once, /health turns 503, and a new engine is
forked from the warm forkserver (new socket names, so nothing stale reaches it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from hotstart.boot.prespawn import EngineLauncher
from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig
from hotstart.messages import (
    AbortRequest, EngineFailed, EngineReady, EngineRequest, EngineStats, Phase, SamplingParams,
    Shutdown, StepOutputs, TokenOutput, encoder, from_engine_decoder,
)

log = logging.getLogger("hotstart")


class EngineDeadError(Exception):
    """The engine process died while a request was in flight."""


class EngineClient:
    def __init__(self, launcher: EngineLauncher, cfg: EngineConfig, timeline: Timeline,
                 auto_restart: bool = True):
        self.launcher, self.cfg, self.timeline = launcher, cfg, timeline
        self.auto_restart = auto_restart
        self.phase = "starting"
        self.ready = False
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.fatal: str | None = None
        self.restarts = 0
        self.recovery_seconds: list[float] = []  # engine death -> replacement ready, per restart
        self._died_at: float | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.on_ready: Callable[[], None] | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._push = self._pull = None
        self._reader_task: asyncio.Task | None = None
        self._closing = False

    # --- lifecycle --------------------------------------------------------------------------
    def spawn(self, new_generation: bool = False) -> None:
        """Ask for the engine process now (sync; callable before the event loop exists)."""
        self.launcher.spawn(self.cfg, new_generation)

    async def start(self) -> None:
        """Bind the sockets and start listening (inside the event loop)."""
        self._ctx = zmq.asyncio.Context()
        self._bind()
        fd = self.launcher.fileno()
        if fd is not None:
            asyncio.get_running_loop().add_reader(fd, self._on_launcher_event)
        else:
            self._watch_task = asyncio.ensure_future(self._watch_direct())
        self._on_launcher_event()

    def _bind(self) -> None:
        in_addr, out_addr = self.launcher.addresses()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(out_addr)
        self._reader_task = asyncio.ensure_future(self._read_outputs(self._pull))

    async def _watch_direct(self) -> None:
        while not self._closing:
            self._on_launcher_event()
            await asyncio.sleep(0.1)

    def _on_launcher_event(self) -> None:
        for ev in self.launcher.poll_events():
            kind = ev.get("event")
            if kind == "preloaded":
                self.timeline.add("forkserver up (torch + engine imported)", ev["start"], ev["end"], "forkserver")
            elif kind == "spawned":
                self.timeline.add("engine forked", ev["start"], ev["time"], "forkserver", f"pid {ev['pid']}")
            elif kind in ("exited", "server-exited") and not self._closing:
                if kind == "server-exited" or ev.get("pid") == self.launcher.engine_pid or self.launcher.engine_pid is None:
                    self._engine_died(ev)

    def _engine_died(self, ev: dict) -> None:
        if self.fatal:
            return
        was_ready = self.ready
        self.ready = False
        code = ev.get("code")
        what = f"engine process exited (code {code})" if kind_is_exit(ev) else "forkserver exited"
        log.error("hotstart: %s", what)
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(what))
        self._queues.clear()
        can_restart = self.auto_restart and was_ready and self.launcher.use_forkserver and ev.get("event") == "exited"
        if can_restart:
            self._died_at = time.time()
            self.restarts += 1
            self.phase = "restarting"
            self._rebind_and_respawn()
        else:
            self._fail(what if not self.fatal else self.fatal)

    def _rebind_and_respawn(self) -> None:
        for s in (self._push, self._pull):
            s.close(linger=0)
        if self._reader_task is not None:
            self._reader_task.cancel()
        self.spawn(new_generation=True)
        self._bind()

    def _fail(self, message: str) -> None:
        self.fatal = message
        self.phase = f"failed: {message}"
        self.ready = False
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(message))
        self._queues.clear()
        if self.on_fatal is not None:
            self.on_fatal(message)

    async def _read_outputs(self, sock) -> None:
        while True:
            try:
                raw = await sock.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            msg = from_engine_decoder.decode(raw)
            if isinstance(msg, StepOutputs):
                self.stats = msg.stats
                for out in msg.outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, Phase):
                if self._died_at is None:  # a replacement engine's phases are not part of startup
                    self.timeline.add(msg.name, msg.start, msg.end, msg.process, msg.detail)
                self.phase = msg.name
            elif isinstance(msg, EngineReady):
                self.info = msg
                self.ready = True
                self.phase = "ready"
                if self._died_at is not None:
                    took = time.time() - self._died_at
                    self.recovery_seconds.append(took)
                    self._died_at = None
                    log.info("hotstart: engine replaced in %.2f s (forked from the warm forkserver)", took)
                    continue
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
        fd = self.launcher.fileno()
        if fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(fd)
            except (ValueError, OSError):
                pass
        for rid, q in list(self._queues.items()):
            q.put_nowait(TokenOutput(rid, [], "abort"))
        if self._push is not None:
            try:
                await asyncio.wait_for(self._push.send(encoder.encode(Shutdown())), 0.2)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
        if self._reader_task is not None:
            self._reader_task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.launcher.shutdown, timeout)
        for s in (self._push, self._pull):
            if s is not None:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # --- requests ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenOutput]:
        """Yield TokenOutputs (token deltas) until one carries finish_reason. Closing the iterator
        early aborts the request in the engine (its KV blocks are freed)."""
        if not self.ready:
            raise EngineDeadError(self.fatal or f"engine not ready ({self.phase})")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        finished = False
        try:
            await self._push.send(encoder.encode(EngineRequest(request_id, list(prompt_token_ids), params)))
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.ready:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        if self._push is not None and not self._closing:
            try:
                await self._push.send(encoder.encode(AbortRequest([request_id])))
            except zmq.ZMQError:
                pass


def kind_is_exit(ev: dict) -> bool:
    return ev.get("event") == "exited"

