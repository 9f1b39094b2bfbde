"""The HTTP layer (hotstart.server.api) over the in-process engine client of the real default model
(no process), with the real tokenizer.

The engine's tokens are scripted (helpers/api.py ScriptedEngine: the prompt's ids reversed, then eos; or a
scripted id list); max_tokens, stop_token_ids, ignore_eos and aborts are the real engine's. Tests with an
engine process live in test_server_e2e.py.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers.api import (
    MODEL,
    TEXT,
    ScriptedEngine,
    assert_error,
    chat_body,
    engine_core,
    make_client,
    sse_events,
)

from hotstart.frontend.generation import StopStringFilter
from hotstart.server.api import ApiSettings
from hotstart.server.routes import build_app
from hotstart.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def core(default_model_dir):
    return engine_core(default_model_dir, max_model_len=256)


@pytest.fixture
def engine(core, tok):
    engine = ScriptedEngine(core, tok.eos_token_id)
    yield engine
    engine.stop()


@pytest.fixture
def client(engine, tok):
    return make_client(engine, tok, prefetch_stats=lambda: {"state": "done", "bytes_read": 1})


def test_api_process_never_imports_torch():
    code = ("import hotstart.server.api, sys; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]


def test_chat_non_streaming(client, engine, tok):
    engine.script = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    r = client.post("/v1/chat/completions", json=chat_body(temperature=0, seed=7))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": TEXT} and choice["finish_reason"] == "stop"
    prompt_ids, params = engine.requests[body["id"]]
    assert prompt_ids == tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(engine.script),
                             "total_tokens": len(prompt_ids) + len(engine.script)}
    # max_tokens defaults to what is left of the context; temperature 0 passes through (greedy)
    assert params.max_tokens == 256 - len(prompt_ids) and params.temperature == 0 and params.seed == 7


def test_chat_content_parts_roles_and_defaults(engine, tok):
    client = make_client(engine, tok, sampling_defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]}]
    r = client.post("/v1/chat/completions", json={"model": "alias", "messages": messages, "max_tokens": 3,
                                                  "some_future_field": {"x": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL and r.json()["choices"][0]["finish_reason"] == "length"
    ids, params = engine.requests[r.json()["id"]]
    assert ids == tok.encode_chat([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi\nthere"}])
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (3, 0.6, 0.9, 20)
    r = client.post("/v1/chat/completions",
                    json=chat_body(top_k=-1, temperature=1.0, max_completion_tokens=2))
    _, params = engine.requests[r.json()["id"]]
    assert (params.top_k, params.temperature, params.max_tokens) == (0, 1.0, 2)


def test_chat_streaming_chunks(client, engine, tok):
    engine.script = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    r = client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events)
    assert not any("usage" in e for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["stop"]
    assert events[-1]["choices"][0]["delta"] == {}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == TEXT


def test_stream_include_usage(client, engine, tok):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world", "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    *chunks, last = events
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    n = len(tok.encode("Hello world"))
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": n, "completion_tokens": n + 1,
                                                       "total_tokens": 2 * n + 1}


def test_completion_prompt_forms(client, engine, tok):
    ids = tok.encode("Paris is the capital", add_special_tokens=False)
    expected = tok.decode(list(reversed(ids)))
    for prompt in ("Paris is the capital", ["Paris is the capital"], ids, [ids]):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 50})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["prompt_tokens"] == len(ids)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Paris is the capital", "echo": True})
    assert r.json()["choices"][0]["text"] == "Paris is the capital" + expected
    r = client.post("/v1/completions",
                    json={"model": MODEL, "prompt": ids, "max_tokens": 2, "ignore_eos": True})
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 2


def test_stop_strings(client, engine, tok):
    engine.script = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["never", "STOP"]})
    choice = r.json()["choices"][0]
    assert choice == {"index": 0, "text": "The capital of France is Paris. ", "logprobs": None,
                      "finish_reason": "stop"}
    assert r.json()["id"] in engine.aborted  # the engine stops working on it
    # " ST" + "OP": the stop string spans token boundaries; nothing of it may be streamed
    for stop in (" STOP", "Paris. STOP here", "s. ST"):
        r = client.post("/v1/chat/completions", json=chat_body(stream=True, stop=stop))
        events = sse_events(r.text)
        pieces = [e["choices"][0]["delta"].get("content", "") for e in events]
        assert "".join(pieces) == TEXT[:TEXT.index(stop)]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # a stop string that never completes is released at the end
    r = client.post("/v1/chat/completions", json=chat_body(stream=True, stop="follows!"))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r.text)) == TEXT


def test_stop_token_ids_are_not_in_text(client, engine, tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    engine.script = ids + [tok.eos_token_id]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop_token_ids": [ids[7]]})
    assert r.json()["choices"][0]["text"] == "The capital of France is Paris."
    assert r.json()["usage"]["completion_tokens"] == 8


def test_stop_string_filter_random_splits():
    rng = random.Random(0)
    text = "abcabcabd xyz ab" * 3
    for _ in range(300):
        stops = [text[i:i + rng.randint(1, 5)] for i in rng.sample(range(len(text) - 5), 2)] + ["zz"]
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 12)))
        f = StopStringFilter(stops)
        out, seen = "", ""
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            out += f.feed(text[a:b])
            seen = text[:b]
            assert not any(s in out for s in stops)
            if f.stopped:
                break
        out += f.finish()
        # generation ends in the chunk that completes a stop string; the text is cut at the earliest one
        first = min(seen.find(s) for s in stops if s in seen)
        assert f.stopped and out == text[:first]


ERROR_CASES = [
    # (path, body patch, status, param, code)
    ("chat", {"model": "gpt-4"}, 404, "model", "model_not_found"),
    ("chat", {"model": None}, 400, "model", None),
    ("chat", {"messages": []}, 400, "messages", None),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {"url": "x"}},
                    ],
                }
            ]
        },
        400,
        "messages[0].content[1]",
        None,
    ),
    ("chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ("chat", {"messages": "hi"}, 400, "messages", None),
    ("chat", {"temperature": -0.1}, 400, "temperature", None),
    ("chat", {"temperature": 2.5}, 400, "temperature", None),
    ("chat", {"temperature": "hot"}, 400, "temperature", None),
    ("chat", {"top_p": 0}, 400, "top_p", None),
    ("chat", {"top_p": 1.01}, 400, "top_p", None),
    ("chat", {"top_k": -2}, 400, "top_k", None),
    ("chat", {"max_tokens": 0}, 400, "max_tokens", None),
    ("chat", {"max_tokens": -5}, 400, "max_tokens", None),
    ("chat", {"max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("chat", {"max_tokens": 1000}, 400, "max_tokens", "context_length_exceeded"),
    ("chat", {"stop": ["x"] * 17}, 400, "stop", None),
    ("chat", {"stop": ""}, 400, "stop[0]", None),
    ("chat", {"n": 0}, 400, "n", "invalid_value"),
    ("chat", {"n": 9}, 400, "n", "invalid_value"),  # more than the engine's max_num_seqs (8)
    ("chat", {"n": 1.5}, 400, "n", None),
    ("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "invalid_value"),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),  # without logprobs: true
    ("chat", {"presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ("chat", {"frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    ("chat", {"repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ("chat", {"logit_bias": {"abc": 1}}, 400, "logit_bias", "invalid_value"),
    ("chat", {"logit_bias": {"-3": 1}}, 400, "logit_bias", "invalid_value"),
    ("chat", {"logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    ("chat", {"logit_bias": {"999999999": 1}}, 400, "logit_bias", "invalid_value"),
    ("chat", {"logit_bias": {"5": "x"}}, 400, "logit_bias[...]", "invalid_type"),
    ("chat", {"min_p": 1.5}, 400, "min_p", "invalid_value"),
    ("chat", {"min_tokens": -1}, 400, "min_tokens", "invalid_value"),
    ("chat", {"min_tokens": 11, "max_tokens": 10}, 400, "min_tokens", "invalid_value"),
    (
        "chat",
        {"response_format": {"type": "structural_tag"}},
        400,
        "response_format.type",
        "unsupported_parameter",
    ),
    ("chat", {"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("chat", {"seed": 2**70}, 400, "seed", None),
    ("chat", {"stop_token_ids": [10**9]}, 400, "stop_token_ids", None),
    ("chat", {"chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", None),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ("completions", {"prompt": ""}, 400, "prompt", None),
    ("completions", {"prompt": [1, 2, 10**9]}, 400, "prompt", None),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt", None),
    ("completions", {"prompt": "word " * 300}, 400, "prompt", "context_length_exceeded"),
    ("completions", {"logprobs": 6}, 400, "logprobs", "invalid_value"),
    ("completions", {"logprobs": -1}, 400, "logprobs", "invalid_value"),
    ("completions", {"n": 129}, 400, "n", "invalid_value"),
    ("completions", {"best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("completions", {"suffix": "end"}, 400, "suffix", "unsupported_parameter"),
]


@pytest.mark.parametrize("path,patch,status,param,code", ERROR_CASES)
def test_validation_errors(client, path, patch, status, param, code):
    base = chat_body() if path == "chat" else {"model": MODEL, "prompt": "hello"}
    body = {k: v for k, v in {**base, **patch}.items() if v is not None}
    r = client.post(f"/v1/{'chat/' if path == 'chat' else ''}completions", json=body)
    assert_error(r, status, param, code)


def test_context_length_message_names_both_numbers(client, tok):
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=1000))
    n = len(tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]))
    msg = r.json()["error"]["message"]
    assert "256" in msg and f"{n + 1000}" in msg and f"{n} in the prompt" in msg


def test_transport_errors(engine, tok):
    client = make_client(engine, tok, max_request_bytes=2048)
    as_json = {"content-type": "application/json"}
    assert_error(client.post("/v1/chat/completions", content=b"{not json", headers=as_json), 400,
                 code="invalid_json")
    assert_error(client.post("/v1/chat/completions", content=b"[1, 2]"), 400)
    assert_error(client.post("/v1/chat/completions", content=b"model=x",
                             headers={"content-type": "application/x-www-form-urlencoded"}), 415)
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 3000}), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "smol", "prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'
    assert_error(client.post("/v1/completions", content=chunked(), headers=as_json), 413)
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


def test_not_ready_then_ready(core, tok):
    engine = ScriptedEngine(core, tok.eos_token_id, ready=False)
    client = make_client(engine, tok)
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "loading weights"}
    assert_error(client.post("/v1/chat/completions", json=chat_body()), 503, code="engine_not_ready")
    engine.set_ready()
    assert client.get("/health").json() == {"status": "ready"}
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    engine.stop()


def test_engine_failures(client, engine):
    engine.die_after = 2
    assert_error(client.post("/v1/chat/completions", json=chat_body()), 503, code="engine_dead")
    events = sse_events(client.post("/v1/chat/completions", json=chat_body(stream=True)).text)
    assert events[-1]["error"]["code"] == "engine_dead" and events[-1]["error"]["type"] == "server_error"
    assert len(events) == 4  # role chunk, two tokens, the error event
    engine.die_after, engine.error_after = None, 1
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    err = assert_error(r, 500, code="engine_error")
    assert "out of memory" in err["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    events = sse_events(r.text)
    assert events[-1]["error"]["code"] == "engine_error"


def test_api_key(engine, tok):
    client = make_client(engine, tok, api_key="s3cret")
    good = {"Authorization": "Bearer s3cret"}
    for path in ("/v1/models", "/v1/models/smol", "/startup", "/metrics", "/v1/nothing"):
        assert_error(client.get(path), 401, code="invalid_api_key")
        for bad in ("Bearer wrong", "s3cret", "Basic s3cret", "Bearer", "Bearer s3cret2", "Bearer s3cre"):
            assert_error(client.get(path, headers={"Authorization": bad}), 401, code="invalid_api_key")
        expected = 404 if path == "/v1/nothing" else 200
        assert client.get(path, headers=good).status_code == expected
    assert_error(client.post("/v1/chat/completions", json=chat_body()), 401)
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 401)
    assert client.post("/v1/chat/completions", json=chat_body(), headers=good).status_code == 200
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=good)
    assert ok.status_code == 200
    # the scheme is case-insensitive (RFC 7235); only /health is open
    assert client.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_unexpected_exception_is_a_json_500_without_traceback(engine, tok, caplog):
    client = make_client(engine, tok)

    async def broken(*args, **kwargs):
        raise RuntimeError("boom")
        yield  # pragma: no cover

    engine.generate = broken
    with caplog.at_level("ERROR", logger="hotstart"):
        assert_error(client.post("/v1/chat/completions", json=chat_body()), 500, code="internal_error")
    assert client.get("/health").status_code == 200
    assert any("RuntimeError at " in r.getMessage() for r in caplog.records)
    assert not any("boom" in r.getMessage() for r in caplog.records)  # messages can hold request data
    assert not any(r.exc_info for r in caplog.records)


def test_models_startup_and_metrics(client, engine):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL, "alias"]
    assert all(m["object"] == "model" and m["owned_by"] == "hotstart" and m["max_model_len"] == 256
               for m in body["data"])
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/other"), 404, code="model_not_found")
    client.post("/v1/chat/completions", json=chat_body())
    startup = client.get("/startup").json()
    assert startup["prefetch"] == {"state": "done", "bytes_read": 1}
    assert "first request served" in json.dumps(startup)
    client.app.state.set_startup_seconds(1.25)
    text = client.get("/metrics").text
    stats = engine.stats
    for line in ('hotstart_http_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0',
                 'hotstart_http_requests_total{endpoint="/v1/models",status="404"} 1.0',
                 "hotstart_num_requests_running 0.0", "hotstart_num_requests_waiting 0.0",
                 f"hotstart_kv_cache_usage_ratio {stats.kv_blocks_used / stats.kv_blocks_total}",
                 "hotstart_startup_duration_seconds 1.25",
                 "hotstart_engine_ready 1.0", 'hotstart_request_finished_total{finish_reason="stop"} 1.0'):
        assert line in text, line
    for name in ("hotstart_prompt_tokens_total", "hotstart_generation_tokens_total",
                 "hotstart_time_to_first_token_seconds_bucket", "hotstart_e2e_request_latency_seconds_count"):
        assert name in text


# --- a real uvicorn server in a thread: disconnects and the official openai client -----------------
@pytest.fixture
def server(engine, tok):
    import uvicorn

    app = build_app(engine, tok, ApiSettings(served_model_names=[MODEL]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(5)
    sock.close()


def wait_for(cond, timeout=5.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def test_disconnect_aborts_streaming_request(server, engine):
    engine.script, engine.delay = [504] * 1000, 0.01
    with httpx.Client(base_url=server) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first[6:])["id"]
    assert wait_for(lambda: rid in engine.aborted), "closing the stream did not abort the engine request"


def test_disconnect_aborts_non_streaming_request(server, engine):
    engine.script, engine.delay = [504] * 1000, 0.01
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=0.5)
    assert wait_for(lambda: len(engine.aborted) == 1 and len(engine.requests) == 1)


def test_openai_client(server, engine, tok):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    engine.script = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    hi = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=hi, stop=["STOP"])
    assert chat.choices[0].message.content == "The capital of France is Paris. "
    # " ST" + "OP" completes the stop string: 9 tokens were generated
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 9
    stream = client.chat.completions.create(model=MODEL, messages=hi, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    assert chunks[-1].usage.completion_tokens == len(engine.script)
    comp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=hi)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=hi, temperature=5)
    assert e.value.param == "temperature"
