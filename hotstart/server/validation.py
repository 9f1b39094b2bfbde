"""Validation of decoded OpenAI requests (torch-free): range checks, unsupported features, prompts,
and the engine's SamplingParams. Every failure is an ApiError 400 naming the offending `param`."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hotstart.messages import SamplingParams
from hotstart.server.errors import ApiError, bad_param, unsupported
from hotstart.server.schemas import MAX_JSON_DEPTH

if TYPE_CHECKING:
    from hotstart.server.schemas import ChatCompletionRequest, CompletionRequest, _Common

log = logging.getLogger("hotstart")
MAX_STOP_STRINGS = 16
PENALTY_RANGE = 2.0  # OpenAI's range for presence_penalty / frequency_penalty: [-2, 2]
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: [-100, 100]
MAX_N = 128  # choices per request (and at most the engine's max_num_seqs)
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs (OpenAI's limit)
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
# chat_template_kwargs may set template variables, not the arguments the server itself controls
# ("self" too: it would collide with the tokenizer method's own parameter)
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                             "continue_final_message", "self"}


def check_depth(value: Any, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """400 if VALUE (decoded JSON) nests more than LIMIT containers deep. Iterative: no recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                raise bad_param(param, f"`{param}` is nested too deeply (at most {limit} levels)")
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))


def check_common(req: _Common, max_n: int = MAX_N) -> None:
    """Range checks and unsupported features shared by both endpoints; raises ApiError 400."""
    if req.n is not None and not 1 <= req.n <= max_n:
        raise bad_param("n", f"`n` must be in [1, {max_n}], got {req.n}")
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise bad_param(name, f"`{name}` must be a finite number, got {value}")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise bad_param("temperature", f"`temperature` must be in [0, 2], got {req.temperature}")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise bad_param("top_p", f"`top_p` must be in (0, 1], got {req.top_p}")
    if req.top_k is not None and req.top_k < -1:
        raise bad_param("top_k", f"`top_k` must be -1 or 0 (disabled) or positive, got {req.top_k}")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise bad_param("min_p", f"`min_p` must be in [0, 1], got {req.min_p}")
    if req.seed is not None and not INT64_MIN <= req.seed <= UINT64_MAX:
        raise bad_param("seed", "`seed` must fit in 64 bits")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_param("max_tokens", f"`max_tokens` must be at least 1, got {req.max_tokens}")
    if req.min_tokens is not None and req.min_tokens < 0:
        raise bad_param("min_tokens", f"`min_tokens` must be >= 0, got {req.min_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -PENALTY_RANGE <= value <= PENALTY_RANGE:
            raise bad_param(name, f"`{name}` must be in [-2, 2], got {value}")
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise bad_param("repetition_penalty",
                        f"`repetition_penalty` must be > 0, got {req.repetition_penalty}")
    for key, value in (req.logit_bias or {}).items():
        if not math.isfinite(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise bad_param(
                "logit_bias", f"`logit_bias` values must be in [-100, 100], got {value} for {key!r}"
            )
    if req.stream_options is not None and not req.stream:
        raise bad_param("stream_options", "`stream_options` is only allowed when `stream` is true")
    for i, s in enumerate(stop_strings(req)):
        if not s:
            raise bad_param(f"stop[{i}]", "stop strings must not be empty")
    if len(stop_strings(req)) > MAX_STOP_STRINGS:
        raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported")
    for name in ("response_format", "structured_outputs", "guided_json"):
        check_depth(getattr(req, name), name)


def check_chat(req: ChatCompletionRequest, max_n: int = MAX_N) -> None:
    check_common(req, max_n)
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


def check_completion(req: CompletionRequest, max_n: int = MAX_N) -> None:
    check_common(req, max_n)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_param(
            "logprobs", f"`logprobs` must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}"
        )
    if req.best_of not in (None, 1):
        raise unsupported("best_of", "`best_of` > 1")
    if req.suffix:
        raise unsupported("suffix", "`suffix`")


def stop_strings(req: _Common) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


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
                    raise ApiError(400, f"content part type `{kind}` is not supported (only text)",
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


def logit_bias(req: _Common, vocab_size: int | None) -> dict[int, float]:
    """`logit_bias` with token ids as ints (keys are JSON strings), or 400 naming the parameter."""
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        text = key.strip()
        if not (text.isascii() and text.isdigit()):
            raise bad_param("logit_bias", f"`logit_bias` keys must be token ids, got {key!r}")
        token = int(text)
        if vocab_size is not None and token >= vocab_size:
            raise bad_param(
                "logit_bias", f"`logit_bias` token id {token} is out of range (must be < {vocab_size})"
            )
        out[token] = float(value)
    return out


def sampling_params(req: _Common, max_tokens: int | None, max_param: str, prompt_len: int,
                    prompt_param: str, max_model_len: int | None, defaults: dict[str, float | int],
                    vocab_size: int | None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams: max_tokens defaults to what the context leaves; the prompt plus
    max_tokens must fit in MAX_MODEL_LEN (400 naming both numbers otherwise, as vLLM does). DEFAULTS
    (generation_config.json's) fill the sampling fields a request leaves out."""
    if max_model_len is not None:
        if prompt_len >= max_model_len:
            raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                           f"your prompt has {prompt_len} tokens, leaving no room for a completion.",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
        elif prompt_len + max_tokens > max_model_len:
            raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                           f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                           f"{max_tokens} in the completion). Please reduce the prompt or `{max_param}`.",
                           param=max_param, code="context_length_exceeded")
    if max_tokens is None:
        raise bad_param(max_param, f"`{max_param}` is required until the engine reports its context length")
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_param(
            "min_tokens", f"`min_tokens` ({req.min_tokens}) must not exceed `{max_param}` ({max_tokens})"
        )
    check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")

    def pick(name: str, fallback: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    return SamplingParams(
        max_tokens=max_tokens, temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
        top_k=max(int(pick("top_k", 0)), 0),  # -1 and 0 both mean disabled; the engine uses 0
        seed=req.seed, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        n=req.n or 1, min_p=float(pick("min_p", 0.0)),
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=float(pick("repetition_penalty", 1.0)), logit_bias=logit_bias(req, vocab_size),
        min_tokens=req.min_tokens or 0, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def read_generation_config(model_dir: str | Path) -> dict[str, float | int]:
    """Sampling defaults from MODEL_DIR/generation_config.json: the fields of GENERATION_CONFIG_FIELDS it
    sets, as vLLM's `--generation-config auto` reads them (whatever `do_sample` says: a server samples
    unless told temperature 0); values out of their API range are left out. {} if the file is absent.
    (Its eos ids are the engine's business: hotstart.config merges them into the model's eos_token_ids.)
    """
    try:
        cfg = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    ok = {"temperature": lambda v: 0 <= v <= 2, "top_p": lambda v: 0 < v <= 1, "top_k": lambda v: v >= -1,
          "min_p": lambda v: 0 <= v <= 1, "repetition_penalty": lambda v: v > 0}
    out = {}
    for k in GENERATION_CONFIG_FIELDS:
        v = cfg.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok[k](v):
            out[k] = int(v) if k == "top_k" else float(v)
    return out


def sampling_defaults(model_dir: str | Path, mode: str = "auto") -> dict[str, float | int]:
    """`--generation-config MODE` (auto | none): the defaults to apply, logged once when there are any."""
    if mode != "auto":
        return {}
    defaults = read_generation_config(model_dir)
    if defaults:
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        log.info(
            "hotstart: sampling defaults from generation_config.json: %s (--generation-config none: off)",
            shown,
        )
    return defaults
