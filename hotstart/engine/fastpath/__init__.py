"""The fast path: what makes serving faster, built behind READY and swapped in between two steps.

The engine answers at once on the plain eager path (zero-copy weights, F.linear). Then, a little at a
time between steps (everything at once while idle), FastPath (builder.py):
  1. packing (--compile eager-only, auto): prepacks the linear weights for oneDNN (pack.py, the one
     pack_layer() every rank and the step bench use), layer by layer, where the copies fit in memory
     (else, where hotstart's CPU kernels run, only groups the sibling projections for them), then
     installs the CPU kernels (model/cpu_kernels.py, model/layer_ops.py);
  2. compile (--compile graphs; auto where the weights were not prepacked; a C++ compiler present,
     CPU): loads the layer graphs (layer_graphs.py: the model's own decoder layer around its paged
     attention, compiled by AOTInductor per token bucket) from the compile cache (cache.py) and starts
     the compile worker (compile_worker.py, idle CPU priority, another process) for the buckets it
     lacks; each graph is loaded as it is announced.
What is built and when is decided once (plan.py); each stage and bucket then moves along one state
machine (state.py: messages.FastPathState, transition()). The next step of a size a ready bucket covers
runs on the layer graphs. A failure is logged in one line and the engine keeps what it has: never a
crash, never a stall. Status goes to the API process as FastPathStatus messages, its phases as Spans
(the startup timeline goes on past READY).
"""

from hotstart.engine.fastpath.builder import FastPath
from hotstart.engine.fastpath.cache import LayerSpec, cache_folder
from hotstart.engine.fastpath.pack import pack_layer, pack_model

__all__ = ["FastPath", "LayerSpec", "cache_folder", "pack_layer", "pack_model"]
