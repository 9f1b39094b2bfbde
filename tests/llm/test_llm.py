"""`LLM` (hotstart/llm/): greedy float32 equals transformers and the server's completion on a tiny random
odd-shaped checkpoint; chat, n, logprobs and structured outputs on the default model; no process left behind
after close(), `del` and interpreter exit."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import textwrap

import pytest
from helpers.procs import run_session, tagged
from helpers.server import Server, openai_client

from hotstart import LLM, SamplingParams, StructuredOutputsParams
from hotstart.procs import alive

pytestmark = pytest.mark.e2e  # LLM() starts the forkserver and the engine
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint, default_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("llm") / "tiny"
    shutil.copytree(tiny_checkpoint("qwen2"), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, model / name)
    return model


def _pids(llm: LLM) -> list[int]:
    launcher = llm._handle.start.launcher
    pids = [*launcher.engine_pids.values()]
    if launcher.server is not None:
        pids.append(launcher.server.pid)
    return pids


def _gone(pids: list[int]) -> bool:
    return not any(map(alive, pids))


def test_greedy_equals_transformers_and_the_server(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_model), dtype="float32", max_model_len=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        pids = _pids(llm)
        assert pids and not _gone(pids)  # the forkserver and the engine it forked
    assert _gone(pids)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
        assert out.prompt_token_ids == p and out.prompt is None
        (c,) = out.outputs
        assert c.token_ids == want and c.finish_reason == "length" and c.index == 0
    s = Server(str(tiny_model), "--max-model-len", "256", "--dtype", "float32")
    try:
        client = openai_client(s, timeout=60)
        for p, out in zip(PROMPTS, outs):
            r = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == out.outputs[0].text
    finally:
        s.stop()


def test_chat_n_logprobs_structured_and_del(default_model_dir):
    llm = LLM(str(default_model_dir), max_model_len=512)
    pids = _pids(llm)
    conv = [{"role": "user", "content": "Name a color."}]
    (one,) = llm.chat(conv, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert one.outputs[0].text and one.prompt_token_ids == llm.get_tokenizer().encode_chat(conv)
    a, b = llm.chat([conv, conv], [SamplingParams(temperature=0, max_tokens=8),
                                   SamplingParams(n=3, seed=1, max_tokens=5, logprobs=2)])
    assert a.outputs[0].text == one.outputs[0].text and len(b.outputs) == 3
    for c in b.outputs:
        assert len(c.logprobs) == len(c.token_ids) and c.cumulative_logprob <= 0
        assert all(t in lp and len(lp) >= 2 for t, lp in zip(c.token_ids, c.logprobs))
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    (js,) = llm.chat(conv, SamplingParams(temperature=0, max_tokens=40,
                                          structured_outputs=StructuredOutputsParams(json=schema)))
    assert isinstance(json.loads(js.outputs[0].text)["color"], str)
    texts = llm.generate(["The sky is", "One, two,"],
                         SamplingParams(temperature=0, max_tokens=4, stop=["\n"]))
    assert [t.prompt for t in texts] == ["The sky is", "One, two,"]
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate("hi", SamplingParams(max_tokens=600))
    del llm
    gc.collect()
    assert _gone(pids)


def test_nothing_left_at_interpreter_exit(default_model_dir):
    tag = f"llm-exit-{os.getpid()}"
    code = textwrap.dedent(f"""
        from hotstart import LLM, SamplingParams
        llm = LLM({str(default_model_dir)!r}, max_model_len=256)
        print(llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids)
    """)
    env = {**os.environ, "HOTSTART_TEST_TAG": tag, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    done = run_session([sys.executable, "-c", code], timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout.strip().splitlines()[-1])) == 2
    assert not tagged(tag)
