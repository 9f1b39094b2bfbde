"""Tensor-parallel engine groups: rendezvous, the control channel's wire format, and the watchdog that
takes the group down with any of its ranks. engine/executor.py's TensorParallelExecutor drives it.

Every rank is forked from the same warm forkserver. Rank 0 runs the EngineCore (scheduler, sampler,
zmq to the API process); before each forward its executor broadcasts the step's inputs (StepInputs:
token ids, positions as (start, length) per entry, block tables) as tensors: a HEADER-long int64 header
(the op, the payload's length, the op's sizes), then one int64 payload, both over the control group
(gloo, on the CPU: ranks > 0 block in it while idle, not in a device kernel). Every rank then builds the
same attention metadata and runs its part of the model; the activations' collectives (all-reduces of
the row-parallel layers and the embedding, the logits' gather to rank 0) run on the device group: gloo
on CPU (the same group), NCCL on CUDA (rank r on cuda:r). Ranks > 0 loop (executor.follow) until rank 0
broadcasts shutdown. Rendezvous: a file (file:// init) in the engine's private ipc folder, named per
generation: no fixed ports. Any rank's exit ends the others (pidfd watchdog; a collective that fails
does too).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hotstart.config import EngineConfig, ModelConfig, load_model_config
from hotstart.engine.model_runner import StepInputs
from hotstart.engine.placement import resolve_placement
from hotstart.errors import HotstartError
from hotstart.messages import RANK_LEFT, EngineAddresses
from hotstart.model.parallel import TensorParallel, divisibility_error
from hotstart.procs import alive

log = logging.getLogger("hotstart.engine")
OP_STEP, OP_COPY, OP_PACK, OP_NOOP, OP_SHUTDOWN = range(5)
HEADER = 6  # [op, payload length, then the op's sizes]
TIMEOUT = timedelta(minutes=30)  # one collective's limit; an idle rank 0 sends a no-op every HEARTBEAT_S
HEARTBEAT_S = 60.0
POLL_S = 0.2  # the watchdog's period where pidfd_open is missing
LINGER_S = 0.5  # a rank following another out waits this long first: the dead rank's exit is reported first


def rendezvous_file(addresses: EngineAddresses) -> str:
    """The group's FileStore: beside the generation's zmq sockets (a private folder), unique per
    generation."""
    path = addresses.requests.removeprefix("ipc://")
    return os.path.join(os.path.dirname(path), f"tp-{os.path.basename(path)}")


def topology_error(world_size: int, model_cfg: ModelConfig, device: torch.device) -> str | None:
    """Why WORLD_SIZE ranks cannot run MODEL_CFG on DEVICE's kind here (the numbers named), or None."""
    if device.type == "cuda":
        have, what = torch.cuda.device_count(), "visible CUDA devices"
    else:
        have, what = len(os.sched_getaffinity(0)), "CPU cores this process may run on"
    if world_size > have:
        return f"--tensor-parallel-size {world_size}: more ranks than the {have} {what}"
    return divisibility_error(model_cfg, world_size)


def encode_step(s: StepInputs) -> tuple[list[int], list[int]]:
    """(header, payload) of a step: ids, starts, lens, table lengths, tables, want [, all]."""
    flat = [b for t in s.tables for b in t]
    payload = (
        s.token_ids
        + s.starts
        + s.lens
        + [len(t) for t in s.tables]
        + flat
        + [int(w) for w in s.want_logits]
        + ([int(a) for a in s.all_logits] if s.all_logits is not None else [])
    )
    return [OP_STEP, len(payload), len(s.lens), len(s.token_ids), int(s.all_logits is not None)], payload


def decode_step(header: list[int], v: list[int]) -> StepInputs:
    b, t, has_all = header[2], header[3], header[4]
    ids, starts, lens, sizes = v[:t], v[t:t + b], v[t + b:t + 2 * b], v[t + 2 * b:t + 3 * b]
    i, tables = t + 3 * b, []
    for n in sizes:
        tables.append(v[i:i + n])
        i += n
    want = [bool(x) for x in v[i:i + b]]
    return StepInputs(
        ids, starts, lens, tables, want, [bool(x) for x in v[i + b : i + 2 * b]] if has_all else None
    )


class Group:
    """This rank's tensor-parallel group: `tp` for the model's collectives, the control channel rank 0
    broadcasts on, and the watchdog."""

    def __init__(self, rank: int, world_size: int, device: torch.device, control=None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.tp = TensorParallel(rank, world_size)  # the default group: gloo on CPU, NCCL on CUDA
        self.control = control  # gloo group of the broadcasts (None: the default group, on CPU)
        self.leaving = False  # shutdown under way: a peer's exit is expected
        self._last_send = time.monotonic()

    @classmethod
    def join(cls, rank: int, world_size: int, device: torch.device, init_file: str) -> Group:
        """Rendezvous through INIT_FILE with the other ranks; returns once all WORLD_SIZE have joined."""
        kwargs = {}
        if device.type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            kwargs["device_id"] = device
        else:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, no name lookup
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))  # the cores are shared
        group = cls(rank, world_size, device)
        dist.init_process_group(group.backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=TIMEOUT, **kwargs)
        if group.backend != "gloo":
            group.control = dist.new_group(backend="gloo", timeout=TIMEOUT)
        group._watch()
        return group

    # ---- rank 0 -------------------------------------------------------------------------------
    def _send(self, header: list[int], payload: list[int] = ()) -> None:
        dist.broadcast(
            torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.long), 0, group=self.control
        )
        if payload:
            dist.broadcast(torch.tensor(payload, dtype=torch.long), 0, group=self.control)
        self._last_send = time.monotonic()

    def send_step(self, s: StepInputs) -> None:
        self._send(*encode_step(s))

    def send_copies(self, pairs: list[tuple[int, int]]) -> None:
        self._send([OP_COPY, 2 * len(pairs)], [b for pair in pairs for b in pair])

    def send_pack(self, layer: int) -> None:
        """Every rank packs its own shards of LAYER (-1: the LM head) for oneDNN (engine/fastpath.py)."""
        self._send([OP_PACK, 0, layer])

    def heartbeat(self) -> None:
        """Idle: keep the other ranks' wait under the collectives' timeout."""
        if time.monotonic() - self._last_send > HEARTBEAT_S:
            self._send([OP_NOOP, 0])

    def send_shutdown(self) -> None:
        self.leaving = True
        try:
            self._send([OP_SHUTDOWN, 0])
        except RuntimeError:  # a rank is gone already
            pass

    # ---- every rank ---------------------------------------------------------------------------
    def receive(self) -> tuple[list[int], list[int]]:
        header = torch.empty(HEADER, dtype=torch.long)
        dist.broadcast(header, 0, group=self.control)
        head = header.tolist()
        if not head[1]:
            return head, []
        payload = torch.empty(head[1], dtype=torch.long)
        dist.broadcast(payload, 0, group=self.control)
        return head, payload.tolist()

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def _watch(self) -> None:
        """Learn every rank's pid; a daemon thread exits this process when any other rank exits."""
        mine = torch.tensor([os.getpid()], dtype=torch.long)
        pids = [torch.zeros(1, dtype=torch.long) for _ in range(self.world_size)]
        dist.all_gather(pids, mine, group=self.control)
        peers = [int(p.item()) for i, p in enumerate(pids) if i != self.rank]
        fds = None  # without pidfds (an old kernel): poll
        try:
            fds = [os.pidfd_open(p) for p in peers]
        except ProcessLookupError:
            self._peer_gone()
        except (AttributeError, OSError):
            pass
        threading.Thread(target=self._watchdog, args=(fds, peers), name="tp-watchdog", daemon=True).start()

    def _watchdog(self, fds: list[int] | None, peers: list[int]) -> None:
        if fds is not None:
            select.select(fds, [], [])
        else:
            # The peers are the forkserver's (or zygote's) children, not ours: one that exited stays a
            # zombie until its parent reaps it, and counts as gone at once, as a readable pidfd says too.
            while all(alive(p) for p in peers):
                time.sleep(POLL_S)
        self._peer_gone()

    def _peer_gone(self) -> None:
        if not self.leaving:  # shutting down: the main thread exits on its own
            self.leave("another rank of the tensor-parallel group exited")

    def leave(self, why: str) -> None:
        """Exit RANK_LEFT because the group broke, after LINGER_S: the rank that died is reported first
        (the API process usually stops this one meanwhile)."""
        log.error("hotstart: engine rank %d: %s; leaving", self.rank, why)
        time.sleep(LINGER_S)
        os._exit(RANK_LEFT)


def start(cfg: EngineConfig, addresses: EngineAddresses, rank: int, world_size: int) -> Group:
    """Join the group of this engine generation. Rank 0 first checks that the group can work (its error
    is the one the user sees; the other ranks wait in the rendezvous and are stopped with it)."""
    model_cfg = load_model_config(cfg.model_path)
    device = resolve_placement(cfg, model_cfg).device
    if rank == 0 and (problem := topology_error(world_size, model_cfg, device)):
        raise HotstartError(problem)
    return Group.join(rank, world_size, device, rendezvous_file(addresses))


