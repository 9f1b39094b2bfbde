"""The API process's transport to an engine process: requests out, token outputs back (zmq over ipc);
the process implementation of frontend/client.py's EngineClient.

Each server instance uses its own private socket folder (no fixed ports or names). The engine may
be forked before the event loop runs; its messages wait in zmq until the client binds. What a death
means (fail the requests, restart, fall back from a zygote, give up) is the EngineSupervisor's
(frontend/supervisor.py): it asks this transport to fail its requests and to bind the sockets of the
replacement engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig
from hotstart.errors import RequestError
from hotstart.forkserver.client import EngineLauncher
from hotstart.frontend.client import EngineDeadError, RequestOutputs
from hotstart.frontend.supervisor import EngineSupervisor
from hotstart.messages import (
    AbortRequest,
    EngineFailed,
    EngineReady,
    EngineRequest,
    EngineStats,
    FastPathStatus,
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
__all__ = ["EngineDeadError", "ProcessEngineClient"]


class ProcessEngineClient:
    """EngineClient of an engine process the LAUNCHER starts; SUPERVISOR (built here) keeps it alive."""

    def __init__(self, launcher: EngineLauncher, cfg: EngineConfig, timeline: Timeline,
                 auto_restart: bool = True):
        self.launcher, self.cfg, self.timeline = launcher, cfg, timeline
        self.supervisor = EngineSupervisor(launcher, cfg, timeline, self, auto_restart)
        self.supervisor.on_replace = self._on_replace
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.fast_path: FastPathStatus | None = None  # what is built behind READY (engine/fastpath.py)
        self._queues: dict[str, asyncio.Queue] = {}
        self._requests: dict[str, tuple[list[int], SamplingParams]] = {}  # in flight: what a death reports
        self._ctx: zmq.asyncio.Context | None = None
        self._push = self._pull = None
        self._reader_task: asyncio.Task | None = None

    # the supervisor's state, as the protocol names it
    @property
    def ready(self) -> bool:
        return self.supervisor.ready

    @property
    def status(self) -> str:
        return self.supervisor.status

    @property
    def fatal(self) -> str | None:
        return self.supervisor.fatal

    @property
    def server_info(self) -> ServerInfo | None:
        return self.supervisor.server_info

    @property
    def retry_after(self) -> float | None:
        return self.supervisor.retry_after

    def refusal(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestError | None:
        return self.supervisor.crashes.refusal(prompt_token_ids, params)

    @property
    def on_fatal(self) -> Callable[[str], None] | None:
        return self.supervisor.on_fatal

    @on_fatal.setter
    def on_fatal(self, hook: Callable[[str], None] | None) -> None:
        self.supervisor.on_fatal = hook

    @property
    def on_ready(self) -> Callable[[], None] | None:
        return self.supervisor.on_ready

    @on_ready.setter
    def on_ready(self, hook: Callable[[], None] | None) -> None:
        self.supervisor.on_ready = hook

    # --- lifecycle --------------------------------------------------------------------------
    def spawn(self) -> None:
        """Ask for the engine process now (sync; callable before the event loop exists)."""
        self.supervisor.spawn()

    async def start(self) -> None:
        """Bind the sockets and start listening (inside the event loop)."""
        self._ctx = zmq.asyncio.Context()
        self.bind()
        self.supervisor.start()

    def bind(self) -> None:
        addresses = self.launcher.addresses()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(addresses.requests)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(addresses.outputs)
        self._reader_task = asyncio.ensure_future(self._read_outputs(self._pull))

    def unbind(self) -> None:
        for s in (self._push, self._pull):
            s.close(linger=0)
        if self._reader_task is not None:
            self._reader_task.cancel()

    def _on_replace(self) -> None:
        self.fast_path = None  # the replacement builds its own

    def in_flight(self) -> dict[str, tuple[list[int], SamplingParams]]:
        return dict(self._requests)

    def fail_requests(self, message: str) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(message))
        self._queues.clear()
        self._requests.clear()

    async def _read_outputs(self, sock) -> None:
        while True:
            try:
                raw = await sock.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                self._dispatch(from_engine_decoder.decode(raw))
            except msgspec.DecodeError as e:
                self.supervisor.engine_broken(str(e))
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
            self.supervisor.engine_span(msg)
        elif isinstance(msg, FastPathStatus):
            self.fast_path = msg
        elif isinstance(msg, EngineReady):
            self.info = msg
            self.supervisor.engine_ready()
        elif isinstance(msg, EngineFailed):
            self.supervisor.engine_failed(msg.message)

    def begin_shutdown(self) -> None:
        """The server is stopping: engine or forkserver exits from now on are expected, not failures."""
        self.supervisor.closing = True

    async def close(self, timeout: float = 3.0) -> None:
        """Stop the engine (Shutdown message, then the launcher's bounded stop) and free sockets."""
        self.supervisor.stop()
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
        """See EngineClient.generate (frontend/client.py); closing early frees the request's KV blocks."""
        if not self.ready:
            raise EngineDeadError(self.fatal or f"engine not ready ({self.status})")
        if (refused := self.refusal(prompt_token_ids, params)) is not None:  # the HTTP layer asked first
            raise EngineDeadError(refused.message)
        stream = RequestOutputs(params.n)
        self._queues[request_id] = stream.queue
        self._requests[request_id] = (prompt_token_ids, params)
        try:
            await self._push.send(encoder.encode(EngineRequest(request_id, list(prompt_token_ids), params)))
            async for out in stream:
                yield out
        finally:
            self._queues.pop(request_id, None)
            self._requests.pop(request_id, None)
            if not stream.finished and self.ready:
                await self.abort(request_id)

    async def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort REQUEST_ID in the engine (only its choice INDEX if given; that one reports nothing more)."""
        if index is None:
            self._queues.pop(request_id, None)
        if self._push is not None and not self.supervisor.closing:
            try:
                await self._push.send(encoder.encode(AbortRequest([request_id], index)))
            except zmq.ZMQError:
                pass
