"""`hotstart generate`: offline generation through the same EngineCore the server uses, started by the one
start sequence (frontend/start.py) with the engine in this process, the prompt's SamplingParams checked
and resolved as the server's are (frontend/sampling.py)."""

from __future__ import annotations

import argparse
import sys
import time

from hotstart.errors import HotstartError

# engine options that make no sense offline (one sequence; --seed is the request's here; one process, no
# watchdog)
ENGINE_EXCLUDES = ("max_num_seqs", "max_num_batched_tokens", "seed", "tensor_parallel_size",
                   "engine_heartbeat_timeout", "engine_step_timeout")
# SamplingParams fields that `generate` takes as flags (--max-tokens, ...), with its own defaults
SAMPLING_FLAGS = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """--max-tokens, --temperature, --top-p, --top-k, --seed: SamplingParams' fields, checked by it."""
    for name, default in SAMPLING_FLAGS.items():
        kind = float if isinstance(default, float) else int
        greedy = " (0: greedy)" if name == "temperature" else ""
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                            help=f"SamplingParams.{name}{greedy}, default {default}")


def run_generate(args: argparse.Namespace) -> int:
    from hotstart.boot.timeline import Timeline  # noqa: PLC0415
    from hotstart.config import EngineConfig  # noqa: PLC0415
    from hotstart.frontend.sampling import EngineLimits, resolve  # noqa: PLC0415
    from hotstart.frontend.start import EngineStart  # noqa: PLC0415
    from hotstart.sampling_params import SamplingParams  # noqa: PLC0415
    from hotstart.text.tokenizer import IncrementalDetokenizer  # noqa: PLC0415

    try:  # checked before anything loads
        params = SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS})
    except ValueError as e:
        flag = f"--{e.param.replace('_', '-')}: " if getattr(e, "param", None) else ""
        raise HotstartError(f"{flag}{e}") from None
    start = EngineStart(Timeline(time.time()), None, lambda **derived: EngineConfig.from_args(
        args, ENGINE_EXCLUDES, max_num_seqs=1, **derived))
    t_load = time.perf_counter()
    try:
        start.begin(args.model, args.revision)  # in process: builds the EngineCore here
        t_load = time.perf_counter() - t_load
        tok = start.load_tokenizer()
    finally:
        start.close()
    engine, info = start.client, start.client.info
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode(args.prompt)
    if len(ids) >= info.max_model_len:
        raise HotstartError(f"the prompt has {len(ids)} tokens; the model's context is {info.max_model_len}")
    params.max_tokens = min(params.max_tokens, info.max_model_len - len(ids))
    try:
        limits = EngineLimits(info.max_model_len, 1, getattr(tok, "vocab_size", None))
        params = resolve(params, len(ids), limits)
    except ValueError as e:
        raise HotstartError(str(e)) from None
    detok = IncrementalDetokenizer(tok)
    counts = {"tokens": 0, "first_token_s": None}
    t0 = time.perf_counter()

    async def run() -> None:
        await engine.start()
        try:
            async for out in engine.generate("generate", ids, params):
                if out.finish_reason == "error":
                    raise HotstartError(out.error or "request rejected")
                if counts["first_token_s"] is None:
                    counts["first_token_s"] = time.perf_counter() - t0
                counts["tokens"] += len(out.new_token_ids)
                sys.stdout.write(detok.add(out.new_token_ids))
                sys.stdout.flush()
        finally:
            await engine.close()

    import asyncio  # here: `hotstart --help` imports this module for ENGINE_EXCLUDES

    asyncio.run(run())
    sys.stdout.write(detok.flush() + "\n")
    elapsed = time.perf_counter() - t0
    n_out, first_token_s = counts["tokens"], counts["first_token_s"]
    decode_s = elapsed - (first_token_s or 0.0)
    rate = (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0
    print(
        f"[{len(ids)} prompt tokens, {n_out} generated; load {t_load:.2f} s, first token "
        f"{first_token_s or 0:.3f} s, decode {rate:.1f} tok/s on {info.device} {info.dtype}]",
        file=sys.stderr,
    )
    return 0
