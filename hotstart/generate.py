"""`hotstart generate`: offline generation through the same EngineCore the server uses."""

from __future__ import annotations

import argparse
import sys
import time

from hotstart.errors import HotstartError

# engine options that make no sense offline (one sequence; --seed is the request's here; one process)
ENGINE_EXCLUDES = ("max_num_seqs", "max_num_batched_tokens", "seed", "tensor_parallel_size")


def run_generate(args: argparse.Namespace) -> int:
    from hotstart.boot.resolve import resolve_model  # noqa: PLC0415
    from hotstart.config import EngineConfig  # noqa: PLC0415
    from hotstart.engine.core import EngineCore  # noqa: PLC0415 - imports torch
    from hotstart.messages import EngineRequest, SamplingParams  # noqa: PLC0415
    from hotstart.model.files import weight_files  # noqa: PLC0415
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
    core = EngineCore.build(cfg)
    t_load = time.perf_counter() - t_load
    max_tokens = min(args.max_tokens, core.max_model_len - len(ids))
    if max_tokens < 1:
        raise HotstartError(f"the prompt has {len(ids)} tokens; the model's context is {core.max_model_len}")
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=max(args.top_k, 0), seed=args.seed)
    err = core.add_request(EngineRequest("generate", ids, params))
    if err is not None:
        raise HotstartError(err.error or "request rejected")
    detok = IncrementalDetokenizer(tok)
    n_out, first_token_s = 0, None
    t0 = time.perf_counter()
    while core.has_work():
        for out in core.step():
            if first_token_s is None:
                first_token_s = time.perf_counter() - t0
            n_out += len(out.new_token_ids)
            sys.stdout.write(detok.add(out.new_token_ids))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    elapsed = time.perf_counter() - t0
    decode_s = elapsed - (first_token_s or 0.0)
    rate = (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0
    print(
        f"[{len(ids)} prompt tokens, {n_out} generated; load {t_load:.2f} s, first token "
        f"{first_token_s or 0:.3f} s, "
        f"decode {rate:.1f} tok/s on {core.placement.device} {str(core.placement.dtype)[6:]}]",
        file=sys.stderr,
    )
    return 0
