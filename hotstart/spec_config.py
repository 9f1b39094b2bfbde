"""`--speculative-config`: vLLM's JSON spelling of speculative decoding, parsed and checked (stdlib only:
the API process and `hotstart --help` read it without torch). Only prompt lookup ("ngram") exists here;
the engine's half is engine/spec_decode.py, imported only when the option is set."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

MAX_DRAFT = 32  # num_speculative_tokens
MAX_NGRAM = 64  # prompt_lookup_max


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # K: tokens drafted per sequence and step
    prompt_lookup_max: int = 5  # longest n-gram matched against the context
    prompt_lookup_min: int = 5  # shortest

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> SpecConfig:
        """From the JSON text (or the dict LLM(speculative_config=...) takes); ValueError names what is
        wrong. vLLM's defaults: a missing prompt_lookup_min / max equals the other bound; neither: 5."""
        if isinstance(text, dict):
            obj = text
        else:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(obj, dict):
            raise ValueError('expected a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(obj) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(map(repr, unknown))} (known: method, "
                "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)"
            )
        if obj.get("method") != "ngram":
            raise ValueError(
                f'method must be "ngram" (prompt lookup; no draft models here), got {obj.get("method")!r}'
            )
        for key, high in (
            ("num_speculative_tokens", MAX_DRAFT),
            ("prompt_lookup_max", MAX_NGRAM),
            ("prompt_lookup_min", MAX_NGRAM),
        ):
            v = obj.get(key)
            if v is not None and (type(v) is not int or not 1 <= v <= high):
                raise ValueError(f"{key} must be an integer from 1 to {high}, got {v!r}")
        if "num_speculative_tokens" not in obj:
            raise ValueError("num_speculative_tokens is required")
        lo, hi = obj.get("prompt_lookup_min"), obj.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = cls.prompt_lookup_min, cls.prompt_lookup_max
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        return cls("ngram", obj["num_speculative_tokens"], hi, lo)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def speculative_config(text: str) -> str:
    """argparse type of --speculative-config: the checked config as canonical JSON text (configs travel
    as plain data)."""
    try:
        return SpecConfig.parse(text).to_json()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


speculative_config.metavar = "JSON"
