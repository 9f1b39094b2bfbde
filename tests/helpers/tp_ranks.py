"""One rank of a tensor-parallel group for the tensor-parallel tests (run as a script, one process per
rank): join the group through INIT_FILE, then for each case build this rank's part of the model the way
the engine does and run a prefill and a decode step driven by rank 0's broadcasts; rank 0 saves the
gathered logits to OUT.

    python tests/helpers/tp_ranks.py RANK WORLD INIT_FILE CASES_JSON OUT
CASES_JSON: [{"name", "model", "fused", "ids"}]. fused=True: the GPU layout (FusedLinear) on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hotstart.config import EngineConfig, load_model_config
from hotstart.engine import distributed
from hotstart.engine.core import EngineCore
from hotstart.engine.executor import Executor, executor_for
from hotstart.engine.model_runner import ModelRunner, StepInputs
from hotstart.model.files import weight_files
from hotstart.model.loader import load_model

MAX_LEN, BLOCK = 128, 16


def executor_for_case(case: dict, group: distributed.Group | None) -> Executor:
    """This rank's executor of CASE: its part of the model, as the engine builds it (or fused)."""
    files = tuple(str(p) for p in weight_files(case["model"]))
    if not case["fused"]:  # the engine's own path: EngineCore.build (zero-copy unfused weights on CPU)
        cfg = EngineConfig(model_path=case["model"], weight_files=files, device="cpu", dtype="float32",
                           max_model_len=MAX_LEN, kv_cache_memory=4 << 20)
        return EngineCore.build(cfg, group=group).executor
    model = load_model(load_model_config(case["model"]), files, "cpu", torch.float32, MAX_LEN, fused=True,
                       tp=group.tp if group is not None else None)
    runner = ModelRunner(model, 2 * MAX_LEN // BLOCK, BLOCK, torch.device("cpu"), torch.float32)
    return executor_for(runner, group)


def prefill_and_decode(executor: Executor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [V] after the prompt, and after one more (greedy) token read back from the KV cache."""
    table = list(range(1, MAX_LEN // BLOCK + 1))
    first = executor.run(StepInputs(list(ids), [0], [len(ids)], [table], [True]))[0]
    second = executor.run(StepInputs([int(first.argmax())], [len(ids)], [1], [table], [True]))[0]
    return first, second


def run_two_ranks(cases: list[dict], folder: Path, timeout: float) -> dict:
    """CASES through two ranks of this script (one process each, a FileStore in FOLDER): name -> the
    [first, second] logits of rank 0 (prefill_and_decode's)."""
    out, init = folder / "logits.pt", folder / "rendezvous"
    repo = Path(__file__).resolve().parents[2]
    argv = [json.dumps(cases), str(out)]
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), "2", str(init), *argv],
                              env={**os.environ, "PYTHONPATH": str(repo)})
             for rank in range(2)]
    try:
        assert [p.wait(timeout) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    return torch.load(out)


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, cases, out = sys.argv[3], sys.argv[4], sys.argv[5]
    group = distributed.Group.join(rank, world, torch.device("cpu"), init_file)
    results = {}
    for case in json.loads(cases):
        executor = executor_for_case(case, group)
        if rank == 0:
            results[case["name"]] = prefill_and_decode(executor, case["ids"])
            executor.shutdown()  # ends this case's loop on the other ranks
        else:
            executor.follow()
    if rank == 0:
        torch.save(results, out)
    sys.stdout.flush()
    os._exit(0)  # as the engine: no teardown of the process group's threads


if __name__ == "__main__":
    main()
