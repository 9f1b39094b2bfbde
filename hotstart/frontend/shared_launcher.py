"""Several engines from one warm forkserver (or zygote): a launcher view per model (torch-free).

The forkserver protocol already keeps many engines per connection, each named by its generation
(SpawnEngine / EngineSpawned / EngineExited / StopEngine carry it), so N engines of different configs
coexist if generations are unique across them: SharedLauncher hands them out from one counter and
routes the events it reads to the ModelLauncher whose engine they name. A ModelLauncher is what one
EngineSupervisor + ProcessEngineClient see (the EngineLauncher interface they use), so the supervision
code (restarts, forkserver replacement, zygote fallback) is the single-model one. Its shutdown() stops
only its own engine. ForkserverExited goes to every view; the first to ask restarts the forkserver.

Without a forkserver (--no-prespawn, HOTSTART_SERIAL=1) each model gets its own EngineLauncher
(spawning its engine as a fresh interpreter) instead: see launcher_for().
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING

from hotstart.forkserver.client import current_generation
from hotstart.messages import (
    EngineAddresses,
    EngineExited,
    EngineSpawned,
    ForkserverExited,
    ServerInfo,
    SpawnEngine,
    StopEngine,
)
from hotstart.procs import descendants, wait_gone

if TYPE_CHECKING:
    from hotstart.config import EngineConfig
    from hotstart.forkserver.client import EngineLauncher


class SharedLauncher:
    """One EngineLauncher (its forkserver or zygote) shared by the engines of many models."""

    def __init__(self, launcher: EngineLauncher) -> None:
        self.real = launcher
        self._next = 0
        self._views: dict[int, ModelLauncher] = {}  # current generation -> its view
        self._all: list[ModelLauncher] = []
        self._info: ServerInfo | None = None
        self.lock = threading.Lock()  # sends come from the loop and from close()'s executor thread

    def view(self) -> ModelLauncher:
        v = ModelLauncher(self)
        self._all.append(v)
        return v

    def new_generation(self, view: ModelLauncher) -> int:
        self._views.pop(view.generation, None)
        self._next += 1
        self._views[self._next] = view
        return self._next

    def forget(self, view: ModelLauncher) -> None:
        """VIEW's engine is stopped for good (its model unloaded): no more events for it."""
        if self._views.get(view.generation) is view:
            del self._views[view.generation]
        if view in self._all:
            self._all.remove(view)

    def send(self, msg) -> None:
        with self.lock:
            self.real.send(msg)

    def pump(self) -> None:
        """Read what the forkserver said; queue each event on the view it concerns."""
        for ev in self.real.poll_events(all_generations=True):
            if isinstance(ev, ServerInfo):
                self._info = ev
                for v in list(self._all):
                    v.pending.append(ev)
            elif isinstance(ev, (EngineSpawned, EngineExited)):
                v = self._views.get(ev.generation)
                if v is not None:
                    v.pending.append(ev)
            else:  # ForkserverExited: every engine is gone
                for v in list(self._all):
                    v.pending.append(ev)


class ModelLauncher:
    """The EngineLauncher interface of one model's engine, over a SharedLauncher."""

    use_forkserver = True

    def __init__(self, shared: SharedLauncher) -> None:
        self.shared = shared
        self.generation = 0  # 0: none asked for yet (real ones start at 1)
        self.engine_pids: dict[int, int] = {}
        self.pending: list = []
        self._info_sent = False

    # what the supervisor reads of the real launcher
    @property
    def zygote_pid(self) -> int | None:
        return self.shared.real.zygote_pid

    @property
    def last_lost(self) -> str:
        return self.shared.real.last_lost

    @property
    def engine_pid(self) -> int | None:
        return self.engine_pids.get(0)

    def fileno(self) -> None:
        """None: the supervisor polls (one fd can have one asyncio reader; the views share it)."""
        return None

    def addresses(self) -> EngineAddresses:
        d, g = self.shared.real.ipc_dir, self.generation
        return EngineAddresses(f"ipc://{d}/in-{g}", f"ipc://{d}/out-{g}")

    def spawn(self, cfg: EngineConfig, new_generation: bool = False, world_size: int | None = None) -> None:
        self.shared.pump()
        if self.shared.real.fileno() is None:  # it died while no engine was watching it: a fresh one
            self.pending = [e for e in self.pending if not isinstance(e, ForkserverExited)]
            self.restart_server()
        if new_generation or self.generation == 0:
            self.generation = self.shared.new_generation(self)
        self.engine_pids = {}
        self.shared.send(SpawnEngine(self.generation, cfg, self.addresses(),
                                     world_size or cfg.tensor_parallel_size))

    def poll_events(self) -> list:
        self.shared.pump()
        if not self._info_sent and self.shared._info is not None and not any(  # noqa: SLF001
                isinstance(e, ServerInfo) for e in self.pending):
            self.pending.insert(0, self.shared._info)  # noqa: SLF001 - a view made after the preload
        self._info_sent = True
        events, self.pending = self.pending, []
        return current_generation(events, self.generation, self.engine_pids)

    def restart_server(self) -> None:
        """A dead forkserver is replaced once, by whichever of its engines' supervisors asks first."""
        with self.shared.lock:
            if self.shared.real.fileno() is None:
                self.shared.real.restart_server()

    def abandon_server(self, reason: str) -> None:
        self.shared.real.abandon_server(reason)

    def stop_engine(self) -> None:
        if self.generation:
            self.shared.send(StopEngine(self.generation))

    def kill_engine(self) -> None:
        for pid in list(self.engine_pids.values()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop this model's engine (the forkserver stays); SIGKILL what is left past TIMEOUT. Called on
        an executor thread by ProcessEngineClient.close: no imports here."""
        pids = list(self.engine_pids.values())
        self.stop_engine()
        pids = wait_gone(pids, timeout)  # exited is enough: its forkserver (or zygote) reaps it
        # an engine killed here never closes its fast-path builder: its g++ (or compile worker) would
        # outlive it, orphaned; they are found while it still is their parent
        for p in [q for engine in pids for q in (engine, *descendants(engine))]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.engine_pids = {}
        self.shared.forget(self)


def launcher_for(shared: SharedLauncher | None, use_forkserver: bool):
    """The launcher of one model's engine: a view of the shared forkserver, or its own direct launcher."""
    if shared is not None and use_forkserver:
        return shared.view()
    from hotstart.forkserver.client import EngineLauncher  # noqa: PLC0415 - stdlib only, here at load

    return EngineLauncher(use_forkserver=False)
