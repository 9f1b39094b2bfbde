"""One engine's start (torch-free until an in-process engine is asked for): the steps every entry point
takes, in this order, and their clean-up.

  resolve    MODEL -> a local folder, or an s3:// download under way              boot/resolve.py
  files      its weight files, in load order                                      model/files.py
  cursor     the loader's position, shared with the prefetcher                    model/cursor.py
  config     the EngineConfig: the caller's fields plus the derived ones
  spawn      sent to the forkserver / zygote, which forks the engine once its preload is done
  prefetch   sidecars and weights into the page cache (daemon threads, reads only) boot/prefetch.py
  client     the EngineClient: supervised over zmq, or an EngineCore built in this process
  tokenizer  tokenizer.json and the chat template                                 text/tokenizer.py

`hotstart serve` (server/launch.py), each model of a server with several (server/multi_launch.py), the
offline LLM (llm/engine.py) and `hotstart generate` all start an engine through EngineStart. close()
stops what the start began (prefetch, download, cursor, a launcher it made itself); the caller closes
the client (an async close, on its own loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hotstart.boot.timeline import Timeline
from hotstart.errors import HotstartError, WeightsError

if TYPE_CHECKING:
    from hotstart.boot.resolve import ResolvedModel
    from hotstart.config import EngineConfig, ServeConfig
    from hotstart.forkserver.client import EngineLauncher
    from hotstart.frontend.client import EngineClient


class EngineStart:
    """TIMELINE: where each step is recorded. LAUNCHER: the forkserver / zygote / fresh-interpreter
    launcher to start the engine with (None: the engine is built in this process, which imports torch).
    MAKE_CONFIG(**derived) -> EngineConfig, DERIVED being model_path, weight_files, cursor_path and t0.
    PREFETCH: the serve flags that steer the page-cache prefetch (None: no prefetch). IMPORTS: the
    import prefetch started at t=0 (boot/iosched.py), which the weights' prefetch waits for. RANKS: the
    tensor-parallel ranks (one cursor slot each)."""

    def __init__(self, timeline: Timeline, launcher: EngineLauncher | None,
                 make_config: Callable[..., EngineConfig], *, prefetch: ServeConfig | None = None,
                 imports: Any = None, auto_restart: bool = True, ranks: int = 1) -> None:
        self.timeline, self.launcher, self.make_config = timeline, launcher, make_config
        self.prefetch_flags, self.imports = prefetch, imports
        self.auto_restart, self.ranks = auto_restart, ranks
        self.model: ResolvedModel | None = None
        self.files: list[Path] = []
        self.config: EngineConfig | None = None
        self.client: EngineClient | None = None
        self.tokenizer: Any = None
        self.cursor = self.prefetcher = self.remote = None
        self.api_imported = threading.Event()  # set once this process's own imports are over
        self.owns_launcher = False

    @classmethod
    def with_own_launcher(cls, timeline: Timeline, make_config: Callable[..., EngineConfig],
                          **kwargs: Any) -> EngineStart:
        """A start that launches its forkserver (or uses this user's zygote) now, and stops it at close()."""
        from hotstart.forkserver.client import EngineLauncher  # noqa: PLC0415 - stdlib only

        launcher = EngineLauncher(use_forkserver=True, zygote="auto")
        launcher.start()  # t=0: torch imports in the forkserver while this process goes on
        start = cls(timeline, launcher, make_config, **kwargs)
        start.owns_launcher = True
        return start

    # ---- the steps, in order ------------------------------------------------------------------
    def begin(self, spec: str | None = None, revision: str | None = None, *,
              resolved: ResolvedModel | None = None) -> EngineStart:
        """resolve (unless RESOLVED is given) -> files -> cursor -> config -> spawn -> prefetch -> client."""
        from hotstart.model.files import weight_files  # noqa: PLC0415 - stdlib only

        with self.timeline.phase("model resolved") as span:
            if resolved is None:
                from hotstart.boot.resolve import resolve_model  # noqa: PLC0415

                resolved = resolve_model(spec, revision)
            self.model = resolved
            try:
                self.files = weight_files(resolved.path)
            except WeightsError:
                # a shard whose download failed already is gone from the folder: say why, not "missing"
                downloader = getattr(resolved.remote, "downloader", None)
                if downloader is not None and downloader.error:
                    raise WeightsError(downloader.error) from None
                raise
            span.detail = f"{resolved.source}: {resolved.path}"
        self.remote = resolved.remote  # s3:// models (boot/remote/): the weights may be arriving
        if self.remote is not None:
            self.remote.attach(self.timeline.record)
        flags = self.prefetch_flags
        if flags is not None and not flags.prefetch:
            flags = None
        if flags is not None and self.remote is not None and self.remote.downloading:
            flags = None  # the download fills the page cache itself
        if flags is not None and self.launcher is not None:
            from hotstart.model.cursor import LoadCursor  # noqa: PLC0415

            self.cursor = LoadCursor.create(ranks=self.ranks)  # a slot per rank
        self.config = self.make_config(
            model_path=str(resolved.path), weight_files=tuple(map(str, self.files)),
            cursor_path=self.cursor.path if self.cursor is not None else None, t0=self.timeline.t0)
        if self.launcher is not None and self.launcher.use_forkserver:
            with self.timeline.phase("engine config sent"):
                self.launcher.spawn(self.config, world_size=self.config.tensor_parallel_size)
        if flags is not None and self.launcher is not None:
            self.prefetcher = self.start_prefetch(flags)
        self.client = make_engine_client(self.config, self.timeline, launcher=self.launcher,
                                         auto_restart=self.auto_restart)
        return self

    def spawn_serial(self) -> None:
        """Without a forkserver (--no-prespawn, HOTSTART_SERIAL=1): spawn the engine as a fresh
        interpreter now (serve does it once the API is otherwise ready: the serial baseline)."""
        if self.launcher is not None and not self.launcher.use_forkserver:
            self.client.spawn()

    def load_tokenizer(self) -> Any:
        """The tokenizer (a worker thread may run this: Tokenizer's imports are loaded first, here)."""
        with self.timeline.phase("tokenizer loaded"):
            self.tokenizer = load_tokenizer(self.model.path)
        self.api_imported.set()
        return self.tokenizer

    def start_prefetch(self, flags: ServeConfig):
        """The sidecar and weight prefetchers (daemon threads, reads only); returns the weights' one or None.
        With an import prefetch under way the weights start once it is done, and read in the idle I/O
        class until this process's imports are over (load_tokenizer ran) and the engine's loader has
        started (the forkserver's import is done)."""
        from hotstart.boot.iosched import GATE_TIMEOUT_S, start_after  # noqa: PLC0415
        from hotstart.boot.prefetch import Prefetcher  # noqa: PLC0415
        from hotstart.boot.storage import PrefetchOverrides, plan_for  # noqa: PLC0415
        from hotstart.model.files import sidecar_files  # noqa: PLC0415

        files, cursor = self.files, self.cursor
        with self.timeline.phase("prefetch started") as span:
            overrides = PrefetchOverrides(threads=flags.prefetch_threads, block_mib=flags.prefetch_block_mb,
                                          method=flags.prefetch_method)
            try:
                plan = plan_for(files, overrides)
            except ValueError as e:
                raise HotstartError(str(e)) from None
            sidecars = sidecar_files(self.model.path)
            Prefetcher(sidecars, plan_for(sidecars, overrides)).start()
            span.detail = plan.reason if plan.enabled else f"off: {plan.reason}"
            if not plan.enabled:
                return None
            if self.imports is None:
                return Prefetcher(files, plan, cursor).start()

            def imports_over() -> bool:
                return self.api_imported.is_set() and (cursor is None or cursor.position() >= 0)

            prefetcher = Prefetcher(files, plan, cursor, idle_io_until=imports_over)
            start_after(self.imports.done, GATE_TIMEOUT_S, prefetcher.start)
            return prefetcher

    # ---- clean-up -----------------------------------------------------------------------------
    def end_prefetch(self) -> None:
        """Stop the weights' prefetch and remove the cursor (the load is over). Idempotent."""
        if self.prefetcher is not None:
            self.prefetcher.stop()
            self.prefetcher = None
        if self.cursor is not None:
            self.cursor.close()  # the owner's close removes its folder
            self.cursor = None

    def close(self) -> None:
        """Stop the prefetch and the download (what is written is kept for the next start), the launcher
        if this start made it, and remove the cursor. Idempotent."""
        self.end_prefetch()
        if self.remote is not None:
            self.remote.stop()
            self.remote = None
        if self.owns_launcher and self.launcher is not None:
            self.launcher.shutdown()
            self.launcher = None


def load_tokenizer(path: Path | str) -> Any:
    from hotstart.text.tokenizer import Tokenizer  # noqa: PLC0415 - imported by the caller's thread first

    return Tokenizer.from_dir(path)


def make_engine_client(cfg: EngineConfig, timeline: Timeline | None = None, *,
                       launcher: EngineLauncher | None = None, auto_restart: bool = True) -> EngineClient:
    """The engine of CFG: over zmq in the process LAUNCHER starts (supervised: restarts unless
    AUTO_RESTART is off), or, without a launcher, an EngineCore built here and now (this imports torch
    and loads the weights on the caller's thread)."""
    timeline = timeline or Timeline(time.time())
    if launcher is not None:
        from hotstart.frontend.engine_client import ProcessEngineClient  # noqa: PLC0415 - imports zmq

        return ProcessEngineClient(launcher, cfg, timeline, auto_restart=auto_restart)
    from hotstart.frontend.inprocess import InProcessEngineClient  # noqa: PLC0415 - imports torch

    return InProcessEngineClient.build(cfg, timeline)
