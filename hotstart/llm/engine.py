"""The LLM's engine: started through `serve`'s machinery (the warm forkserver or this user's zygote at
once, the model resolved, the weight prefetcher, the tokenizer loaded meanwhile), driven on a private
asyncio loop in a background thread so that `generate` works from any caller, a notebook's running
loop included. Every module that thread needs is imported before it starts (threads never import)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig, ServeConfig
from hotstart.errors import HotstartError


class EngineHandle:
    """An EngineClient, its loop thread, and what it takes to stop it all (close() is idempotent)."""

    def __init__(self, model: str | None, revision: str | None, engine_kwargs: dict[str, Any],
                 process: bool) -> None:
        from hotstart.boot.resolve import resolve_model  # noqa: PLC0415 - the start, in order
        from hotstart.forkserver.client import EngineLauncher  # noqa: PLC0415
        from hotstart.model.files import weight_files  # noqa: PLC0415

        t0 = time.time()
        self.timeline = Timeline(t0)
        self.launcher = self.cursor = self.prefetcher = None
        self.client: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        try:
            if process:
                self.launcher = EngineLauncher(use_forkserver=True, zygote="auto")
                self.launcher.start()  # t=0: torch imports in the forkserver while we go on
            self.model = resolve_model(model, revision)
            files = weight_files(self.model.path)
            if process:
                from hotstart.model.cursor import LoadCursor  # noqa: PLC0415

                self.cursor = LoadCursor.create(ranks=engine_kwargs.get("tensor_parallel_size", 1))
            cfg = EngineConfig(model_path=str(self.model.path), weight_files=tuple(map(str, files)),
                               cursor_path=self.cursor.path if self.cursor else None, t0=t0, **engine_kwargs)
            if process and self.launcher.use_forkserver:
                self.launcher.spawn(cfg, world_size=cfg.tensor_parallel_size)
            if process:
                from hotstart.server.launch import _start_prefetch  # noqa: PLC0415

                self.prefetcher = _start_prefetch(ServeConfig(), self.model.path, files, self.cursor,
                                                  self.timeline)
            from hotstart.server.client import make_engine_client  # noqa: PLC0415
            from hotstart.server.generation import Generation  # noqa: F401, PLC0415 - before the thread
            from hotstart.text.tokenizer import Tokenizer  # noqa: PLC0415

            if process:
                self.client = make_engine_client(cfg, self.timeline, launcher=self.launcher,
                                                 auto_restart=False)
            self.tokenizer = Tokenizer.from_dir(self.model.path)
            if not process:
                self.client = make_engine_client(cfg, self.timeline)  # builds the core here (torch)
            elif not self.launcher.use_forkserver:
                self.client.spawn()
            self._start_loop()
            self.call(self.client.start())
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _start_loop(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hotstart-llm-loop", daemon=True)
        self.thread.start()

    def _wait_ready(self) -> None:
        while not self.client.ready:
            if self.client.fatal:
                raise HotstartError(f"the engine failed to start: {self.client.fatal}")
            time.sleep(0.005)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    @property
    def info(self):
        return self.client.info

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine (and forkserver), the loop and the prefetcher; no process is left behind."""
        client, self.client = self.client, None
        if client is not None and self.loop is not None and self.loop.is_running():
            client.begin_shutdown()
            try:
                self.call(client.close(timeout), timeout + 5)
            except Exception:  # noqa: BLE001 - closing: the launcher's shutdown below still runs
                pass
        elif client is not None and hasattr(client, "stop"):
            client.stop()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self.thread is not None:
                self.thread.join(timeout)
            if not self.loop.is_running():
                self.loop.close()
            self.loop = None
        if self.prefetcher is not None:
            self.prefetcher.stop()
            self.prefetcher = None
        if self.launcher is not None:
            self.launcher.shutdown()
            self.launcher = None
        if self.cursor is not None:
            self.cursor.close()
            self.cursor = None
