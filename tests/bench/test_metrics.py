"""`hotstart bench serve`'s metrics are `vllm bench serve`'s: checked on a hand-built trace of token
timestamps (every figure worked out by hand below, and the statistics against numpy), and the stream
parser on a real HTTP stream (an in-process stdlib server) that sends every kind of SSE event."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from hotstart.bench import serve_client
from hotstart.bench.metrics import RequestTrace, compute, median_of_runs, percentile, summary


def trace() -> list[RequestTrace]:
    # A: sent at 0, token events at 0.5 0.6 0.8 1.1, usage 4 completion / 10 prompt tokens
    a = RequestTrace(0.0, prompt_len=9, events=[0.5, 0.6, 0.8, 1.1], usage_prompt_tokens=10,
                     usage_completion_tokens=4)
    # B: sent at 0.1, events at 0.3 0.4, usage 2 tokens
    b = RequestTrace(0.1, prompt_len=10, events=[0.3, 0.4], usage_prompt_tokens=10, usage_completion_tokens=2)
    # C: sent at 0.2, one event at 1.0 carrying two words, no usage: the tokenizer counts 2 tokens
    c = RequestTrace(0.2, prompt_len=7, events=[1.0], text="hello world")
    # D: failed (no token event counts, its tokens are not counted)
    d = RequestTrace(0.3, prompt_len=10, error="HTTP 500: boom")
    return [a, b, c, d]


def test_hand_built_trace_has_vllms_figures():
    m = compute(trace(), duration_s=2.0, count_tokens=lambda s: len(s.split()))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["errors"] == ["HTTP 500: boom"]
    # input: usage where reported (10, 10), else the prompt's own count (7); output: usage, else the tokenizer
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (27, 8)
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    assert m["output_throughput"] == pytest.approx(8 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((27 + 8) / 2.0)
    # TTFT = first event - send: 0.5, 0.2, 0.8 s
    assert m["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert m["ttft_ms"]["median"] == pytest.approx(500.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(1000 * (0.5 + 0.3 * 0.98))  # linear between ranks 1 and 2
    # TPOT = (E2E - TTFT) / (tokens - 1): A 0.6/3 = 0.2, B 0.1/1 = 0.1, C 0/1 = 0
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["tpot_ms"]["median"] == pytest.approx(100.0)
    # ITL = gaps between events, pooled: A 0.1 0.2 0.3, B 0.1
    assert m["itl_ms"]["mean"] == pytest.approx(175.0)
    assert m["itl_ms"]["median"] == pytest.approx(150.0)
    # E2E = last event - send: 1.1, 0.3, 0.8
    assert m["e2el_ms"]["median"] == pytest.approx(800.0)
    assert m["e2el_ms"]["mean"] == pytest.approx(1000 * 2.2 / 3)


def test_output_tokens_without_usage_or_tokenizer_count_one():
    t = RequestTrace(0.0, prompt_len=5, events=[0.1, 0.2, 0.3], text="a b c")
    m = compute([t], 1.0)
    assert m["total_output_tokens"] == 1 and m["tpot_ms"]["median"] is None  # vLLM: one token, no TPOT
    assert m["itl_ms"]["median"] == pytest.approx(100.0)


def test_statistics_are_numpys():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = list(rng.exponential(0.05, size=n))
        s = summary(xs)
        assert s["mean"] == pytest.approx(np.mean(xs) * 1000)
        assert s["median"] == pytest.approx(np.median(xs) * 1000)
        assert s["std"] == pytest.approx(np.std(xs) * 1000)
        assert s["p99"] == pytest.approx(np.percentile(xs, 99) * 1000)
        for q in (0, 25, 50, 90, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert summary([]) == {"mean": None, "median": None, "std": None, "p99": None}


def test_median_of_rounds():
    runs = [compute(trace(), d, lambda s: len(s.split())) for d in (1.0, 2.0, 4.0)]
    m = median_of_runs(runs)
    assert m["rounds"] == 3 and m["completed"] == 9 and m["failed"] == 3
    assert m["output_throughput"] == pytest.approx(8 / 2.0)  # the middle duration's
    assert m["ttft_ms"]["median"] == pytest.approx(500.0)


# One completions stream with every kind of event: a comment, text chunks (one empty: a token event all
# the same, as vLLM counts it), a finish chunk without text, a usage chunk without choices, [DONE].
EVENTS = [": ping", {"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]},
          {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
          {"choices": [{"index": 0, "text": "lo", "finish_reason": None}]},
          {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
          {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}, "[DONE]"]


class _Stream(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for ev in EVENTS:
            if isinstance(ev, dict):
                line = f"data: {json.dumps(ev)}"
            else:
                line = ev if ev.startswith(":") else f"data: {ev}"
            self.wfile.write(f"{line}\n\n".encode())
            self.wfile.flush()


def test_stream_parser_counts_choice_events_only():
    import httpx

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"

    async def go() -> RequestTrace:
        async with httpx.AsyncClient() as client:
            force = {"ignore_eos": True}
            body = serve_client.request_body("/v1/completions", "m", "hi", 3, force, None, None)
            return await serve_client.traced_request(client, url, body, prompt_len=1, timeout=30)

    try:
        t = asyncio.run(go())
    finally:
        server.shutdown()
    assert t.ok and t.error is None
    assert len(t.events) == 4 and t.events == sorted(t.events) and t.events[0] > t.sent
    assert t.text == "Hello" and t.finish_reason == "length"
    assert (t.usage_prompt_tokens, t.usage_completion_tokens) == (12, 3)
    assert len(t.itl) == 3


def test_request_body_shapes():
    force = {"ignore_eos": True, "stream_options": None, "model": None}
    chat = serve_client.request_body("/v1/chat/completions", "m", "hi", 5, force, 0.0, {"top_k": 1})
    assert chat == {"stream": True, "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 5, "temperature": 0.0, "ignore_eos": True, "top_k": 1}
    text = serve_client.request_body("/v1/completions", "m", "hi", 5, {}, None, None)
    assert text == {"stream": True, "stream_options": {"include_usage": True}, "model": "m", "prompt": "hi",
                    "max_tokens": 5}
