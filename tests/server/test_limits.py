"""Each request's cost bounded up front (no process): the limits of hotstart/sampling_params.py, nesting in
any field (frontend/validation.py), stop strings in linear time (frontend/stops.py), streams that keep
nothing, byte-bounded caches (hotstart/lru.py), prompts refused by characters, long texts tokenized with the
GIL released. The same classes against `hotstart serve`: tests/server/test_limits_e2e.py and the corpus."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgspec
import pytest

from hotstart.errors import RequestError
from hotstart.frontend.generation import Choice
from hotstart.frontend.protocol import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest
from hotstart.frontend.stops import StopStringFilter
from hotstart.frontend.validation import check_nesting, check_prompt_chars, loads_json
from hotstart.lru import ByteLRU, digest
from hotstart.messages import EngineReady, TokenLogprobs, TokenOutput
from hotstart.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    check_logprob_entries,
)
from hotstart.server.schemas import decode_request


def refused(fn, *args, **kw) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("field, value, param", [
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "logit_bias"),
    ("stop", ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)], "stop[1]"),
    ("stop", ["s%d" % i for i in range(17)], "stop"),
])
def test_lengths_past_their_limit_are_400s_naming_the_field(field, value, param):
    err = refused(SamplingParams, **{field: value})
    assert err.param == param and err.code == "invalid_value"
    SamplingParams(**{field: value[:-1] if isinstance(value, list) else dict(list(value.items())[:-1])})


def test_a_whole_answers_logprobs_are_bounded():
    p = SamplingParams(n=64, max_tokens=256, logprobs=20)
    err = refused(check_logprob_entries, p, 10, "top_logprobs")
    assert err.param == "top_logprobs" and str(MAX_LOGPROB_ENTRIES) in err.message and "344064" in err.message
    check_logprob_entries(SamplingParams(n=1, max_tokens=8192, logprobs=20), 100)  # 172,032: fine
    echo = SamplingParams(n=8, max_tokens=10, logprobs=5, prompt_logprobs=5)
    refused(check_logprob_entries, echo, 6000)  # 8 x 6000 x 6 of the echoed prompt
    check_logprob_entries(SamplingParams(n=128, max_tokens=100_000), 10)  # no logprobs: no entries


def test_streams_are_not_bounded_by_the_whole_answer_limit():
    from hotstart.server.api import ApiSettings, OpenAIServing

    class Engine:
        ready, status, fatal, fast_path = True, "ready", None, None
        info = EngineReady(pid=1, device="cpu", dtype="float32", max_model_len=4096, block_size=16,
                           num_kv_blocks=8, max_num_seqs=64)

    s = OpenAIServing(Engine(), None, ApiSettings(served_model_names=["m"], vocab_size=1000))  # type: ignore
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 64, "logprobs": True,
            "top_logprobs": 20, "max_tokens": 1000}
    whole = msgspec.convert(body, ChatCompletionRequest)
    err = refused(s.sampling, whole, 1000, "max_tokens", 10, "messages", 20, logprobs_param="top_logprobs")
    assert err.param == "top_logprobs"
    streamed = msgspec.convert({**body, "stream": True}, ChatCompletionRequest)
    assert s.sampling(streamed, 1000, "max_tokens", 10, "messages", 20).logprobs == 20


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("body, param", [
    ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"a": %s}]}', "tools"),
    ('{"model": "m", "messages": [{"role": "user", "content": "hi", "tool_calls": [{"a": %s}]}]}',
     "messages[0].tool_calls"),
    ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "guided_json": %s}', "guided_json"),
    ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"x": %s}}',
     "response_format"),
])
def test_nesting_past_the_limit_in_any_field_names_it(body, param):
    ok = decode_request((body % nested(MAX_JSON_DEPTH - 3)).encode(), ChatCompletionRequest)
    check_nesting(ok)
    err = refused(decode_request, (body % nested(MAX_JSON_DEPTH + 1)).encode(), ChatCompletionRequest)
    assert err.param == param, err.message
    err = refused(decode_request, (body % nested(100_000)).encode(), ChatCompletionRequest)  # past recursion
    assert "nested too deeply" in err.message


def test_a_long_flat_list_is_checked_in_one_cheap_pass():
    body = b'{"model": "m", "prompt": [%s]}' % b",".join(b"1" for _ in range(300_000))
    t = time.perf_counter()
    req = decode_request(body, CompletionRequest)
    assert len(req.prompt) == 300_000 and time.perf_counter() - t < 1.0


def test_json_text_inside_a_field_is_depth_checked():
    err = refused(loads_json, nested(5000), "guided_json")  # json.loads alone: RecursionError, a 500
    assert err.param == "guided_json" and "nested too deeply" in err.message
    refused(loads_json, nested(MAX_JSON_DEPTH + 1), "x")
    assert loads_json(nested(MAX_JSON_DEPTH), "x") is not None
    assert loads_json("not json", "x", lenient=True) is None
    assert refused(loads_json, "not json", "x").param == "x"


def test_tool_calls_in_a_models_answer_nested_too_deeply_stay_text():
    from hotstart.frontend.tools import HERMES, LLAMA3, parse

    deep = '{"name": "f", "arguments": {"a": %s}}' % nested(3000)
    assert parse(HERMES, f"<tool_call>\n{deep}\n</tool_call>")[1] == []
    assert parse(LLAMA3, deep)[1] == []
    ok = parse(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": [[1]]}}\n</tool_call>')[1]
    assert ok and ok[0]["function"]["arguments"] == '{"a": [[1]]}'


def naive_cut(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def test_stop_strings_match_as_a_plain_search_on_random_splits():
    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice("aab") for _ in range(rng.randint(1, 60)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 4))]
        f, out, fed = StopStringFilter(stops), "", 0
        while fed < len(text) and not f.stopped:
            step = rng.randint(1, 5)
            out += f.feed(text[fed:fed + step])
            fed += step
            # nothing released can still become a stop string, nor contains one
            assert naive_cut(out, stops) is None
        out += f.finish()
        cut = naive_cut(text[:fed], stops)
        assert out == (text[:cut] if cut is not None else text), (text, stops)
        assert f.text == out


def test_stop_strings_cost_is_linear_in_the_text():
    # the worst case of the old hold-back scan (each delta compared every tail of every string): 16 strings
    # of the longest length, the text always one character short of completing them
    stops = ["a" * (MAX_STOP_STRING_CHARS - 1) + chr(0x62 + i) for i in range(16)]
    f = StopStringFilter(stops, keep=False)
    t = time.perf_counter()
    released = sum(len(f.feed("a" * 4)) for _ in range(5000))
    took = time.perf_counter() - t
    assert released == 20_000 - (MAX_STOP_STRING_CHARS - 1) and not f.stopped
    assert took < 5.0, took  # ~0.5 s here; the quadratic scan took minutes
    assert len(f.text) == MAX_STOP_STRING_CHARS - 1  # a stream keeps only what it holds back


class _Tok:
    """Byte-level stand-in: id i is chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_a_streams_choice_keeps_neither_text_nor_logprobs():
    kept, streamed = (Choice(0, _Tok(), [], ["zz"], set(), keep=k) for k in (True, False))
    for i in range(2000):
        out = TokenOutput("r", [97 + i % 20], logprobs=[TokenLogprobs(-1.0, list(range(20)), [-2.0] * 20)])
        a, b = kept.feed(out), streamed.feed(out)
        assert (a.text, a.logprobs) == (b.text, b.logprobs)
    assert len(kept.logprobs) == 2000 and len(kept.text) == 2000
    assert streamed.logprobs == [] and len(streamed.text) <= 1


def test_byte_lru_bounds_entries_and_bytes():
    c = ByteLRU(max_items=3, max_bytes=100)
    for i in range(3):
        c.put(digest("k", str(i)), i, 40)
    assert len(c) == 2 and c.bytes == 80  # 120 bytes > 100: the oldest went
    assert c.get(digest("k", "0")) is None and c.get(digest("k", "1")) == 1
    c.put(digest("k", "3"), 3, 40)  # "2" is now the least recently used
    assert c.get(digest("k", "2")) is None and c.get(digest("k", "1")) == 1
    c.put(digest("big"), "x", 101)
    assert digest("big") not in c and c.bytes <= 100
    assert digest("ab", "c") != digest("a", "bc") and len(digest("x" * 1_000_000)) == 32


def test_the_grammar_cache_holds_no_request_text():
    from hotstart.frontend import structured

    schema = {"type": "object", "properties": {"k%d" % i: {"type": "string"} for i in range(50)}}
    structured.compile_grammar("json", schema, "guided_json")
    keys = list(structured._cache._entries)
    assert keys and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert structured._cache.bytes <= structured.CACHE_BYTES


def test_prompts_are_refused_by_characters_before_tokenizing():
    check_prompt_chars(512 * 81, 512, 81, "prompt")
    err = refused(check_prompt_chars, 512 * 81 + 1, 512, 81, "messages")
    assert err.code == "context_length_exceeded" and err.param == "messages"
    check_prompt_chars(10**9, None, 81, "prompt")  # no context length known yet: tokenized and counted


def test_long_texts_encode_the_same_with_the_gil_released(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    assert tok.max_token_chars() >= max(len(t) for t in ("<|im_start|>", "hello"))
    text = "Héllo, wörld! 🙂 The quick brown fox.\n" * 3000  # past the threshold: the batch call
    ids = tok.encode(text)
    assert ids == tok._backend.encode(text).ids and tok.decode(ids) == tok._backend.decode(ids)
    gaps, done = [], threading.Event()

    def encode_many():
        for _ in range(2):
            tok.encode(text * 8)  # ~1 MB
        done.set()

    threading.Thread(target=encode_many, daemon=True).start()
    last = time.perf_counter()
    while not done.is_set():
        asyncio.run(asyncio.sleep(0.001))
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    assert max(gaps) < 0.5, max(gaps)  # the single call held the GIL ~1.3 s per megabyte here
