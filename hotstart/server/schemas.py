"""OpenAI request schemas (torch-free): msgspec Structs, read_body(request) and decode_request(body, cls).

Schemas are msgspec Structs rather than pydantic models: measured here, building three pydantic
models costs ~90 ms at startup and parsing a small chat request ~4 us; the msgspec equivalents cost
~5 ms and ~0.6 us, and msgspec's errors name the offending field (`at $.messages[0].role`), which
becomes the OpenAI error's `param`. Unknown fields are ignored, as the OpenAI API does.
Range checks and the rest of the validation are in hotstart.server.validation.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

from hotstart.server.errors import ApiError

if TYPE_CHECKING:
    from starlette.requests import Request

# Free-form JSON (tools, tool_calls, content parts, chat_template_kwargs, ...) may nest this deep: enough
# for any JSON schema, and far below the recursion limit of the code that walks it (chat templates).
MAX_JSON_DEPTH = 64


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    user: str | None = None
    # structured outputs (hotstart.server.structured): OpenAI's, and vLLM's extras
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]: checked by completion_prompt()
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


_AT = re.compile(r" - at `\$\.?(.*)`$")


def decode_request(body: bytes, cls: type[msgspec.Struct]) -> Any:
    """bytes -> CLS, or ApiError 400 naming the offending parameter."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _AT.search(msg)
        param = m.group(1) if m else None
        if msg.startswith("Object missing required field"):
            missing = msg.split("`")[1]
            param = f"{param}.{missing}" if param else missing
        return_msg = _AT.sub("", msg) + (f" (parameter `{param}`)" if param else "")
        raise ApiError(400, return_msg, param=param, code="invalid_type") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # msgspec's own depth limit (~1000 levels)
        raise ApiError(400, f"the body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                       code="invalid_json") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body: JSON content type (or none), at most LIMIT bytes (413), counted while streaming."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got `{ctype}`",
                       code="unsupported_media_type")
    too_big = ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)
