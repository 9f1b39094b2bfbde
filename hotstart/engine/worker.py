"""The engine process: build the EngineCore, then serve requests over zmq until told to stop.

It runs forked from the warm forkserver (hotstart.forkserver.server) or spawned directly
(`python -m hotstart.engine.worker CONFIG_JSON IN_ADDR OUT_ADDR`) when pre-spawn is off.
A message it cannot decode is logged and, when it names a request, answered with an error for it.
"""

from __future__ import annotations

import os
import signal
import sys

import msgspec
import torch  # noqa: F401 - imported here so the forkserver preloads it
import zmq

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import FastPath
from hotstart.errors import HotstartError
from hotstart.messages import (
    AbortRequest, EngineAddresses, EngineFailed, EngineReady, EngineRequest, Shutdown, StepOutputs, TokenOutput,
    encoder, to_engine_decoder,
)
from hotstart.model.cursor import LoadCursor

IDLE_POLL_MS = 200
FAST_PATH_POLL_MS = 20  # idle wait while the fast path is still being built


def _fatal_message(e: BaseException) -> str:
    if isinstance(e, HotstartError):
        return str(e)
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
        return f"out of memory while starting the engine: {e}"
    return f"{type(e).__name__}: {e}"


def _undecodable(raw: bytes, err: Exception) -> TokenOutput | None:
    """Log a message that does not decode; an error output for its request if it names one."""
    try:
        loose = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        loose = None
    rid = loose.get("request_id") if isinstance(loose, dict) else None
    print(f"hotstart: engine: malformed message ({err}){f' for request {rid}' if rid else ''}",
          file=sys.stderr, flush=True)
    if isinstance(rid, str):
        return TokenOutput(rid, [], "error", f"the engine could not decode this request: {err}")
    return None


def run_engine(cfg: EngineConfig, addresses: EngineAddresses, rank: int = 0, world_size: int = 1) -> int:
    if world_size != 1 or rank != 0:
        raise ValueError(f"rank {rank} of {world_size}: this engine runs one rank")
    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    pull.connect(addresses.requests)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(addresses.outputs)
    send = lambda msg: push.send(encoder.encode(msg))  # noqa: E731

    cursor = None
    try:
        if cfg.cursor_path:
            try:
                cursor = LoadCursor.open(cfg.cursor_path)
            except (OSError, ValueError):
                cursor = None  # best effort: the prefetcher then runs uncoordinated
        core = EngineCore.build(cfg, send, cursor.advance if cursor else None)
    except BaseException as e:  # noqa: BLE001 - any startup failure is reported, then the process exits
        send(EngineFailed(_fatal_message(e)))
        push.close(linger=2000)
        ctx.term()
        return 1
    finally:
        if cursor is not None:
            cursor.close()
    device = core.placement.device
    send(EngineReady(os.getpid(), str(device), str(core.placement.dtype).removeprefix("torch."),
                     core.max_model_len, cfg.block_size, core.blocks.num_blocks, cfg.max_num_seqs))
    fast = FastPath(core, cfg.compile, cfg.compile_bucket_sizes(), send)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    running = True
    while running:
        timeout = 0 if core.has_work() or fast.packing_left() else FAST_PATH_POLL_MS if fast.busy() else IDLE_POLL_MS
        if poller.poll(timeout):
            while True:
                try:
                    raw = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = to_engine_decoder.decode(raw)
                except msgspec.DecodeError as e:
                    if (err := _undecodable(raw, e)) is not None:
                        send(StepOutputs([err], core.stats()))
                    continue
                if isinstance(msg, EngineRequest):
                    err = core.add_request(msg)
                    if err is not None:
                        send(StepOutputs([err], core.stats()))
                elif isinstance(msg, AbortRequest):
                    outs = core.abort(msg.request_ids, msg.index)
                    if outs:
                        send(StepOutputs(outs, core.stats()))
                elif isinstance(msg, Shutdown):
                    running = False
        if running and core.has_work():
            outputs = core.step()
            send(StepOutputs(outputs, core.stats()))
        if running:
            fast.tick(idle=not core.has_work())  # between two steps: swaps in what is ready
    fast.close()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
    return 0


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process orchestrates shutdown
    cfg = msgspec.json.decode(sys.argv[1], type=EngineConfig)
    code = run_engine(cfg, EngineAddresses(sys.argv[2], sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow interpreter teardown


if __name__ == "__main__":
    main()
