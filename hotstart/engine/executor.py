"""Executors: where a step's forward runs. The EngineCore hands each scheduled batch to its executor and
knows nothing of ranks.

Executor runs it in this process. TensorParallelExecutor is one rank of a tensor-parallel group
(engine/distributed.py): on rank 0, under the EngineCore, it broadcasts each step's inputs (and block
copies, and weight packing) to the other ranks, then runs its own part; ranks > 0 have no EngineCore and
spend their life in follow(), receiving and running what rank 0 sends until it sends shutdown.
"""

from __future__ import annotations

import torch

from hotstart.engine import distributed
from hotstart.engine.fastpath.pack import pack_layer
from hotstart.engine.model_runner import ModelRunner, StepInputs
from hotstart.engine.sequence import Sequence
from hotstart.messages import RANK_LEFT


class Executor:
    """The single-process executor (and the interface of the tensor-parallel one)."""

    world_size = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, batch: list[tuple[Sequence, int]], want_logits: list[bool],
                all_logits: list[bool] | None = None) -> torch.Tensor | None:
        """One forward over BATCH (sequence, new tokens): float32 logits [N, V] as ModelRunner.forward."""
        return self.runner.forward(batch, want_logits, all_logits)

    def run(self, s: StepInputs) -> torch.Tensor | None:
        """execute() on plain inputs."""
        return self.runner.run(s)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of the KV blocks (src, dst), on every rank."""
        self.runner.copy_blocks(pairs)

    def pack_on_peers(self, layer: int) -> None:
        """The other ranks pack their shards of LAYER (-1: the LM head) as this one just did."""

    def heartbeat(self) -> None:
        """Called while idle (the other ranks wait under a timeout)."""

    def step_failed(self, error: RuntimeError) -> None:
        """A step raised ERROR: alone, re-raise it; in a group (a collective failed: a rank is gone),
        leave the group, which exits this process."""
        raise error

    def shutdown(self) -> None:
        """The engine is stopping: stop the other ranks."""


class TensorParallelExecutor(Executor):
    """One rank of a tensor-parallel group: rank 0 broadcasts, then runs its part; ranks > 0 follow()."""

    def __init__(self, runner: ModelRunner, group: distributed.Group):
        super().__init__(runner)
        self.group = group
        self.world_size = group.world_size

    def execute(self, batch: list[tuple[Sequence, int]], want_logits: list[bool],
                all_logits: list[bool] | None = None) -> torch.Tensor | None:
        return self.run(StepInputs.of(batch, want_logits, all_logits))

    def run(self, s: StepInputs) -> torch.Tensor | None:
        self.group.send_step(s)
        return self.runner.run(s)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.group.send_copies(pairs)
        self.runner.copy_blocks(pairs)

    def pack_on_peers(self, layer: int) -> None:
        self.group.send_pack(layer)

    def heartbeat(self) -> None:
        self.group.heartbeat()

    def step_failed(self, error: RuntimeError) -> None:
        self.group.leave(f"the tensor-parallel group broke ({error})")

    def shutdown(self) -> None:
        self.group.send_shutdown()

    def follow(self) -> int:
        """Ranks > 0: run what rank 0 broadcasts until it broadcasts shutdown (0), or the group breaks
        (RANK_LEFT: a collective failed, rank 0 or another rank is gone)."""
        group = self.group
        try:
            while True:
                head, payload = group.receive()
                op = head[0]
                if op == distributed.OP_STEP:
                    self.runner.run(distributed.decode_step(head, payload))
                elif op == distributed.OP_COPY:
                    self.runner.copy_blocks(list(zip(payload[::2], payload[1::2])))
                elif op == distributed.OP_PACK:
                    pack_layer(self.runner.model, head[2])
                elif op == distributed.OP_SHUTDOWN:
                    group.leaving = True
                    return 0
        except RuntimeError as e:
            if not group.leaving:
                group.leave(f"the tensor-parallel group broke ({e})")
            return RANK_LEFT


def executor_for(runner: ModelRunner, group: distributed.Group | None) -> Executor:
    """The executor of RUNNER: alone, or this rank's of GROUP."""
    return Executor(runner) if group is None else TensorParallelExecutor(runner, group)
