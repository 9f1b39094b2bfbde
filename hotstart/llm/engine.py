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
from hotstart.errors import HotstartError


class EngineHandle:
    """An EngineClient, its loop thread, and what it takes to stop it all (close() is idempotent)."""

    def __init__(self, model: str | None, revision: str | None, engine_kwargs: dict[str, Any],
                 process: bool) -> None:
        from hotstart.config import EngineConfig, ServeConfig  # noqa: PLC0415 - stdlib only
        from hotstart.frontend.generation import Generation  # noqa: F401, PLC0415 - before the thread
        from hotstart.frontend.start import EngineStart  # noqa: PLC0415

        def config(**derived: Any) -> EngineConfig:
            return EngineConfig(**derived, **engine_kwargs)

        timeline = self.timeline = Timeline(time.time())
        ranks = engine_kwargs.get("tensor_parallel_size", 1)
        self.client: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        if process:  # the forkserver (or this user's zygote) from t=0, the weights prefetched as serve does
            self.start = EngineStart.with_own_launcher(timeline, config, prefetch=ServeConfig(),
                                                       auto_restart=False, ranks=ranks)
        else:
            self.start = EngineStart(timeline, None, config)
        try:
            self.start.begin(model, revision)  # in process: builds the core here (torch)
            self.client, self.model = self.start.client, self.start.model
            self.tokenizer = self.start.load_tokenizer()
            self.start.spawn_serial()
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
        self.start.close()  # the prefetch, the forkserver it launched, the cursor
