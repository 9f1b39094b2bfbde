"""OpenAI's server-sent event streams of a Generation (torch-free): chunks per choice, tool-call deltas,
usage, [DONE]; and the response that always closes its iterator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.responses import StreamingResponse

from hotstart.errors import error_body
from hotstart.frontend.generation import Generation, close_shielded
from hotstart.frontend.tools import ToolStream
from hotstart.server.logprobs import LogprobsFormat

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


async def sse_events(gen: Generation, head: dict[str, Any], chat: bool, include_usage: bool,
                     prefix: str = "", on_error: Callable[[Exception], dict] | None = None,
                     logprobs: LogprobsFormat | None = None, tool_parser: str | None = None
                     ) -> AsyncIterator[bytes]:
    """OpenAI stream chunks for GEN, each naming its choice's index: (chat: a role chunk per choice
    first) content deltas, a finish chunk per choice as it ends, an optional usage chunk with empty
    choices, then [DONE]. A failure becomes an error event + [DONE]. PREFIX is sent first for every choice
    (completions' echo; with prompt logprobs, once the engine has sent them). LOGPROBS (set when the
    request asked for logprobs) formats the logprobs each content chunk carries. TOOL_PARSER (chat with
    tools): the text goes through a ToolStream per choice; each tool call is one delta (id, type, name and
    the whole arguments), sent once complete; the finish reason is then "tool_calls"."""
    extra = {"usage": None} if include_usage else {}
    n = len(gen.choices)

    def chunk(index: int, text: str | None, finish: str | None = None, role: bool = False,
              lps: Any = None) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish}
        return sse({**head, "choices": [choice], **extra})

    tools = [ToolStream(tool_parser) for _ in range(n)] if tool_parser else None
    n_calls = [0] * n

    def calls_chunk(index: int, calls: list[dict[str, Any]]) -> bytes:
        items = [{"index": n_calls[index] + k, **c} for k, c in enumerate(calls)]
        n_calls[index] += len(calls)
        choice = {"index": index, "delta": {"tool_calls": items}, "logprobs": None, "finish_reason": None}
        return sse({**head, "choices": [choice], **extra})

    def formatted(index: int, items: Any) -> Any:
        if logprobs is None or items is None:
            return None
        return logprobs.chat(items) if chat else logprobs.completion(index, items)

    echo_logprobs = logprobs is not None and gen.params.prompt_logprobs is not None  # set only with echo

    def echo() -> list[bytes]:
        if not echo_logprobs:
            return [chunk(i, prefix) for i in range(n)]
        prompt = (gen.prompt_ids, gen.prompt_logprobs or [])
        return [chunk(i, prefix, lps=logprobs.completion(i, [], prompt)) for i in range(n)]

    if chat:
        for i in range(n):
            yield chunk(i, None, role=True)
    pending_echo = bool(prefix) or echo_logprobs
    if pending_echo and not echo_logprobs:
        for c in echo():
            yield c
        pending_echo = False
    stream = gen.deltas()
    try:
        async for d in stream:
            if pending_echo:
                for c in echo():
                    yield c
                pending_echo = False
            text, calls, reason = d.text, [], d.finish_reason
            if tools is not None:
                text, calls = tools[d.index].feed(d.text)
                if reason is not None:
                    more, late = tools[d.index].finish()
                    text, calls = text + more, calls + late
            if text or d.logprobs:
                yield chunk(d.index, text, lps=formatted(d.index, d.logprobs))
            if calls:
                yield calls_chunk(d.index, calls)
            if reason is not None:
                yield chunk(d.index, None, "tool_calls" if n_calls[d.index] and reason == "stop" else reason)
    except Exception as e:  # noqa: BLE001 - engine died / request failed: the status line is already sent
        body = on_error(e) if on_error is not None else error_body(str(e), "server_error")
        yield sse(body)
        yield DONE
        return
    finally:
        await close_shielded(stream)
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
