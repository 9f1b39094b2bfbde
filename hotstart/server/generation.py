"""One request's generation as text: engine ids -> detokenized deltas -> stop strings -> SSE (torch-free).

The engine knows token ids only; stop strings are applied here, on the text. A stop string ends the
request (its text and everything after it are dropped, finish_reason "stop") and closes the engine's
iterator, which aborts the request in the engine so it stops spending steps on it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.responses import StreamingResponse

from hotstart.server.errors import error_body
from hotstart.text.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from hotstart.messages import SamplingParams
    from hotstart.server.metrics import Metrics

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


class GenerationError(Exception):
    """The engine finished the request with finish_reason "error"."""


class StopStringFilter:
    """Cuts text at the first stop string; never releases text that may still become one.

    feed() returns what is safe to send: everything except the longest suffix that is a prefix of
    some stop string (held back until later text proves it is not one, or finish()).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        if not self.stops:
            self.text += delta
            self.sent = len(self.text)
            return delta
        # a stop string completed by DELTA starts at most longest-1 chars before it
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        hold = 0
        for k in range(min(self.longest - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        return self._release(len(self.text) - hold)

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


class Generation:
    """Runs one request in the engine; `deltas()` yields its text, then finish_reason / counts are set."""

    def __init__(self, engine: Any, tokenizer: Any, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, stops: list[str], metrics: Metrics, t_arrival: float,
                 on_finish: Callable[[str], None] | None = None) -> None:
        self.engine, self.request_id, self.prompt_ids, self.params = engine, request_id, prompt_ids, params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, prompt_ids=prompt_ids)
        self.filter = StopStringFilter(stops)
        # a user stop token ends the text without appearing in it (eos is special: decode skips it)
        self.stop_ids = set(params.stop_token_ids)
        self.metrics, self.t_arrival, self.on_finish = metrics, t_arrival, on_finish
        self.finish_reason: str | None = None
        self.completion_tokens = 0

    @property
    def text(self) -> str:
        return self.filter.text

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas (never empty). Raises EngineDeadError or GenerationError on failure."""
        agen = self.engine.generate(self.request_id, self.prompt_ids, self.params)
        try:
            async for out in agen:
                ids = out.new_token_ids
                if ids:
                    if self.completion_tokens == 0:
                        self.metrics.ttft.observe(time.perf_counter() - self.t_arrival)
                    self.completion_tokens += len(ids)
                    self.metrics.generation_tokens.inc(len(ids))
                reason = out.finish_reason
                if reason == "error":
                    raise GenerationError(out.error or "the engine could not run this request")
                if reason == "stop" and ids and ids[-1] in self.stop_ids:
                    ids = ids[:-1]
                delta = self.detok.add(ids) if ids else ""
                if reason is not None:
                    delta += self.detok.flush()
                piece = self.filter.feed(delta)
                if self.filter.stopped:
                    reason = "stop"
                elif reason is not None:
                    piece += self.filter.finish()
                if piece:
                    yield piece
                if reason is not None:
                    self._finish(reason)
                    return
            raise GenerationError("the engine ended the request without a finish reason")
        finally:
            # Shielded: when the client disconnects this runs inside a cancelled scope, and the
            # abort must still reach the engine so the request's KV blocks are freed
            await close_shielded(agen)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.e2e.observe(time.perf_counter() - self.t_arrival)
        self.metrics.finished.labels(reason).inc()
        if self.on_finish is not None:
            self.on_finish(reason)

    def usage(self) -> dict[str, int]:
        n, m = len(self.prompt_ids), self.completion_tokens
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


async def close_shielded(it: Any) -> None:
    """Close an async iterator even inside a cancelled scope (a gone client cancels the handler)."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def unless_disconnected(receive: Callable[[], Any], run: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, await run()), or (False, None) if the client disconnects first.

    RECEIVE is the ASGI receive of a request whose body was read: its next message is
    http.disconnect. run() is then cancelled, which closes the engine iterator (abort)."""
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        async def work() -> None:
            try:
                outcome["value"] = await run()
            except Exception as e:  # re-raised below, not wrapped in the task group's ExceptionGroup
                outcome["error"] = e
            finally:
                tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(work)
        tg.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    return "value" in outcome, outcome.get("value")


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


async def sse_events(gen: Generation, head: dict[str, Any], chat: bool, include_usage: bool,
                     prefix: str = "", on_error: Callable[[Exception], dict] | None = None
                     ) -> AsyncIterator[bytes]:
    """OpenAI stream chunks for GEN: (chat: a role chunk first) content deltas, a finish chunk, an
    optional usage chunk with empty choices, then [DONE]. A failure becomes an error event + [DONE].
    PREFIX is sent first (completions' echo)."""
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return sse({**head, "choices": [choice], **extra})

    if chat:
        yield chunk(None, role=True)
    if prefix:
        yield chunk(prefix)
    stream = gen.deltas()
    try:
        async for text in stream:
            yield chunk(text)
    except Exception as e:  # engine died / request failed: the status line is already sent
        body = on_error(e) if on_error is not None else error_body(str(e), "server_error")
        yield sse(body)
        yield DONE
        return
    finally:
        await close_shielded(stream)
    yield chunk(None, gen.finish_reason)
    if include_usage:
        yield sse({**head, "choices": [], "usage": gen.usage()})
    yield DONE


class SSEResponse(StreamingResponse):
    """text/event-stream that always closes its iterator, so a gone client aborts the engine request.

    Starlette cancels the stream when the client disconnects, but an iterator suspended at a yield
    would only be closed by the garbage collector; closing it here runs Generation's finally now.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_shielded(self.body_iterator)
