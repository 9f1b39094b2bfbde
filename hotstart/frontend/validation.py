"""Checks of decoded OpenAI requests beyond their sampling fields (torch-free): messages, tools, prompts,
nesting, unsupported features. Every failure is a RequestError 400 naming the offending `param`. The
sampling fields are checked by SamplingParams itself (hotstart/sampling_params.py) when
frontend/sampling.py builds it from a request."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

from hotstart.errors import RequestError, bad_param, unsupported
from hotstart.frontend.protocol import MAX_JSON_DEPTH

if TYPE_CHECKING:
    from hotstart.frontend.protocol import ChatCompletionRequest, Common, CompletionRequest

MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs (OpenAI's limit)
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}
# chat_template_kwargs may set template variables, not the arguments the server itself controls
# ("self" too: it would collide with the tokenizer method's own parameter)
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                             "continue_final_message", "self"}


def too_deep(param: str | None, limit: int = MAX_JSON_DEPTH) -> RequestError:
    where = f"`{param}`" if param else "the body"
    return RequestError(400, f"{where} is nested too deeply (at most {limit} levels)", param=param,
                        code="invalid_value")


def check_depth(value: Any, param: str, limit: int = MAX_JSON_DEPTH, depth: int = 1) -> None:
    """400 if VALUE (decoded JSON, itself at DEPTH) nests more than LIMIT containers deep. Iterative: no
    recursion, and only containers are stacked (a long list of numbers costs one pass in C)."""
    stack = [(value, depth)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                raise too_deep(param, limit)
            children = v.values() if isinstance(v, dict) else v
            stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))


def check_nesting(req: msgspec.Struct, limit: int = MAX_JSON_DEPTH) -> None:
    """400 naming the field if any free-form JSON value of a decoded request (any field, a Struct's inside a
    list included) nests more than LIMIT containers deep, counted from the field: what templates, schema
    walkers and json.dumps recurse over stays far below Python's recursion limit."""
    stack: list[tuple[msgspec.Struct, str]] = [(req, "")]
    while stack:
        struct, path = stack.pop()
        for name in struct.__struct_fields__:
            v, param = getattr(struct, name), f"{path}.{name}" if path else name
            if isinstance(v, msgspec.Struct):
                stack.append((v, param))
            elif isinstance(v, list) and any(isinstance(x, msgspec.Struct) for x in v):
                for i, x in enumerate(v):
                    if isinstance(x, msgspec.Struct):
                        stack.append((x, f"{param}[{i}]"))
                    else:
                        check_depth(x, param, limit, depth=2)
            else:
                check_depth(v, param, limit)


def loads_json(text: str, param: str, lenient: bool = False) -> Any:
    """JSON sent as text inside a field (a schema, tool-call arguments), decoded and no deeper than
    MAX_JSON_DEPTH; 400 naming PARAM otherwise (LENIENT: None for text that is not JSON at all)."""
    try:
        value = json.loads(text)
    except RecursionError:  # nested past the interpreter's limit: too deep by far
        raise too_deep(param) from None
    except ValueError:
        if lenient:
            return None
        raise bad_param(param, f"`{param}` is not valid JSON") from None
    check_depth(value, param)
    return value


def check_prompt_chars(chars: int, max_model_len: int | None, token_chars: int | None, param: str) -> None:
    """Refuses, before tokenizing, a prompt of CHARS characters that cannot fit the context: no token of
    the vocabulary spells more than TOKEN_CHARS characters, so such a prompt has at least
    CHARS / TOKEN_CHARS tokens (400 context_length_exceeded, as a counted prompt gets)."""
    if max_model_len is None or not token_chars or chars <= max_model_len * token_chars:
        return
    raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt has {chars} characters: at least {-(-chars // token_chars)} tokens (no token "
                       f"is longer than {token_chars} characters).", param=param,
                       code="context_length_exceeded")


def prompt_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the text a chat's messages carry (what the template renders at least)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def check_request(req: Common) -> None:
    """What both endpoints check beyond the sampling fields; raises RequestError 400."""
    if req.stream_options is not None and not req.stream:
        raise bad_param("stream_options", "`stream_options` is only allowed when `stream` is true")
    for name in ("response_format", "structured_outputs", "guided_json"):
        check_depth(getattr(req, name), name)


def check_chat(req: ChatCompletionRequest) -> None:
    check_request(req)
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_param("max_completion_tokens",
                        f"`max_completion_tokens` must be at least 1, got {req.max_completion_tokens}")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_param(
                "top_logprobs", f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}"
            )
        if not req.logprobs:
            raise bad_param("top_logprobs", "`top_logprobs` needs `logprobs` set to true")
    for name in ("tools", "tool_choice", "chat_template_kwargs"):
        check_depth(getattr(req, name), name)
    for i, tool in enumerate(req.tools or []):
        check_tool(tool, f"tools[{i}]")
    for i, m in enumerate(req.messages):
        check_depth(m.content, f"messages[{i}].content")
        check_depth(m.tool_calls, f"messages[{i}].tool_calls")
        for j, call in enumerate(m.tool_calls or []):
            check_tool_call(call, f"messages[{i}].tool_calls[{j}]")


def check_tool(tool: dict[str, Any], param: str) -> None:
    """A tool definition: {"type": "function", "function": {"name": str, "description"?: str,
    "parameters"?: object}} (the only kind chat templates render)."""
    if tool.get("type") != "function":
        raise bad_param(f"{param}.type", f"`{param}.type` must be \"function\", got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_param(f"{param}.function", f"`{param}.function` must be an object")
    _check_function_name(fn, f"{param}.function")
    if not isinstance(fn.get("description", ""), str):
        raise bad_param(f"{param}.function.description", "`description` must be a string")
    if not isinstance(fn.get("parameters", {}), dict):
        raise bad_param(f"{param}.function.parameters", "`parameters` must be a JSON schema object")


def check_tool_call(call: dict[str, Any], param: str) -> None:
    """A tool call in an assistant message: {"id"?: str, "type"?: "function",
    "function": {"name": str, "arguments": str (JSON text)}}."""
    if call.get("type", "function") != "function":
        raise bad_param(f"{param}.type", f"`{param}.type` must be \"function\", got {call.get('type')!r}")
    if not isinstance(call.get("id", ""), str):
        raise bad_param(f"{param}.id", "`id` must be a string")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise bad_param(f"{param}.function", f"`{param}.function` must be an object")
    _check_function_name(fn, f"{param}.function")
    if not isinstance(fn.get("arguments", ""), str):
        raise bad_param(f"{param}.function.arguments", "`arguments` must be a string (JSON text)")


def _check_function_name(fn: dict[str, Any], param: str) -> None:
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_param(f"{param}.name", f"`{param}.name` must be a non-empty string")


def check_completion(req: CompletionRequest) -> None:
    check_request(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_param(
            "logprobs", f"`logprobs` must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}"
        )
    if req.best_of not in (None, 1):
        raise unsupported("best_of", "`best_of` > 1")
    if req.suffix:
        raise unsupported("suffix", "`suffix`")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as chat-template dicts: roles normalised, text parts joined with newlines (as vLLM)."""
    if not req.messages:
        raise bad_param("messages", "`messages` must contain at least one message")
    out = []
    for i, m in enumerate(req.messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise bad_param(f"messages[{i}].role",
                            f"unknown role `{m.role}`; expected one of {', '.join(CHAT_ROLES)}")
        content = m.content
        if isinstance(content, list):
            if not content:
                raise bad_param(f"messages[{i}].content", "`content` must not be an empty list")
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind != "text":
                    raise RequestError(400, f"content part type `{kind}` is not supported (only text)",
                                       param=f"messages[{i}].content[{j}]", code="unsupported_content")
                if not isinstance(part.get("text"), str):
                    raise bad_param(f"messages[{i}].content[{j}].text", "a text part needs a string `text`")
                texts.append(part["text"])
            content = "\n".join(texts)
        if content is None and not m.tool_calls:
            raise bad_param(f"messages[{i}].content", "`content` is required unless `tool_calls` is set")
        msg: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """`chat_template_kwargs` as keyword arguments for the chat template, or 400 naming a reserved one."""
    kwargs = dict(req.chat_template_kwargs or {})
    if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys()):
        raise bad_param("chat_template_kwargs", f"cannot set {', '.join(reserved)} here")
    return kwargs


def completion_prompt(prompt: Any) -> str | list[int]:
    """One prompt as text or token ids. Batched prompts (several per request) are not supported."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # ["text"] or [[ids]]: one prompt in a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param("prompt", "`prompt` must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise unsupported("prompt", "a batch of several prompts (send one request per prompt)")
    raise bad_param("prompt", "`prompt` must be a non-empty string or a non-empty list of token ids")


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = f"[0, {vocab_size})" if vocab_size else "non-negative"
        raise bad_param(param, f"token id {bad[0]} is out of range (must be {limit})")
