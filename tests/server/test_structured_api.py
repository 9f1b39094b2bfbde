"""Structured outputs and tool calls in the HTTP layer, against test_api's FakeEngine (scripted token ids)
and the real default-model tokenizer: which grammar reaches the engine, 400s naming the parameter,
OpenAI's tool_calls (whole and streamed deltas) and finish reasons."""

from __future__ import annotations

import json

import pytest
from helpers.api import MODEL, ScriptedEngine, assert_error, chat_body, engine_core, make_client, sse_events

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture
def engine(default_model_dir, tok):
    engine = ScriptedEngine(engine_core(default_model_dir, max_model_len=1024), tok.eos_token_id)
    yield engine
    engine.stop()


@pytest.fixture
def client(engine, tok):
    return make_client(engine, tok)


def grammar_sent(engine) -> str | None:
    (_, params), = engine.requests.values()
    return params.grammar


@pytest.mark.parametrize(
    "path,patch",
    [
        ("chat", {"response_format": {"type": "json_object"}}),
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA, "strict": True},
                }
            },
        ),
        ("chat", {"structured_outputs": {"regex": "[a-z]+"}}),
        ("chat", {"structured_outputs": {"choice": ["yes", "no"]}}),
        ("chat", {"guided_json": json.dumps(SCHEMA)}),
        ("chat", {"guided_grammar": 'start: "a" | "b"'}),
        ("chat", {"tools": [WEATHER], "tool_choice": "required"}),
        (
            "chat",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ),
        ("chat", {"tools": [WEATHER], "response_format": {"type": "json_object"}}),  # calls or JSON
        ("completions", {"response_format": {"type": "json_object"}}),
        ("completions", {"guided_choice": ["left", "right"]}),
    ],
)
def test_constraints_reach_the_engine_as_grammars(client, engine, path, patch):
    # a few tokens: the grammar's arrival is what is checked (unbounded, a JSON answer that never closes
    # runs to the context's end on the real model)
    base = chat_body(max_tokens=8) if path == "chat" else {"model": MODEL, "prompt": "hello", "max_tokens": 8}
    r = client.post(f"/v1/{'chat/' if path == 'chat' else ''}completions", json={**base, **patch})
    assert r.status_code == 200, r.text
    import llguidance

    grammar = grammar_sent(engine)
    assert grammar and llguidance.LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize("patch", [{}, {"response_format": {"type": "text"}}, {"tools": [WEATHER]},
                                   {"tools": [WEATHER], "tool_choice": "none"}])
def test_no_constraint_no_grammar(client, engine, patch):
    assert client.post("/v1/chat/completions", json=chat_body(**patch)).status_code == 200
    assert grammar_sent(engine) is None


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            }
        },
        "response_format",
        "objec",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                },
            }
        },
        "response_format",
        "missing",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "string", "format": "zodiac-sign"}},
                    },
                },
            }
        },
        "response_format",
        "format",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": "nope"}},
        "response_format.json_schema",
        None,
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        "response_format.json_schema.schema",
        None,
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
        None,
    ),
    ({"response_format": "json"}, "response_format", None),
    ({"guided_regex": "(ab"}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", None),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ({"guided_json": "{not json"}, "guided_json", None),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"tool_choice": "required"}, "tool_choice", None),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
        "tool_choice",
        "other",
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "combined",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
            "tool_choice": "required",
        },
        "tools",
        None,
    ),
]


@pytest.mark.parametrize("patch,param,needle", BAD)
def test_bad_constraints_are_400s_naming_the_param(client, engine, patch, param, needle):
    err = assert_error(client.post("/v1/chat/completions", json=chat_body(**patch)), 400, param)
    if needle:
        assert needle in err["message"], err
    assert not engine.requests


def test_tool_calls_answer(client, engine, tok):
    engine.script = tok.encode(CALL_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    r = client.post("/v1/chat/completions", json=chat_body(tools=[WEATHER])).json()
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Checking." and msg["role"] == "assistant"
    (call,) = msg["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Paris"
    }
    # tool_choice none: the text stays text
    r = client.post("/v1/chat/completions", json=chat_body(tools=[WEATHER], tool_choice="none")).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert r["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_streamed_as_whole_call_deltas(client, engine, tok):
    engine.script = tok.encode(CALL_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    r = client.post("/v1/chat/completions", json=chat_body(tools=[WEATHER], stream=True))
    events = sse_events(r.text)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.strip() == "Checking." and "<tool" not in content
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_off_and_llama3_parser(engine, tok):
    from hotstart.frontend.tools import LLAMA3

    engine.script = tok.encode(CALL_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    off = make_client(engine, tok, auto_tool_choice=False)
    r = off.post("/v1/chat/completions", json=chat_body(tools=[WEATHER])).json()
    assert r["choices"][0]["message"]["content"] == CALL_TEXT
    llama = make_client(engine, tok, tool_call_parser=LLAMA3)
    engine.script = tok.encode('{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                               add_special_tokens=False) + [tok.eos_token_id]
    r = llama.post("/v1/chat/completions", json=chat_body(tools=[WEATHER])).json()
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert r["choices"][0]["message"]["content"] is None
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_closed_objects():
    from hotstart.frontend.structured import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "properties": {"type": "string"},
        },
        "$defs": {"D": {"properties": {"x": {}}}},
        "allOf": [{"properties": {"y": {}}}],
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert (
        out["$defs"]["D"]["additionalProperties"] is False and "additionalProperties" not in out["allOf"][0]
    )
    assert "additionalProperties" not in out["properties"]["properties"]
    assert closed_objects({"properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in schema  # a copy


def test_startup_imports_no_grammar_library():
    import subprocess
    import sys

    code = ("import sys, hotstart.server.api, hotstart.server.launch, hotstart.engine.worker; "
            "assert 'llguidance' not in sys.modules, 'llguidance imported at startup'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
