"""The Responses API, /tokenize and /detokenize on a real `hotstart serve`: the openai client (plain,
streamed, a previous_response_id follow-up) and an OpenAI Agents SDK agent with one function tool."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.server import openai_client, serving

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(default_model_dir):
    yield from serving("--max-model-len", "1024", "--max-num-seqs", "8", "--api-key", "sk-test")


@pytest.fixture(scope="module")
def client(server):
    c = openai_client(server)
    c.api_key = "sk-test"
    return c


def test_responses_plain_streamed_follow_up(client):
    r = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8, temperature=0)
    assert r.output_text and r.usage.output_tokens <= 8
    kinds = [e.type for e in client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8,
                                                     temperature=0, stream=True)]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and "response.output_text.delta" in kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    follow = client.responses.create(model=MODEL, input="And another.", previous_response_id=r.id,
                                     max_output_tokens=4)
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_tokenize_detokenize_round_trip(server, default_model_dir):
    import httpx

    from hotstart.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    headers = {"Authorization": "Bearer sk-test"}
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    text = "Round trips: café, 東京, 🙂."
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}, headers=headers).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=headers).json()
    assert back["prompt"] == tok.decode(r["tokens"]) and text in back["prompt"]


def test_agents_sdk_agent_with_a_function_tool(server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def main():
        oai = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=600)
        agent = Agent(name="weather", instructions="Answer with the get_weather tool.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=oai),
                      model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
                      tool_use_behavior="stop_on_first_tool")
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = asyncio.run(main())
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert result.final_output == f"sunny in {calls[0]}"
    assert json.dumps(result.raw_responses[0].usage.input_tokens)
