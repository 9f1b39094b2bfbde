"""Structured outputs (torch-free): a request's constraint -> an llguidance grammar for the engine.

Sources, at most one per request (else 400):
  response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema",
                    "strict"}} (OpenAI; chat and completions), "text" = none
  structured_outputs {"json": schema, "regex": str, "choice": [str], "grammar": lark, "json_object": true}
                    (vLLM)
  guided_json, guided_regex, guided_choice, guided_grammar (vLLM's older fields)
Tools with tool_choice "required" / a named function are constrained too (hotstart/frontend/tools.py).

The grammar is built and validated here, so that a bad schema is a 400 naming the parameter with
llguidance's own message; the engine compiles it against the tokenizer (engine/grammar.py). llguidance
is imported on the first constrained request, on the event loop's (main) thread, never at startup (the
grammars are then built on the worker pool's threads, server/offload.py: they never import).
JSON gets at most WHITESPACE between tokens: a model (a random one certainly) cannot loop on blanks.
`strict: true` refuses what llguidance does not implement (unknown `format`s, ...); otherwise such
keywords are ignored, as OpenAI's non-strict mode does not enforce the schema either. An object schema
that leaves additionalProperties unset gets no extra properties (closed_objects; vLLM's default xgrammar
backend does the same): the answer still validates against the schema as written, and a model cannot
wander off into properties nobody asked for. `"additionalProperties": true` allows them.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import msgspec

from hotstart.errors import RequestError, bad_param, unsupported
from hotstart.frontend.validation import loads_json
from hotstart.lru import ByteLRU, digest

WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"  # JSON whitespace, at most 24 characters in a row
TOOL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # tojson's style
MAX_ERROR_CHARS = 600
# built grammars by the SHA-256 of (kind, spec, lenient): at most 256 of them and 32 MiB of their text
CACHE_ITEMS, CACHE_BYTES = 256, 32 << 20
_cache = ByteLRU(CACHE_ITEMS, CACHE_BYTES)
_cache_lock = threading.Lock()  # requests build grammars on the worker pool's threads (server/offload.py)
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/\"")


def llguidance() -> Any:
    import llguidance as llg  # noqa: PLC0415 - loaded by the first constrained request

    return llg


def _build(kind: str, spec: str, lenient: bool) -> tuple[str | None, str | None]:
    """(grammar, None) or (None, llguidance's error), cached."""
    key = digest(kind, spec, "lenient" if lenient else "strict")
    with _cache_lock:
        found = _cache.get(key)
    if found is None:
        found = _compile(kind, spec, lenient)
        with _cache_lock:
            _cache.put(key, found, len(found[0] or found[1] or ""))
    return found


def _compile(kind: str, spec: str, lenient: bool) -> tuple[str | None, str | None]:
    matcher = llguidance().LLMatcher
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(spec, defaults={"whitespace_pattern": WHITESPACE,
                                                                       "lenient": lenient})
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        else:
            grammar = matcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as e:
        return None, str(e)
    is_error, messages = matcher.validate_grammar_with_warnings(grammar)
    return (None, messages[0] if messages else "invalid grammar") if is_error else (grammar, None)


def compile_grammar(kind: str, spec: Any, param: str, lenient: bool = True) -> str:
    """KIND (json | regex | lark) SPEC -> llguidance grammar JSON, or 400 naming PARAM. A JSON schema's
    objects are closed (closed_objects)."""
    if kind == "json":
        spec = closed_objects(spec)
    text = spec if isinstance(spec, str) else json.dumps(spec, ensure_ascii=False)
    grammar, error = _build(kind, text, lenient)
    if error is not None:
        what = {"json": "JSON schema", "regex": "regular expression", "lark": "grammar"}[kind]
        raise RequestError(400, f"invalid {what} in `{param}`: {error.strip()[:MAX_ERROR_CHARS]}",
                           param=param,
                           code="invalid_value")
    return grammar


_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_AS_IS = ("allOf", "const", "enum", "default", "examples", "required")


def closed_objects(schema: Any) -> Any:
    """A copy of SCHEMA where object schemas with `properties` and no additionalProperties (nor
    unevaluated / pattern properties) get additionalProperties false; allOf members are left alone (each
    closed, they would forbid each other's properties)."""
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _MAPS and isinstance(v, dict):  # name -> schema
            out[k] = {name: closed_objects(sub) for name, sub in v.items()}
        else:
            out[k] = v if k in _AS_IS else closed_objects(v)
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def escape_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def choice_regex(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_param(param, f"`{param}` must be a non-empty list of non-empty strings")
    return "(" + "|".join(escape_regex(c) for c in choices) + ")"


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):  # vLLM accepts the schema as JSON text too
        value = loads_json(value, param)
    if not isinstance(value, (dict, bool)):
        raise bad_param(param, f"`{param}` must be a JSON schema (an object)")
    return value


def _response_format(rf: dict[str, Any]) -> tuple[str, Any, str, bool] | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", {"type": "object"}, "response_format", True
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_param("response_format.json_schema", "`response_format.json_schema` must be an object")
        if not isinstance(js.get("name"), str) or not js["name"]:  # required by OpenAI too
            raise bad_param(
                "response_format.json_schema.name",
                "`response_format.json_schema.name` must be a non-empty string",
            )
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_param("response_format.json_schema.strict", "`strict` must be a boolean")
        schema = _schema(js.get("schema", {"type": "object"}), "response_format.json_schema.schema")
        return "json", schema, "response_format", not strict
    raise unsupported("response_format.type", f"response_format `{kind}` (text, json_object, json_schema)")


def constraint(req: Any) -> tuple[str, Any, str, bool] | None:
    """(kind, spec, param, lenient) of REQ's constraint, or None; 400 if it sets more than one."""
    found: list[tuple[str, Any, str, bool]] = []
    response_format = getattr(req, "response_format", None)  # REQ: an HTTP request or a SamplingParams
    if isinstance(response_format, dict):
        if (c := _response_format(response_format)) is not None:
            found.append(c)
    elif response_format is not None:
        raise bad_param("response_format", "`response_format` must be an object")
    so = req.structured_outputs or {}
    if isinstance(so, msgspec.Struct):  # the offline API's StructuredOutputsParams
        so = msgspec.structs.asdict(so)
    fields = [(f"structured_outputs.{k}", so.get(k)) for k in ("json", "regex", "choice", "grammar")]
    fields += [(f"guided_{k}", getattr(req, f"guided_{k}", None))
               for k in ("json", "regex", "choice", "grammar")]
    for param, value in fields:
        if value is None:
            continue
        key = param.rsplit(".", 1)[-1].removeprefix("guided_")
        if key == "json":
            found.append(("json", _schema(value, param), param, True))
        elif key == "choice":
            found.append(("regex", choice_regex(value, param), param, True))
        elif not isinstance(value, str) or not value:
            raise bad_param(param, f"`{param}` must be a non-empty string")
        else:
            found.append(("regex" if key == "regex" else "lark", value, param, True))
    if so.get("json_object"):
        found.append(("json", {"type": "object"}, "structured_outputs.json_object", True))
    if len(found) > 1:
        raise bad_param(
            found[1][2], f"only one constraint per request: `{found[0][2]}` and `{found[1][2]}` are set"
        )
    return found[0] if found else None


def request_grammar(req: Any) -> str | None:
    """The llguidance grammar REQ's response_format / structured_outputs / guided_* ask for, or None."""
    c = constraint(req)
    return None if c is None else compile_grammar(c[0], c[1], c[2], c[3])
