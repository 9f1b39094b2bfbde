"""The one SamplingParams (hotstart/sampling_params.py, vLLM's names): the server's checks as ValueErrors,
resolved against the engine's facts (frontend/sampling.py), and `import hotstart` staying light."""

from __future__ import annotations

import json

import pytest

from hotstart.frontend.sampling import EngineLimits, resolve
from hotstart.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kw,words", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "`n`"),
    ({"min_p": 2}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"), ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {5: 500}}, "logit_bias"), ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"structured_outputs": StructuredOutputsParams(regex="a"),
      "guided_decoding": GuidedDecodingParams(regex="b")}, "not both"),
    ({"structured_outputs": StructuredOutputsParams(regex="a", choice=["x"])}, "only one constraint"),
])
def test_bad_values_raise_value_error(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_resolved_params():
    sp = SamplingParams(n=2, temperature=0.5, top_k=-1, seed=3, stop_token_ids=[7], logit_bias={4: 1.5},
                        logprobs=2, max_tokens=None,
                        structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    w = resolve(sp, 10, EngineLimits(100, 256, 1000))
    got = (w.n, w.temperature, w.top_k, w.seed, w.stop_token_ids, w.logit_bias, w.logprobs, w.max_tokens)
    assert got == (2, 0.5, 0, 3, [7], {4: 1.5}, 2, 90)
    assert w.grammar and json.loads(w.grammar)
    choice = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert resolve(choice, 3, EngineLimits(100)).grammar
    with pytest.raises(ValueError, match="maximum context length is 100"):
        resolve(SamplingParams(max_tokens=95), 10, EngineLimits(100))
    with pytest.raises(ValueError, match="out of range"):
        resolve(SamplingParams(stop_token_ids=[5000]), 10, EngineLimits(100, 256, 1000))
    with pytest.raises(ValueError, match="`n` must be in"):
        resolve(SamplingParams(n=8), 10, EngineLimits(100, 4, 1000))  # more choices than the engine batches
    assert SamplingParams(stop="x").stop_strings == ["x"]


def test_wrong_types_are_named():
    for kw, name in (({"temperature": "hot"}, "temperature"), ({"n": 1.5}, "n"), ({"stop": [1]}, "stop"),
                     ({"logit_bias": {"a": 1}}, "logit_bias"), ({"ignore_eos": 1}, "ignore_eos")):
        with pytest.raises(ValueError, match=f"`{name}` must be") as e:
            SamplingParams(**kw)
        assert e.value.param == name


def test_one_class_from_user_to_engine():
    """The offline API's class is the engine's: a request travels as the object the user made."""
    import msgspec

    from hotstart.messages import EngineRequest

    sp = resolve(SamplingParams(temperature=0.5, stop=["\n"], max_tokens=None), 4, EngineLimits(32))
    wire = msgspec.msgpack.encode(EngineRequest("r", [1, 2, 3, 4], sp))
    back = msgspec.msgpack.decode(wire, type=EngineRequest)
    assert back.params == sp and back.params.max_tokens == 28


def test_import_hotstart_stays_light():
    from helpers.procs import no_torch_in

    # the LLM's API side is torch-free too, and so is the start sequence until it builds an engine here
    for module in ("hotstart", "hotstart.llm", "hotstart.frontend.start", "hotstart.server.api"):
        ok, heavy = no_torch_in(module)
        assert ok, f"{module} imported {heavy}"
    import hotstart

    assert hotstart.SamplingParams is SamplingParams
    with pytest.raises(AttributeError):
        hotstart.Nope  # noqa: B018
