"""Tool calls (torch-free): the model's text -> OpenAI `tool_calls`, tool_choice as a grammar, and
assistant tool calls as chat templates expect them.

Parsers (`--tool-call-parser`, else chosen from the chat template's text by detect_parser):
  hermes       Qwen2.5 / Qwen3 / Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one
               block per call; text outside the blocks is content
  llama3_json  Llama 3.x: {"name": ..., "parameters": {...}} (after <|python_tag|>, which decoding drops),
               several separated by ";"; an answer that does not start with "{" is content
tool_choice "required" / {"type": "function", "function": {"name"}} are enforced by tool_grammar: the
answer must be one (or, with parallel_tool_calls, several) calls in the parser's format, arguments valid
against the function's JSON schema. Streaming (ToolStream): content is sent as it comes, except text that
may be the start of a call; each call is sent whole, in one delta, as soon as it is complete (hermes: at
its </tool_call>; llama3_json: at the end of the answer).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from typing import Any

from hotstart.errors import bad_param
from hotstart.frontend.structured import TOOL_JSON, WHITESPACE, closed_objects, compile_grammar, constraint
from hotstart.frontend.validation import check_depth, loads_json

HERMES, LLAMA3 = "hermes", "llama3_json"
PARSERS = (HERMES, LLAMA3)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_BLOCK = re.compile(r"\s*(\{.*\})\s*$", re.DOTALL)


def detect_parser(template: str | None) -> str:
    """The parser a chat template's text asks for: llama3_json for Llama 3.x markers, else hermes."""
    if template and OPEN not in template and (PYTHON_TAG in template or '"parameters"' in template):
        return LLAMA3
    return HERMES


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call: id call_<hex>, arguments as JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _loads(text: str) -> Any:
    """A model's JSON; ValueError if it is none, or nests deeper than a request may (it is text then)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    check_depth(value, "tool call")  # a RequestError is a ValueError
    return value


def _call(obj: Any) -> dict[str, Any] | None:
    """{"name", "arguments" | "parameters"} -> a tool call, or None if OBJ is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = _loads(args)
        except ValueError:
            return None
    return new_call(obj["name"], args) if isinstance(args, dict) else None


def _json_call(text: str) -> dict[str, Any] | None:
    m = _BLOCK.match(text)
    if m is None:
        return None
    try:
        return _call(_loads(m.group(1)))
    except ValueError:
        return None


def _llama3_calls(text: str) -> list[dict[str, Any]] | None:
    """Calls separated by ";" (the whole text), or None if it is not only calls."""
    s, decoder, calls, pos = text.strip().removeprefix(PYTHON_TAG), json.JSONDecoder(), [], 0
    while True:
        while pos < len(s) and (s[pos].isspace() or s[pos] == ";"):
            pos += 1
        if pos == len(s):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(s, pos)
            check_depth(obj, "tool call")
        except (ValueError, RecursionError):  # not JSON, or nested deeper than a request may be: text
            return None
        if (call := _call(obj)) is None:
            return None
        calls.append(call)


class ToolStream:
    """One choice's text -> (content to send now, tool calls complete now), as it streams."""

    def __init__(self, parser: str) -> None:
        self.parser, self.buf, self.calls = parser, "", 0
        self.in_call = False  # hermes: buf starts with an open <tool_call>
        self.decided = parser == HERMES  # llama3_json: whether the answer is calls (starts with "{")
        self.spaces = ""  # blanks after a call, sent only if more content follows

    def _content(self, text: str) -> str:
        if self.calls and not text.strip():
            self.spaces += text
            return ""
        text, self.spaces = self.spaces + text, ""
        return text

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        if self.parser == LLAMA3:
            if not self.decided:
                head = self.buf.lstrip()
                if not head:
                    return "", []
                self.decided, self.in_call = True, head.startswith(("{", PYTHON_TAG))
            if self.in_call:
                return "", []
            out, self.buf = self.buf, ""
            return out, []
        content, calls = "", []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:  # hold back a tail that may become <tool_call>
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                                 if OPEN.startswith(self.buf[-k:])), 0)
                    cut = len(self.buf) - keep
                    content += self._content(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return content, calls
                content += self._content(self.buf[:i])
                self.buf, self.in_call = self.buf[i:], True
            j = self.buf.find(CLOSE)
            if j < 0:
                return content, calls
            block, self.buf, self.in_call = self.buf[:j + len(CLOSE)], self.buf[j + len(CLOSE):], False
            call = _json_call(block[len(OPEN):-len(CLOSE)])
            if call is None:
                content += self._content(block)
            else:
                calls.append(call)
                self.calls += 1

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end of the answer."""
        rest, self.buf = self.buf, ""
        if self.parser == LLAMA3:
            calls = _llama3_calls(rest) if self.in_call else None
            if calls:
                self.calls += len(calls)
                return "", calls
            return rest, []
        if self.in_call and (call := _json_call(rest[len(OPEN):])) is not None:  # no </tool_call>
            self.calls += 1
            return "", [call]
        return (self._content(rest) if rest.strip() else ""), []


def parse(parser: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer -> (content or None, tool calls)."""
    stream = ToolStream(parser)
    content, calls = stream.feed(text)
    more, late = stream.finish()
    content = (content + more).strip() if calls or late else content + more
    return content or None, calls + late


# --- requests ---------------------------------------------------------------------------------------

def forced_names(tools: list[dict[str, Any]] | None, choice: Any) -> list[str] | None:
    """The functions the answer must call (tool_choice "required" / named), None if not forced; 400s."""
    names = [t["function"]["name"] for t in tools or []]
    if choice in (None, "auto", "none"):
        return None
    if not names:
        raise bad_param("tool_choice", "`tool_choice` needs `tools`")
    if choice == "required":
        return names
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_param("tool_choice", '`tool_choice` must be "none", "auto", "required" or '
                                           '{"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise bad_param("tool_choice", f"`tool_choice` names `{name}`, which is not in `tools`")
        return [name]
    raise bad_param("tool_choice", f'unknown `tool_choice` {choice!r} (none, auto, required or a function)')


def _function_schema(fn: dict[str, Any], key: str) -> dict[str, Any]:
    params = closed_objects(copy.deepcopy(fn.get("parameters") or {"type": "object"}))
    schema: dict[str, Any] = {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
                              "required": ["name", key], "additionalProperties": False,
                              "x-guidance": {**TOOL_JSON, "lenient": True}}
    for defs in ("$defs", "definitions"):  # "#/$defs/X" references resolve against the root
        if isinstance(params.get(defs), dict):
            schema[defs] = params.pop(defs)
    return schema


def tool_grammar(tools: list[dict[str, Any]], names: list[str], parser: str, parallel: bool,
                 answer: dict[str, Any] | None = None) -> str:
    """Lark text for llguidance: calls to NAMES in PARSER's format (several if PARALLEL); with ANSWER (a
    JSON schema), that JSON answer is allowed instead of calls (tool_choice auto + response_format)."""
    key = "arguments" if parser == HERMES else "parameters"
    fns = [t["function"] for t in tools if t["function"]["name"] in names]
    rules = [
        f"fn{i}: %json {json.dumps(_function_schema(fn, key), ensure_ascii=False)}"
        for i, fn in enumerate(fns)
    ]
    alts = " | ".join(f"fn{i}" for i in range(len(fns)))
    call = f'"{OPEN}\\n" ({alts}) "\\n{CLOSE}"' if parser == HERMES else f"({alts})"
    sep = '"\\n"' if parser == HERMES else '"; "'
    calls = f"call ({sep} call)*" if parallel else "call"
    start = "start: calls | answer" if answer is not None else "start: calls"
    lines = [start, f"calls: {calls}", f"call: {call}", *rules]
    if answer is not None:
        lines.append(f"answer: %json {json.dumps(answer, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as Hugging Face chat templates expect them: arguments as a dict (OpenAI sends
    JSON text; Qwen's and Llama's templates apply `tojson` to it), as vLLM hands them over too."""
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):  # left as text unless it is JSON
                    args = loads_json(fn["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments",
                                      lenient=True)
                    if isinstance(args, dict):
                        fn["arguments"] = args
                calls.append({**call, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def chat_grammar(req: Any, parser: str) -> str | None:
    """The grammar of a chat request: its tool_choice (required / named), else its response_format /
    structured outputs; with tools under tool_choice auto and a JSON constraint, calls or that JSON."""
    names = forced_names(req.tools, req.tool_choice)
    found = constraint(req)
    if names is not None:
        if found is not None:
            raise bad_param(found[2], f"`{found[2]}` cannot be combined with tool_choice {req.tool_choice!r}")
        parallel = req.parallel_tool_calls is not False and not isinstance(req.tool_choice, dict)
        return compile_grammar(
            "lark", tool_grammar(req.tools, names, parser, parallel), "tools", lenient=True
        )
    if found is None:
        return None
    kind, spec, param, lenient = found
    if req.tools and req.tool_choice != "none" and kind == "json":
        names = [t["function"]["name"] for t in req.tools]
        schema = spec if isinstance(spec, dict) else {}
        answer = {**schema, "x-guidance": {"whitespace_pattern": WHITESPACE, "lenient": lenient}}
        return compile_grammar("lark", tool_grammar(req.tools, names, parser, True, answer), param, lenient)
    return compile_grammar(kind, spec, param, lenient)


def chat_message(parser: str | None, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, finish_reason) of a whole answer; with PARSER, its tool calls parsed
    (finish_reason "tool_calls" when the answer ended by itself)."""
    if parser is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = parse(parser, text)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": calls,
    }, "tool_calls" if reason == "stop" else reason
