"""The worker pool (torch-free): a request's CPU work off the event loop, so that the loop only does I/O.

Decoding and checking a body, chat templating, tokenizing, building a grammar and formatting a whole answer
run on WORK's few threads; /live, /health and the streams in flight are answered meanwhile. The tokenizer
releases the GIL while it encodes or decodes a long input (text/tokenizer.py); pure-Python work (templates,
checks) takes turns with the loop at the interpreter's switch interval (5 ms). Measured here: /live took
2.8 s while 8 one-megabyte /tokenize requests ran on the loop; tests/server/test_limits_e2e.py bounds it.

The pool is bounded: THREADS threads, and a request waits for one with nothing but its body held (the
connections, and so the waiting requests, are bounded by --max-connections). A request whose client leaves
while it waits is dropped from the queue; one already running finishes and its result is discarded.

The threads never import: a module imported off the main thread races with the main thread's imports
(docs/design.md). What they run is imported before (server/api.py imports the request path; llguidance,
loaded by the first constrained request, is imported on the loop before that request's work is handed
over: `ensure_imported`); HOTSTART_AUDIT_IMPORTS=FILE records any import off the main thread (cli.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREADS = max(2, min(4, os.cpu_count() or 1))


class WorkPool:
    """THREADS daemon-like worker threads (started on first use) behind `await run(fn, *args)`."""

    def __init__(self, threads: int = THREADS) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="hotstart-work")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """FN(*ARGS) on a worker thread; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


WORK = WorkPool()


def ensure_imported(req: Any) -> None:
    """Import, on the calling (main) thread, what REQ's work will need and nothing imported yet: llguidance
    for a constraint or a forced tool call (a few ms, once per process)."""
    fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "text")
    constrained = any(getattr(req, f, None) is not None for f in fields)
    forced = getattr(req, "tool_choice", None) not in (None, "auto", "none")
    if constrained or forced:
        from hotstart.frontend.structured import llguidance  # noqa: PLC0415 - imported by server/api.py

        llguidance()
