"""POST /v1/responses, /tokenize and /detokenize through the real openai client, over the app in memory
(starlette's TestClient as the client's transport) and the real in-process engine on the default model."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from helpers.api import MODEL, assert_error, engine_core, make_client

from hotstart.boot.timeline import Timeline
from hotstart.frontend.inprocess import InProcessEngineClient

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                          "n": {"type": "integer", "maximum": 1000}},
          "required": ["city", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def http(default_model_dir, tok):
    engine = InProcessEngineClient(engine_core(default_model_dir, max_model_len=1024), Timeline(time.time()))
    engine.start_stepping()
    with make_client(engine, tok) as client:
        yield client
    engine.stop()


@pytest.fixture(scope="module")
def oai(http):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_plain_and_follow_up(oai, http):
    r = oai.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=8,
                             temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.input_tokens > 5 and 1 <= r.usage.output_tokens <= 8
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]})
    assert chat.json()["choices"][0]["message"]["content"] == r.output_text  # the same chat machinery
    follow = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "Again."}],
                                  previous_response_id=r.id, max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == r.id
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens  # the history is in
    gone = http.post("/v1/responses",
                     json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"})
    assert_error(gone, 404, "previous_response_id")
    unstored = oai.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    assert_error(http.post("/v1/responses", json={"model": MODEL, "input": "y",
                                                 "previous_response_id": unstored.id}), 404)


def test_stream_event_order(oai):
    events = list(oai.responses.create(model=MODEL, input="Count to five.", max_output_tokens=10,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert deltas and kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                    "response.content_part.added"]
    assert kinds[deltas[-1] + 1:] == ["response.output_text.done", "response.content_part.done",
                                      "response.output_item.done", kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(events[i].delta for i in deltas)
    assert events[-1].response.output_text == text == events[deltas[-1] + 1].text


def test_json_schema(oai):
    r = oai.responses.create(model=MODEL, input="A city and a number as JSON.", max_output_tokens=100,
                             temperature=0,
                             text={"format": {"type": "json_schema", "name": "c", "schema": SCHEMA,
                                              "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    r = oai.responses.create(model=MODEL, input="JSON please.", max_output_tokens=100, temperature=0,
                             text={"format": {"type": "json_object"}})
    assert r.output_text.lstrip().startswith("{")  # a small model may not close it within the budget
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call_and_its_output(oai, stream):
    kw = {"model": MODEL, "input": "Weather in Paris?", "temperature": 0, "tools": [WEATHER],
          "max_output_tokens": 100,
          "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        events = list(oai.responses.create(**kw, stream=True))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        r = events[-1].response
    else:
        r = oai.responses.create(**kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id
    follow = oai.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize("patch,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "c", "schema": 3}}}, None),
    ({"input": 5}, "input"),
])
def test_bad_requests_name_the_field(http, patch, param):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **patch})
    assert_error(r, 400, param)


def test_tokenize_detokenize(http, tok):
    text = "Hello, tokenizers!"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": tok.decode(r["tokens"])}
    messages = [{"role": "user", "content": "Hi there"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == tok.encode_chat(messages, True) and r["token_strs"] is None
    assert_error(http.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "model")
    assert_error(http.post("/tokenize", json={"prompt": "x", "messages": messages}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")


def test_api_key_applies(default_model_dir, tok):
    engine = InProcessEngineClient(engine_core(default_model_dir, max_model_len=1024), Timeline(time.time()))
    with make_client(engine, tok, api_key="k") as client:
        for path in ("/tokenize", "/detokenize", "/v1/responses"):
            assert client.post(path, json={"prompt": "x"}).status_code == 401
        ok = client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
