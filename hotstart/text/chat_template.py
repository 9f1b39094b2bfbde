"""Chat templates rendered like transformers renders them, without transformers.

jinja2 in the environment transformers builds (transformers/utils/chat_template_utils.py: sandbox,
trim_blocks/lstrip_blocks, raise_exception, tojson, strftime_now, dict, namespace, loop controls,
{% generation %}), templates found where transformers finds them, messages prepared as it prepares them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.debug  # noqa: F401 - jinja imports it on the first template error: not on a request thread
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotstart.errors import HotstartError

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # templates read the first
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(HotstartError):
    """The chat template is missing, does not compile, or fails on the given messages."""


_ENV: ImmutableSandboxedEnvironment | None = None


def _environment() -> ImmutableSandboxedEnvironment:
    global _ENV
    if _ENV is None:
        if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
            # Older versions have known sandbox escapes, and chat templates from the Hub are untrusted code
            raise ChatTemplateError(f"jinja2 {jinja2.__version__} is too old to run chat templates safely: "
                                    "pip install 'jinja2>=3.1.6'")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                           dict=_TemplateDict(), namespace=_TemplateNamespace)
        _ENV = env
    return _ENV


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Unlike jinja's own tojson: no HTML escaping, and the json.dumps options templates use
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without handing them the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore names ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: render it as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _load_chat_templates(folder: Path, config: dict) -> dict[str, tuple[str, str]]:
    """name -> (source, where). Template files win over tokenizer_config.json, as in transformers."""
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = folder / "chat_template.jinja"
    if (folder / "additional_chat_templates").is_dir():
        files.update({p.name.removesuffix(".jinja"): p
                      for p in sorted((folder / "additional_chat_templates").glob("*.jinja"))})
    if files:
        try:
            return {name: (p.read_text(encoding="utf-8"), str(p)) for name, p in files.items()}
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"chat template unreadable: {e}") from None
    where = f"{folder / 'tokenizer_config.json'}: chat_template"
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": (value, where)}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: (t["template"], f"{where}[{t['name']}]") for t in value}
    raise ChatTemplateError(f"{where}: expected a string or a list of {{'name', 'template'}} objects")


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types only, so the sandbox never sees objects with dangerous methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums, ...) carry extra methods: keep only the base type's value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _plain_message(message, index: int) -> dict:
    plain = _plain(message)
    if not isinstance(plain, dict):
        raise ChatTemplateError(f"messages[{index}]: expected a JSON object, got {type(message).__name__}")
    # APIs send content=None / tool_calls=None; templates handle a missing key better than a None
    return {k: v for k, v in plain.items() if v is not None}


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # Fill reasoning_content from its other names, and `thinking` for the templates that read that
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict], field: bool | str, source: str) -> str:
    """Append a tag to the last message's text, so the rendered prompt can be cut right after it."""
    field = field if isinstance(field, str) else "content"
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message: the last message has no {field!r} to continue")
    fields = [f for f in REASONING_FIELDS if last.get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in source for f in fields):
        raise ChatTemplateError(f"continue_final_message: the chat template does not use {field!r}")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise ChatTemplateError("continue_final_message: the last message has no text part to continue")
    for f in fields:
        last[f] = last[f] + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the chat template dropped part of the last message")
    at = text.rindex(tag)
    # A template that strips the message's trailing space strips the tag's too
    return text[:at] if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
