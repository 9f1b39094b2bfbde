"""`hotstart generate`: offline generation through the same EngineCore the server uses, driven by the
in-process EngineClient (server/client.py)."""

from __future__ import annotations

import argparse
import sys
import time

from hotstart.errors import HotstartError

# engine options that make no sense offline (one sequence; --seed is the request's here; one process, no
# watchdog)
ENGINE_EXCLUDES = ("max_num_seqs", "max_num_batched_tokens", "seed", "tensor_parallel_size",
                   "engine_heartbeat_timeout", "engine_step_timeout")


def run_generate(args: argparse.Namespace) -> int:
    from hotstart.boot.resolve import resolve_model  # noqa: PLC0415
    from hotstart.config import EngineConfig  # noqa: PLC0415
    from hotstart.messages import SamplingParams  # noqa: PLC0415
    from hotstart.model.files import weight_files  # noqa: PLC0415
    from hotstart.server.client import make_engine_client  # noqa: PLC0415
    from hotstart.text.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: PLC0415

    if args.temperature < 0 or args.temperature != args.temperature:
        raise HotstartError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise HotstartError(f"--top-p must be in (0, 1], got {args.top_p}")
    model = resolve_model(args.model, args.revision)
    tok = Tokenizer.from_dir(model.path)
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode(args.prompt)
    cfg = EngineConfig.from_args(args, ENGINE_EXCLUDES, model_path=str(model.path), max_num_seqs=1,
                                 weight_files=tuple(str(p) for p in weight_files(model.path)))
    t_load = time.perf_counter()
    engine = make_engine_client(cfg)  # in process: builds the EngineCore here
    t_load = time.perf_counter() - t_load
    info = engine.info
    max_tokens = min(args.max_tokens, info.max_model_len - len(ids))
    if max_tokens < 1:
        raise HotstartError(f"the prompt has {len(ids)} tokens; the model's context is {info.max_model_len}")
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=max(args.top_k, 0), seed=args.seed)
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
