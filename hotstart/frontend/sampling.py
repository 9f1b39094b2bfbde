"""From a request to what the engine runs (torch-free).

  from_request   an OpenAI request's sampling fields -> the one SamplingParams (hotstart/sampling_params.py),
                 generation_config.json's defaults where a field is left out
  resolve        SamplingParams (from a request or from the offline LLM's user) against the engine's facts
                 (context length, vocabulary, batch size): max_tokens set, the constraint compiled into
                 an llguidance grammar. Every refusal is a RequestError naming the parameter.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from hotstart.errors import RequestError, bad_param
from hotstart.frontend.protocol import REQUEST_SAMPLING_FIELDS
from hotstart.frontend.validation import check_token_ids
from hotstart.sampling_params import MAX_LOGIT_BIAS, MAX_N, SamplingParams

if TYPE_CHECKING:
    from hotstart.frontend.protocol import Common

log = logging.getLogger("hotstart")
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class EngineLimits:
    """The engine's facts a request is checked against (None: not known yet)."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    vocab_size: int | None = None

    @property
    def max_n(self) -> int:
        """Largest `n`: MAX_N, and no more than the engine batches."""
        return min(MAX_N, self.max_num_seqs) if self.max_num_seqs else MAX_N


def token_keys(bias: dict[str, float] | None) -> dict[int, float]:
    """`logit_bias` with token ids as ints (JSON object keys are strings), or 400 naming the parameter."""
    out: dict[int, float] = {}
    if bias and len(bias) > MAX_LOGIT_BIAS:  # before reading them all
        raise bad_param("logit_bias",
                        f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
    for key, value in (bias or {}).items():
        text = key.strip()
        if not (text.isascii() and text.isdigit()):
            raise bad_param("logit_bias", f"`logit_bias` keys must be token ids, got {key!r}")
        out[int(text)] = value
    return out


def _renamed(e: RequestError, name: str, as_sent: str) -> RequestError:
    """E as the request spelled the field (chat's max_completion_tokens for max_tokens)."""
    if e.param != name or name == as_sent:
        return e
    return RequestError(e.status, e.message.replace(f"`{name}`", f"`{as_sent}`"), param=as_sent, code=e.code)


def from_request(req: Common, defaults: dict[str, float | int], *, max_tokens: int | None,
                 max_param: str = "max_tokens", logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
    """REQ's sampling fields as SamplingParams: what the request leaves out takes DEFAULTS
    (generation_config.json's), else SamplingParams' own; MAX_TOKENS None means what the context leaves
    (OpenAI's meaning), not the offline default of 16."""
    given: dict[str, Any] = {k: v for k in REQUEST_SAMPLING_FIELDS if (v := getattr(req, k)) is not None}
    given["logit_bias"] = token_keys(req.logit_bias)
    for k, v in defaults.items():
        given.setdefault(k, v)
    given.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    try:
        return SamplingParams(**given)
    except RequestError as e:
        raise _renamed(e, "max_tokens", max_param) from None


def resolve(params: SamplingParams, prompt_len: int, limits: EngineLimits, *, prompt_param: str = "prompt",
            max_param: str = "max_tokens", grammar: str | None = None) -> SamplingParams:
    """PARAMS for a prompt of PROMPT_LEN tokens, as the engine runs them: max_tokens defaults to what the
    context leaves, and the prompt plus max_tokens must fit in max_model_len (400 naming both numbers
    otherwise, as vLLM does); `n` within the batch, token ids within the vocabulary; GRAMMAR (built by
    the caller from a request's own fields), else the one PARAMS.structured_outputs asks for."""
    max_len, max_tokens = limits.max_model_len, params.max_tokens
    if max_len is not None:
        if prompt_len >= max_len:
            raise RequestError(400, f"This model's maximum context length is {max_len} tokens. However, "
                               f"your prompt has {prompt_len} tokens, leaving no room for a completion.",
                               param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max_len - prompt_len
        elif prompt_len + max_tokens > max_len:
            raise RequestError(400, f"This model's maximum context length is {max_len} tokens. However, "
                               f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                               f"{max_tokens} in the completion). Please reduce the prompt or `{max_param}`.",
                               param=max_param, code="context_length_exceeded")
    if max_tokens is None:
        raise bad_param(max_param, f"`{max_param}` is required until the engine reports its context length")
    if params.min_tokens > max_tokens:
        raise bad_param(
            "min_tokens", f"`min_tokens` ({params.min_tokens}) must not exceed `{max_param}` ({max_tokens})")
    if params.n > limits.max_n:
        raise bad_param("n", f"`n` must be in [1, {limits.max_n}], got {params.n}")
    check_token_ids(params.stop_token_ids, limits.vocab_size, "stop_token_ids")
    if limits.vocab_size is not None and params.logit_bias:
        if (top := max(params.logit_bias)) >= limits.vocab_size:
            raise bad_param("logit_bias",
                            f"`logit_bias` token id {top} is out of range (must be < {limits.vocab_size})")
    if grammar is None and params.structured_outputs is not None:
        from hotstart.frontend.structured import request_grammar  # noqa: PLC0415 - only when constrained

        grammar = request_grammar(params)
    return msgspec.structs.replace(params, max_tokens=max_tokens, top_k=max(params.top_k, 0),
                                   grammar=grammar or params.grammar)


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
