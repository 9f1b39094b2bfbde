"""Decode attention over the paged KV cache alone (issue 26): the candidates side by side, interleaved.

    python benchmarks/paged_attention.py [--dtype float32,bfloat16] [--reps 30] [--threads N]
                                         [--shapes 1x200,4x1000,16x200,16x1000] [--out FILE]

Shapes are SmolLM2-135M's (3 KV heads, 9 query heads, head_dim 64, 30 layers, blocks of 16); BxC is B
sequences of contexts spread evenly from C / 5 to C (ragged, as real streams are), the longest exactly C.
Every repetition runs every candidate once over all 30 layers' caches, in turn (each layer its own cache,
so a step reads the KV from memory as the engine does, not from a warm cache), and the report gives the
median ms per step (30 layers) and the ratio to "old". Blocks are laid out as the engine lays
them: each prompt's blocks in a row, the decode blocks after them interleaved across the sequences.

Candidates: "old" (the path before issue 26: one gather of every sequence's blocks, padded to the
longest, matmuls in the cache's dtype), "gather" (model/attention.py with one chunk: the same gather,
matmuls in float32), "chunks/R" (model/attention.py's two-pass chunked decode, at most R keys x
sequences a chunk), "online/R" (one pass per chunk with flash-style running max and sum, for comparison).
Figures only mean something on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hotstart.model.attention import DecodeGroup, _gather, decode_attention

KVH, G, D, LAYERS, BS = 3, 3, 64, 30, 16
PROMPT_SHARE = 0.8  # of each context: prompt blocks (contiguous); the rest decode blocks (interleaved)


def layout(contexts: list[int]) -> tuple[list[list[int]], int]:
    """Block tables as the engine hands blocks out; and the blocks used (ids 1..)."""
    nxt, tables = 1, []
    for c in contexts:
        n = -(-int(c * PROMPT_SHARE) // BS)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    grow = True
    while grow:
        grow = False
        for table, c in zip(tables, contexts):
            if len(table) * BS < c:
                table.append(nxt)
                nxt, grow = nxt + 1, True
    return tables, nxt


def old(q, k_cache, v_cache, g: DecodeGroup, scale: float) -> torch.Tensor:
    """model/attention.py's decode before issue 26 (kept here to compare against)."""
    bd, h, d = q.shape
    k = _gather(k_cache, g.block_tables.flatten(), bd, BS)  # [KVH, Bd, L, D]
    v = _gather(v_cache, g.block_tables.flatten(), bd, BS)
    qg = q.view(bd, KVH, h // KVH, d).transpose(0, 1)  # [KVH, Bd, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale + g.bias.view(1, bd, 1, -1)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [KVH, Bd, G, L]
    return torch.matmul(probs, v).transpose(0, 1).reshape(bd, h, d)


def online(q, k_cache, v_cache, g: DecodeGroup, scale: float) -> torch.Tensor:
    """One pass: per chunk, scores, running max m and sum s, output rescaled (flash-style)."""
    bd, h, d = q.shape
    qg = q.view(bd, KVH, G, d).transpose(0, 1)  # [KVH, Bd, G, D]
    bias = g.bias.view(1, bd, 1, -1)
    m = q.new_full((KVH, bd, G, 1), float("-inf"), dtype=torch.float32)
    s = q.new_zeros((KVH, bd, G, 1), dtype=torch.float32)
    out = q.new_zeros((KVH, bd, G, d), dtype=torch.float32)
    for c in g.chunks:
        n = c.n
        k = _gather(k_cache, c.blocks, n, BS)
        v = _gather(v_cache, c.blocks, n, BS)
        sc = torch.matmul(qg[:, :n], k.transpose(-1, -2)).float().mul_(scale)
        sc.add_(bias[:, :n, :, c.start:c.stop])
        m_new = torch.maximum(m[:, :n], sc.amax(-1, keepdim=True))
        p = torch.exp(sc - m_new)
        alpha = torch.exp(m[:, :n] - m_new)
        s[:, :n] = s[:, :n] * alpha + p.sum(-1, keepdim=True)
        out[:, :n] = out[:, :n] * alpha + torch.matmul(p.to(q.dtype), v).float()
        m[:, :n] = m_new
    return (out / s).to(q.dtype).transpose(0, 1).reshape(bd, h, d)


def run(name: str, q, k_cache, v_cache, grp: DecodeGroup) -> torch.Tensor:
    if name == "old":
        return old(q, k_cache, v_cache, grp, 0.125)
    if name.startswith("online"):
        return online(q, k_cache, v_cache, grp, 0.125)
    return decode_attention(q, k_cache, v_cache, grp, BS, 0.125)


def bench_shape(batch: int, context: int, dtype: torch.dtype, reps: int, rows: list[int]) -> dict:
    contexts = [round(context / 5 + (context - context / 5) * i / max(1, batch - 1)) for i in range(batch)]
    contexts[-1] = context
    tables, used = layout(contexts)
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(KVH, (used + 1) * BS, D, generator=g).to(dtype),
               torch.randn(KVH, (used + 1) * BS, D, generator=g).to(dtype)) for _ in range(LAYERS)]
    q = torch.randn(batch, KVH * G, D, generator=g).to(dtype)
    cpu = torch.device("cpu")
    whole = DecodeGroup.build(tables, contexts, None, BS, cpu, 1 << 40)
    groups = {"old": whole, "gather": whole}
    for r in rows:
        grp = DecodeGroup.build(tables, contexts, None, BS, cpu, r)
        if grp.chunks:
            groups[f"chunks/{r}"] = grp
            groups[f"online/{r}"] = grp
    ref = whole
    qs = q if ref.tokens is None else q[ref.tokens]  # every group holds the same sorted order

    def step(name: str) -> float:
        grp = groups[name]
        t = time.perf_counter()
        for kc, vc in caches:
            run(name, qs, kc, vc, grp)
        return time.perf_counter() - t

    want = run("old", qs, *caches[0], ref)
    for name, grp in groups.items():  # every candidate computes the same thing
        got = run(name, qs, *caches[0], grp)
        assert torch.allclose(got.float(), want.float(), atol=2e-2 if dtype != torch.float32 else 1e-5), name
    times: dict[str, list[float]] = {name: [] for name in groups}
    with torch.inference_mode():
        for name in groups:
            step(name)  # warm-up
        for _ in range(reps):
            for name in groups:
                times[name].append(step(name))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."),
            "chunks": {name: len(grp.chunks) for name, grp in groups.items()},
            "ms_per_step": med, "x_old": {name: m / med["old"] for name, m in med.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--shapes", default="1x200,4x1000,16x200,16x1000")
    ap.add_argument("--rows", default="1024,2048,4096,8192", help="chunk sizes (keys x sequences) to try")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for dt in args.dtype.split(","):
        for shape in args.shapes.split(","):
            b, c = (int(x) for x in shape.split("x"))
            r = bench_shape(b, c, getattr(torch, dt), args.reps, rows)
            results.append(r)
            cells = "  ".join(f"{n} {m:.2f} ms ({r['x_old'][n]:.2f}x, {r['chunks'][n]} chunks)"
                              for n, m in r["ms_per_step"].items())
            print(f"{dt} {b}x{c}: {cells}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
