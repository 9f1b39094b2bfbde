"""Issue 40's classes against a real `hotstart serve` of two model names (the many-models server: one request
path for every model, plus the model leases): each request's cost bounded up front, the event loop only doing
I/O, clients that stop reading, nested JSON. Each test here failed on the code before the fix (the audit's
examples: a 500 for a nested guided_json string; 200,000 stop_token_ids and sixteen 60,000-character stop
strings accepted; /live 2.8 s late while 8 large /tokenize ran; a client that never read held its stream,
its drain slot and its model lease). The hostile corpus (tests/data/bad_requests.json) has the rest."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest
from helpers.cli import assert_fails_with, hotstart
from helpers.server import serving

MODEL = "smol"
WRITE_S = 2


@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    return tmp_path_factory.mktemp("audit") / "imports.json"


@pytest.fixture(scope="module")
def server(default_model_dir, audit):
    yield from serving(f"{MODEL}={default_model_dir}", f"spare={default_model_dir}", "--max-model-len", "512",
                       "--write-timeout", str(WRITE_S), "--max-connections-per-client", "16",
                       "--shutdown-timeout", "60", env={"HOTSTART_AUDIT_IMPORTS": str(audit)})


def post(server, path: str, body: dict | bytes, timeout: float = 120) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"},
                      timeout=timeout)


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def refused(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err


def metric(server, name: str, labels: str = "") -> float:
    """The sum of the /metrics samples of NAME whose labels include LABELS."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
    return sum(float(v) for got, v in found if labels in got)


def test_the_audits_requests_are_400s_naming_the_field_and_the_limit(server):
    stops = ["ab" * 30_000] * 16  # 960 KB: under the 1 MiB body limit
    assert "1024" in refused(post(server, "/v1/chat/completions", chat(stop=stops)), "stop[0]")["message"]
    ids = b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [%s]}' % (
        b",".join(b"7" for _ in range(200_000)))
    assert "1024" in refused(post(server, "/v1/chat/completions", ids), "stop_token_ids")["message"]
    deep = "[" * 5000 + "]" * 5000
    refused(post(server, "/v1/chat/completions", chat(guided_json=deep)), "guided_json")
    r = post(server, "/v1/chat/completions", chat(n=64, logprobs=True, top_logprobs=20, max_tokens=256))
    assert "262144" in refused(r, "top_logprobs")["message"]
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "hi", "chat_template_kwargs": {"a": [[[deep]]]}})
    assert r.status_code == 200  # a string is no nesting
    # the same requests within the limits are answered (a grammar built on the worker pool)
    at_limits = chat(stop=["ab" * 512] * 16, stop_token_ids=list(range(40_000, 41_024)),
                     guided_choice=["yes", "no"], temperature=0)
    r = post(server, "/v1/chat/completions", at_limits)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text


def test_live_and_health_answer_while_8_large_tokenize_requests_run(server):
    assert post(server, "/tokenize", {"model": MODEL, "prompt": "warm"}).status_code == 200  # model loaded
    text = ("The quick brown fox jumps over the lazy dog. " * 21_000)[:900_000]
    answers: list[httpx.Response] = []

    def tokenize() -> None:
        answers.append(post(server, "/tokenize", {"model": MODEL, "prompt": text}, timeout=300))

    threads = [threading.Thread(target=tokenize) for _ in range(8)]
    for t in threads:
        t.start()
    waits = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        while any(t.is_alive() for t in threads):
            for path in ("/live", "/health"):
                t0 = time.perf_counter()
                assert c.get(path).status_code == 200
                waits.append(time.perf_counter() - t0)
            time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(answers) == 8 and all(r.status_code == 200 and r.json()["count"] > 150_000 for r in answers)
    waits.sort()
    # before: the loop tokenized, and /live waited for all 8 (2.8 s on a quiet machine)
    assert len(waits) >= 4 and waits[-1] < 1.0 and waits[len(waits) // 2] < 0.2, waits[-5:]


def test_per_client_connection_cap(server):
    port = int(server.url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    try:
        time.sleep(0.2)
        r = httpx.get(server.url + "/v1/models", timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert "--max-connections-per-client 16" in r.json()["error"]["message"]
    finally:
        for s in held:
            s.close()


def test_max_connections_past_the_open_files_limit_is_one_error_line():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard NOFILE limit here")
    run = hotstart("serve", "--port", "0", "--max-connections", str(hard), timeout=60)
    assert_fails_with(run, f"--max-connections {hard}", "ulimit -Hn")
    assert "serving" not in run.stderr  # refused before the socket is bound


def non_reader(server, body: dict) -> socket.socket:
    """Sends BODY to /v1/chat/completions and reads nothing: a small receive buffer and segment size keep
    the kernel from absorbing megabytes first, as a slow link would."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    port = int(server.url.rsplit(":", 1)[1])
    s.connect(("127.0.0.1", port))
    raw = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (port, len(raw), raw))
    return s


def test_a_client_that_stops_reading_releases_its_stream_lease_and_drain_slot(server, audit):
    """Last in the module: it ends the server with SIGTERM (the drain must not wait for the cut stream),
    then reads what the server recorded of its imports."""
    lease = ("hotstart_model_requests_in_flight", f'model="{MODEL}"')
    running = ("vllm:num_requests_running", f'model_name="{MODEL}"')
    s = non_reader(server, chat(n=8, logprobs=True, top_logprobs=20, max_tokens=400, ignore_eos=True,
                                stream=True))
    t0 = time.monotonic()
    while metric(server, *lease) == 0:  # admitted and leased
        assert time.monotonic() - t0 < 120, server.output[-2000:]
        time.sleep(0.1)
    while "read nothing for" not in server.output:
        assert time.monotonic() - t0 < 180, server.output[-2000:]
        time.sleep(0.2)
    while metric(server, *lease) or metric(server, *running):  # lease released, engine sequences aborted
        assert time.monotonic() - t0 < 200, server.output[-2000:]
        time.sleep(0.2)
    generated = metric(server, "vllm:generation_tokens_total", f'model_name="{MODEL}"')
    assert generated < 8 * 400  # cut, not run to max_tokens
    s.settimeout(10)
    try:
        while s.recv(65536):  # what was buffered, then the end: the server dropped the connection
            pass
    except ConnectionResetError:
        pass
    s.close()
    assert post(server, "/v1/chat/completions", chat()).status_code == 200
    took = server.stop()  # SIGTERM drains: nothing is in flight, so it ends at once (not --shutdown-timeout)
    assert took < 30, took
    report = json.loads(audit.read_text())
    assert report["off_main_thread"] == [] and report["torch_imported"] is False, report
