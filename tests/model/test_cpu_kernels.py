"""hotstart's CPU kernels (hotstart/model/cpu_kernels.py): the small-batch linear kernel equals a float64
matmul on odd shapes, segments and strided rows (the paged decode kernel against its reference:
tests/model/test_paged_attention.py); a model whose steps run through both equals the plain path in
float32 (greedy identical); the fast path builds, loads and attaches them behind READY, says so, and
serves on when they cannot be built."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.engine import greedy_batch
from helpers.kernels import shared_kernels_home

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import FastPath, pack_model
from hotstart.engine.fastpath.pack import attach_gemv
from hotstart.messages import FastPathState as S
from hotstart.model import cpu_kernels
from hotstart.model.files import weight_files

DTYPES = [torch.float32, torch.bfloat16]
# three greedy requests of 12, 16 and 20 tokens: their decodes run 3, then 2, then 1 at a time, all
# <= MAX_ROWS (the small-batch kernel's)
RAGGED = (12, 16, 20)


def _needs(dtype: torch.dtype) -> None:
    if cpu_kernels.compiler() is None:
        pytest.skip("no C++ compiler: the engine serves with oneDNN alone")
    if not cpu_kernels.supported(dtype):
        pytest.skip(f"this CPU lacks the instructions of the {dtype} kernel (the engine says so and "
                    "serves with oneDNN)")


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HOTSTART_HOME", str(shared_kernels_home(tmp_path_factory)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_a_float64_matmul(dtype):
    """Rows 1-5 (5: a second pass over the weights), widths not a multiple of the vector (33, 100) and
    one that is (576), rows too long for 4 rows of x in L1 (5,000: taken in pieces), three segments side
    by side with and without biases, a weight whose rows are a view of a wider tensor, float32 or bf16
    out."""
    _needs(dtype)
    cpu_kernels.load(cpu_kernels.build())
    g = torch.Generator().manual_seed(0)
    for k in (33, 100, 576, 5000):
        wide = torch.randn(21, k + 7, generator=g).to(dtype)
        weights = [torch.randn(37, k, generator=g).to(dtype), wide[:, 3:3 + k],
                   torch.randn(5, k, generator=g).to(dtype)]
        assert weights[1].stride(0) == k + 7
        for biased in (False, True):
            biases = [torch.randn(w.shape[0], generator=g).to(dtype) if biased else None for w in weights]
            seg = cpu_kernels.Segments(weights, biases)
            for m in range(1, 6):
                x = torch.randn(m, k, generator=g).to(dtype)
                ref = x.double() @ torch.cat(weights).double().t()
                if biased:
                    ref = ref + torch.cat(biases).double()
                outs = [seg(x)] + ([seg(x, torch.float32)] if dtype == torch.bfloat16 else [])
                for out in outs:
                    assert out.shape == (m, 63)
                    scale = ref.abs().max().item()
                    # float32: accumulation order; bf16: the products are exact, the sum float32, then one
                    # rounding to bf16 (<= 2^-8 relative) unless the output is float32
                    tol = 1e-5 * scale if out.dtype == torch.float32 else 2 ** -8 * ref.abs() + 1e-4 * scale
                    assert ((out.double() - ref).abs() <= tol).all(), (k, m, biased, out.dtype)


def test_tile_kernel_equals_a_float64_matmul():
    """bf16 steps of 2 - 48 tokens through the repacked copy: widths not a multiple of 64 outputs (37 + 5)
    nor of 2 inputs (33), a bias on one segment, bf16 or float32 out: one bf16 rounding of a float32 sum
    of exact products."""
    if not cpu_kernels.tiles_supported(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16 (the engine keeps oneDNN past the GEMV's 4 tokens)")
    cpu_kernels.load(cpu_kernels.build())
    g = torch.Generator().manual_seed(2)
    for n, k in ((37, 33), (200, 100), (960, 576)):
        weights = [torch.randn(n, k, generator=g).bfloat16(), torch.randn(5, k, generator=g).bfloat16()]
        biases = [torch.randn(n, generator=g).bfloat16(), None]
        seg = cpu_kernels.Segments(weights, biases, tiles=True)
        assert seg.tiles.nbytes >= sum(w.nbytes for w in weights)  # a copy, padded
        for m in (2, 5, 7, 13, 48):
            assert seg.fits(torch.empty(m, k))
            x = torch.randn(m, k, generator=g).bfloat16()
            bias = torch.cat([biases[0], torch.zeros(5)]).double()
            ref = x.double() @ torch.cat(weights).double().t() + bias
            scale = ref.abs().max().item()
            for out_dtype in (torch.bfloat16, torch.float32):
                out = seg(x, out_dtype)
                assert out.shape == (m, n + 5) and out.dtype == out_dtype
                tol = (2 ** -8 if out_dtype == torch.bfloat16 else 0) * ref.abs() + 1e-5 * scale
                assert ((out.double() - ref).abs() <= tol).all(), (n, k, m, out_dtype)
    assert not seg.fits(torch.empty(cpu_kernels.TILE_MAX_ROWS + 1, k))


def _paged(kvh: int, d: int, block_size: int, contexts: list[int], g: torch.Generator):
    """Caches [KVH, slots, D] holding each context's keys in shuffled blocks (block 0: the null block)
    -> (k, v, tables [B, nb], each sequence's slots in order)."""
    counts = [-(-c // block_size) for c in contexts]
    blocks = (torch.randperm(sum(counts), generator=g) + 1).split(counts)
    k, v = (torch.randn(kvh, (sum(counts) + 1) * block_size, d, generator=g).bfloat16() for _ in range(2))
    tables = torch.zeros(len(contexts), max(counts), dtype=torch.long)
    slots = []
    for i, (b, c) in enumerate(zip(blocks, contexts, strict=True)):
        tables[i, :len(b)] = b
        slots.append((b[:, None] * block_size + torch.arange(block_size)).flatten()[:c])
    return k, v, tables, slots


def test_prefill_attention_kernel_equals_float64_attention():
    """Causal attention of several sequences' new rows over their paged keys: from position 0 and after
    a cached prefix (keys before the first row), grouped-query ratios 1 / 3 / 7, head sizes 16 / 64 / 96
    / 128, block sizes 16 and 32, a sliding window. Error bound: P rounded to bf16 (<= 2^-8 of the
    largest value) and the output rounded to bf16 (<= 2^-8 relative)."""
    if not cpu_kernels.tiles_supported(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16 (prefill attention keeps torch's SDPA)")
    cpu_kernels.load(cpu_kernels.build())
    cpu_kernels.enable_attention(True)
    assert cpu_kernels.prefill_enabled()
    g = torch.Generator().manual_seed(5)
    cases = [  # (rows, first positions), H, KVH, D, block size, window
        (([200], [0]), 9, 3, 64, 16, None),
        (([37, 5, 130], [0, 100, 17]), 8, 8, 128, 16, None),
        (([70, 1], [10, 0]), 14, 2, 96, 32, 33),
        (([1], [0]), 2, 1, 16, 16, None),
        (([150, 3], [0, 64]), 28, 4, 128, 16, 100),
    ]
    for (rows, starts), h, kvh, d, bs, window in cases:
        contexts = [s + n for s, n in zip(starts, rows, strict=True)]
        k, v, tables, slots = _paged(kvh, d, bs, contexts, g)
        q = torch.randn(sum(rows), h, d, generator=g).bfloat16()
        first = torch.tensor([0, *rows[:-1]]).cumsum(0)
        spans = torch.stack([first, torch.tensor(rows), torch.tensor(starts)], 1)
        out = cpu_kernels.prefill_attention(q, k, v, spans, tables, bs, d ** -0.5, window)
        assert out is not None and out.shape == q.shape and out.dtype == torch.bfloat16
        for i, (n, s) in enumerate(zip(rows, starts, strict=True)):
            kk, vv = (c[:, slots[i]].double().repeat_interleave(h // kvh, 0) for c in (k, v))  # [H, L, D]
            qq = q[first[i]:first[i] + n].double().transpose(0, 1)  # [H, n, D]
            pos, keys = s + torch.arange(n), torch.arange(contexts[i])
            seen = keys[None, :] <= pos[:, None]
            if window:
                seen &= keys[None, :] > pos[:, None] - window
            scores = (qq @ kk.transpose(1, 2) * d ** -0.5).masked_fill(~seen, float("-inf"))
            ref = (torch.softmax(scores, -1) @ vv).transpose(0, 1)  # [n, H, D]
            got = out[first[i]:first[i] + n].double()
            tol = 2 ** -8 * (ref.abs() + vv.abs().max())
            assert ((got - ref).abs() <= tol).all(), (rows, h, kvh, d, window, (got - ref).abs().max())


def _core(model_dir, dtype: str = "float32") -> EngineCore:
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))),
                       device="cpu", dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20)
    return EngineCore.build(cfg)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen2-moe", "phi3", "gemma2", "gemma3", "mistral"])
def test_model_through_the_kernels_equals_plain_in_float32(family, tiny_checkpoint, monkeypatch):
    """qwen2's q/k/v biases, llama, the experts of qwen2-moe, phi3's fused checkpoint, gemma2's tied head,
    soft-capping and sliding layers, mistral's window: every decode step of <= MAX_ROWS tokens goes
    through the small-batch kernel and every decode attention through the paged kernel (both counted),
    and the greedy tokens are those of the plain path, logits within float32 accumulation order."""
    _needs(torch.float32)
    core = _core(tiny_checkpoint(family))
    ref_logits: list = []
    ref = greedy_batch(core, ref_logits, RAGGED, ignore_eos=True)
    model = core.runner.model
    pack_model(model)
    cpu_kernels.load(cpu_kernels.build())
    assert attach_gemv(model) >= len(model.model.layers) + 1
    cpu_kernels.enable_attention(True)
    calls, attended = [], []
    call, attend = cpu_kernels.Segments.__call__, cpu_kernels._attention_fn
    monkeypatch.setattr(cpu_kernels.Segments, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    monkeypatch.setattr(cpu_kernels, "_attention_fn", lambda *a: attended.append(1) or attend(*a))
    logits: list = []
    assert greedy_batch(core, logits, RAGGED, ignore_eos=True) == ref
    layers = len(model.model.layers)
    decodes = max(RAGGED) - 1  # decode steps (the longest request's: its first token came with its prefill)
    assert len(calls) >= decodes * (layers + 1)  # every layer and the LM head, at each of those steps
    assert len(attended) >= decodes * layers
    assert len(logits) == len(ref_logits) > 0
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


def test_bfloat16_steps_through_every_kernel_add_no_error(default_model_dir):
    """The default model in bf16, a 40-token prompt teacher-forced (one step of 40 tokens: the tile kernel,
    the layer ops) and 4 greedy requests decoding together: the kernels add no error beyond bf16's own
    (against the float32 model: mean |error| within 1.25x of the plain bf16 path's, top-1 agreement
    within 5 points), and it serves."""
    if not cpu_kernels.tiles_supported(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16 (no tile kernel)")
    from hotstart.engine.fastpath.pack import install_kernels
    from hotstart.engine.model_runner import StepInputs

    ids = [(i * 7919) % 49000 + 3 for i in range(40)]

    def logits(core):
        return core.runner.run(StepInputs(ids, [0], [len(ids)], [[1, 2, 3]], [False], [True]))

    exact = logits(_core(default_model_dir, "float32"))
    core = _core(default_model_dir, "bfloat16")
    plain = logits(core)
    model = core.runner.model
    pack_model(model)
    notes = install_kernels(model, cpu_kernels.build(), ("", "", ""))
    assert f"(<= {cpu_kernels.TILE_MAX_ROWS} tokens)" in notes[0] and model.layer_ops, notes
    tiles, call = [], cpu_kernels.Tiles.__call__
    cpu_kernels.Tiles.__call__ = lambda self, *a: tiles.append(1) or call(self, *a)
    prefills, prefill = [], cpu_kernels._prefill_call
    cpu_kernels._prefill_call = lambda *a: prefills.append(1) or prefill(*a)
    try:
        fast = logits(core)
        assert len(tiles) == len(model.model.layers) * 4 + 1  # q/k/v, o, gate/up, down; the LM head
        assert len(prefills) == len(model.model.layers)  # the prompt's attention: the prefill kernel
        assert sum(len(t) for t in greedy_batch(core).values()) == 4 * 24
    finally:
        cpu_kernels.Tiles.__call__ = call
        cpu_kernels._prefill_call = prefill
    err_plain, err_fast = (plain - exact).abs().mean().item(), (fast - exact).abs().mean().item()
    assert err_fast <= 1.25 * err_plain + 1e-3, (err_fast, err_plain)
    top1 = lambda x: (x.argmax(-1) == exact.argmax(-1)).float().mean().item()  # noqa: E731
    assert top1(fast) >= top1(plain) - 0.05


def _settle(fast: FastPath) -> None:
    deadline = time.monotonic() + 300
    while fast.busy() and time.monotonic() < deadline:
        fast.tick(idle=True)
        time.sleep(0.01)
    assert not fast.busy()


def test_the_fast_path_builds_and_attaches_it_behind_ready(tiny_checkpoint, tmp_path, monkeypatch):
    """Built by g++ in a child process into $HOTSTART_HOME/kernels (the next engine loads it from there),
    attached once the layers are prepacked, and named in the packing stage's detail."""
    _needs(torch.float32)
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    core = _core(tiny_checkpoint("llama"))
    fast = FastPath(core, "eager-only", (8,), lambda m: None)
    _settle(fast)
    status = fast.status()
    assert status.packing is S.PACKED and "small-batch kernels on" in status.packing_detail, status
    assert cpu_kernels.library_path().parent == tmp_path / "kernels" and cpu_kernels.library_path().exists()
    assert core.runner.model.lm_head_gemv is not None and cpu_kernels._attention_fn is not None
    assert "paged decode kernel" in status.packing_detail
    again = FastPath(_core(tiny_checkpoint("llama")), "eager-only", (8,), lambda m: None)
    again.tick(idle=True)
    assert again._kernels_build is None  # cached: no second compile


def test_closing_mid_build_ends_the_compiler_and_its_children(tiny_checkpoint, tmp_path, monkeypatch):
    """An engine shut down while g++ builds the library (behind READY) ends g++ and the cc1plus it runs
    (g++ alone, signalled, left cc1plus compiling on: a server took over 10 s to stop), at once."""
    from hotstart.procs import alive, descendants

    _needs(torch.float32)
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    fast = FastPath(_core(tiny_checkpoint("llama")), "eager-only", (8,), lambda m: None)
    deadline = time.monotonic() + 60
    while fast._kernels_build is None and time.monotonic() < deadline:
        fast.tick(idle=False)
    proc = fast._kernels_build[0]
    while not descendants(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    tree = [proc.pid, *descendants(proc.pid)]
    assert len(tree) > 1, "g++ ran no compiler process"
    t = time.monotonic()
    fast.close()
    assert time.monotonic() - t < 1.0
    assert not [pid for pid in tree if alive(pid)] and not list((tmp_path / "kernels").glob(".*.tmp"))


def test_without_the_kernels_the_engine_serves_on(tiny_checkpoint, monkeypatch):
    """HOTSTART_GEMV=off, HOTSTART_DECODE_KERNEL=off, or a compiler that fails: the packing stage says
    which kernel is off and why, and the steps run on oneDNN / torch's attention (and serve)."""
    _needs(torch.float32)
    for env, why in ((("HOTSTART_GEMV", "off"), "no small-batch kernel: HOTSTART_GEMV=off"),
                     (("HOTSTART_DECODE_KERNEL", "off"), "paged decode kernel: HOTSTART_DECODE_KERNEL=off"),
                     (("CXX", "false"), "no small-batch kernel: g++ failed")):
        monkeypatch.setenv(*env)
        core = _core(tiny_checkpoint("llama"))
        fast = FastPath(core, "eager-only", (8,), lambda m: None)
        _settle(fast)
        status = fast.status()
        assert status.packing is S.PACKED and why in status.packing_detail, status
        assert (core.runner.model.lm_head_gemv is None) == (env[0] != "HOTSTART_DECODE_KERNEL")
        assert (cpu_kernels._attention_fn is None) == (env[0] != "HOTSTART_GEMV")
        assert sum(map(len, greedy_batch(core, None, RAGGED, ignore_eos=True).values())) == sum(RAGGED)
        monkeypatch.delenv(env[0])
