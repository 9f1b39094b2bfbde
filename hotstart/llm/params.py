"""vLLM's SamplingParams and StructuredOutputsParams (names, fields, defaults), checked like the server's
requests (server/validation.py) and converted to the engine's wire type (hotstart.messages.SamplingParams).
Bad values raise ValueError naming the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from hotstart.messages import SamplingParams as WireParams
from hotstart.server.errors import ApiError
from hotstart.server.schemas import CompletionRequest
from hotstart.server.structured import constraint, request_grammar
from hotstart.server.validation import MAX_N, MAX_TOP_LOGPROBS, check_common, sampling_params


@dataclass
class StructuredOutputsParams:
    """At most one constraint: a JSON schema (dict or JSON text), a regex, a list of choices, a Lark grammar,
    or any JSON object (json_object=True)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass
class SamplingParams:
    """How to sample, as vLLM spells it (max_tokens defaults to 16, as vLLM's)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._request()  # check now: a bad value fails where it is written

    def _request(self) -> CompletionRequest:
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("set `structured_outputs` or `guided_decoding`, not both")
        if not self.skip_special_tokens:
            raise ValueError("skip_special_tokens=False is not supported by hotstart")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"`{name}` must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        so = self.structured_outputs or self.guided_decoding
        if isinstance(so, dict):
            so = StructuredOutputsParams(**so)
        body = {"model": "", "prompt": "", "n": self.n, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p,
                "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos, "max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
                "logit_bias": {str(k): v for k, v in (self.logit_bias or {}).items()} or None,
                "structured_outputs": so.to_dict() if so is not None else None}
        try:
            req = msgspec.convert(body, CompletionRequest)
            check_common(req, MAX_N)
            constraint(req)  # at most one, well-formed (the grammar itself is built by to_wire)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid SamplingParams: {e}") from None
        except ApiError as e:
            raise ValueError(e.message) from None
        return req

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_wire(self, prompt_len: int, max_model_len: int | None, vocab_size: int | None) -> WireParams:
        """The engine's SamplingParams for a prompt of PROMPT_LEN tokens (ValueError if it does not fit)."""
        req = self._request()
        try:
            wire = sampling_params(req, self.max_tokens, "max_tokens", prompt_len, "prompt", max_model_len,
                                   {}, vocab_size, self.logprobs, self.prompt_logprobs)
            grammar = request_grammar(req)
        except ApiError as e:
            raise ValueError(e.message) from None
        return msgspec.structs.replace(wire, grammar=grammar) if grammar else wire
