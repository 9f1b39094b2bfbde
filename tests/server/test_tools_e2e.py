"""Tool calling and structured outputs end to end: a real `hotstart serve`, the real `openai` client (tools
loop, chat.completions.parse with a pydantic model, streams) and LangChain (bind_tools,
with_structured_output), on the default model; and a random-weight Qwen2-shaped model with a Qwen2.5
chat template (hermes chosen from it), sampled hot, whose forced calls must still be valid."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.models import DATA, make_tiny
from helpers.server import Server, openai_client, serving
from openai import OpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time of a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 20}},
            "required": ["tz"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class City(BaseModel):
    # bounded where a 135M model would otherwise repeat digits until max_tokens ("length")
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def server(default_model_dir):
    yield from serving("--max-model-len", "2048", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server)


def test_openai_tools_loop(client):
    """call -> tool result -> final answer; the call is forced (the 135M model rarely picks tools itself)."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER_PARAMS)
    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=40
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.mark.parametrize("temperature,seed", [(0, None), (1.0, 1), (1.0, 2)])
def test_openai_parse_with_pydantic(client, temperature, seed):
    r = client.chat.completions.parse(
        model=MODEL,
        response_format=City,
        temperature=temperature,
        seed=seed,
        max_tokens=500,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    )
    assert r.choices[0].finish_reason == "stop"
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_and_schema_streamed_and_not(client, stream):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 80},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["answer"],
    }
    formats = [{"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}]
    for fmt in formats:
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            response_format=fmt,
            temperature=0,
            max_tokens=300,
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            r = client.chat.completions.create(**kw)
            text, reason = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert reason == ["stop"], (fmt, text)
        value = json.loads(text)
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            jsonschema.validate(value, schema)


def test_completions_guided_choice_and_regex(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Is Paris in France? Answer:",
        max_tokens=10,
        temperature=1.0,
        n=4,
        seed=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert {c.text for c in r.choices} <= {"yes", "no"} and all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="The year Paris hosted the Olympics:", max_tokens=10,
                                  temperature=0, extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()


def test_streamed_named_tool_call(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], stream=True, temperature=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1  # one delta carries the whole call: id, type, name and arguments
    assert calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_PARAMS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_invalid_schema_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "integr"}}}}})
    assert e.value.body["param"] == "response_format" and "integr" in e.value.body["message"]


def test_langchain_bind_tools_and_structured_output(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather of a city (unit: celsius or fahrenheit)."""
        return f"21 degrees {unit} in {city}"

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=200,
        max_retries=0,
        timeout=120,
    )
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert (
        call["name"] == "get_weather"
        and set(call["args"]) == {"city", "unit"}
        and call["id"].startswith("call_")
    )
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
        assert isinstance(city, City) and city.name, method


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory, default_model_dir):
    d = make_tiny(
        tmp_path_factory.mktemp("qwen-tools") / "m", (DATA / "qwen2.5_chat_template.jinja").read_text()
    )
    yield from serving(str(d), "--served-model-name", "tiny", "--max-model-len", "1024", "--dtype", "float32")


def test_random_model_forced_calls_are_valid(qwen_server):
    client = openai_client(qwen_server)
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, temperature=0)
    kw = dict(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=300, temperature=1.5, n=4, seed=11
    )
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the Qwen template rendered the tools
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        schema = WEATHER_PARAMS if call.function.name == "get_weather" else TIME["function"]["parameters"]
        jsonschema.validate(args, schema)
    r = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw
    )
    assert all(c.message.tool_calls[0].function.name == "get_time" for c in r.choices)


def test_api_process_imports_grammar_library_on_its_main_thread(default_model_dir, tmp_path):
    audit = tmp_path / "audit.json"
    s = Server("--max-model-len", "512", env={"HOTSTART_AUDIT_IMPORTS": str(audit)})
    try:
        client = openai_client(s)
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                           extra_body={"guided_choice": ["sunny", "rainy"]})
        assert r.choices[0].message.content in ("sunny", "rainy")
    finally:
        s.stop()
    report = json.loads(audit.read_text())
    assert report["off_main_thread"] == [] and report["torch_imported"] is False
