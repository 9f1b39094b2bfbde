"""The three measurements of `hotstart bench step`, each on the same BenchCore (engine_setup.py).

profile   where a decode step's time goes: STEPS steps of STREAMS sequences timed without the
          profiler, then STEPS more under torch.profiler for the table of ops by self CPU time (the
          profiler adds ~20 us per op: its self times are upper bounds; "outside ops" = unprofiled
          step - profiled op time is a lower bound on Python and dispatch)
sampling  what the general sampler costs: the same decode with plain sampling, with penalties and
          with logit_bias + min_p + min_tokens (temperature 0.8, seeded), interleaved rounds, medians
grammar   what constrained decoding costs: all streams unconstrained vs all under a JSON-schema
          grammar (llguidance), alternating rounds, full decode steps only, medians and minima
blocks    where a decode step's time goes without the profiler: wall time around each block of every
          decoder layer (CPU ops are synchronous, so a call's wall time is its cost; each wrapper adds
          ~1 us), by the layer's own split (attn_inputs: norm, q/k/v, RoPE; attend: KV write and
          paged attention; finish: o_proj, MLP, norms), the LM head, the model's forward and the step
          around it (metadata, sampling, scheduling); every family has these methods (a step the
          layer ops take, model/layer_ops.py, times their three functions instead)
"""

from __future__ import annotations

import statistics

from hotstart.bench.engine_setup import BenchCore, drain, start_batch, timed_steps

SAMPLING_KINDS = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "bias+min_p": {"logit_bias": {5: -100.0, 6: 5.0}, "min_p": 0.05, "min_tokens": 8},
}
# An order: nested objects, arrays, enums, a pattern, $defs; as an array of >= 50 so no stream can end early
STRING = {"type": "string"}
ADDRESS = {"type": "object", "properties": {
    "street": STRING, "city": STRING, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]}},
    "required": ["street", "city", "country"]}
ORDER = {"type": "object", "properties": {
    "order_id": STRING,
    "customer": {"type": "object", "properties": {"name": STRING, "email": STRING, "vip": {"type": "boolean"},
                                                  "shipping": {"$ref": "#/$defs/address"}},
                 "required": ["name", "email", "shipping"]},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": STRING, "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "quantity", "price"]}},
    "status": {"enum": ["pending", "paid", "shipped"]}},
    "required": ["order_id", "customer", "items", "status"]}
ORDERS = {"type": "array", "minItems": 50, "items": ORDER, "$defs": {"address": ADDRESS}}


def _params(max_tokens: int, **extra):
    from hotstart.sampling_params import SamplingParams

    if "min_tokens" in extra:  # eos masked for the whole run: never more than max_tokens (vLLM's rule too)
        extra["min_tokens"] = min(extra["min_tokens"], max_tokens)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


def profile(bc: BenchCore, streams: int, context: int, steps: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hotstart.model import cpu_kernels

    core = bc.core
    start_batch(core, "profile", streams, context, _params(2 * steps + 16, temperature=0.0))
    timed_steps(core, 5)  # first-use costs out of the way
    wall = statistics.median(timed_steps(core, steps))
    cpu_kernels.trace(True)  # the CPU kernels are ctypes calls: named for the profiler while it records
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled = timed_steps(core, steps)
    finally:
        cpu_kernels.trace(False)
    drain(core)
    rows = [{"op": e.key, "calls_per_step": e.count / steps,
             "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in prof.key_averages()]
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    in_ops = sum(r["self_ms_per_step"] for r in rows)
    return {"streams": streams, "context": context, "steps": steps, "threads": torch.get_num_threads(),
            "step_ms": wall * 1e3, "profiled_step_ms": statistics.median(profiled) * 1e3,
            "in_torch_ops_ms": in_ops, "outside_ops_ms": wall * 1e3 - in_ops,
            "tokens_per_s": streams / wall, "top": rows[:top]}


def sampling(bc: BenchCore, streams: int, context: int, steps: int, rounds: int) -> dict:
    core = bc.core
    times: dict[str, list[float]] = {k: [] for k in SAMPLING_KINDS}
    for rnd in range(rounds + 1):  # round 0 warms
        for kind, extra in SAMPLING_KINDS.items():
            start_batch(core, f"{kind}-{rnd}", streams, context,
                        _params(steps + 2, temperature=0.8, seed=rnd, **extra))
            ts = timed_steps(core, steps)
            drain(core)
            if rnd:
                times[kind].append(statistics.median(ts))
    plain = statistics.median(times["plain"])
    return {"streams": streams, "rounds": rounds, "steps": steps,
            "kinds": {k: {"step_ms_median": statistics.median(v) * 1e3, "step_ms_min": min(v) * 1e3,
                          "x_plain": statistics.median(v) / plain} for k, v in times.items()}}


def grammar(bc: BenchCore, streams: int, context: int, steps: int, rounds: int) -> dict:
    import llguidance as llg

    core = bc.core
    schema = llg.LLMatcher.grammar_from_json_schema(ORDERS)

    def run(constrained: bool, tag: str) -> list[float]:
        g = {"grammar": schema} if constrained else {}
        start_batch(core, tag, streams, context, _params(steps + 2, temperature=0.0, **g))
        ts = timed_steps(core, steps, width=streams)
        drain(core)
        return ts

    run(False, "warm")
    run(True, "warm-json")  # imports llguidance in the engine, builds the tokenizer view, compiles
    plain, constrained = [], []
    for r in range(rounds):
        constrained += run(True, f"json-{r}")
        plain += run(False, f"plain-{r}")
    med = statistics.median
    return {"streams": streams, "rounds": rounds, "steps": steps,
            "plain_step_ms": {"median": med(plain) * 1e3, "min": min(plain) * 1e3},
            "constrained_step_ms": {"median": med(constrained) * 1e3, "min": min(constrained) * 1e3},
            "overhead_pct_median": 100 * (med(constrained) - med(plain)) / med(plain),
            "overhead_pct_min": 100 * (min(constrained) - min(plain)) / min(plain)}


# block label -> (what to wrap, the attribute); wrapped on the instances, so nothing else sees them
def _block_targets(core) -> list[tuple[str, object, str]]:
    model = core.runner.model
    targets = [("step (all)", core, "step"), ("runner forward (metadata, model, logits, sampling)",
                                               core.runner, "forward"),
               ("model forward (embedding, layers, final norm)", model, "forward"),
               ("LM head", model, "compute_logits")]
    if getattr(model, "layer_ops", False):  # steps run model/layer_ops.py's functions instead
        from hotstart.model import layer_ops

        targets += [("layer ops: add + norm, q/k/v, RoPE + KV write (attn_inputs)", layer_ops, "attn_inputs"),
                    ("layer ops: attention (attend)", layer_ops, "attend"),
                    ("layer ops: o_proj, add + norm, MLP (finish)", layer_ops, "finish")]
    for layer in model.model.layers:
        targets += [("layer: norm + q/k/v + RoPE (attn_inputs)", layer, "attn_inputs"),
                    ("layer: KV write + attention (attend)", layer.self_attn, "attend"),
                    ("layer: o_proj + MLP + norms (finish)", layer, "finish"),
                    ("  of which o_proj", layer.self_attn.o_proj, "forward")]
        ffn = layer.ffn() if hasattr(layer, "ffn") else getattr(layer, "mlp", None)
        if ffn is not None:
            targets.append(("  of which the MLP (or experts)", ffn, "forward"))
    return targets


def blocks(bc: BenchCore, streams: int, context: int, steps: int) -> dict:
    import time

    core = bc.core
    start_batch(core, "blocks", streams, context, _params(steps + 16, temperature=0.0))
    timed_steps(core, 5)
    total: dict[str, float] = {}
    wrapped = []

    def wrap(label: str, obj, name: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                total[label] = total.get(label, 0.0) + time.perf_counter() - t

        own = name in vars(obj)  # a module's function (layer ops), not a class's method
        setattr(obj, name, timed)
        wrapped.append((obj, name, inner if own else None))

    targets = _block_targets(core)
    for label, obj, name in targets:
        wrap(label, obj, name)
    try:
        timed_steps(core, steps)
    finally:
        for obj, name, own in wrapped:
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)  # the class's method again
        drain(core)
    order = list(dict.fromkeys(label for label, _, _ in targets))
    rows = [{"block": k, "ms_per_step": total[k] * 1e3 / steps} for k in order if k in total]
    return {"streams": streams, "context": context, "steps": steps, "rows": rows}
