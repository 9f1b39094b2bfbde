"""FastPath: builds the fast path behind READY, a bounded piece per gap between two steps, and swaps
each piece in as it is ready. Its stages and buckets move only along state.py's transition()."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hotstart.diskio import home_writable, publish_recorded, remove_stale_temps
from hotstart.engine.fastpath.cache import (
    LayerSpec,
    cache_folder,
    discard,
    package_name,
    remove_stale,
    usable,
)
from hotstart.engine.fastpath.layer_graphs import LayerGraphForward
from hotstart.engine.fastpath.pack import LM_HEAD, KernelInstall, pack_layer
from hotstart.engine.fastpath.plan import compile_plan, kernel_plans, packing_plan
from hotstart.engine.fastpath.state import Stage
from hotstart.messages import BucketState, FastPathStatus, Span
from hotstart.messages import FastPathState as S
from hotstart.model import cpu_kernels
from hotstart.procs import descendants, terminate_then_kill
from hotstart.trust import discard_recorded, make_private_dir

log = logging.getLogger("hotstart.engine")

REPORT_EVERY_S = 1.0  # step counts are resent at most this often
TICK_IDLE_S = 0.01  # work per tick while the engine is idle (busy: one layer's prepacking, ~1 ms)
KERNELS_BUILD_TIMEOUT_S = 120.0  # g++ takes ~2 s for hotstart's CPU kernels


class FastPath:
    def __init__(self, core, mode: str, buckets: tuple[int, ...], send: Callable[[object], None],
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        self.core, self.runner, self.mode, self.send = core, core.runner, mode, send
        self.popen = popen  # starts g++ (engine/cpu_share.py: from a low-priority thread, which it inherits)
        self.model = self.runner.model
        state, why, self._pack_bytes = packing_plan(core, mode)
        # PLANNED with a why: grouped for the CPU kernels without oneDNN's copies (they would not fit)
        self._copies = not (state is S.PLANNED and why)
        self._no_copies_why = "" if self._copies else why
        self.packing = Stage("packing", state, "" if state is S.PLANNED else why)
        state, why = compile_plan(core, mode, packing=self.packing.state is S.PLANNED)
        self.compile = Stage("compile", state, why)
        planned = sorted(set(buckets)) if self.compile.pending() else []
        self.buckets = {b: Stage(f"bucket {b}") for b in planned}  # tokens -> its layer graph's state
        self._todo: list[int] = []  # layers left to prepack, then LM_HEAD
        # hotstart's CPU kernels (model/cpu_kernels.py), settled with the packing stage
        self._whys = ("", "", "")  # why not the small-batch kernel / paged decode kernel / layer ops
        # g++, the staging file it writes, the library's path, when it started
        self._kernels_build: tuple[subprocess.Popen, Path, Path, float] | None = None
        self._kernels_path: Path | None = None  # built, to load once the layers are prepacked
        self._install: KernelInstall | None = None  # loaded, its kernels attached a few layers per tick
        self._kernels_rebuilt = False  # a library that failed to load is discarded and rebuilt once
        self._pack_t0 = 0.0
        self.forward: LayerGraphForward | None = None  # installed as runner.compiled once compiling
        self.folder: Path | None = None  # the compile cache's folder of this model's layer graphs
        self.proc: subprocess.Popen | None = None  # the compile worker
        self._out = b""  # its stdout not yet split into lines
        self._errors_logged: set[str] = set()  # compile errors logged once each
        self._last_report = 0.0
        self._dirty = True
        self._sent: FastPathStatus | None = None

    # ---- the loop's hook ---------------------------------------------------------------------
    def before_ready(self) -> None:
        """A quantized model's packing stage costs milliseconds (sibling projections grouped, no copies):
        where this host's kernel library is already built, settle it before READY, so that the first
        request multiplies on the kernels, not on the reference path (dequantize per call)."""
        if self.packing.state is not S.PLANNED or self.model.quant_head is None:
            return
        path = cpu_kernels.library_path()
        if not path.exists() or cpu_kernels.verified(path) is not None:
            return  # built behind READY (g++), as for every model
        for _ in range(len(self._todo) + len(self.model.model.layers) + 3):  # bounded: a tick packs >= 1
            self.tick(idle=True)
            if self.packing.state is not S.PACKING:
                return

    def packing_left(self) -> bool:
        return self.packing.pending()

    def busy(self) -> bool:
        """Work is left (the engine's idle wait should stay short)."""
        return self.packing.pending() or self.compile.pending()

    def tick(self, idle: bool) -> None:
        """Called between steps: a bounded amount of work (a few ms), more while IDLE, so a request that
        arrives meanwhile waits at most that long."""
        try:
            if self.packing.state is S.PLANNED:
                self._start_packing()
            if self.packing.state is S.PACKING:
                self._pack(TICK_IDLE_S if idle else 0.0)
                self._kernels_tick(TICK_IDLE_S if idle else 0.0)
            elif self.compile.state is S.PLANNED:
                self._start_compiling()
            if self.proc is not None:
                self._poll_compiler()
        except Exception as e:  # noqa: BLE001 - the fast path is optional; serving goes on
            self._fail(f"{type(e).__name__}: {e}")
        self._report()

    def close(self) -> None:
        if self.proc is not None:
            terminate_then_kill([self.proc], 1.0)
            self.proc = None
        if self._kernels_build is not None:
            proc, tmp, _, _ = self._kernels_build
            terminate_then_kill([proc, *descendants(proc.pid)], 1.0)  # g++ and its cc1plus / as
            tmp.unlink(missing_ok=True)
            self._kernels_build = None

    def _fail(self, why: str) -> None:
        """Stop building: whatever is not final yet FAILED; what is built keeps serving."""
        self.close()
        for stage in (self.packing, self.compile, *self.buckets.values()):
            if stage.pending():
                stage.move(S.FAILED, why)
        log.error(f"hotstart: engine: fast path stopped ({why}); serving eagerly")
        self._dirty = True

    # ---- prepacking (oneDNN) -----------------------------------------------------------------
    def _start_packing(self) -> None:
        self.packing.move(S.PACKING)
        self._todo = [*range(len(self.model.model.layers)), LM_HEAD]
        self._pack_t0 = time.time()
        self._dirty = True
        self._start_kernels()

    def _pack(self, budget_s: float) -> None:
        """Prepack one layer, then more while BUDGET_S lasts."""
        end = time.perf_counter() + budget_s
        while self._todo:
            index = self._todo.pop(0)
            pack_layer(self.model, index, self._copies)
            self.core.executor.pack_on_peers(index)  # tensor parallel: each rank prepacks its own shards
            if time.perf_counter() >= end:
                break

    # ---- hotstart's CPU kernels (model/cpu_kernels.py) ------------------------------------------
    def _start_kernels(self) -> None:
        """Plan the kernels; start g++ in a child process if this host has not built the library."""
        self._whys = kernel_plans(self.core)
        if all(self._whys):
            return
        path = cpu_kernels.library_path()
        why = cpu_kernels.verified(path) if path.exists() else "not built"
        if why is None:
            self._kernels_path = path
            return
        if not home_writable():
            self._kernels_failed(f"$HOTSTART_HOME takes no writes this run; cached library: {why}")
            return
        self._build_kernels(path)

    def _build_kernels(self, path: Path) -> None:
        """g++ in a child process, writing a name unique to this process (pods may share the cache)."""
        make_private_dir(path.parent)
        remove_stale_temps(path.parent)
        tmp = cpu_kernels.staging_path(path)
        with open(path.parent / "build.log", "ab") as log_file:
            proc = self.popen(cpu_kernels.build_command(tmp), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=log_file)
        self._kernels_build = (proc, tmp, path, time.time())

    def _kernels_failed(self, why: str) -> None:
        self._whys = tuple(w or why for w in self._whys)
        log.error(f"hotstart: engine: no CPU kernels ({why}); oneDNN and torch serve every step")

    def _kernels_tick(self, budget_s: float = 0.0) -> None:
        """Poll g++; once the layers are prepacked, load the library, attach the kernels (a layer, then more
        while BUDGET_S lasts, per tick), settle the stage."""
        if self._kernels_build is not None:
            proc, tmp, path, t0 = self._kernels_build
            code = proc.poll()
            if code is None and time.time() - t0 < KERNELS_BUILD_TIMEOUT_S:
                return
            self._kernels_build = None
            if code is None:
                terminate_then_kill([proc, *descendants(proc.pid)], 1.0)
                self._kernels_failed(f"g++ took over {KERNELS_BUILD_TIMEOUT_S:.0f} s")
            elif code != 0:
                self._kernels_failed(f"g++ failed (code {code}, {tmp.parent}/build.log)")
            else:
                publish_recorded(tmp, path)
                self._kernels_path = path
                self.send(Span("CPU kernels built (g++)", t0, time.time(), "compiler", path.name))
            tmp.unlink(missing_ok=True)
        if self._todo:
            return
        if self._kernels_path is not None:
            path, self._kernels_path = self._kernels_path, None
            try:
                self._install = KernelInstall(self.model, path, self._whys, self._copies)
            except Exception as e:  # noqa: BLE001 - e.g. a torn or foreign library: oneDNN serves meanwhile
                if not self._kernels_rebuilt and home_writable():
                    log.error(f"hotstart: engine: the CPU kernels' library did not load ({e}): rebuilding it")
                    self._kernels_rebuilt = True
                    discard_recorded(path)
                    self._build_kernels(path)
                    return
                self._kernels_failed(f"{type(e).__name__}: {e}")
        notes = []
        if self._install is not None:
            end = time.perf_counter() + budget_s
            while not self._install.step():
                if time.perf_counter() >= end:
                    return  # the next layers in the next gap between steps
            notes, self._install = self._install.finish(), None
        gemv_why, attention_why, ops_why = self._whys
        if gemv_why:
            notes.append(f"no small-batch kernel: {gemv_why}")
        if attention_why:
            cpu_kernels.enable_attention(False)  # process-wide: off unless this engine's plan says on
            notes.append(f"no paged decode kernel: {attention_why}")
        if ops_why:  # install_kernels left model.layer_ops off
            notes.append(f"no layer ops: {ops_why}")
        size = f"{self._pack_bytes / 1e6:.0f} MB" if self._copies else self._no_copies_why
        self.packing.move(S.PACKED, "; ".join([size, *notes]))
        name = "weights prepacked (oneDNN)" if self._copies else "CPU kernels installed (no copies)"
        self.send(Span(name, self._pack_t0, time.time(), "engine",
                       self.packing.detail))
        self._dirty = True

    # ---- layer graphs ------------------------------------------------------------------------
    def _start_compiling(self) -> None:
        p = self.core.placement
        spec = LayerSpec.of(self.core.model_cfg)
        self.compile.move(S.COMPILING)
        self.folder = cache_folder(spec, p.dtype)
        writable = home_writable()  # else the API process said so, once: what is cached serves
        if writable:
            make_private_dir(self.folder)
            remove_stale(self.folder)
        self.forward = LayerGraphForward(self.model)
        missing = []
        for b, bucket in self.buckets.items():
            bucket.move(S.COMPILING)
            path = self.folder / package_name(b)
            if usable(path):  # verified (ours, its recorded hash); one failing to load stays eager
                self._load(b, str(path), time.time(), "from the compile cache")
            else:
                missing.append(b)
        self.runner.compiled = self.forward
        self._dirty = True
        if not writable:
            for b in missing:
                self.buckets[b].move(S.FAILED, "not compiled: $HOTSTART_HOME takes no writes this run")
        if not missing or not writable:
            self._settle_compile()
            return
        job = json.dumps({"model": self.core.model_cfg.path, "dtype": str(p.dtype).removeprefix("torch."),
                          "buckets": missing, "folder": str(self.folder)})
        log = open(self.folder / "compile.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            argv = [sys.executable, "-m", "hotstart.engine.fastpath.compile_worker", job]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        finally:
            log.close()
        os.set_blocking(self.proc.stdout.fileno(), False)

    def _load(self, tokens: int, path: str, start: float, how: str) -> None:
        """Load a package that verifies (cache.usable: ours, its recorded hash)."""
        t = time.time()
        try:
            if how == "compiled" and not usable(Path(path)):
                raise PermissionError("the package does not verify against its recorded hash")
            self.forward.load(tokens, path)
        except Exception as e:  # noqa: BLE001 - e.g. a package from an incompatible build
            discard(Path(path))  # the next start compiles it again
            self.buckets[tokens].move(S.FAILED, f"cannot load: {type(e).__name__}")
            log.error(f"hotstart: engine: layer graph for {tokens} tokens failed to load ({e}); "
                      "that bucket stays eager")
        else:
            self.buckets[tokens].move(S.READY, how)
            self.send(Span(f"layer graph ready ({tokens} tokens)", start, time.time(),
                           "compiler" if how == "compiled" else "engine",
                           f"{how}, loaded in {time.time() - t:.3f} s"))
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
            for bucket in self.buckets.values():
                if bucket.pending():
                    bucket.move(S.FAILED, f"the compile worker exited (code {code}) before it")
            self._settle_compile()

    def _settle_compile(self) -> None:
        """Every bucket is READY or FAILED: the compile stage is READY if any layer graph serves."""
        if any(b.state is S.READY for b in self.buckets.values()):
            self.compile.move(S.READY)
        else:
            self.compile.move(S.FAILED, "no layer graph built (see the buckets)")
        self._dirty = True

    def _announced(self, msg: dict) -> None:
        tokens = msg["tokens"]
        if "error" in msg:
            self.buckets[tokens].move(S.FAILED, msg["error"])
            if msg["error"] not in self._errors_logged:  # a full disk fails every bucket the same way
                self._errors_logged.add(msg["error"])
                log.error(f"hotstart: engine: compiling the layer graph for {tokens} tokens failed "
                          f"({msg['error']}); that bucket stays eager (and any other failing the same way)")
            self._dirty = True
        else:
            self._load(tokens, msg["path"], msg["start"], "compiled")

    # ---- reporting ---------------------------------------------------------------------------
    def status(self) -> FastPathStatus:
        steps = self.forward.steps if self.forward is not None else {}
        buckets = [BucketState(b, s.state, steps.get(b, 0), s.detail) for b, s in self.buckets.items()]
        return FastPathStatus(self.mode, self.packing.state, self.compile.state, self.packing.detail,
                              self.compile.detail, buckets, self.runner.eager_steps)

    def _report(self) -> None:
        now = time.time()
        if self._dirty or now - self._last_report >= REPORT_EVERY_S:
            status = self.status()
            if self._dirty or status != self._sent:
                self.send(status)
                self._sent = status
            self._dirty, self._last_report = False, now
