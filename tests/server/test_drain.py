"""The drain (server/gate.py Drain, begun by SIGTERM in server/launch.py) and the vLLM-named metrics,
over the real in-process engine with scripted outputs (fast: no server process; the SIGTERM itself is
tests/server/test_drain_e2e.py's)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from helpers.api import MODEL, ScriptedEngine, assert_error, chat_body, engine_core, make_client

from hotstart.server.gate import Drain
from hotstart.text.tokenizer import Tokenizer

VLLM_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
               "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
               "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket")


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture
def engine(default_model_dir, tok):
    engine = ScriptedEngine(engine_core(default_model_dir, max_model_len=256), tok.eos_token_id)
    yield engine
    engine.stop()


@pytest.fixture
def client(engine, tok):
    return make_client(engine, tok)


def events(lines: list[str]) -> list:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def test_draining_refuses_new_requests_and_turns_readiness_only(client):
    assert client.get("/health").status_code == 200 and client.get("/live").json() == {"status": "alive"}
    client.app.state.drain.begin()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "draining" and r.headers["retry-after"] == "1"
    assert client.get("/live").status_code == 200  # liveness: the process serves, do not restart it
    for method, path, body in (("POST", "/v1/chat/completions", chat_body()), ("GET", "/v1/models", None)):
        r = client.request(method, path, json=body)
        assert_error(r, 503, code="server_draining")
        assert r.headers["retry-after"] == "1"
    text = client.get("/metrics").text
    assert "hotstart_draining 1.0" in text
    assert 'hotstart_http_requests_total{endpoint="/v1/chat/completions",status="503"} 1.0' in text


def test_live_needs_no_api_key(engine, tok):
    c = make_client(engine, tok, api_key="k")
    assert c.get("/live").status_code == 200 and c.get("/v1/models").status_code == 401


def test_stream_in_flight_finishes_normally_while_draining(client, engine):
    engine.delay = 0.02
    drain = client.app.state.drain
    with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
        lines = r.iter_lines()
        got = [next(lines), next(lines)]
        assert drain.in_flight == 1
        drain.begin()
        assert client.get("/health").status_code == 503
        assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 503)
        got += list(lines)
    assert got[-2:] == ["data: [DONE]", ""] or got[-1] == "data: [DONE]", got[-3:]
    evs = events(got)
    assert not any("error" in e for e in evs)
    assert evs[-1]["choices"][0]["finish_reason"] == "stop"
    assert drain.in_flight == 0 and asyncio.run(drain.wait_idle(0.1))


def test_forced_drain_ends_streams_with_an_error_event(client, engine):
    engine.delay = 0.05
    drain = client.app.state.drain
    with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
        lines = r.iter_lines()
        got = [next(lines), next(lines)]
        drain.force()
        got += list(lines)
    assert "data: [DONE]" in got
    err = [e for e in events(got) if "error" in e]
    assert err and err[0]["error"]["code"] == "engine_dead" and "shutting down" in err[0]["error"]["message"]


def test_forced_drain_answers_a_request_in_flight_with_503(client, engine):
    engine.delay = 0.05
    drain = client.app.state.drain
    import threading

    threading.Timer(0.3, drain.force).start()
    assert_error(client.post("/v1/chat/completions", json=chat_body()), 503, code="engine_dead")


def test_wait_idle_times_out_while_requests_stay():
    d = Drain()
    d.in_flight = 1
    assert asyncio.run(d.wait_idle(0.05)) is False
    d.in_flight = 0
    assert asyncio.run(d.wait_idle(0.05)) is True


def test_vllm_metrics_with_model_name(client, engine):
    before = client.get("/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{model_name="{MODEL}"}} 0.0' in before, name  # present from the first scrape
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    usage = r.json()["usage"]
    body = {"model": MODEL, "prompt": "Hello world", "stream": True, "max_tokens": 3}
    with client.stream("POST", "/v1/completions", json=body) as s:
        list(s.iter_lines())
    text = client.get("/metrics").text
    for name in VLLM_SERIES:
        assert re.search(rf'^{re.escape(name)}{{.*model_name="{MODEL}"', text, re.M), name
    prompt = float(re.search(rf'^vllm:prompt_tokens_total{{model_name="{MODEL}"}} (\S+)', text, re.M)[1])
    assert prompt == usage["prompt_tokens"] + 2  # "Hello world": 2 tokens
    gen = float(re.search(rf'^vllm:generation_tokens_total{{model_name="{MODEL}"}} (\S+)', text, re.M)[1])
    assert gen == usage["completion_tokens"] + 3
    success = rf'^vllm:request_success_total{{finished_reason="(\w+)",model_name="{MODEL}"}} (\S+)'
    done = re.findall(success, text, re.M)
    assert sum(float(v) for _, v in done) == 2 and "length" in dict(done), done
    assert f'vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}} 2.0' in text
    assert f'vllm:time_to_first_token_seconds_count{{model_name="{MODEL}"}} 2.0' in text
    assert "hotstart_prompt_tokens_total" in text  # the hotstart_* series stay
