"""A decode / prefill step's linear layers on quantized weights (hotstart/model/quant_kernels.py) against
the bf16 kernels (model/cpu_kernels.py: the GEMV up to 4 tokens, the tile kernel beyond), in one process,
alternating rounds: GB/s of weights read and GMAC/s per ggml type and tokens per step.

    python benchmarks/quant_matmul.py --model small --types Q4_1,Q8_0,Q4_K --tokens 1,2,4,8,16,48 --bf16
    python benchmarks/quant_matmul.py --model 7b --types Q4_K,Q8_0 --tokens 1,4,16 --layers 2 --bf16
    python benchmarks/quant_matmul.py --model 4096x14336 --types Q4_0,Q8_0 --tokens 1,4,8,16

--model small: SmolLM2-135M's 30 layers (q, k, v, o, gate, up, down as a llama GGUF stores them) + its LM
head; 7b: Qwen2.5-7B's layer shapes (49k vocabulary); NxK: one [N, K] weight (test-backend-ops' MUL_MAT
perf shapes: `benchmarks/llamacpp_ops.sh` runs llama.cpp's own on the same shapes). K-quants on a K that
is not a multiple of 256 fall back as llama.cpp's quantizer does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K ->
Q8_0). Weights are valid random blocks (random codes, small positive fp16 scales): the kernels' speed does
not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hotstart.model import cpu_kernels
from hotstart.model import quant_kernels as qk

TYPES = {name: t for t, name in qk.NAMES.items()}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's, for K % 256 != 0
# per layer: (rows, cols) of q, k, v, o, gate, up, down; the LM head's rows; layers
MODELS = {"small": ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)],
                    49152, 30),
          "7b": ([(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584),
                  (3584, 18944)], 49152, 28)}


def random_blocks(n: int, k: int, name: str, g: torch.Generator) -> torch.Tensor:
    """[n, row bytes] uint8 of valid NAME blocks: random codes, fp16 scales (and mins) in [0, 0.01)."""
    t = TYPES[name]
    block, size = qk.BLOCKS[t]
    b = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, generator=g)
    where = {12: [0, 2], 13: [0, 2], 14: [208]}.get(t, [0, 2] if t in (3, 7) else [0])
    for off in where:
        scale = (torch.rand(n, k // block, 1, generator=g) * 0.01).half()
        b[:, :, off:off + 2] = scale.view(torch.uint8)
    return b.reshape(n, -1)


def shapes(model: str, layers: int | None) -> list[list[tuple[int, int]]]:
    """The step's weights, layer by layer (the LM head last, as a layer of one)."""
    if "x" in model:
        n, k = map(int, model.split("x"))
        return [[(n, k)]]
    per_layer, vocab, count = MODELS[model]
    hidden = per_layer[0][1]
    return [per_layer] * (layers or count) + [[(vocab, hidden)]]


def timed(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="small, 7b or NxK")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_K")
    ap.add_argument("--tokens", default="1,2,4,8,16,48")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--isa", choices=["host", "avx2", "portable"], default="host")
    ap.add_argument("--x-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--bf16", action="store_true", help="the bf16 kernels on the same shapes too")
    ap.add_argument("--cpu-time", action="store_true",
                    help="process CPU seconds, not wall time (with --threads 1: steadier on a loaded host)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernels.load(cpu_kernels.build())
    if not qk.bind():
        sys.exit("the kernel library has no hs_quant_matmul")
    isa = {"host": qk.host_isa(), "avx2": qk.AVX2, "portable": qk.PORTABLE}[args.isa]
    xdtype = getattr(torch, args.x_dtype)
    layers = shapes(args.model, args.layers)
    tokens = [int(t) for t in args.tokens.split(",")]
    g = torch.Generator().manual_seed(0)
    print(f"model {args.model}: {len(layers)} weight groups, threads {args.threads}, "
          f"isa {qk.ISA_NAMES[isa]}, x {args.x_dtype}, load {os.getloadavg()[0]:.2f}")
    variants = {}  # name -> (bytes, macs per token, run(M))
    for name in args.types.split(","):
        weights = []
        for layer in layers:
            weights.append([])
            for n, k in layer:
                t = name if k % qk.BLOCKS[TYPES[name]][0] == 0 else FALLBACK[name]
                weights[-1].append((random_blocks(n, k, t, g), TYPES[t]))
        nbytes = sum(w.nbytes for layer in weights for w, _ in layer)
        macs = sum(n * k for layer in layers for n, k in layer)

        def run(m, weights=weights):
            xs = {}
            for layer in weights:
                for w, t in layer:
                    k = w.shape[1] // qk.BLOCKS[t][1] * qk.BLOCKS[t][0]
                    x = xs.setdefault(k, torch.randn(m, k).to(xdtype))
                    qk.matmul(x, [(w, t)], isa)
        variants[name] = (nbytes, macs, run)
    if args.bf16:
        tiles = cpu_kernels.tiles_supported(torch.bfloat16) and max(tokens) > cpu_kernels.MAX_ROWS
        segs = [[cpu_kernels.Segments([torch.randn(n, k, generator=g).bfloat16()], [None], tiles)
                 for n, k in layer] for layer in layers]
        nbytes = sum(s.weights[0].nbytes for layer in segs for s in layer)

        def run_bf16(m):
            xs = {}
            for layer in segs:
                for s in layer:
                    x = xs.setdefault(s.k, torch.randn(m, s.k).bfloat16())
                    s(x, torch.float32)  # as the engine: GEMV at 1 token, tiles from 2 (copies)
        variants["bf16"] = (nbytes, sum(n * k for layer in layers for n, k in layer), run_bf16)
    results = []
    print(f"{'type':>6} {'tokens':>6} {'ms med':>8} {'ms min':>8} {'GB/s':>6} {'GMAC/s':>7}   (min)")
    clock = time.process_time if args.cpu_time else time.perf_counter
    for m in tokens:
        times = {name: [] for name in variants}
        for _, _, run in variants.values():
            run(m)  # warm: pages touched, threads up
        for _ in range(args.rounds):  # alternating: a noisy second hits every variant alike
            for name, (_, _, run) in variants.items():
                times[name].append(timed(lambda run=run, m=m: run(m), clock))
        for name, (nbytes, macs, _) in variants.items():
            med, best = statistics.median(times[name]), min(times[name])
            results.append({"type": name, "tokens": m, "ms_median": med * 1e3, "ms_min": best * 1e3,
                            "gb_s": nbytes / best / 1e9, "gmac_s": m * macs / best / 1e9, "bytes": nbytes})
            print(f"{name:>6} {m:>6} {med * 1e3:8.2f} {best * 1e3:8.2f} {nbytes / best / 1e9:6.1f} "
                  f"{m * macs / best / 1e9:7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
