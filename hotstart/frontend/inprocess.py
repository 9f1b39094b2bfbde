"""The EngineClient of an EngineCore in this process (frontend/client.py's protocol): `hotstart generate`,
offline Python use, and tests that drive the real engine without a process.

One stepping thread owns the core: requests and aborts reach it through an inbox it drains between
steps, so every request in flight is batched into the same steps (continuous batching), and the event
loop never waits on a forward pass. Its outputs go back to each request's own event loop (a request
may come from any loop: a test client runs one per request). The core is built, and torch imported, on
the caller's thread before the stepping thread starts: threads never import (the grammar library, which
the core loads on the first constrained request, is imported by generate() for that reason).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from hotstart.boot.timeline import Timeline
from hotstart.frontend.client import EngineDeadError, RequestOutputs
from hotstart.messages import EngineReady, EngineRequest, TokenOutput
from hotstart.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hotstart.config import EngineConfig
    from hotstart.engine.core import EngineCore
    from hotstart.messages import FastPathStatus


class InProcessEngineClient:
    """EngineClient over CORE, stepped by a thread of its own from start() to close()."""

    def __init__(self, core: EngineCore, timeline: Timeline) -> None:
        self.core, self.timeline = core, timeline
        self.ready, self.status, self.fatal = False, "starting", None
        self.fast_path: FastPathStatus | None = None  # the eager path only: nothing is built behind
        self.retry_after: float | None = None  # never backs off: this process is the engine
        self.info = EngineReady(os.getpid(), str(core.placement.device),
                                str(core.placement.dtype).removeprefix("torch."), core.max_model_len,
                                core.cfg.block_size, core.blocks.num_blocks, core.cfg.max_num_seqs)
        self.stats = core.stats()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    @classmethod
    def build(cls, cfg: EngineConfig, timeline: Timeline) -> InProcessEngineClient:
        """Build the core of CFG here (imports torch, loads the weights; phases on TIMELINE)."""
        from hotstart.engine.core import EngineCore  # noqa: PLC0415 - imports torch

        return cls(EngineCore.build(cfg, on_span=timeline.record), timeline)

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self.start_stepping()

    def start_stepping(self) -> None:
        """Start the stepping thread (sync: callable outside an event loop too)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hotstart-engine-step", daemon=True)
        self._thread.start()
        self.ready, self.status = True, "ready"
        self.timeline.mark("engine ready", "engine")

    def begin_shutdown(self) -> None:
        self._closing = True

    async def close(self, timeout: float = 3.0) -> None:
        self.stop(timeout)

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the stepping thread; requests in flight end with "abort" and leave the core (it can be
        served again by another client)."""
        self.ready, self.status = False, "stopped"
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for rid in list(self._streams):
            self._deliver(TokenOutput(rid, [], "abort"))
        self._streams.clear()
        if self._thread is None or not self._thread.is_alive():  # else the core is still the thread's
            self.core.abort(list(self.core.requests))
            if self.core.store is not None:  # the prefix cache on disk: what it has not written yet
                self.core.store.sync()

    # --- the stepping thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._closing or self.core.has_work()):
                    self._wake.wait()
                if self._closing:
                    return
                inbox, self._inbox = self._inbox, []
            try:
                for kind, arg in inbox:
                    if kind == "add":
                        error = self.core.add_request(arg)
                        if error is not None:
                            self._deliver(error)
                    else:
                        for out in self.core.abort(*arg):
                            self._deliver(out)
                if self.core.has_work():
                    for out in self.step():
                        self._deliver(out)
            except Exception as e:  # noqa: BLE001 - a broken engine fails its requests, not the thread silently
                self._die(f"engine step failed: {type(e).__name__}: {e}")
                return

    def step(self) -> list[TokenOutput]:
        """One engine step (on the stepping thread)."""
        outputs = self.core.step()
        self.stats = self.core.stats()
        return outputs

    def _deliver(self, item: TokenOutput | Exception, request_id: str | None = None) -> None:
        stream = self._streams.get(request_id or item.request_id)
        if stream is None:
            return
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # that request's loop is closed: nobody is listening
            pass

    def _die(self, message: str) -> None:
        """The engine is gone: every request in flight fails with MESSAGE, and no new one is taken."""
        self.fatal, self.ready, self.status = message, False, f"failed: {message}"
        for rid in list(self._streams):
            self._deliver(EngineDeadError(message), rid)

    def _send(self, kind: str, arg: Any) -> None:
        with self._wake:
            self._inbox.append((kind, arg))
            self._wake.notify()

    # --- requests ---------------------------------------------------------------------------
    def refusal(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Nothing is refused before the engine: an engine death here is this process's."""
        return None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenOutput]:
        if not self.ready:
            raise EngineDeadError(self.fatal or f"engine not ready ({self.status})")
        if params.grammar is not None:
            import llguidance  # noqa: F401, PLC0415 - loaded here: the stepping thread must not import
        stream = RequestOutputs(params.n)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        try:
            self._send("add", EngineRequest(request_id, list(prompt_token_ids), params))
            async for out in stream:
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished and self.ready:
                await self.abort(request_id)

    async def abort(self, request_id: str, index: int | None = None) -> None:
        if index is None:
            self._streams.pop(request_id, None)
        if not self._closing:
            self._send("abort", ([request_id], index))
