"""How one request samples: the one SamplingParams (vLLM's field names and defaults), torch-free.

The offline `LLM` takes it from the user, the HTTP API builds it from a request's fields
(frontend/validation.py), and the engine receives it inside EngineRequest (hotstart/messages.py). Every
value is checked where the object is made (`__post_init__`, also when msgspec decodes it), raising
RequestError (a ValueError) that names the field; the checks that need the engine's facts (context
length, vocabulary, batch size) and the grammar build are frontend/validation.py's `resolve`, which turns
it into what the engine runs: max_tokens set, `grammar` compiled.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from hotstart.errors import RequestError, bad_param

# Each request's worst-case cost is bounded where it is admitted (docs/security.md, "Request limits"); a
# value over a limit is a 400 naming the field and the limit. OpenAI's values where it has one.
MAX_N = 128  # choices per request (OpenAI's; and at most the engine's max_num_seqs)
MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's chat limit)
MAX_STOP_STRINGS = 16  # OpenAI takes 4, vLLM any number: each is matched on every choice's every delta
MAX_STOP_STRING_CHARS = 1024  # per string: its matcher's table, and the text a stream may hold back
MAX_STOP_TOKEN_IDS = 1024  # looked up on every generated token, masked every step under min_tokens
MAX_LOGIT_BIAS = 300  # token ids in logit_bias (OpenAI refuses more than 300): added every step
# n x max_tokens x (logprobs + 1), plus the prompt's tokens x (prompt_logprobs + 1) with echo: the logprob
# entries a request's answer carries. A whole answer holds them in the API process and encodes them at once
# (~350 bytes each while formatted, ~90 bytes of JSON: 2**18 is ~90 MB and ~1 s of one core at most)
MAX_LOGPROB_ENTRIES = 1 << 18
PENALTY_RANGE = 2.0  # OpenAI's range for presence_penalty / frequency_penalty: [-2, 2]
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: [-100, 100]
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """At most one constraint (vLLM's): a JSON schema (an object, or its JSON text), a regex, a list of
    choices, a Lark grammar, or any JSON object (json_object=True)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's SamplingParams (the fields hotstart implements, with vLLM's defaults: max_tokens 16)."""

    n: int = 1  # choices; they share the prompt's KV blocks
    presence_penalty: float = 0.0  # OpenAI: logit -= presence x [count > 0], counts over generated tokens
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency x count
    repetition_penalty: float = 1.0  # HF: over prompt + generated tokens, logit / p if > 0 else logit x p
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top one's (after temperature)
    seed: int | None = None  # choice i of n samples with seed + i
    stop: str | list[str] | None = None  # stop strings (matched on the text, in the frontend)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: what the context leaves after the prompt
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens are generated
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's raw logprob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (echo)
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name: moved to structured_outputs
    # an llguidance grammar (the JSON text LLMatcher.grammar_from_* returns): the tokens are constrained
    # to it, eos allowed only where it accepts (engine/grammar.py); built by the frontend's resolve
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise bad_param("guided_decoding", "set `structured_outputs` or `guided_decoding`, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        check(self)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def needs_sampler_state(self) -> bool:
        """True unless the request takes only the plain path (temperature / top-p / top-k)."""
        return (self.min_p > 0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or bool(self.logit_bias) or self.min_tokens > 0
                or self.logprobs is not None or self.prompt_logprobs is not None or self.grammar is not None)


def _in(p: SamplingParams, name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    value = getattr(p, name)
    if not math.isfinite(value):
        raise bad_param(name, f"`{name}` must be a finite number, got {value}")
    if value < lo or value > hi or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad_param(name, f"`{name}` must be in {interval}, got {value}")


_NUMBERS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(p: SamplingParams) -> None:
    """What msgspec checks when it decodes, for objects made in Python (the offline LLM's users)."""
    def wrong(name: str, what: str) -> RequestError:
        return RequestError(400, f"`{name}` must be {what}, got {type(getattr(p, name)).__name__}",
                            param=name, code="invalid_type")

    for name in _NUMBERS:
        if not isinstance(getattr(p, name), (int, float)) or isinstance(getattr(p, name), bool):
            raise wrong(name, "a number")
    for name in _INTS:
        if not _is_int(getattr(p, name)):
            raise wrong(name, "an integer")
    for name in _OPTIONAL_INTS:
        if getattr(p, name) is not None and not _is_int(getattr(p, name)):
            raise wrong(name, "an integer or None")
    for name in ("ignore_eos", "skip_special_tokens"):
        if not isinstance(getattr(p, name), bool):
            raise wrong(name, "true or false")
    if not (p.stop is None or isinstance(p.stop, str)
            or (isinstance(p.stop, list) and all(isinstance(s, str) for s in p.stop))):
        raise wrong("stop", "a string or a list of strings")
    if not isinstance(p.stop_token_ids, list) or not all(_is_int(t) for t in p.stop_token_ids):
        raise wrong("stop_token_ids", "a list of token ids")
    if not isinstance(p.logit_bias, dict) or not all(
            _is_int(k) and isinstance(v, (int, float)) for k, v in p.logit_bias.items()):
        raise wrong("logit_bias", "a dict of token id -> number")
    so = p.structured_outputs
    if so is not None and not isinstance(so, StructuredOutputsParams):
        raise wrong("structured_outputs", "a StructuredOutputsParams")
    given = [k for k in so.__struct_fields__ if getattr(so, k) not in (None, False)] if so is not None else []
    if len(given) > 1:
        raise bad_param(f"structured_outputs.{given[1]}",
                        f"only one constraint per request: `{given[0]}` and `{given[1]}` are set")


def check(p: SamplingParams) -> None:
    """The checks that need nothing but the values; RequestError naming the field."""
    _check_types(p)
    if not 1 <= p.n <= MAX_N:
        raise bad_param("n", f"`n` must be in [1, {MAX_N}], got {p.n}")
    _in(p, "temperature", 0.0, 2.0)
    _in(p, "top_p", 0.0, 1.0, lo_open=True)
    _in(p, "min_p", 0.0, 1.0)
    _in(p, "presence_penalty", -PENALTY_RANGE, PENALTY_RANGE)
    _in(p, "frequency_penalty", -PENALTY_RANGE, PENALTY_RANGE)
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise bad_param("repetition_penalty", f"`repetition_penalty` must be > 0, got {p.repetition_penalty}")
    if p.top_k < -1:
        raise bad_param("top_k", f"`top_k` must be -1 or 0 (disabled) or positive, got {p.top_k}")
    if p.seed is not None and not INT64_MIN <= p.seed <= UINT64_MAX:
        raise bad_param("seed", "`seed` must fit in 64 bits")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise bad_param("max_tokens", f"`max_tokens` must be at least 1, got {p.max_tokens}")
    if p.min_tokens < 0:
        raise bad_param("min_tokens", f"`min_tokens` must be >= 0, got {p.min_tokens}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise bad_param("min_tokens",
                        f"`min_tokens` ({p.min_tokens}) must not exceed `max_tokens` ({p.max_tokens})")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad_param(name, f"`{name}` must be in [0, {MAX_LOGPROBS}], got {value}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise bad_param("logit_bias", f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} token ids, got "
                                      f"{len(p.logit_bias)}")
    for token, value in p.logit_bias.items():
        if not math.isfinite(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise bad_param("logit_bias",
                            f"`logit_bias` values must be in [-100, 100], got {value} for token {token}")
        if token < 0:
            raise bad_param("logit_bias", f"`logit_bias` token id {token} is out of range (must be >= 0)")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_param("stop_token_ids", f"`stop_token_ids` may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                                          f"{len(p.stop_token_ids)}")
    if any(t < 0 for t in p.stop_token_ids):
        raise bad_param("stop_token_ids", "`stop_token_ids` must be non-negative token ids")
    stops = p.stop_strings
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise bad_param(f"stop[{i}]", "stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise bad_param(f"stop[{i}]", f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters "
                                          f"long, got {len(s)}")
    if not p.skip_special_tokens:
        raise RequestError(400, "skip_special_tokens=False is not supported by hotstart",
                           param="skip_special_tokens", code="unsupported_parameter")


def logprob_entries(p: SamplingParams, prompt_len: int) -> int:
    """The logprob entries P's answer carries at most (P resolved: max_tokens set)."""
    out = 0
    if p.logprobs is not None:
        out += p.n * (p.max_tokens or 0) * (p.logprobs + 1)
    if p.prompt_logprobs is not None:
        out += p.n * prompt_len * (p.prompt_logprobs + 1)  # echoed once per choice
    return out


def check_logprob_entries(p: SamplingParams, prompt_len: int, param: str = "logprobs") -> None:
    """400 naming PARAM if P's answer would carry more than MAX_LOGPROB_ENTRIES logprobs."""
    entries = logprob_entries(p, prompt_len)
    if entries > MAX_LOGPROB_ENTRIES:
        k = p.logprobs if p.logprobs is not None else p.prompt_logprobs
        echo = " + the echoed prompt's" if p.prompt_logprobs is not None else ""
        raise bad_param(param, f"this request may return {entries} logprobs (n={p.n} x max_tokens="
                               f"{p.max_tokens} x (top {k} + 1){echo}); at most {MAX_LOGPROB_ENTRIES} per "
                               f"request: lower `n`, `max_tokens` or `{param}`, or stream them")


def sampling_fields() -> tuple[str, ...]:
    """The names a user sets (the internal `grammar` and the alias `guided_decoding` left out)."""
    return tuple(f for f in SamplingParams.__struct_fields__ if f not in ("grammar", "guided_decoding"))
