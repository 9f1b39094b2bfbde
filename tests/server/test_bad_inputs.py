"""Malformed and hostile requests (tests/data/bad_requests.json) against one real `hotstart serve`.

Every request must get its 4xx with OpenAI's error body, never a 5xx or a traceback; afterwards the
server is healthy, answers a normal chat request correctly, and its engine holds no request.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from helpers.server import serving

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 256 * 1024  # small on purpose: --max-request-bytes is what limits, not the 1 MiB default
CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "bad_requests.json").read_text())
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    yield from serving("--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_REQUEST_BYTES))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def build_body(entry: dict) -> bytes | None:
    """The bytes ENTRY sends (see the corpus' description), or None for no body."""
    if "body" in entry:
        return json.dumps(entry["body"]).encode()
    if "raw" in entry:
        return entry["raw"].encode()
    if "raw_base64" in entry:
        return base64.b64decode(entry["raw_base64"])
    gen = entry.get("generate")
    if gen is None:
        return None
    if gen["kind"] == "big_body":
        size = MAX_REQUEST_BYTES + 1 if gen["bytes"] == "limit+1" else int(gen["bytes"])
        head = b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode()
        tail = b'"}]}'
        return head + b"x" * (size - len(head) - len(tail)) + tail
    if gen["kind"] == "nested":
        d = int(gen["depth"])
        return gen["template"].replace("@@", "[" * d + "]" * d).encode()
    if gen["kind"] == "repeat":
        return gen["template"].replace("@@", gen["sep"].join([gen["unit"]] * int(gen["count"]))).encode()
    raise ValueError(f"unknown generate kind {gen['kind']!r}")


def send(http: httpx.Client, entry: dict) -> httpx.Response:
    body = build_body(entry)
    headers = dict(entry.get("headers") or {})
    if body is not None and not any(k.lower() == "content-type" for k in headers):
        headers["content-type"] = "application/json"
    content = body
    if body is not None and (entry.get("generate") or {}).get("chunked"):
        content = iter([body[i:i + 65536] for i in range(0, len(body), 65536)])  # no Content-Length
    return http.request(entry["method"], entry["path"], content=content, headers=headers)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, f"{r.status_code} != {status}: {r.text[:500]}"
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error", err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_corpus_is_large_and_well_formed():
    names = [e["name"] for e in CORPUS["requests"]]
    assert len(names) >= 50 and len(set(names)) == len(names)
    for e in CORPUS["requests"]:
        assert 400 <= e["expect_status"] < 500, e["name"]
        assert e["path"].startswith("/") and e["method"] in {"GET", "POST", "PUT", "PATCH", "DELETE"}


@pytest.mark.parametrize("entry", CORPUS["requests"], ids=lambda e: e["name"])
def test_bad_request(http, entry):
    r = send(http, entry)
    assert_openai_error(r, entry["expect_status"], entry.get("expect_param"), entry.get("expect_code"))


@pytest.mark.parametrize("entry", CORPUS["must_succeed"], ids=lambda e: e["name"])
def test_must_succeed(http, entry):
    r = send(http, entry)
    assert r.status_code == 200, r.text[:500]
    if (entry.get("body") or {}).get("stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"usage"' in r.text
    else:
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_request_size_limit_is_the_flag(http):
    # just under --max-request-bytes: read and parsed (the prompt is then too long: a 400, not a 413)
    head = b'{"model": "%s", "prompt": "' % MODEL.encode()
    body = head + b"hi " * ((MAX_REQUEST_BYTES - len(head) - 2) // 3) + b'"}'
    assert len(body) <= MAX_REQUEST_BYTES
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "prompt", "context_length_exceeded")
    r = http.post("/v1/completions", content=body + b" " * (MAX_REQUEST_BYTES + 1 - len(body)),
                  headers={"content-type": "application/json"})
    err = assert_openai_error(r, 413, code="request_too_large")
    assert str(MAX_REQUEST_BYTES) in err["message"]


def test_http_level_garbage_does_not_hurt(server):
    host, port = server.url.removeprefix("http://").split(":")
    for junk in (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 64,  # a TLS ClientHello
                 b"GARBAGE / HTTP/9.9\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(junk)
            s.settimeout(10)
            try:
                reply = s.recv(4096)
            except OSError:
                reply = b""
        assert not reply.startswith(b"HTTP/1.1 5"), reply


def test_server_healthy_after_the_corpus(server, http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "temperature": 0,
                                                 "max_tokens": 32})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 10
    while True:
        text = http.get("/metrics").text
        running = float(re.search(r"^hotstart_num_requests_running (\S+)$", text, re.M).group(1))
        waiting = float(re.search(r"^hotstart_num_requests_waiting (\S+)$", text, re.M).group(1))
        if (running, waiting) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (running, waiting) == (0, 0)
    # (/health answers 503 while the engine loads: that is its job, not an error)
    counted = re.findall(r'^hotstart_http_requests_total\{endpoint="([^"]*)",status="(\d+)"\}', text, re.M)
    assert counted and not [c for c in counted if c[1].startswith("5") and c[0] != "/health"], counted


def test_no_traceback_or_internal_error_in_the_log(server):
    out = server.output
    assert "Traceback" not in out, out[-3000:]
    assert "internal error" not in out and "Exception in ASGI" not in out, out[-3000:]
