"""vLLM's /tokenize and /detokenize (torch-free), over the server's tokenizer and chat templates.

  POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                    {model?, messages, add_generation_prompt=true, continue_final_message=false,
                     add_special_tokens=false, chat_template_kwargs?, tools?, return_token_strs=false}
                    -> {count, max_model_len, tokens, token_strs}
  POST /detokenize  {model?, tokens} -> {prompt}
`model` may be left out with one model; a many-models server needs it (server/multi_api.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response

from hotstart.errors import RequestError, bad_param
from hotstart.frontend.protocol import ChatMessage
from hotstart.frontend.tools import template_messages
from hotstart.frontend.validation import (
    chat_messages,
    check_depth,
    check_token_ids,
    check_tool,
    template_kwargs,
)
from hotstart.server.gate import json_response
from hotstart.text.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from hotstart.server.api import OpenAIServing


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class _Chat(msgspec.Struct):
    """What chat_messages / template_kwargs read of a request."""

    messages: list[ChatMessage]
    chat_template_kwargs: dict[str, Any] | None = None


def tokenize_ids(serving: OpenAIServing, req: TokenizeRequest) -> list[int]:
    """The ids of REQ's prompt or messages, or RequestError 400."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_param("prompt", "send exactly one of `prompt` and `messages`")
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        return serving.tokenizer.encode(req.prompt, add_special_tokens=add)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_param("continue_final_message",
                        "`continue_final_message` and `add_generation_prompt` cannot both be true")
    check_depth(req.tools, "tools")
    check_depth(req.chat_template_kwargs, "chat_template_kwargs")
    for i, tool in enumerate(req.tools or []):
        check_tool(tool, f"tools[{i}]")
    chat = _Chat(req.messages or [], req.chat_template_kwargs)
    messages = template_messages(chat_messages(chat))
    kwargs = template_kwargs(chat)
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = serving.tokenizer.apply_chat_template(messages, req.add_generation_prompt, req.tools, **kwargs)
    except ChatTemplateError as e:
        raise RequestError(400, str(e), param="messages", code="chat_template_error") from None
    except TypeError as e:  # a template argument the tokenizer does not take
        raise bad_param("messages", f"cannot apply the chat template: {e}") from None
    return serving.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))


def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> Response:
    if req.model is not None:
        serving.check_model(req.model)
    ids = tokenize_ids(serving, req)
    strs = [serving.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return json_response({"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids,
                          "token_strs": strs})


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> Response:
    if req.model is not None:
        serving.check_model(req.model)
    check_token_ids(req.tokens, serving.vocab_size, "tokens")
    return json_response({"prompt": serving.tokenizer.decode(req.tokens)})
