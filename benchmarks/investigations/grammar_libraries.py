"""Grammar libraries for constrained decoding, measured on this machine (runs with whichever of
llguidance / xgrammar imports): the investigation behind the choice of llguidance (docs/serving.md,
"Constrained decoding"). The engine's decode step with and without grammars is `hotstart bench step
--parts grammar`.

  python benchmarks/investigations/grammar_libraries.py [--tokenizer DIR] [--streams 16]

Per library: import time, the tokenizer view (built from the tokenizer once per engine), compiling a
realistic JSON schema (an order with nested objects, arrays, enums, a pattern, $defs; cold = first
compile, warm = median of recompiles with caches off), and per decode step at --streams concurrent
streams: the token masks of every stream (one batched call) + each stream taking its token, walking
a valid instance token by token. xgrammar needs transformers (and pulls torch + triton): run it from a
throwaway venv, e.g. /tmp/xgr-venv (pip install torch==2.13.0, then xgrammar).
The load average is printed beside: on a shared machine the figures are indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ORDER = {
    "type": "object",
    "$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]}},
        "required": ["street", "city", "country"]}},
    "properties": {
        "order_id": {"type": "string"}, "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}, "vip": {"type": "boolean"},
            "shipping": {"$ref": "#/$defs/address"}, "billing": {"$ref": "#/$defs/address"}},
            "required": ["name", "email", "shipping"]},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["sku", "quantity", "price"]}},
        "status": {"enum": ["pending", "paid", "shipped"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "status"],
}
INSTANCE = {"order_id": "A-1093",
            "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "vip": True,
                         "shipping": {"street": "12 Rue de Rivoli", "city": "Paris", "zip": "75001",
                                      "country": "FR"}},
            "items": [{"sku": "KB-01", "quantity": 2, "price": 49.9, "tags": ["keyboard", "usb"]},
                      {"sku": "MS-7", "quantity": 1, "price": 19.5}], "status": "paid", "notes": None}


def default_tokenizer_dir() -> Path:
    home = Path(os.environ.get("HOTSTART_HOME", Path.home() / ".cache" / "hotstart"))
    return home / "models" / "SmolLM2-135M-Instruct"


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_llguidance(tok_dir: Path, streams: int, steps_cap: int) -> dict:
    t, llg = timed(lambda: __import__("llguidance"))
    out = {"import_s": t}
    text = (tok_dir / "tokenizer.json").read_text()
    out["tokenizer_s"], tok = timed(lambda: llg.LLTokenizer(text))
    grammar = llg.LLMatcher.grammar_from_json_schema(ORDER)
    out["compile_cold_s"], _ = timed(lambda: llg.LLMatcher(tok, grammar))
    out["compile_warm_s"], _ = timed(lambda: llg.LLMatcher(tok, grammar), repeat=5)
    ids = tok.tokenize_str(json.dumps(INSTANCE))
    out["instance_tokens"] = len(ids)
    words = (tok.vocab_size + 31) // 32
    import torch

    mask = torch.zeros(streams, words, dtype=torch.int32)
    ex = llg.LLExecutor()
    matchers = [llg.LLMatcher(tok, grammar) for _ in range(streams)]
    pos = [k % 8 for k in range(streams)]  # streams at different points of the document
    for m, p in zip(matchers, pos, strict=True):
        m.consume_tokens(ids[:p])
    times = []
    for step in range(min(steps_cap, len(ids) - 8)):
        t = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], mask.data_ptr(), words * 4,
                                   streams)
        ex.consume_token_par([(m, ids[p + step]) for m, p in zip(matchers, pos, strict=True)])
        times.append(time.perf_counter() - t)
    assert not any(m.is_error() for m in matchers), [m.get_error() for m in matchers if m.is_error()][:1]
    out["step_ms_median"] = 1e3 * statistics.median(times)
    out["step_ms_p90"] = 1e3 * sorted(times)[int(0.9 * len(times))]
    return out


def bench_xgrammar(tok_dir: Path, streams: int, steps_cap: int) -> dict:
    t, xgr = timed(lambda: __import__("xgrammar"))
    out = {"import_s": t}
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    out["tokenizer_s"], info = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf))
    schema = json.dumps(ORDER)
    out["compile_cold_s"], compiled = timed(
        lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema))
    out["compile_warm_s"], _ = timed(
        lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema), repeat=5)
    ids = hf.encode(json.dumps(INSTANCE))
    out["instance_tokens"] = len(ids)
    mask = xgr.allocate_token_bitmask(streams, info.vocab_size)
    batch = xgr.BatchGrammarMatcher()
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(streams)]
    pos = [k % 8 for k in range(streams)]
    for m, p in zip(matchers, pos, strict=True):
        for i in ids[:p]:
            assert m.accept_token(i)
    times = []
    for step in range(min(steps_cap, len(ids) - 8)):
        t = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask)
        ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, [ids[p + step] for p in pos])
        times.append(time.perf_counter() - t)
        assert all(ok)
    out["step_ms_median"] = 1e3 * statistics.median(times)
    out["step_ms_p90"] = 1e3 * sorted(times)[int(0.9 * len(times))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=default_tokenizer_dir(),
                    help="folder with tokenizer.json")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200, help="decode steps measured at most")
    args = ap.parse_args()
    report = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            report[name] = fn(args.tokenizer, args.streams, args.steps)
        except ImportError as e:
            report[name] = f"not importable here ({e.name})"
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
