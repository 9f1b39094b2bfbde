"""End to end: a real `hotstart serve` with the default model, through the real `openai` client.

The shared server runs float32, where outputs are exactly reproducible whatever else is batched
(bfloat16 matmuls round differently for different batch shapes, as in every batching server);
one test covers the default dtype.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys

import httpx
import pytest
from helpers.server import Server, openai_client, serving
from openai import OpenAI

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    yield from serving("--max-model-len", "1024", "--max-num-seqs", "16", "--dtype", "float32")


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


def test_chat_greedy_answers_paris_with_exact_usage(client, tok):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=32
    )
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tok.encode_chat(QUESTION))
    # completion tokens: the answer's tokens plus the eos token that ended it
    assert r.usage.completion_tokens == len(tok.encode(text, add_special_tokens=False)) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_equals_generate_and_transformers(client, tok, default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=32
    )
    served = r.choices[0].message.content
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hotstart",
            "generate",
            "--prompt",
            QUESTION[0]["content"],
            "--chat",
            "--max-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == served.strip()
    ids = tok.encode_chat(QUESTION)
    ref = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    assert tok.decode(gen[0, len(ids):].tolist()) == served


def test_completions_and_models(client, server):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert (
        r.choices[0].text.strip()
        and r.usage.completion_tokens == 8
        and r.choices[0].finish_reason == "length"
    )
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_stream_reassembles_to_non_streaming(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name three fruits."}],
                  temperature=0, max_tokens=40)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]


def test_sixteen_concurrent_streams_match_alone(client):
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]

    def ask(p: str, stream: bool) -> str:
        kw = dict(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": p}],
            temperature=0,
            max_tokens=24,
        )
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
        )

    alone = [ask(p, False) for p in prompts[:4]]
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: ask(p, True), prompts))
    assert all(t for t in together)
    assert together[:4] == alone


def test_errors_leave_server_healthy(server, client):
    base = server.url
    r = httpx.post(base + "/v1/chat/completions", json={"model": "nope", "messages": QUESTION})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(base + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi " * 2000})
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
    r = httpx.post(
        base + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(base + "/health").status_code == 200
    ok = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=16
    )
    assert "Paris" in ok.choices[0].message.content


def test_startup_and_metrics_endpoints(server):
    s = httpx.get(server.url + "/startup").json()
    names = [p["name"] for p in s["phases"]]
    for phase in (
        "model resolved",
        "tokenizer loaded",
        "socket bound",
        "weights loaded",
        "KV cache allocated",
    ):
        assert phase in names, names
    m = httpx.get(server.url + "/metrics").text
    assert "hotstart_startup_duration_seconds" in m or "startup" in m


def test_api_process_never_imports_torch(server):
    maps = open(f"/proc/{server.proc.pid}/maps").read()
    assert "libtorch" not in maps
    engine_maps = [open(f"/proc/{pid}/maps").read() for pid in server.descendants()]
    assert any("libtorch" in m for m in engine_maps)  # the engine side has it


def test_default_dtype_answers_and_sigterm_stops_everything(default_model_dir):
    s = Server("--max-model-len", "512")
    assert len(s.descendants()) >= 2  # forkserver + engine
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                   json={"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "temperature": 0})
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    took = s.stop()
    assert took < 5, took
    assert s.proc.returncode == 0
