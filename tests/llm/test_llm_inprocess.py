"""`LLM(..., engine="inprocess")`: the engine in this process; batched answers equal one-by-one answers
(float32), the progress bar, prompt forms, close()."""

from __future__ import annotations

import pytest

from hotstart import LLM, SamplingParams


def test_inprocess_batch_equals_one_by_one(default_model_dir, capsys):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(default_model_dir), engine="inprocess", dtype="float32", max_model_len=256)
    try:
        prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
        batch = llm.generate(prompts, greedy, use_tqdm=True)
        assert "3/3" in capsys.readouterr().err  # the progress bar (tqdm or the plain one)
        alone = [llm.generate(p, greedy, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
        assert all(len(o.outputs[0].token_ids) == 6 and o.outputs[0].finish_reason == "length" for o in batch)
        ids = llm.get_tokenizer().encode(prompts[0])
        (same,) = llm.generate([ids], greedy, use_tqdm=False)
        assert same.outputs[0].text == batch[0].outputs[0].text and same.prompt_token_ids == ids
        with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
            llm.generate(prompts, [greedy, greedy])
        with pytest.raises(TypeError, match="unexpected arguments: bogus"):
            LLM(str(default_model_dir), bogus=1)
    finally:
        llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x", greedy)
