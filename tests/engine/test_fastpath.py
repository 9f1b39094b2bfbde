"""The fast path built behind READY: oneDNN-prepacked weights and AOTInductor-compiled layer graphs equal
the plain eager path; a bucket swaps in under load without an error or a lost token; a failed compile
falls back to eager; the compile cache is reused by the next start."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

import httpx
import pytest
import torch
import torch.nn.functional as F
from helpers.engine import greedy_batch
from helpers.server import Server

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import FastPath, LayerSpec, cache_folder
from hotstart.engine.fastpath.state import IllegalTransition, transition
from hotstart.engine.model_runner import StepInputs
from hotstart.messages import FastPathState as S
from hotstart.messages import FastPathStatus, Span
from hotstart.model import cpu_kernels, onednn
from hotstart.model.files import weight_files

pytestmark = pytest.mark.skipif(not onednn.available(torch.device("cpu"), torch.float32),
                                reason="no oneDNN packing in this torch build")
# bf16 prepacking needs avx512bw/vl/dq or avx_ne_convert: an AVX2-only host (seen: an AVX2 EPYC) has none
BF16_PREPACK = onednn.available(torch.device("cpu"), torch.bfloat16)


def test_packed_linear_equals_plain():
    g = torch.Generator().manual_seed(0)
    # bf16: oneDNN's kernels (chosen by host) may round differently from F.linear's, within bf16's own
    # precision; float32: the same up to accumulation order
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        if dtype == torch.bfloat16 and not BF16_PREPACK:
            with pytest.raises(RuntimeError):  # what available() probes for
                onednn.pack(torch.ones(16, 16, dtype=dtype))
            continue
        w, b = torch.randn(96, 80, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
        p = onednn.pack(w)
        for rows in (1, 5, 16, 33):
            x = torch.randn(rows, 80, generator=g).to(dtype)
            ref = F.linear(x, w, b)
            assert (onednn.linear(x, p, b) - ref).abs().max().item() <= tol * ref.abs().max().item()


def _core(model_dir, dtype="float32", buckets="8") -> EngineCore:
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))),
                       device="cpu", dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
                       compile_buckets=buckets)
    return EngineCore.build(cfg)


def _build(core: EngineCore, mode: str, timeout: float = 900.0) -> tuple[FastPath, list]:
    sent: list = []
    fast = FastPath(core, mode, core.cfg.compile_bucket_sizes(), sent.append)
    deadline = time.monotonic() + timeout
    while fast.busy() and time.monotonic() < deadline:
        fast.tick(idle=True)
        time.sleep(0.02)
    assert not fast.busy() and fast.status().settled(), fast.status()
    return fast, sent


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_compiled_graphs_equal_plain_eager_in_float32(family, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    core = _core(tiny_checkpoint(family))
    ref_logits: list = []
    ref = greedy_batch(core, ref_logits)
    fast, sent = _build(core, "graphs")
    status = fast.status()
    assert status.packing is S.OFF and status.compile is S.READY, status
    assert [(b.tokens, b.state, b.detail) for b in status.buckets] == [(8, S.READY, "compiled")]
    logits: list = []
    assert greedy_batch(core, logits) == ref  # identical greedy tokens
    assert core.runner.compiled.steps[8] > 0  # decodes of <= 8 tokens ran compiled
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-4
    names = [m.name for m in sent if isinstance(m, Span)]
    assert names == ["layer graph ready (8 tokens)"]
    assert any(isinstance(m, FastPathStatus) for m in sent)
    fast.close()


def _all_logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill of IDS (teacher forced: no sampling feeds back)."""
    blocks = list(range(1, -(-len(ids) // core.cfg.block_size) + 1))
    return core.runner.run(StepInputs(ids, [0], [len(ids)], [blocks], [False], [True]))


def test_packed_weights_equal_plain_in_float32_and_add_no_error_in_bfloat16(default_model_dir):
    """oneDNN picks its bf16 kernels by host (AMX, AVX512-BF16, ...): their accumulation order, and so
    bf16 results, may differ from F.linear's. The claim that holds on every host: in float32 packed ==
    plain (greedy tokens identical, logits within 2e-4 of their scale: 30 layers of accumulation
    order); in bf16 packing adds no error beyond bf16's own
    (measured against the float32 model: mean |error| within 1.25x of the plain bf16 path's, top-1
    agreement within 5 points)."""
    ids = [(i * 7919) % 49000 + 3 for i in range(96)]
    ref32 = _core(default_model_dir, dtype="float32")
    exact = _all_logits(ref32, ids)
    greedy32 = greedy_batch(ref32)
    fast32, _ = _build(ref32, "eager-only")
    assert fast32.status().packing is S.PACKED
    assert greedy_batch(ref32) == greedy32
    assert (_all_logits(ref32, ids) - exact).abs().max().item() < 2e-4 * exact.abs().max().item()

    core = _core(default_model_dir, dtype="bfloat16")
    plain = _all_logits(core, ids)
    if not BF16_PREPACK:  # this host: the fast path says so and the engine serves eagerly
        fast = FastPath(core, "eager-only", (8,), lambda m: None)
        status = fast.status()
        assert status.packing is S.OFF and "no oneDNN prepacking for cpu bfloat16" in status.packing_detail
        assert sum(len(t) for t in greedy_batch(core).values()) == 4 * 24
        return
    fast, _ = _build(core, "eager-only")
    assert fast.status().packing is S.PACKED and fast.status().compile is S.OFF
    packed_ = _all_logits(core, ids)
    err_plain, err_packed = (plain - exact).abs().mean().item(), (packed_ - exact).abs().mean().item()
    assert err_packed <= 1.25 * err_plain + 1e-3, (err_packed, err_plain)
    top1 = lambda x: (x.argmax(-1) == exact.argmax(-1)).float().mean().item()  # noqa: E731
    assert top1(packed_) >= top1(plain) - 0.05
    assert sum(len(t) for t in greedy_batch(core).values()) == 4 * 24  # and it serves


@pytest.mark.parametrize("family", ["qwen2", "olmo2", "qwen2-moe", "phi3", "gemma2"])
def test_sibling_projections_packed_as_one_equal_plain_in_float32(family, tiny_checkpoint):
    """q/k/v and gate/up (experts' too) are prepacked as one stacked weight each (PackedGroup, with
    biases: qwen2), through the families' own projections (olmo2), beside a checkpoint that ships them
    fused already (phi3): greedy tokens identical, logits within float32 accumulation order."""
    from hotstart.engine.fastpath import pack_model
    from hotstart.model.layers import Linear, PackedGroup

    core = _core(tiny_checkpoint(family))
    ids = [(i * 31) % 200 + 3 for i in range(23)]
    exact, greedy = _all_logits(core, ids), greedy_batch(core)
    model = core.runner.model
    pack_model(model)
    groups = [g for m in model.modules() for g in vars(m).values() if isinstance(g, PackedGroup)]
    grouped = {id(lin) for m in model.modules() if hasattr(m, "pack_groups")
               for lins in m.pack_groups().values() for lin in lins}
    # one q/k/v group and at least one gate/up group a layer (an MoE layer: one per expert)
    assert len(groups) >= (0 if family == "phi3" else 2 * len(model.model.layers))
    for m in model.model.layers.modules():  # every linear is served prepacked: alone, or in its group
        if isinstance(m, Linear):
            assert (m.prepacked is None) == (id(m) in grouped), m
    assert greedy_batch(core) == greedy
    packed = _all_logits(core, ids)
    assert (packed - exact).abs().max().item() < 1e-4 * exact.abs().max().item()


def test_auto_packs_where_it_fits_and_else_groups_for_the_kernels_or_compiles(tiny_checkpoint, monkeypatch):
    """Where the prepacked copies fit: packed. Where they do not: the CPU kernels over the checkpoint's own
    weights (no copy made; greedy tokens those of the plain path), or, without them (no compiler or no
    AVX2), the layer graphs."""
    from hotstart.engine.fastpath import plan
    from hotstart.model.layers import Linear

    core = _core(tiny_checkpoint("llama"))
    greedy = greedy_batch(core)
    fast = FastPath(core, "auto", (8,), lambda m: None)
    status = fast.status()
    assert status.packing is S.PLANNED and status.compile is S.OFF, status
    assert status.compile_detail.startswith("the prepacked weights"), status
    # the prepacked copies cannot fit
    monkeypatch.setattr(plan, "available_memory_detail", lambda: (1000, "MemAvailable"))
    fast = FastPath(core, "auto", (8,), lambda m: None)
    status = fast.status()
    if cpu_kernels.compiler() is not None and cpu_kernels.attention_supported(torch.float32):
        assert status.packing is S.PLANNED and status.compile is S.OFF and not status.buckets, status
        deadline = time.monotonic() + 300
        while fast.busy() and time.monotonic() < deadline:
            fast.tick(idle=True)
        status = fast.status()
        assert status.packing is S.PACKED, status
        assert status.packing_detail.startswith("no copies: prepacked weights"), status
        assert "small-batch kernels on" in status.packing_detail and "layer ops" in status.packing_detail
        model = core.runner.model
        assert model.lm_head_prepacked is None and model.layer_ops
        assert all(m.prepacked is None for m in model.modules() if isinstance(m, Linear))
        assert all(layer.self_attn.packed_qkv.prepacked is None for layer in model.model.layers)
        assert greedy_batch(core) == greedy
        return
    assert status.packing is S.OFF and status.packing_detail.startswith("prepacked weights"), status
    no_cxx = (S.OFF, "no C++ compiler (g++) found")
    assert (status.compile, status.compile_detail) in ((S.PLANNED, ""), no_cxx)
    planned = [(8, S.PLANNED)] if status.compile is S.PLANNED else []
    assert [(b.tokens, b.state) for b in status.buckets] == planned


def test_off_builds_nothing(tiny_checkpoint):
    core = _core(tiny_checkpoint("llama"))
    fast = FastPath(core, "off", (8,), lambda m: None)
    fast.tick(idle=True)
    assert not fast.busy() and core.runner.compiled is None
    assert all(getattr(m, "prepacked", None) is None for m in core.runner.model.modules())
    status = fast.status()
    assert status.packing is S.OFF and status.compile is S.OFF and status.settled()


def test_the_state_machine_moves_only_forward():
    assert transition("packing", S.PLANNED, S.PACKING) is S.PACKING
    assert transition("packing", S.PACKING, S.PACKED) is S.PACKED
    assert transition("bucket 8", S.COMPILING, S.READY) is S.READY
    for now, to in ((S.PACKED, S.PACKING), (S.READY, S.FAILED), (S.OFF, S.PLANNED), (S.PLANNED, S.READY),
                    (S.PACKING, S.COMPILING), (S.FAILED, S.READY)):
        with pytest.raises(IllegalTransition):
            transition("x", now, to)


# ---- a real server ------------------------------------------------------------------------------

PROMPTS = [list(range(5 + i, 25 + 2 * i)) for i in range(16)]  # token ids: the tiny model's vocab is 512


def _served_model(tiny_checkpoint, default_model_dir, tmp_path_factory):
    """A tiny float32 checkpoint with the default model's tokenizer, so a server can run it."""
    import shutil

    folder = tmp_path_factory.mktemp("served-qwen2")
    src = tiny_checkpoint("qwen2")
    for f in src.iterdir():
        shutil.copy(f, folder / f.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def served(tiny_checkpoint, default_model_dir, tmp_path_factory):
    return _served_model(tiny_checkpoint, default_model_dir, tmp_path_factory)


def _complete(url: str, prompt: list[int], tokens: int = 96) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == tokens
    return r.json()["choices"][0]["text"]


def _wave(url: str) -> list[str]:
    with cf.ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda p: _complete(url, p), PROMPTS))


def _fast_path(url: str) -> dict:
    return httpx.get(url + "/startup", timeout=10).json().get("fast_path") or {}


def _serve(model, home, *args, env=None) -> Server:
    return Server(str(model), "--served-model-name", "m", "--max-model-len", "512", "--max-num-seqs", "16",
                  "--compile-buckets", "16", *args, env={"HOTSTART_HOME": str(home), **(env or {})})


def test_bucket_swaps_in_under_load_then_the_cache_is_reused(served, tmp_path):
    ref_server = _serve(served, tmp_path, "--compile", "off")
    try:
        reference = _wave(ref_server.url)
    finally:
        ref_server.stop()
    s = _serve(served, tmp_path, "--compile", "graphs")
    try:
        waves = 0
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # 16 streams in flight the whole time the bucket compiles
            assert _wave(s.url) == reference
            waves += 1
            buckets = _fast_path(s.url).get("buckets", [])
            if buckets and buckets[0][2] > 0:  # [tokens, state, steps]: the compiled graph ran
                break
            time.sleep(1.0)  # load with gaps: the compile worker runs only on a core the engine leaves idle
        assert buckets and buckets[0][:2] == [16, "ready"], buckets
        assert _wave(s.url) == reference  # and once more, all on the compiled graph
        metrics = httpx.get(s.url + "/metrics").text
        assert 'hotstart_compiled_bucket_state{bucket="16",state="ready"} 1.0' in metrics
        startup = httpx.get(s.url + "/startup").json()
        names = [p["name"] for p in startup["phases"]]
        assert names.index("layer graph ready (16 tokens)") > names.index("engine ready")
    finally:
        s.stop()
    assert "Traceback" not in s.output
    # The next start finds the graph in the cache: in use long before a compile could finish.
    t = time.monotonic()
    s = _serve(served, tmp_path, "--compile", "graphs")
    try:
        while time.monotonic() - t < 60:
            buckets = _fast_path(s.url).get("buckets", [])
            if buckets and buckets[0][1] == "ready":
                break
            time.sleep(0.1)
        assert buckets[0][1] == "ready" and time.monotonic() - t < 15, (buckets, time.monotonic() - t)
        ready = [
            p
            for p in httpx.get(s.url + "/startup").json()["phases"]
            if p["name"].startswith("layer graph")
        ]
        assert "from the compile cache" in ready[0]["detail"]
        assert _wave(s.url) == reference
    finally:
        s.stop()


def test_a_failed_compile_keeps_serving_eagerly(served, tmp_path):
    # A C++ compiler that fails, through CXX, which Inductor honours (and the CPU kernels' build, which
    # --compile graphs does not start: only the compile worker ever runs it)
    cxx = tmp_path / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text("#!/bin/sh\necho 'g++: fatal error: cannot compile anything here' >&2\nexit 1\n")
    cxx.chmod(0o755)
    s = _serve(served, tmp_path, "--compile", "graphs", env={"CXX": str(cxx)})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            fast = _fast_path(s.url)
            if fast.get("compile") not in (None, "planned", "compiling"):
                break
            time.sleep(0.2)
        assert fast["buckets"][0][1] == "failed" and fast["compile"] == "failed", fast
        assert _complete(s.url, PROMPTS[0], 8)
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()
    failures = [line for line in s.lines if "failed" in line and "stays eager" in line]
    assert len(failures) == 1, s.output
    assert "Traceback" not in s.output
    assert not list((tmp_path / "compile").glob("*/*.pt2"))  # nothing half-written is left to load


def test_compile_cache_key_changes_with_what_the_graph_depends_on(tiny_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    from hotstart.config import load_model_config

    cfg = load_model_config(tiny_checkpoint("qwen2"))
    a = cache_folder(LayerSpec.of(cfg), torch.float32)
    assert a == cache_folder(LayerSpec.of(cfg), torch.float32)
    assert a != cache_folder(LayerSpec.of(cfg), torch.bfloat16)
    assert a.parent == tmp_path / "compile"
    assert json.dumps(LayerSpec.of(cfg).as_dict())  # plain data: it travels to the compile worker
    assert os.path.basename(a) != os.path.basename(cache_folder(LayerSpec.of(load_model_config(
        tiny_checkpoint("qwen3"))), torch.float32))


def test_the_kernels_are_attached_a_layer_per_gap_between_steps(tiny_checkpoint):
    """A busy engine's tick attaches the small-batch kernel to one decoder layer (the tile kernel's copies
    take milliseconds each: all at once held a gap ~0.45 s on the default model); the engine serves in
    between on what is attached so far, the layer ops turned on only once every layer has its kernels."""
    core = _core(tiny_checkpoint("llama"))
    fast = FastPath(core, "eager-only", core.cfg.compile_bucket_sizes(), lambda m: None)
    if fast._whys[0]:
        pytest.skip(f"no small-batch kernel here: {fast._whys[0]}")
    cpu_kernels.build()
    layers = core.runner.model.model.layers

    def attached() -> int:
        return sum(any(getattr(m, "gemv", None) is not None for m in layer.modules()) for layer in layers)

    ids = [(i * 7) % 90 + 3 for i in range(12)]
    want = greedy_batch(core)
    seen = []
    deadline = time.monotonic() + 300
    while fast.busy() and time.monotonic() < deadline:
        fast.tick(idle=False)
        seen.append((attached(), core.runner.model.layer_ops))
        if 0 < seen[-1][0] < len(layers):
            assert not seen[-1][1]  # the layer ops wait for every layer
            assert greedy_batch(core) == want  # serving on a part of the kernels
        time.sleep(0.01)
    assert fast.status().packing is S.PACKED, fast.status()
    counts = [n for n, _ in seen]
    assert counts[-1] == len(layers) and len(layers) > 1
    assert any(0 < n < len(layers) for n in counts), counts  # more than one tick
    assert all(b - a <= 1 for a, b in zip(counts, counts[1:])), counts  # one layer per busy tick
    assert greedy_batch(core) == want and _all_logits(core, ids).isfinite().all()
