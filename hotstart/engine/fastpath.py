"""What makes serving faster, built behind READY and swapped in between two steps.

The engine answers at once on the plain eager path (zero-copy weights, F.linear). Then, a little at a
time between steps (everything at once while idle), FastPath:
  1. (--compile eager-only, auto) packs the linear weights for oneDNN (model/packed.py), layer by
     layer, where the copies fit in memory;
  2. (--compile graphs; auto where the weights were not packed; a C++ compiler present, CPU) loads
     the compiled layer graphs of every token bucket from the compile cache and starts the compile
     worker (engine/compiler.py, idle CPU priority, another process) for the buckets it lacks; each
     graph is loaded as it is announced.
The next step of a size a ready bucket covers runs compiled. A failure is logged in one line and the
engine keeps what it has: never a crash, never a stall. Status goes to the API process as
FastPathStatus messages, its phases as Spans (the startup timeline goes on past READY).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hotstart import __version__
from hotstart.messages import BucketState, FastPathStatus, Span
from hotstart.model import packed
from hotstart.model.graphs import LayerSpec
from hotstart.model.layers import Linear
from hotstart.procs import terminate_then_kill
from hotstart.system import cpu_flags, hotstart_home, mem_available

PACK_RAM_FRACTION = 0.5  # pack only if the packed copy takes at most this share of MemAvailable
REPORT_EVERY_S = 1.0  # step counts are resent at most this often
TICK_IDLE_S = 0.01  # work per tick while the engine is idle (busy: one layer's packing, ~1 ms)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")


def cache_folder(spec: LayerSpec, dtype: torch.dtype) -> Path:
    """$HOTSTART_HOME/compile/KEY: KEY hashes what a compiled graph depends on (layer shapes, dtype,
    packed or not, torch, hotstart, Python, the CPU's instruction sets); not the weights (inputs)."""
    key = {"spec": spec.as_dict(), "dtype": str(dtype), "torch": torch.__version__, "hotstart": __version__,
           "python": list(sys.version_info[:2]), "isa": sorted(cpu_flags() & set(ISA_FLAGS))}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return hotstart_home() / "compile" / digest


def _remove_stale(folder: Path) -> None:
    """Temp files of compile workers that died mid-write (named .NAME.PID.tmp.pt2)."""
    for f in folder.glob(".*.tmp.pt2"):
        try:
            os.kill(int(f.name.split(".")[-3]), 0)
        except (ValueError, ProcessLookupError):
            f.unlink(missing_ok=True)
        except PermissionError:
            pass


class FastPath:
    def __init__(self, core, mode: str, buckets: tuple[int, ...], send: Callable[[object], None]):
        from hotstart.engine.compiled import CompiledForward  # noqa: PLC0415 - only where it is used

        self._compiled_cls = CompiledForward
        self.core, self.runner, self.mode, self.send = core, core.runner, mode, send
        self.model = self.runner.model
        self.linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        self._todo = list(range(len(self.model.model.layers))) if self._pack_plan() else []
        self.compile = self._compile_plan(packing=bool(self._todo))
        self.buckets = (
            {b: BucketState(b, "compiling") for b in sorted(set(buckets))} if not self.compile else {}
        )
        self.proc: subprocess.Popen | None = None
        self._out = b""
        self._pack_t0 = time.time()
        self._last_report = 0.0
        self._dirty = True
        self.folder: Path | None = None

    # ---- plans -------------------------------------------------------------------------------
    def _pack_plan(self) -> bool:
        p = self.core.placement
        if self.mode in ("off", "graphs"):
            self.packing = f"off: --compile {self.mode}"
        elif self.model.fused:
            self.packing = "off: fused weights (GPU layout)"
        elif not packed.available(p.device, p.dtype):
            self.packing = f"off: no oneDNN packing for {p.device.type} {str(p.dtype)[6:]}"
        else:
            need = sum(m.weight.nbytes for m in self.linears) + self.model.output_weight().nbytes
            need *= (
                self.runner.peers.world_size if self.runner.peers is not None else 1
            )  # ranks share the RAM
            avail = mem_available()
            if avail is not None and need > PACK_RAM_FRACTION * avail:
                self.packing = (f"off: packed weights ({need / 1e9:.1f} GB) would take over "
                                f"{PACK_RAM_FRACTION:.0%} of MemAvailable ({avail / 1e9:.1f} GB)")
            else:
                self.packing, self._pack_bytes = "packing", need
                return True
        return False

    def _compile_plan(self, packing: bool) -> str:
        """'' if the compiled path will be built, else 'off: why'. auto compiles only where the weights
        are not packed: over packed weights the graphs measured no faster (docs/serving.md)."""
        cxx = os.environ.get("CXX", "g++")
        if self.mode not in ("auto", "graphs"):
            return f"off: --compile {self.mode}"
        if self.mode == "auto" and packing:
            return "off: the packed weights serve faster (auto)"
        if not self.model.graph_layers:
            return "off: the compiled layer graphs are Llama's layer, not this family's"
        if self.runner.peers is not None:
            return "off: tensor parallel (the compiled layer graphs hold no collectives)"
        if self.core.placement.device.type != "cpu" or self.model.fused:
            return "off: the compiled path is built for CPU engines"
        if shutil.which(cxx) is None:
            return f"off: no C++ compiler ({cxx}) found"
        return ""

    # ---- the loop's hook ---------------------------------------------------------------------
    def packing_left(self) -> bool:
        return bool(self._todo)

    def busy(self) -> bool:
        """Work is left (the engine's idle wait should stay short)."""
        return bool(self._todo) or self.proc is not None

    def tick(self, idle: bool) -> None:
        """Called between steps: a bounded amount of work (a few ms), more while IDLE, so a request that
        arrives meanwhile waits at most that long."""
        try:
            if self._todo:
                self._pack(TICK_IDLE_S if idle else 0.0)
            elif self.compile == "" and self.folder is None:
                self._start_compiling()
            if self.proc is not None:
                self._poll_compiler()
        except Exception as e:  # noqa: BLE001 - the fast path is optional; serving goes on
            self._todo = []
            self.compile = f"failed: {type(e).__name__}: {e}"
            print(
                f"hotstart: engine: fast path stopped ({self.compile}); serving eagerly",
                file=sys.stderr,
                flush=True,
            )
            self._dirty = True
        self._report()

    def close(self) -> None:
        if self.proc is not None:
            terminate_then_kill([self.proc], 1.0)
            self.proc = None

    # ---- packing -----------------------------------------------------------------------------
    def _pack(self, budget_s: float) -> None:
        """Pack one layer, then more while BUDGET_S lasts."""
        end = time.perf_counter() + budget_s
        while self._todo:
            index = self._todo.pop(0)
            for m in self.model.model.layers[index].modules():
                if isinstance(m, Linear) and m.packed is None:
                    m.packed = packed.pack(m.weight)
            if self.runner.peers is not None:  # tensor parallel: each rank packs its own shards
                self.runner.peers.send_pack(index)
            if time.perf_counter() >= end:
                break
        if not self._todo:
            if self.model.lm_head_packed is None:
                self.model.lm_head_packed = packed.pack(self.model.output_weight())
                if self.runner.peers is not None:
                    self.runner.peers.send_pack(-1)
            self.packing = f"packed: {self._pack_bytes / 1e6:.0f} MB"
            self.send(Span("weights packed (oneDNN)", self._pack_t0, time.time(), "engine", self.packing))
            self._dirty = True

    # ---- compiling ---------------------------------------------------------------------------
    def _start_compiling(self) -> None:
        p = self.core.placement
        spec = LayerSpec.of(self.core.model_cfg)
        self.folder = cache_folder(spec, p.dtype)
        self.folder.mkdir(parents=True, exist_ok=True)
        _remove_stale(self.folder)
        self.forward = self._compiled_cls(self.model, spec)
        from hotstart.engine.compiler import package_name  # noqa: PLC0415

        missing = []
        for b in self.buckets:
            path = self.folder / package_name(b)
            if path.is_file():
                self._load(b, str(path), time.time(), "from the compile cache")
            else:
                missing.append(b)
        self.runner.compiled = self.forward
        if not missing:
            self.compile = "done"
            return
        job = json.dumps({"spec": spec.as_dict(), "dtype": str(p.dtype).removeprefix("torch."),
                          "buckets": missing, "folder": str(self.folder)})
        log = open(self.folder / "compile.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "hotstart.engine.compiler", job],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        finally:
            log.close()
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.compile = "compiling"

    def _load(self, tokens: int, path: str, start: float, how: str) -> None:
        t = time.time()
        try:
            self.forward.load(tokens, path)
        except Exception as e:  # noqa: BLE001 - e.g. a package from an incompatible build
            self.buckets[tokens].state = f"failed: cannot load: {type(e).__name__}"
            print(f"hotstart: engine: compiled graph for {tokens} tokens failed to load ({e}); "
                  "that bucket stays eager", file=sys.stderr, flush=True)
        else:
            self.buckets[tokens].state = "ready"
            self.send(
                Span(
                    f"compiled graph ready ({tokens} tokens)",
                    start,
                    time.time(),
                    "compiler" if how == "compiled" else "engine",
                    f"{how}, loaded in {time.time() - t:.3f} s",
                )
            )
        self._dirty = True

    def _poll_compiler(self) -> None:
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk:
            self._out += chunk
            while b"\n" in self._out:
                line, self._out = self._out.split(b"\n", 1)
                self._announced(json.loads(line))
        if chunk == b"" or self.proc.poll() is not None and chunk is None:
            code = self.proc.wait()
            self.proc = None
            left = [b for b, s in self.buckets.items() if s.state == "compiling"]
            for b in left:
                self.buckets[b].state = f"failed: the compile worker exited (code {code})"
            self.compile = "done" if not left else f"failed: the compile worker exited (code {code})"
            self._dirty = True

    def _announced(self, msg: dict) -> None:
        tokens = msg["tokens"]
        if "error" in msg:
            self.buckets[tokens].state = f"failed: {msg['error']}"
            print(f"hotstart: engine: compiling the graph for {tokens} tokens failed ({msg['error']}); "
                  "that bucket stays eager", file=sys.stderr, flush=True)
            self._dirty = True
        else:
            self._load(tokens, msg["path"], msg["start"], "compiled")

    # ---- reporting ---------------------------------------------------------------------------
    def status(self) -> FastPathStatus:
        steps = getattr(self.runner.compiled, "steps", {}) if self.runner.compiled is not None else {}
        buckets = [BucketState(b, s.state, steps.get(b, 0)) for b, s in self.buckets.items()]
        return FastPathStatus(
            self.mode, self.packing, self.compile or "pending", buckets, self.runner.eager_steps
        )

    def _report(self) -> None:
        now = time.time()
        if self._dirty or now - self._last_report >= REPORT_EVERY_S:
            status = self.status()
            if self._dirty or status != getattr(self, "_sent", None):
                self.send(status)
                self._sent = status
            self._dirty, self._last_report = False, now
