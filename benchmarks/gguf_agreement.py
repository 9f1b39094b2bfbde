"""Agreement with llama.cpp on the same GGUF file: teacher-forced top-1 tokens over real text.

For the default model's Q4_1 GGUF and copies requantized from it by llama.cpp's own quantizer (Q8_0, Q4_0,
Q5_0, Q5_1, Q4_K_M, Q5_K_M, Q6_K), one fixed English text is tokenized once (hotstart's GGUF tokenizer)
and the same ids are fed to three computations per file; each gives the top-1 token at every position
0..N-2 (the prediction of ids[i+1]):

  hotstart   the engine as served: EngineCore in its served dtype (auto: bfloat16 here), with the
             quantized matmul kernels installed as the fast path installs them before READY
  reference  the same file through hotstart's reference path (no kernels: every weight dequantized as
             the `gguf` package does) in float32: a float32 computation of the dequantized weights
  llama.cpp  llama-cpp-python (a separate venv, run as a subprocess) on the same file and ids
             (llama.cpp quantizes the activations too: it does not reach the reference exactly)

Reported per type: % of positions where two top-1s agree (hotstart-ref, llama.cpp-ref, hotstart-llama.cpp),
each one's accuracy against the real next token, and hotstart's agreement with the reference minus
llama.cpp's, in points (the goal: hotstart within 2 points of llama.cpp, or above it).

    python benchmarks/gguf_agreement.py                                  # every type, the whole text
    python benchmarks/gguf_agreement.py --types Q4_1,Q8_0 --tokens 64 --json out.json

Requantized files are made once into --out-dir (default /tmp/gguf-agreement) and reused.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hotstart.boot.default_model import find_gguf
from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import FastPath
from hotstart.engine.model_runner import StepInputs
from hotstart.engine.sequence import Sequence
from hotstart.gguf_file import GGUFFile
from hotstart.model import cpu_kernels, quant, quant_kernels
from hotstart.sampling_params import SamplingParams
from hotstart.text.tokenizer import Tokenizer

TYPES = ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K")  # Q4_1: the shipped file
LLAMACPP_PYTHON = "/work/venvs/llamacpp/bin/python"

# Jane Austen, Pride and Prejudice (1813), the opening of chapter 1: public domain
TEXT = """It is a truth universally acknowledged, that a single man in possession of a good fortune, must be \
in want of a wife.

However little known the feelings or views of such a man may be on his first entering a neighbourhood, \
this truth is so well fixed in the minds of the surrounding families, that he is considered the rightful \
property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune \
from the north of England; that he came down on Monday in a chaise and four to see the place, and was so \
much delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before \
Michaelmas, and some of his servants are to be in the house by the end of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a \
fine thing for our girls!"

"How so? How can it affect them?"

"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am thinking of \
his marrying one of them."

"Is that his design in settling here?"

"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one of them, \
and therefore you must visit him as soon as he comes."
"""

QUANTIZE = r"""
import sys, llama_cpp as L
src, dst, name = sys.argv[1:]
p = L.llama_model_quantize_default_params()
p.ftype, p.allow_requantize, p.nthread = getattr(L, "LLAMA_FTYPE_MOSTLY_" + name), True, 2
sys.exit(L.llama_model_quantize(src.encode(), dst.encode(), p))
"""

LLAMACPP = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
req = json.load(sys.stdin)
ids = req["ids"]
llm = Llama(model_path=path, logits_all=True, n_ctx=len(ids) + 16, n_batch=len(ids) + 16,
            n_ubatch=len(ids) + 16, n_threads=threads, n_threads_batch=threads, verbose=False)
own = llm.tokenize(req["text"].encode(), add_bos=True, special=False)
llm.eval(ids)
print(json.dumps({"ids": llm.input_ids[:llm.n_tokens].tolist(), "own_ids": list(own),
                  "top1": np.asarray(llm.scores[:llm.n_tokens]).argmax(-1).tolist()}))
"""


def make_file(src: Path, name: str, out_dir: Path, python: str) -> Path:
    """SRC requantized to NAME by llama.cpp's quantizer (made once)."""
    if name == "Q4_1":
        return src
    dst = out_dir / f"{src.stem.rsplit('.', 1)[0]}.{name}.gguf"
    if not dst.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".part")
        p = subprocess.run([python, "-c", QUANTIZE, str(src), str(tmp), name], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"llama.cpp could not quantize to {name}: {(p.stderr or p.stdout)[-2000:]}")
        tmp.rename(dst)
    return dst


def tensor_types(path: Path) -> str:
    counts = Counter(t.type_name for t in GGUFFile(path).tensors.values())
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def engine(path: Path, dtype: str, n: int) -> EngineCore:
    cfg = EngineConfig(model_path=str(path), weight_files=(str(path),), device="cpu", dtype=dtype,
                       max_model_len=n + 16, kv_cache_memory=64 << 20, compile_buckets="8")
    return EngineCore.build(cfg)


@torch.inference_mode()
def top1(core: EngineCore, ids: list[int]) -> list[int]:
    """The argmax of the logits at positions 0..N-2 of one prefill of IDS (teacher forced)."""
    seq = Sequence("agreement", list(ids), len(ids), SamplingParams(max_tokens=1))
    core.blocks.allocate(seq, len(ids))
    try:
        logits = core.runner.run(StepInputs.of([(seq, len(ids))], [False], [True]))
    finally:
        core.blocks.free(seq)
    assert logits.shape[0] == len(ids), logits.shape
    return logits.float().argmax(-1).tolist()[:-1]


def reference(path: Path, ids: list[int]) -> list[int]:
    assert quant.kernel() is None, "the reference runs before any kernel is registered"
    core = engine(path, "float32", len(ids))
    out = top1(core, ids)
    del core
    gc.collect()
    return out


def served(path: Path, ids: list[int]) -> tuple[list[int], str, str]:
    """hotstart as served: its dtype, the quantized kernels installed by the fast path before READY."""
    core = engine(path, "auto", len(ids))
    fast = FastPath(core, "auto", (8,), lambda m: None)
    fast.before_ready()
    detail = fast.packing.detail
    if "quantized matmul kernels" not in detail:
        raise SystemExit(f"{path.name}: the fast path installed no quantized kernels: {detail!r}")
    calls: Counter[str] = Counter()  # did the kernel take every product? (None: the reference path did)
    matmul = quant_kernels.matmul

    def counted(*a, **kw):
        y = matmul(*a, **kw)
        calls["kernel" if y is not None else "declined"] += 1
        return y

    quant_kernels.matmul = counted
    try:
        out = top1(core, ids)
    finally:
        quant_kernels.matmul = matmul
    if not calls["kernel"] or calls["declined"]:
        raise SystemExit(f"{path.name}: the quantized kernel did not take every product: {dict(calls)}")
    detail += f"; {calls['kernel']} kernel calls in the prefill, none declined"
    dtype = str(core.placement.dtype).removeprefix("torch.")
    fast.close()
    quant.set_kernel(None)
    del core, fast
    gc.collect()
    return out, dtype, detail


def llamacpp(path: Path, ids: list[int], text: str, python: str, threads: int) -> dict:
    p = subprocess.run([python, "-c", LLAMACPP, str(path), str(threads)], check=True, text=True,
                       input=json.dumps({"ids": ids, "text": text}), capture_output=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def pct(a: list[int], b: list[int]) -> float:
    assert len(a) == len(b)
    return 100.0 * sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {','.join(TYPES)}")
    ap.add_argument("--tokens", type=int, default=0, help="use the first N ids of the text (0: all)")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/gguf-agreement"))
    ap.add_argument("--llamacpp-python", default=LLAMACPP_PYTHON)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--json", type=Path, help="write every number and token stream here")
    args = ap.parse_args()
    names = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = sorted(set(names) - set(TYPES))
    if unknown:
        ap.error(f"--types: unknown {unknown}; known: {','.join(TYPES)}")

    src = find_gguf()
    all_ids = Tokenizer.from_gguf(src).encode(TEXT)  # once; the same ids go to every engine
    ids = all_ids[:args.tokens] if args.tokens else all_ids
    n = len(ids) - 1  # positions 0..N-2 predict ids[1..N-1]
    print("command: " + " ".join([sys.executable, *sys.argv]))
    print(f"text: {len(ids)} tokens, {n} positions scored; torch threads {torch.get_num_threads()}, "
          f"llama.cpp threads {args.threads}")

    files = {t: make_file(src, t, args.out_dir, args.llamacpp_python) for t in names}
    results: dict[str, dict] = {}
    for t in names:  # the reference first, for every file: no kernel library loaded yet
        results[t] = {"file": str(files[t]), "tensors": tensor_types(files[t]),
                      "reference": reference(files[t], ids)}
        print(f"{t}: reference done ({results[t]['tensors']})", flush=True)
    for t in names:
        got = llamacpp(files[t], ids, TEXT, args.llamacpp_python, args.threads)
        assert got["ids"] == ids, f"{t}: llama.cpp evaluated other ids"
        results[t]["llamacpp"] = got["top1"][:n]
        results[t]["llamacpp_tokenizes_same"] = got["own_ids"] == all_ids  # the whole text's ids
        print(f"{t}: llama.cpp done (its own ids of the text equal hotstart's: {got['own_ids'] == all_ids})",
              flush=True)
    cpu_kernels.build()  # as serving builds it behind READY (once; cached under $HOTSTART_HOME)
    for t in names:
        results[t]["hotstart"], results[t]["dtype"], results[t]["kernels"] = served(files[t], ids)
        print(f"{t}: hotstart done ({results[t]['dtype']}; {results[t]['kernels']})", flush=True)

    truth = ids[1:]
    rows = []
    for t in names:
        r = results[t]
        hs, lc, ref = r["hotstart"], r["llamacpp"], r["reference"]
        r["agree"] = {"hotstart_ref": pct(hs, ref), "llamacpp_ref": pct(lc, ref),
                      "hotstart_llamacpp": pct(hs, lc)}
        r["accuracy"] = {"hotstart": pct(hs, truth), "llamacpp": pct(lc, truth), "reference": pct(ref, truth)}
        r["hotstart_minus_llamacpp"] = r["agree"]["hotstart_ref"] - r["agree"]["llamacpp_ref"]
        a, c = r["agree"], r["accuracy"]
        rows.append(f"| {t} | {a['hotstart_ref']:.1f} | {a['llamacpp_ref']:.1f} | "
                    f"{r['hotstart_minus_llamacpp']:+.1f} | {a['hotstart_llamacpp']:.1f} | "
                    f"{c['hotstart']:.1f} | {c['llamacpp']:.1f} | {c['reference']:.1f} |")
    print(f"\nTop-1 agreement over {n} teacher-forced positions (%); hotstart in "
          f"{results[names[0]]['dtype']} with its quantized kernels, reference: float32 of the dequantized "
          f"weights\n")
    print("| type | hotstart = ref | llama.cpp = ref | hotstart - llama.cpp (points) | hotstart = llama.cpp "
          "| hotstart acc | llama.cpp acc | ref acc |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\ntensors: " + "; ".join(f"{t}: {results[t]['tensors']}" for t in names))
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "ids": ids, "positions": n,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
