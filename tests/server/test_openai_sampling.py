"""OpenAI sampling features end to end through the real `openai` client and a real `hotstart serve`:
n choices (streamed and not), chat and completions logprobs (with echo), penalties and biases,
min_tokens, stop strings per choice, prefix-cache metrics, and generation_config.json defaults."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
from helpers.server import Server, openai_client, serving
from openai import OpenAI

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
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


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", QUESTION), **kw)


def test_n_choices_seeded_reproducible_with_openai_usage(client, tok):
    kw = dict(n=3, seed=7, temperature=1.0, max_tokens=10, logprobs=True)
    r = chat(client, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    per_choice = [len(c.logprobs.content) for c in r.choices]
    assert r.usage.prompt_tokens == len(tok.encode_chat(QUESTION))  # the prompt once
    assert r.usage.completion_tokens == sum(
        per_choice
    ) and r.usage.total_tokens == r.usage.prompt_tokens + sum(per_choice)
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1
    assert [c.message.content for c in chat(client, **kw).choices] == texts
    # choice i samples as a single request seeded seed + i would
    assert chat(client, **{**kw, "n": 1, "seed": 8}).choices[0].message.content == texts[1]


def test_n_choices_streamed(client):
    kw = dict(n=2, seed=3, temperature=1.0, max_tokens=12)
    full = chat(client, **kw)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    texts, roles, finishes = ["", ""], [0, 0], [[], []]
    for c in chunks[:-1]:
        (choice,) = c.choices
        if choice.delta.role:
            roles[choice.index] += 1
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert roles == [1, 1]
    assert texts == [c.message.content for c in full.choices]
    assert finishes == [[c.finish_reason] for c in full.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(client):
    kw = dict(temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    r = chat(client, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert (
            e.token == e.top_logprobs[0].token and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6
        )  # greedy
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    text = "".join(e.token for e in content)
    assert text.startswith(r.choices[0].message.content)
    streamed = [c.choices[0].logprobs.content for c in chat(client, stream=True, **kw)
                if c.choices and c.choices[0].logprobs]
    flat = [e for part in streamed for e in part]
    assert [e.token for e in flat] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(flat, content))
    assert chat(client, temperature=0, max_tokens=3).choices[0].logprobs is None


def test_completion_logprobs_with_echo(client, tok):
    prompt = "The capital of France is"
    n_prompt = len(tok.encode(prompt))
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True
    )
    (choice,) = r.choices
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert (
        len(lp.tokens)
        == n_prompt + r.usage.completion_tokens
        == len(lp.token_logprobs)
        == len(lp.text_offset)
    )
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # the top dict holds the top 2 and the chosen token
    assert all(2 <= len(d) <= 3 and lp.tokens[i] in d for i, d in enumerate(lp.top_logprobs) if d is not None)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    assert plain.choices[0].text == choice.text[len(prompt):]
    assert plain.choices[0].logprobs.tokens == lp.tokens[n_prompt:]
    assert all(
        abs(a - b) < 1e-3
        for a, b in zip(plain.choices[0].logprobs.token_logprobs, lp.token_logprobs[n_prompt:])
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.tokens == lp.tokens[:n_prompt]
    assert first.logprobs.token_logprobs[0] is None
    later = [
        t for c in chunks[1:] if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert later == lp.tokens[n_prompt:]


def test_penalties_biases_and_min_tokens(client, tok):
    base = dict(temperature=0, max_tokens=24)
    plain = chat(client, logprobs=True, **base).choices[0]
    first = tok.encode(plain.logprobs.content[0].token, add_special_tokens=False)
    assert len(first) == 1
    biased = chat(client, logprobs=True, logit_bias={str(first[0]): -100}, **base).choices[0]
    assert biased.logprobs.content[0].token != plain.logprobs.content[0].token
    boosted = chat(
        client,
        logit_bias={str(tok.encode(" banana", add_special_tokens=False)[0]): 100},
        max_tokens=3,
        temperature=0,
    )
    assert boosted.choices[0].message.content == " banana" * 3
    repeat = [{"role": "user", "content": "Write the word cat ten times."}]
    unpenalized = chat(client, messages=repeat, **base).choices[0].message.content
    assert unpenalized.count("Cat,") >= 5
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"extra_body": {"repetition_penalty": 1.8}}):
        penalized = chat(client, messages=repeat, **base, **extra).choices[0].message.content
        assert penalized.count("Cat,") < 2, extra
    assert plain.finish_reason == "stop"
    forced = chat(client, temperature=0, max_tokens=40, extra_body={"min_tokens": 30}).choices[0]
    assert len(tok.encode(forced.message.content, add_special_tokens=False)) >= 29
    assert forced.message.content.startswith(plain.message.content.rstrip())
    sampled = chat(client, temperature=0.8, seed=1, max_tokens=8, extra_body={"min_p": 0.2, "top_k": 40})
    assert sampled.choices[0].message.content


def test_stop_string_ends_each_choice(client):
    r = chat(client, n=2, temperature=0, max_tokens=30, stop=["."])
    for c in r.choices:
        assert "." not in c.message.content and c.finish_reason == "stop" and "Paris" in c.message.content


def test_bad_values_name_the_parameter(server):
    for body, param in (({"n": 17}, "n"), ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
                        ({"logit_bias": {"hello": 1}}, "logit_bias"), ({"best_of": 2}, None)):
        path = "/v1/completions" if "best_of" in body else "/v1/chat/completions"
        req = {"model": MODEL, **({"prompt": "hi"} if "best_of" in body else {"messages": QUESTION}), **body}
        r = httpx.post(server.url + path, json=req)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == (param or "best_of")


def test_prefix_cache_hits_show_in_metrics(server, client):
    def counters():
        text = httpx.get(server.url + "/metrics").text
        return [float(re.search(rf"^hotstart_{name}_total (\S+)$", text, re.MULTILINE).group(1))
                for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed")]

    messages = [{"role": "system", "content": "You are a geography teacher. " * 12}, *QUESTION]
    q0, _h0, _c0 = counters()
    a = chat(client, messages=messages, temperature=0, max_tokens=8).choices[0].message.content
    q1, h1, c1 = counters()
    b = chat(client, messages=messages, temperature=0, max_tokens=8).choices[0].message.content
    q2, h2, c2 = counters()
    assert a == b
    n = q1 - q0
    assert n > 64 and q2 - q1 == n
    assert h2 - h1 >= n - 16 and c2 - c1 <= 16  # the second time only the last (partial) block is computed


def test_generation_config_defaults(tiny_checkpoint, default_model_dir, tmp_path):
    """A Qwen2.5-like generation_config.json: its sampling fields are the defaults requests override."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint("qwen2"), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, model / name)
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
              "eos_token_id": 2}
    (model / "generation_config.json").write_text(json.dumps(config))
    s = Server(str(model), "--max-model-len", "256")
    try:
        assert "sampling defaults from generation_config.json: temperature=0.7, top_p=0.8, top_k=20, " \
               "repetition_penalty=1.05" in s.output
        c = openai_client(s, timeout=60)

        def text(**kw):
            r = c.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=16, seed=4,
                                     extra_body={"ignore_eos": True, **kw.pop("extra", {})}, **kw)
            return r.choices[0].text

        default = text()
        assert default == text(temperature=0.7, top_p=0.8, extra={"top_k": 20, "repetition_penalty": 1.05})
        assert default != text(temperature=1.0, top_p=1.0, extra={"top_k": 0, "repetition_penalty": 1.0})
        assert text(temperature=0) == text(temperature=0, extra={"repetition_penalty": 1.05})
    finally:
        s.stop()
