"""hotstart on Ray Serve (`pip install hotstart[ray]`; imported only by those who ask for it):

    serve run hotstart.ray:app model=MODEL [min_replicas=0 max_replicas=4 num_cpus=4 ...]
    serve.run(hotstart.ray.build(model=MODEL, min_replicas=0))

Each replica is hotstart's API process (torch-free) with its engine forked from the node's zygote or its own
forkserver; Ray's proxy routes the same OpenAI endpoints as `hotstart serve` (docs/scale.md). `app` and
`build` are resolved on first use, so Ray's proxy can import hotstart.ray.proxy alone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app", "build"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hotstart.ray import builder  # noqa: PLC0415 - ray.serve and the replica, on first use

        return getattr(builder, name)
    raise AttributeError(f"module 'hotstart.ray' has no attribute {name!r}")
