"""Constrained decoding in EngineCore on a random-weight Qwen2-shaped checkpoint with the real tokenizer
(make-model --size tiny; logits 64 ids wider than the tokenizer): every answer parses and validates,
greedy and sampled, n > 1, beside unconstrained streams; eos only where the grammar accepts; max_tokens
cuts give "length"; bad grammars are errors; compiling runs off the step loop; unconstrained requests
never load the grammar library; the engine imports nothing off its main thread."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers.models import make_tiny

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.frontend.structured import choice_regex, compile_grammar
from hotstart.frontend.tools import HERMES, parse, tool_grammar
from hotstart.messages import EngineRequest
from hotstart.model.files import weight_files
from hotstart.sampling_params import SamplingParams

PET = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "kind": {"enum": ["cat", "dog", "axolotl"]}, "vaccinated": {"type": "boolean"},
    "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "kind"],
    # a random model takes every blank it may: a few per slot keep its answers within max_tokens
    "x-guidance": {"whitespace_pattern": "[ \n]{0,2}"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return make_tiny(tmp_path_factory.mktemp("grammar") / "qwen2-tiny")


def build(model_dir, **kw) -> EngineCore:
    cfg = dict(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, max_num_seqs=16)
    cfg.update(kw)
    return EngineCore.build(
        EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))), **cfg)
    )


@pytest.fixture(scope="module")
def core(model_dir):
    return build(model_dir)


@pytest.fixture(scope="module")
def tok(model_dir):
    from hotstart.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def run(core, reqs, max_steps=5000):
    for rid, (ids, params) in reqs.items():
        assert core.add_request(EngineRequest(rid, ids, params)) is None
    out = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for o in core.step():
            d = out.setdefault((o.request_id, o.index), {"ids": [], "reason": None, "error": None})
            d["ids"] += o.new_token_ids
            d["reason"], d["error"] = o.finish_reason, o.error
    assert not core.has_work() and core.blocks.num_used == 0 and core.sampler.num_active == 0
    assert core.sampler.num_constrained == 0
    return out


def test_json_schema_answers_validate_greedy_sampled_and_n(core, tok):
    jsonschema = pytest.importorskip("jsonschema")
    grammar = compile_grammar("json", PET, "response_format")
    prompt = tok.encode("Describe a pet as JSON:")
    reqs = {
        f"s{i}": (
            prompt,
            SamplingParams(max_tokens=400, temperature=1.0 if i else 0.0, seed=i, grammar=grammar),
        )
        for i in range(8)
    }
    reqs["n"] = (prompt, SamplingParams(max_tokens=400, temperature=1.2, seed=99, n=3, grammar=grammar))
    reqs["plain"] = (prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    out = run(core, reqs)
    assert len(out) == 8 + 3 + 1
    for (rid, _), d in out.items():
        if rid == "plain":
            assert d["reason"] == "length" and len(d["ids"]) == 30
            continue
        assert d["reason"] == "stop", d
        assert all(t < 49152 for t in d["ids"])  # never one of the ids the tokenizer lacks
        jsonschema.validate(json.loads(tok.decode(d["ids"])), PET)
    texts = {tok.decode(d["ids"]) for (rid, _), d in out.items() if rid.startswith("s")}
    assert len(texts) > 4  # sampled answers differ


def test_max_tokens_cuts_with_length(core, tok):
    grammar = compile_grammar("json", {"type": "object"}, "response_format")
    out = run(
        core,
        {"r": (tok.encode("hi"), SamplingParams(max_tokens=5, temperature=1.0, seed=3, grammar=grammar))},
    )
    (d,) = out.values()
    assert d["reason"] == "length" and len(d["ids"]) == 5 and tok.decode(d["ids"]).startswith("{")


def test_regex_and_choice(core, tok):
    date = compile_grammar("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "guided_regex")
    pick = compile_grammar(
        "regex", choice_regex(["yes", "no", "c++ (maybe)"], "guided_choice"), "guided_choice"
    )
    reqs = {
        f"d{i}": (tok.encode("Date:"), SamplingParams(max_tokens=50, temperature=1.5, seed=i, grammar=date))
        for i in range(4)
    }
    reqs.update(
        {
            f"c{i}": (
                tok.encode("Pick:"),
                SamplingParams(max_tokens=50, temperature=1.5, seed=i, grammar=pick),
            )
            for i in range(6)
        }
    )
    for (rid, _), d in run(core, reqs).items():
        text = tok.decode(d["ids"])
        assert d["reason"] == "stop"
        if rid.startswith("d"):
            assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text), text
        else:
            assert text in ("yes", "no", "c++ (maybe)"), text


def test_forced_tool_call_parses(core, tok):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 10},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "unit"],
                },
            },
        }
    ]
    grammar = compile_grammar("lark", tool_grammar(tools, ["get_weather"], HERMES, False), "tools")
    reqs = {
        f"t{i}": (
            tok.encode("Weather?"),
            SamplingParams(max_tokens=200, temperature=1.0, seed=i, grammar=grammar),
        )
        for i in range(4)
    }
    for d in run(core, reqs).values():
        assert d["reason"] == "stop"
        content, calls = parse(HERMES, tok.decode(d["ids"]))
        assert content is None and len(calls) == 1
        args = json.loads(calls[0]["function"]["arguments"])
        assert calls[0]["function"]["name"] == "get_weather" and args["unit"] in ("celsius", "fahrenheit")


def test_eos_only_where_the_grammar_accepts(core, tok):
    # logit_bias pushes eos far up: it may still only come where the grammar accepts
    eos = core.model_cfg.eos_token_ids[0]
    grammar = compile_grammar(
        "json",
        {
            "type": "array",
            "items": {"type": "integer", "maximum": 10**6},
            "minItems": 3,
            "maxItems": 6,
            "x-guidance": {"whitespace_flexible": False},
        },
        "guided_json",
    )
    out = run(
        core,
        {
            f"e{i}": (
                tok.encode("Numbers:"),
                SamplingParams(
                    max_tokens=300, temperature=1.0, seed=i, logit_bias={eos: 100.0}, grammar=grammar
                ),
            )
            for i in range(4)
        },
    )
    for d in out.values():
        assert d["reason"] == "stop"
        value = json.loads(tok.decode(d["ids"]))
        assert isinstance(value, list) and len(value) >= 3


def test_bad_grammar_is_an_error_and_others_run(core, tok):
    out = run(
        core,
        {
            "bad": (tok.encode("x"), SamplingParams(max_tokens=10, grammar='{"grammars": [{"nope": 1}]}')),
            "ok": (tok.encode("x"), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)),
        },
    )
    assert out[("bad", 0)]["reason"] == "error" and "grammar" in out[("bad", 0)]["error"]
    assert out[("ok", 0)]["reason"] == "length"


def test_abort_while_compiling(core, tok):
    grammar = compile_grammar(
        "json", {"type": "object", "properties": {"q": {"type": "string"}}}, "guided_json"
    )
    assert (
        core.add_request(EngineRequest("a", tok.encode("x"), SamplingParams(max_tokens=10, grammar=grammar)))
        is None
    )
    outs = core.abort(["a"])
    assert [o.finish_reason for o in outs] == ["abort"]
    for _ in range(50):
        if not core.has_work():
            break
        assert core.step() == []
    assert not core.has_work() and core.sampler.num_active == 0


def test_unconstrained_requests_load_nothing(model_dir):
    code = f"""
import sys
from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.messages import EngineRequest
from hotstart.sampling_params import SamplingParams
from hotstart.model.files import weight_files
d = {str(model_dir)!r}
files = tuple(map(str, weight_files(d)))
core = EngineCore.build(EngineConfig(model_path=d, weight_files=files, device="cpu",
                                     kv_cache_memory=16 << 20, max_model_len=256))
core.add_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, logprobs=2)))
while core.has_work():
    core.step()
assert "llguidance" not in sys.modules and core.grammars is None and len(core.sampler.transforms) == 4
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_compiling_imports_only_on_the_main_thread(model_dir):
    """The compile thread only calls into llguidance (its tokenizer view, matchers): no import off the
    main thread, while other streams keep stepping."""
    code = f"""
import sys, threading
off = []
main = threading.main_thread()
def hook(e, a):
    if e == "import" and threading.current_thread() is not main:
        off.append(a[0])
sys.addaudithook(hook)
from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.messages import EngineRequest
from hotstart.sampling_params import SamplingParams
from hotstart.model.files import weight_files
from hotstart.frontend.structured import compile_grammar
d = {str(model_dir)!r}
files = tuple(map(str, weight_files(d)))
core = EngineCore.build(EngineConfig(model_path=d, weight_files=files, device="cpu",
                                     kv_cache_memory=16 << 20, max_model_len=256))
core.add_request(EngineRequest("u", [1, 2, 3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
core.step()
g = compile_grammar("json", {{"type": "object", "properties": {{"a": {{"type": "integer", "maximum": 99}}}},
                             "required": ["a"], "x-guidance": {{"whitespace_flexible": False}}}}, "x")
core.add_request(EngineRequest("c", [1, 2, 3], SamplingParams(max_tokens=30, temperature=0, grammar=g)))
reasons = {{}}
while core.has_work():
    for o in core.step():
        reasons[o.request_id] = o.finish_reason
assert reasons == {{"u": "length", "c": "stop"}}, reasons
assert off == [], off
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
