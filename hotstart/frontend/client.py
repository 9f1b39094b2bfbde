"""What the HTTP layer and the offline entry points hold of an engine: the EngineClient protocol and the
types its implementations share (torch-free, zmq-free). The factory that picks an implementation, and
imports it only when it is chosen, is frontend/start.py's make_engine_client:

  in-process  frontend/inprocess.py InProcessEngineClient: an EngineCore built in this process and stepped
              by one thread (continuous batching of concurrent requests); `hotstart generate`, offline
              Python use, fast tests
  process     frontend/engine_client.py ProcessEngineClient: zmq to an engine process started by the
              launcher (forkserver, zygote or a fresh interpreter), supervised by frontend/supervisor.py
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from hotstart.boot.timeline import Timeline

if TYPE_CHECKING:
    from hotstart.errors import RequestError
    from hotstart.messages import EngineReady, EngineStats, FastPathStatus, TokenOutput
    from hotstart.sampling_params import SamplingParams


class RequestOutputs:
    """One request's outputs as its transport queues them (`queue`): TokenOutputs, or an exception to
    raise, until every one of its N choices carried a finish_reason or an output says "error" / "abort".
    `finished` tells the caller whether the engine still holds the request (else it must abort it)."""

    def __init__(self, n: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._open = set(range(n))

    async def __aiter__(self) -> AsyncIterator[TokenOutput]:
        while not self.finished:
            out = await self.queue.get()
            if isinstance(out, Exception):
                self.finished = True
                raise out
            if out.finish_reason is not None:
                self._open.discard(out.index)
            self.finished = not self._open or out.finish_reason in ("error", "abort")
            yield out

class EngineDeadError(Exception):
    """The engine died (or stopped) while a request was in flight."""


class EngineClient(Protocol):
    """A handle on one engine: requests in, TokenOutputs back, and what /health, /metrics and /startup
    report. Attributes are read at any time on the event loop's thread."""

    ready: bool
    """Requests are accepted (generate raises EngineDeadError otherwise)."""
    status: str
    """"starting", an engine startup phase, "ready", "restarting" or "failed: ..."."""
    fatal: str | None
    """Why the engine is gone for good, or None."""
    info: EngineReady | None
    """The engine's facts (max_model_len, max_num_seqs, ...), once ready."""
    stats: EngineStats
    """Scheduler and KV-cache counts as of the last step."""
    fast_path: FastPathStatus | None
    """What is built behind READY (engine process only; None in process)."""
    timeline: Timeline
    """Startup phases, and the marks the HTTP layer adds."""
    retry_after: float | None
    """Seconds until the engine starts again while the server backs off from a crash loop, else None."""

    def refusal(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestError | None:
        """The error a request is refused with before it reaches the engine (a poison request: in flight
        at two engine deaths in a row, frontend/crashes.py), else None."""

    async def start(self) -> None:
        """Begin serving (inside the event loop)."""

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenOutput]:
        """TokenOutputs (token deltas, each naming its choice) until every choice has carried a
        finish_reason, or one output says "error" / "abort". Raises EngineDeadError if the engine is not
        ready or dies meanwhile. Closing the iterator early aborts the request in the engine."""

    async def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort REQUEST_ID in the engine; with INDEX only that choice (it reports nothing more: the
        API process ended it, e.g. with a stop string)."""

    def begin_shutdown(self) -> None:
        """Stopping: engine exits from now on are expected, not failures."""

    async def close(self, timeout: float = 3.0) -> None:
        """Stop the engine; requests in flight end with an "abort" output."""
