"""The compile worker: AOTInductor-compiles the layer graph (layer_graphs.py MidGraph) per token bucket.

`python -m hotstart.engine.fastpath.compile_worker JOB_JSON`, started by the engine after READY
(builder.py). It runs at idle CPU priority (SCHED_IDLE: only when the engine leaves a core free) with one
thread, dies with the engine, and never touches the engine's weights: it exports the family's decoder
layer (built on the meta device from the model's config.json) against random inputs of the right
shapes, since weights are graph inputs. Each package is written to the cache folder atomically
(temp file + rename, its sha256 recorded beside it) and announced as one JSON line on stdout:
  {"tokens": N, "path": P, "start": T, "end": T}      or      {"tokens": N, "error": "..."}
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT = 1, 3, 13
SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


def _idle_priority() -> None:
    """CPU: SCHED_IDLE (runs only on a core nobody else wants); disk: the idle I/O class."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    nr = SYS_IOPRIO_SET.get(os.uname().machine)
    if nr is not None:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).syscall(
            nr, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT
        )


def layer_template(model_path: str):
    """One decoder layer of the model's family and shapes, on the meta device (no memory): what the
    layer graph is exported from; its parameters are replaced by graph inputs."""
    import torch  # noqa: PLC0415

    from hotstart.model.registry import model_class  # noqa: PLC0415
    from hotstart.model_config import load_model_config  # noqa: PLC0415

    cfg = load_model_config(model_path)
    with torch.device("meta"):
        return cfg, model_class(cfg).layer_class(cfg, False)  # unfused: the CPU layout


def compile_bucket(model_path: str, tokens: int, dtype, folder: Path) -> Path:
    import torch  # noqa: PLC0415
    import torch._inductor  # noqa: PLC0415 - only this process ever imports inductor

    from hotstart.diskio import publish_recorded, temp_name  # noqa: PLC0415
    from hotstart.engine.fastpath.cache import package_name  # noqa: PLC0415
    from hotstart.engine.fastpath.layer_graphs import MidGraph, example_inputs  # noqa: PLC0415

    cfg, layer = layer_template(model_path)
    graph = MidGraph(layer)
    with torch.no_grad():
        program = torch.export.export(graph, example_inputs(graph, tokens, cfg.q_size, cfg.head_dim, dtype))
    out = folder / package_name(tokens)
    tmp = temp_name(out, ".pt2")  # unique across pods sharing the cache; cache.remove_stale sweeps it
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    publish_recorded(tmp, out)  # fsynced, renamed, the folder fsynced, its sha256 beside it
    return out


def main() -> None:
    from hotstart.diskio import is_disk_error  # noqa: PLC0415
    from hotstart.procs import die_with_parent  # noqa: PLC0415

    die_with_parent(signal.SIGKILL)
    _idle_priority()
    job = json.loads(sys.argv[1])
    folder = Path(job["folder"])
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder.parent / "inductor"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    dtype = getattr(torch, job["dtype"])
    buckets = list(job["buckets"])
    for i, tokens in enumerate(buckets):
        start = time.time()
        try:
            path = compile_bucket(job["model"], tokens, dtype, folder)
            _say({"tokens": tokens, "path": str(path), "start": start, "end": time.time()})
        except Exception as e:  # noqa: BLE001 - reported to the engine, which keeps serving eagerly
            if is_disk_error(e):  # a full or read-only cache: the others would fail the same way
                why = f"cannot write the compile cache in {folder}: {getattr(e, 'strerror', None) or e}"
                for t in buckets[i:]:
                    _say({"tokens": t, "error": why[:300], "start": start, "end": time.time()})
                break
            last = traceback.format_exception_only(type(e), e)[-1].strip().splitlines()[0][:300]
            _say({"tokens": tokens, "error": last, "start": start, "end": time.time()})
    os._exit(0)


if __name__ == "__main__":
    main()
