"""`hotstart bench step` (one EngineCore: profile, sampling, grammar) and `hotstart bench roofline`, end to
end on tiny configurations; a few seconds each on 2 quiet cores."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from helpers import REPO
from helpers.procs import run_session

from hotstart.model import cpu_kernels


def hotstart_bench(verb: str, args: list[str], env: dict | None = None, timeout: float = 300):
    return run_session([sys.executable, "-m", "hotstart", "bench", verb, *args], timeout, env or os.environ,
                       cwd=REPO)


def test_step_all_parts_on_one_core(tmp_path, default_model_dir):
    out = tmp_path / "step.json"
    res = hotstart_bench("step", [str(default_model_dir), "--fast-path", "packed", "--streams", "2",
                                  "--context", "8", "--steps", "2", "--rounds", "1", "--top", "4",
                                  "--parts", "profile,sampling,grammar,blocks",
                                  "--bandwidth", "10", "--json", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    # auto: bf16 where the CPU computes it natively (avx512_bf16 / amx), else float32
    assert data["dtype"] in ("bfloat16", "float32") and data["fast_path"] == "packed" and data["pack_s"] > 0
    p = data["profile"]
    assert p["step_ms"] > 0 and p["tokens_per_s"] == 2 / (p["step_ms"] / 1000)
    # the linear layers: oneDNN's prepacked, or at 2 streams the small-batch kernel (named for the profiler)
    assert len(p["top"]) == 4 and any("linear" in r["op"] for r in p["top"])
    assert p["roofline"]["bandwidth"] == {"bandwidth_gbs": 10, "source": "given"}
    assert p["roofline_fraction"] > 0
    assert set(data["sampling"]["kinds"]) == {"plain", "penalties", "bias+min_p"}
    assert data["sampling"]["kinds"]["plain"]["x_plain"] == 1
    assert data["grammar"]["constrained_step_ms"]["median"] > 0
    assert "| op | calls/step | self ms/step | share |" in res.stdout and "x plain" in res.stdout
    blocks = {r["block"] for r in data["blocks"]["rows"]}
    assert blocks >= {"step (all)", "LM head"}  # and the layers' blocks: the layer ops' where they run
    assert blocks & {"layer: KV write + attention (attend)", "layer ops: attention (attend)"}
    assert "| block | ms per step |" in res.stdout


@pytest.mark.parametrize("family", ["llama", "qwen2-moe", "olmo2"])
def test_blocks_nest_and_leave_nothing_wrapped(tiny_checkpoint, family):
    """`--parts blocks` in the process: every block timed, the parts within their wholes, and the
    engine's methods its own again afterwards (the wrappers live on instances, or are put back on the
    layer ops' module). Llama's steps take the layer ops where the CPU kernels run (model/layer_ops.py)."""
    from hotstart.bench import step_parts
    from hotstart.bench.engine_setup import build_core
    from hotstart.model import layer_ops

    own = {name: getattr(layer_ops, name) for name in ("attn_inputs", "attend", "finish")}
    bc = build_core(str(tiny_checkpoint(family)), "float32", "packed", batch=3, max_model_len=128)
    ops = bc.core.runner.model.layer_ops
    assert ops == (family == "llama" and not layer_ops.unsupported(bc.core.runner.model)
                   and cpu_kernels.compiler() is not None and cpu_kernels.attention_supported(torch.float32))
    res = step_parts.blocks(bc, streams=3, context=9, steps=4)
    ms = {r["block"]: r["ms_per_step"] for r in res["rows"]}
    assert all(v > 0 for v in ms.values()) and len(ms) == (8 if ops else 9), ms
    layers = sum(v for k, v in ms.items() if k.startswith("layer ops:" if ops else "layer:"))
    assert ms["step (all)"] >= ms["runner forward (metadata, model, logits, sampling)"] >= (
        ms["model forward (embedding, layers, final norm)"]) >= layers
    if ops:
        assert ms["layer ops: o_proj, add + norm, MLP (finish)"] >= ms["  of which o_proj"]
    else:
        assert ms["layer: o_proj + MLP + norms (finish)"] >= ms["  of which the MLP (or experts)"]
    assert all(getattr(layer_ops, name) is f for name, f in own.items())
    core = bc.core
    objs = [core, core.runner, core.runner.model, *core.runner.model.model.layers]
    objs += [m for layer in core.runner.model.model.layers for m in layer.modules()]
    assert not any(name in vars(o) for o in objs for name in ("step", "forward", "attn_inputs", "attend",
                                                               "finish", "compute_logits"))


def test_step_bad_parts_is_a_one_line_error():
    res = hotstart_bench("step", ["--parts", "profile,nope"], timeout=60)
    want = "hotstart: error: --parts 'profile,nope': give some of profile, sampling, grammar, blocks"
    assert res.returncode == 2 and res.stderr.strip() == want, res.stderr


def test_roofline_measures_saves_and_converts(tmp_path, default_model_dir):
    env = {**os.environ, "HOTSTART_HOME": str(tmp_path / "home")}
    args = [str(default_model_dir), "--size-mb", "16", "--reps", "2", "--threads", "1,2",
            "--tokens-per-s", "20", "--context", "100"]
    res = hotstart_bench("roofline", args, env, 120)
    assert res.returncode == 0, res.stderr[-3000:]
    saved = json.loads((tmp_path / "home" / "bench" / "roofline.json").read_text())["cpu"]
    kinds = {(r["kernel"], r["threads"]) for r in saved["results"]}
    assert kinds == {("read", 1), ("read", 2), ("copy", 1), ("copy", 2)}
    assert all(r["best_gbs"] >= r["median_gbs"] > 0 for r in saved["results"])
    read2 = next(r for r in saved["results"] if r["kernel"] == "read" and r["threads"] == 2)
    assert saved["bandwidth_gbs"] == read2["median_gbs"] and saved["threads"] == 2
    assert "of the roofline" in res.stdout and "269.0 MB of BF16 weights per step" in res.stdout
    # `bench serve` / `bench step` take the saved figure (here: from a child that finds it)
    code = "from hotstart.bench import roofline; print(roofline.bandwidth(None, measure_if_unknown=False))"
    got = run_session([sys.executable, "-c", code], 60, env, cwd=REPO)
    assert str(saved["bandwidth_gbs"]) in got.stdout
