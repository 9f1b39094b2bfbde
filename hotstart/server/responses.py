"""OpenAI's Responses API (`POST /v1/responses`, torch-free): a Responses request becomes the internal chat
request (server/schemas.py ChatCompletionRequest), so templates, tool parsers and structured outputs are
chat's own; the answer becomes Responses output items (message / function_call).

Supported: `input` (a string, or message items with string or input_text content, function_call and
function_call_output items), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`,
`text.format` (text, json_object, json_schema), function `tools` + `tool_choice` + `parallel_tool_calls`,
`previous_response_id` and `store`. Built-in tools, `background`, `prompt`, `conversation`, `include`d
extras and non-text content are 400s naming the field.

Stored responses (for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`): the last
STORE_MAX_RESPONSES (1,000) responses, in memory, in this server process only (gone on restart); `store:
false` keeps a response out of the store. Each is its maker's: found only with the key that made it (the
gate's Caller.owner; a keyless server's are every local user's), anyone else gets the 404 of an unknown id.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import msgspec

from hotstart.errors import bad_param, unsupported
from hotstart.frontend.protocol import ChatCompletionRequest
from hotstart.frontend.validation import check_depth

STORE_MAX_RESPONSES = 1000
_TEXT_PARTS = ("input_text", "output_text", "text")
# fields we refuse when set to anything but these (OpenAI's defaults / no-ops)
_UNSUPPORTED = {"background": (None, False), "prompt": (None,), "conversation": (None,),
                "top_logprobs": (None, 0), "truncation": (None, "disabled")}
_INCLUDE_OK: set[str] = set()


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    prompt: Any = None
    conversation: Any = None
    top_logprobs: int | None = None
    truncation: str | None = None


class ResponseStore:
    """The conversations behind the last MAX responses (chat messages, the answer included) and the
    Response objects, LRU; each entry is its OWNER's (server/gate.py Caller.owner) alone."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES) -> None:
        self.max = max_responses
        # id -> (owner, conversation, the Response object)
        self._items: OrderedDict[str, tuple[str | None, list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def put(self, rid: str, messages: list[dict[str, Any]], owner: str | None = None,
            response: dict[str, Any] | None = None) -> None:
        self._items[rid] = (owner, messages, response or {})
        self._items.move_to_end(rid)
        while len(self._items) > self.max:
            self._items.popitem(last=False)

    def _entry(self, rid: str, owner: str | None):
        entry = self._items.get(rid)
        return entry if entry is not None and entry[0] == owner else None

    def get(self, rid: str, owner: str | None = None) -> list[dict[str, Any]] | None:
        """The conversation of RID if OWNER made it."""
        entry = self._entry(rid, owner)
        return None if entry is None else entry[1]

    def response(self, rid: str, owner: str | None = None) -> dict[str, Any] | None:
        """The Response object of RID if OWNER made it."""
        entry = self._entry(rid, owner)
        return None if entry is None else entry[2]

    def delete(self, rid: str, owner: str | None = None) -> bool:
        """Forget RID if OWNER made it; whether it did."""
        if self._entry(rid, owner) is None:
            return False
        del self._items[rid]
        return True


def check_unsupported(req: ResponsesRequest) -> None:
    for name, ok in _UNSUPPORTED.items():
        value = getattr(req, name)
        if value not in ok:
            raise unsupported(name, f"`{name}` = {value!r}")
    for i, item in enumerate(req.include or []):
        if item not in _INCLUDE_OK:
            raise unsupported(f"include[{i}]", f"include `{item}`")
    for i, tool in enumerate(req.tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise unsupported(f"tools[{i}].type", f"the built-in tool `{kind}` (function tools only)")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_param("max_output_tokens",
                        f"`max_output_tokens` must be at least 1, got {req.max_output_tokens}")
    for name in ("input", "text", "tools", "tool_choice"):
        check_depth(getattr(req, name), name)


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad_param(param, f"`{param}` must be a string or a non-empty list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise unsupported(f"{param}[{j}].type", f"content of type `{kind}` (text only)")
        if not isinstance(part.get("text"), str):
            raise bad_param(f"{param}[{j}].text", "a text part needs a string `text`")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages (OpenAI chat shape: tool_calls with JSON-text arguments)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not inp:
        raise bad_param("input", "`input` must not be empty")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(inp):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_param(f"{param}.role",
                                f"unknown role `{role}` (user, system, developer, assistant)")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_param(f"{param}.{key}", f"`{param}.{key}` must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant" and prev.get("tool_calls") is not None:
                prev["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise bad_param(f"{param}.call_id", f"`{param}.call_id` must be a string")
            text = output if isinstance(output, str) else _text(output, f"{param}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing a chat template renders
        else:
            raise unsupported(f"{param}.type", f"input items of type `{kind}`")
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise unsupported("tool_choice", f"tool_choice {choice!r} (none, auto, required or a function)")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_param("text.format", "`text.format` must be an object")
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    return {"type": fmt.get("type")}


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list]:
    """(the chat request of REQ after HISTORY, the conversation to store: history + input)."""
    conversation = [*history, *input_messages(req.input)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                               if t.get(k) is not None}} for t in req.tools or []]
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": tools or None,
            "tool_choice": _tool_choice(req.tool_choice) if tools else None,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text)}
    try:
        chat = msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise bad_param("input", f"invalid input: {e}") from None
    return chat, conversation


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": new_id("fc"), "call_id": call.get("id") or new_id("call"),
            "name": fn["name"], "arguments": fn.get("arguments") or "{}", "status": "completed"}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer (tools.chat_message) as Responses output items."""
    calls = message.get("tool_calls") or []
    items = [message_item(message["content"] or "")] if message.get("content") or not calls else []
    return items + [call_item(c) for c in calls]


def answer_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items back as chat messages, for the store."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def response_object(rid: str, req: ResponsesRequest, model: str, created: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, int] | None,
                    reason: str | None = None) -> dict[str, Any]:
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": req.store is not False, "temperature": req.temperature, "text": {"format": fmt},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
        "truncation": "disabled", "user": req.user, "metadata": req.metadata or {},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]},
    }


def now() -> int:
    return int(time.time())
