"""The engine process: build the EngineCore, then serve requests over zmq until told to stop.

It runs forked from the warm forkserver (hotstart.forkserver.server) or spawned directly
(`python -m hotstart.engine.worker CONFIG_JSON IN_ADDR OUT_ADDR [RANK WORLD_SIZE]`) when pre-spawn is
off. A message it cannot decode is logged and, when it names a request, answered with an error for it.
With tensor parallelism (WORLD_SIZE > 1) every rank joins the group first and builds its part under a
TensorParallelExecutor (engine/executor.py): rank 0 is that engine and its executor broadcasts each step
to the other ranks, which run the executor's follow() loop and talk to nobody else. Every rank beats
from its first moment (hotstart/heartbeat.py): the API process's supervisor kills a silent one.
Where other models serve (cfg.background_load) the load runs on a helper thread at low CPU priority and
the fast path's build with one torch thread (engine/cpu_share.py). SIGTERM, like a Shutdown message,
ends the loop after the current step; the prefix cache on disk (engine/kv_store.py) then writes what
it has not yet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

import msgspec
import torch  # noqa: F401 - imported here so the forkserver preloads it
import zmq

from hotstart import heartbeat, logs
from hotstart.config import EngineConfig
from hotstart.engine import distributed
from hotstart.engine.core import EngineCore
from hotstart.engine.cpu_share import Background
from hotstart.engine.fastpath import FastPath
from hotstart.errors import HotstartError
from hotstart.messages import (
    AbortRequest,
    EngineAddresses,
    EngineFailed,
    EngineReady,
    EngineRequest,
    Shutdown,
    Span,
    StepOutputs,
    TokenOutput,
    encoder,
    to_engine_decoder,
)
from hotstart.model.cursor import LoadCursor

log = logging.getLogger("hotstart.engine")
IDLE_POLL_MS = 200
RECONNECT_MS = 2
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
    log.error("hotstart: engine: malformed message (%s)%s", err, f" for request {rid}" if rid else "")
    if isinstance(rid, str):
        return TokenOutput(rid, [], "error", f"the engine could not decode this request: {err}")
    return None


def _open_cursor(cfg: EngineConfig, rank: int) -> LoadCursor | None:
    if not cfg.cursor_path:
        return None
    try:
        return LoadCursor.open(cfg.cursor_path, rank)
    except (OSError, ValueError):
        return None  # best effort: the prefetcher then runs uncoordinated


def _join(cfg: EngineConfig, addresses: EngineAddresses, rank: int, world_size: int, send=None):
    t = time.time()
    group = distributed.start(cfg, addresses, rank, world_size)
    if send is not None:
        send(Span("tensor-parallel group joined", t, time.time(), "engine",
                  f"{world_size} ranks, {group.backend}"))
    return group


def run_rank(cfg: EngineConfig, addresses: EngineAddresses, rank: int, world_size: int) -> int:
    """A tensor-parallel rank > 0: join, build this rank's part, then follow rank 0 until it stops."""
    cursor = _open_cursor(cfg, rank)
    try:
        group = _join(cfg, addresses, rank, world_size)
        core = EngineCore.build(cfg, on_progress=cursor.advance if cursor else None, group=group)
    except BaseException as e:  # noqa: BLE001 - reported, then the group goes down with this rank
        log.error("hotstart: engine rank %d: %s", rank, _fatal_message(e))
        return 1
    finally:
        if cursor is not None:
            cursor.close()
    return core.executor.follow()


def run_engine(cfg: EngineConfig, addresses: EngineAddresses, rank: int = 0, world_size: int = 1) -> int:
    logs.setup("engine")
    heart = heartbeat.start(addresses.requests, rank, cfg.engine_heartbeat_timeout)
    if rank > 0:
        return run_rank(cfg, addresses, rank, world_size)
    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    for sock in (pull, push):  # the API may bind after this connects (a zygote's engine is up first):
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)  # retry often, not every 100 ms (zmq's default)
    pull.connect(addresses.requests)
    push.connect(addresses.outputs)
    send = lambda msg: push.send(encoder.encode(msg))  # noqa: E731

    cursor = group = None
    background = Background() if cfg.background_load and world_size == 1 else None
    run = background.run if background is not None else lambda fn, *a, **k: fn(*a, **k)
    try:
        cursor = _open_cursor(cfg, 0)
        if world_size > 1:
            group = _join(cfg, addresses, 0, world_size, send)
        core = run(EngineCore.build, cfg, send, cursor.advance if cursor else None, group=group)
    except BaseException as e:  # noqa: BLE001 - any startup failure is reported, then the process exits
        send(EngineFailed(_fatal_message(e)))
        push.close(linger=2000)
        pull.close(linger=0)  # else ctx.term() waits for it forever and the failed engine never exits
        ctx.term()
        return 1
    finally:
        if cursor is not None:
            cursor.close()
    device = core.placement.device
    fast = FastPath(core, cfg.compile, cfg.compile_bucket_sizes(), send,
                    **({"popen": lambda *a, **k: run(subprocess.Popen, *a, **k)} if background else {}))
    fast.before_ready()
    send(EngineReady(os.getpid(), str(device), str(core.placement.dtype).removeprefix("torch."),
                     core.max_model_len, cfg.block_size, core.blocks.num_blocks, cfg.max_num_seqs))
    few_threads = background.few_threads if background is not None else contextlib.nullcontext
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    running, first_step = True, True
    while running and not stop:
        timeout = (
            0
            if core.has_work() or fast.packing_left()
            else FAST_PATH_POLL_MS
            if fast.busy() or (core.store is not None and core.store.preloading)
            else IDLE_POLL_MS
        )
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
            heart.step_began()
            t_step = time.time()
            try:
                outputs = core.step()
            except RuntimeError as e:
                core.executor.step_failed(e)
            heart.step_ended()
            send(StepOutputs(outputs, core.stats()))
            if first_step:  # a swap's timeline: READY -> the first request's first step
                send(Span("first step", t_step, time.time(), "engine", f"{core.stats().num_running} running"))
                first_step = False
        else:
            core.executor.heartbeat()
        if running:
            idle = not core.has_work()
            with few_threads() if fast.busy() else contextlib.nullcontext():
                fast.tick(idle=idle)  # between two steps: a piece of the build, what is ready swapped in
            if core.store is not None:
                core.store.tick(idle)
    core.executor.shutdown()
    fast.close()
    if core.store is not None:
        core.store.close()
    if background is not None:
        background.close()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
    return 0


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process orchestrates shutdown
    cfg = msgspec.json.decode(sys.argv[1], type=EngineConfig)
    rank, world_size = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0, 1)
    code = run_engine(cfg, EngineAddresses(sys.argv[2], sys.argv[3]), rank, world_size)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow interpreter teardown


if __name__ == "__main__":
    main()
