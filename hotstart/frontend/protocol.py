"""OpenAI request types (torch-free, HTTP-free): msgspec Structs that server/schemas.py decodes bodies into.

Schemas are msgspec Structs rather than pydantic models: measured here, building three pydantic
models costs ~90 ms at startup and parsing a small chat request ~4 us; the msgspec equivalents cost
~5 ms and ~0.6 us, and msgspec's errors name the offending field (`at $.messages[0].role`), which
becomes the OpenAI error's `param`. Unknown fields are ignored, as the OpenAI API does.

The sampling fields are SamplingParams' own (hotstart/sampling_params.py), each optional here: a field a
request leaves out takes generation_config.json's default, else SamplingParams' (frontend/validation.py).
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from hotstart.sampling_params import SamplingParams, sampling_fields

# Free-form JSON (tools, tool_calls, content parts, chat_template_kwargs, ...) may nest this deep: enough
# for any JSON schema, and far below the recursion limit of the code that walks it (chat templates).
MAX_JSON_DEPTH = 64

# sampling fields that each endpoint spells its own way (chat: logprobs + top_logprobs; completions:
# logprobs + echo), or that only the offline API takes as an object
_NOT_IN_REQUESTS = {"logprobs", "prompt_logprobs", "structured_outputs"}
# JSON object keys are strings: token ids arrive as text and are checked by frontend/validation.py
_WIRE_TYPES = {"logit_bias": dict[str, float]}


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


def _sampling_request_fields() -> list[tuple[str, Any, None]]:
    types = {f.name: f.type for f in msgspec.structs.fields(SamplingParams)}
    return [(name, Optional[_WIRE_TYPES.get(name, types[name])], None)  # noqa: UP007 - a runtime type
            for name in sampling_fields() if name not in _NOT_IN_REQUESTS]


class _Request(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions beyond the sampling ones."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured outputs (frontend/structured.py): OpenAI's, and vLLM's extras
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# _Request + every sampling field, optional (None: not given)
Common = msgspec.defstruct("Common", _sampling_request_fields(), bases=(_Request,), kw_only=True,
                           module=__name__)
REQUEST_SAMPLING_FIELDS = tuple(name for name, _, _ in _sampling_request_fields())


class ChatCompletionRequest(Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Common, kw_only=True):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]: checked by completion_prompt()
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
