"""The quantized matmul kernels (hotstart/model/quant_kernels.py) against dequantize-then-matmul: every ggml
type they take, weights from the gguf package's quantizer (or crafted random K-quant blocks), dequantized by
the gguf package (its numpy reference); odd N and M, K across a segment boundary, steps of 1 - 4 and 5 - 65
tokens, 1 and 2 threads, float32 and bf16 activations, each instruction set this host runs (AVX512-VNNI:
the transposed tiles up to 7 tokens, the 16-token lanes from 8; AVX2; the portable C++) forced in turn.

Two bounds per output (n, m), both in float64:
- exact arithmetic: the kernels' integer dot products are exact, so against xq @ W^T (xq: x quantized as
  the kernels quantize it) only float32 accumulation remains: within 1e-6 of sum_k |xq_mk W_nk| (float32's
  2^-24 per rounding, summed over a few dozen roundings in the vector lanes' order: <= 1e-7 measured);
- against the product itself, x @ W^T: int8 activations add at most d_a / 2 per element (d_a = max |x| / 127
  over its block of 32, rounding to nearest), so |out - x @ W^T| <= sum_k |W_nk| d_a(k) / 2 plus the first
  bound; llama.cpp bounds its vec_dot tests by a relative error instead (0.02 of the product's scale): this
  is tighter, and its normalized mean squared error is checked below llama.cpp's test-backend-ops limit
  for mul_mat (5e-4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.kernels import shared_kernels_home
from helpers.quant_blocks import TYPES, dequantize, quantize_activations, random_weight

from hotstart.model import cpu_kernels
from hotstart.model import quant_kernels as qk
from hotstart.system import cpu_flags

ISAS = [isa for isa in (qk.AVX512_VNNI, qk.AVX2, qk.PORTABLE)
        if isa == qk.PORTABLE or set(qk._ISA_NEEDS[isa]) <= cpu_flags()]


@pytest.fixture(scope="module", autouse=True)
def _library(tmp_path_factory):
    if cpu_kernels.compiler() is None:
        pytest.skip("no C++ compiler: quantized weights take model/quant.py's reference path")
    mp = pytest.MonkeyPatch()
    mp.setenv("HOTSTART_HOME", str(shared_kernels_home(tmp_path_factory)))
    mp.delenv("HOTSTART_QUANT_KERNEL", raising=False)  # the suite's default keeps GGUF on the plain path
    cpu_kernels.load(cpu_kernels.build())
    assert qk.bind()
    yield
    mp.undo()


def _check(out: torch.Tensor, x: torch.Tensor, w_deq: np.ndarray) -> float:
    """Both bounds (module docstring) -> the normalized mean squared error against x @ W^T."""
    xf = x.float().numpy()
    xq, d = quantize_activations(xf)
    got = out.numpy().astype(np.float64)
    exact = xq @ w_deq.T
    assert (np.abs(got - exact) <= 1e-6 * (np.abs(xq) @ np.abs(w_deq).T) + 1e-30).all()
    ref = xf.astype(np.float64) @ w_deq.T
    bound = (0.5 * d) @ np.abs(w_deq).T + 1e-6 * (np.abs(xq) @ np.abs(w_deq).T)
    assert (np.abs(got - ref) <= bound).all()
    return float(((got - ref) ** 2).mean() / (ref ** 2).mean())


@pytest.mark.parametrize("name", list(TYPES))
def test_kernels_equal_dequantize_then_matmul(name):
    rng = np.random.default_rng(TYPES[name])
    block = qk.BLOCKS[TYPES[name]][0]
    k = 1280 if block == 256 else 1120  # past one segment (1,024 elements), a partial vector at the end
    n = 37
    w = random_weight(name, n, k, rng)
    w_deq = dequantize(w, name)
    wt = torch.from_numpy(w)
    threads = torch.get_num_threads()
    try:
        for m, dtype, isa, t in [(1, torch.float32, ISAS[0], 1), (3, torch.bfloat16, ISAS[0], 2),
                                 (4, torch.float32, ISAS[-1], 1), (5, torch.bfloat16, ISAS[-1], 2),
                                 *[(m, dt, isa, 2) for isa in ISAS for m, dt in ((1, torch.bfloat16),
                                                                               (2, torch.float32),
                                                                               (17, torch.bfloat16))],
                                 # a last pass of one token after 64 (AVX2: the one-token rows)
                                 *[(65, torch.float32, isa, 2) for isa in ISAS if isa == qk.AVX2],
                                 (48, torch.float32, ISAS[0], 2), (48, torch.bfloat16, ISAS[-1], 1),
                                 # the fewest tokens the 16-token lanes take on AVX512-VNNI (7: the tiles)
                                 (8, torch.bfloat16, ISAS[0], 1), (7, torch.float32, ISAS[0], 2),
                                 # a step of 256 tokens (4 blocks of 64 over rows unpacked once on
                                 # AVX512-VNNI), then one of 44
                                 (300, torch.bfloat16, ISAS[0], 2)]:
            torch.set_num_threads(t)
            x = (torch.randn(m, k, dtype=torch.float32) * torch.rand(1, k) * 4).to(dtype)  # uneven channels
            out = qk.matmul(x, [(wt, TYPES[name])], isa)
            assert out is not None and out.shape == (m, n) and out.dtype == torch.float32
            nmse = _check(out, x, w_deq)
            assert nmse < 5e-4, (name, m, isa, nmse)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(TYPES))
def test_one_token_over_long_rows(name):
    """Rows past 8,192 elements: one token takes them two at a time on AVX512-VNNI (x read once for both;
    the 4- and 5-bit block types one at a time) with the weights fetched into L2 only; an odd row count
    leaves one row alone. Each ISA, both bounds."""
    rng = np.random.default_rng(100 + TYPES[name])
    k, n = 8448, 19  # 33 super-blocks; a chunk of 16 rows and one of 3
    w = random_weight(name, n, k, rng)
    w_deq = dequantize(w, name)
    for isa in ISAS:
        x = (torch.randn(1, k, dtype=torch.float32) * torch.rand(1, k) * 4).to(torch.bfloat16)
        out = qk.matmul(x, [(torch.from_numpy(w), TYPES[name])], isa)
        assert out is not None and out.shape == (1, n)
        assert _check(out, x, w_deq) < 5e-4, (name, isa)


def test_several_weights_side_by_side():
    """q / k / v of a Q4_K_M file: one call, three weights of two types, outputs side by side, as separate
    calls give them; the contract's hook (x, w, type) is one of them."""
    rng = np.random.default_rng(1)
    k = 512
    parts = [("Q4_K", 19), ("Q4_K", 5), ("Q6_K", 5)]
    ws = [torch.from_numpy(random_weight(name, n, k, rng)) for name, n in parts]
    x = torch.randn(3, k)
    both = qk.matmul(x, [(w, TYPES[name]) for w, (name, _) in zip(ws, parts)])
    alone = torch.cat([qk.kernel(x, w, TYPES[name]) for w, (name, _) in zip(ws, parts)], dim=1)
    assert both.shape == (3, 29)
    assert torch.equal(both, alone)


def test_what_the_kernels_do_not_take_returns_none():
    """None, so that model/quant.py's reference path runs: another type (F16, Q2_K), K not in whole blocks,
    row bytes that do not match K, an integer x, a transposed weight."""
    w = torch.from_numpy(random_weight("Q4_0", 8, 64, np.random.default_rng(2)))
    x = torch.randn(2, 64)
    assert qk.kernel(x, w, TYPES["Q4_0"]) is not None
    assert qk.kernel(x, w.view(torch.uint8), 1) is None  # F16
    assert qk.kernel(x, w, 10) is None  # Q2_K
    assert qk.kernel(torch.randn(2, 48), w, TYPES["Q4_0"]) is None
    assert qk.kernel(torch.randn(2, 96), w, TYPES["Q4_0"]) is None
    assert qk.kernel(x.to(torch.int32), w, TYPES["Q4_0"]) is None
    assert qk.kernel(x, w.t(), TYPES["Q4_0"]) is None


def test_install_registers_with_the_quant_hook():
    """The fast path's install step (engine/fastpath/pack.py install_kernels) registers `kernel` with
    model/quant.py's set_kernel where the model holds ggml blocks; quant.matmul then returns the kernel's
    product (equal to a direct call), and set_kernel(None) puts the reference path back."""
    quant = pytest.importorskip("hotstart.model.quant", reason="model/quant.py (the GGUF loader's) not here")
    holder = torch.nn.Module()
    holder.ggml_type = TYPES["Q4_1"]
    assert qk.quantized(holder) and not qk.quantized(torch.nn.Linear(2, 2))
    w = torch.from_numpy(random_weight("Q4_1", 9, 96, np.random.default_rng(3)))
    x = torch.randn(2, 96)
    try:
        assert qk.install().startswith("quantized matmul kernels")
        assert torch.equal(quant.matmul(x, w, TYPES["Q4_1"]), qk.kernel(x, w, TYPES["Q4_1"]))
    finally:
        quant.set_kernel(None)


@pytest.mark.parametrize("family,mix", [("llama", "Q4_1"), ("qwen2", "Q5_0"), ("qwen3", "Q4_K_M")])
def test_the_fast_path_runs_a_gguf_model_on_the_kernels_before_ready(family, mix, tmp_path):
    """A GGUF engine's fast path plans the packing stage without copies, and with the library built settles
    it before READY (FastPath.before_ready): q/k/v and gate/up grouped, one kernel call each (their outputs
    equal to one call per projection: llama's q/k rows put back in the checkpoint's order), the kernels in
    model/quant.py's slot. The logits then differ from the reference path's by the int8 activations only:
    normalized mean squared error under llama.cpp's mul_mat limit (5e-4), the same top token."""
    from helpers.gguf import make
    from helpers.reference import float32_engine, prefill_logits

    from hotstart.engine.fastpath import FastPath
    from hotstart.messages import FastPathState as S
    from hotstart.model import quant

    path, _ = make(family, mix, tmp_path)
    core = float32_engine(path, max_model_len=128)
    ids = [1, 504, 3458, 282, 4649, 314, 25, 1159, 1230, 17]
    plain = prefill_logits(core, ids)
    sent = []
    fast = FastPath(core, "auto", (8,), sent.append)
    try:
        assert fast.packing.state is S.PLANNED and fast.compile.state is S.OFF
        fast.before_ready()
        assert fast.packing.state is S.PACKED, fast.packing.detail
        assert "quantized matmul kernels" in fast.packing.detail
        assert any(getattr(s, "name", "") == "CPU kernels installed (no copies)" for s in sent)
        attn, mlp = core.runner.model.model.layers[0].self_attn, core.runner.model.model.layers[0].mlp
        x = torch.randn(3, attn.q_proj.in_features)
        for group, linears in ((attn.packed_qkv, [attn.q_proj, attn.k_proj, attn.v_proj]),
                               (mlp.packed_gate_up, [mlp.gate_proj, mlp.up_proj])):
            assert group is not None and group.quantized
            assert torch.equal(group.stacked(x), torch.cat([m(x) for m in linears], dim=-1))
        fast_logits = prefill_logits(core, ids)
        nmse = ((fast_logits - plain) ** 2).mean() / (plain ** 2).mean()
        assert nmse < 5e-4 and fast_logits.argmax() == plain.argmax(), nmse
    finally:
        fast.close()
        quant.set_kernel(None)


def test_the_default_model_is_served_on_the_kernels_from_its_first_request():
    """`hotstart serve` of the default model (its Q4_1 GGUF) with this host's kernel library built: the
    kernels are installed before READY (the timeline's span ends before "engine ready") and the README's
    first example answers as it says."""
    import httpx
    from helpers.server import Server

    s = Server("--max-model-len", "512")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": "Name the capital of France."}]})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        startup = httpx.get(s.url + "/startup", timeout=30).json()
        assert "quantized matmul kernels" in startup["fast_path"]["packing_detail"]
        ends = {p["name"]: p["end_s"] for p in startup["phases"]}
        assert ends["CPU kernels installed (no copies)"] <= ends["engine ready"]
    finally:
        s.stop()
