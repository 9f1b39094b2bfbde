"""vLLM-shaped SamplingParams (hotstart/llm/params.py): the server's checks as ValueErrors, the wire params,
and `import hotstart` staying light."""

from __future__ import annotations

import json

import pytest

from hotstart.llm.params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams


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


def test_wire_params():
    sp = SamplingParams(n=2, temperature=0.5, top_k=-1, seed=3, stop_token_ids=[7], logit_bias={4: 1.5},
                        logprobs=2, max_tokens=None,
                        structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    w = sp.to_wire(10, 100, 1000)
    got = (w.n, w.temperature, w.top_k, w.seed, w.stop_token_ids, w.logit_bias, w.logprobs, w.max_tokens)
    assert got == (2, 0.5, 0, 3, [7], {4: 1.5}, 2, 90)
    assert w.grammar and json.loads(w.grammar)
    choice = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert choice.to_wire(3, 100, None).grammar
    with pytest.raises(ValueError, match="maximum context length is 100"):
        SamplingParams(max_tokens=95).to_wire(10, 100, None)
    with pytest.raises(ValueError, match="out of range"):
        SamplingParams(stop_token_ids=[5000]).to_wire(10, 100, 1000)
    assert SamplingParams(stop="x").stop_strings() == ["x"]


def test_import_hotstart_stays_light():
    from helpers.procs import no_torch_in

    for module in ("hotstart", "hotstart.llm", "hotstart.server.api"):  # the LLM's API side is torch-free too
        ok, heavy = no_torch_in(module)
        assert ok, f"{module} imported {heavy}"
    import hotstart

    assert hotstart.SamplingParams is SamplingParams
    with pytest.raises(AttributeError):
        hotstart.Nope  # noqa: B018
