"""Loading never starves serving: where other models serve (a many-models server), an engine loads its
weights on a helper thread at a low CPU priority with one torch thread, builds its fast path with one
torch thread (g++ started from the helper, at its priority), and steps requests at its full share (the
main thread: normal priority, every core) from the first one on.

Why a thread: a priority (nice) is per thread, inherited by the threads a thread creates, and raising
one back takes CAP_SYS_NICE (RLIMIT_NICE is 0 by default): a helper thread lowered for good does the
background work, and the main thread, never lowered, serves at its full share. Torch's intra-op thread
count is per thread too (OpenMP's nthreads-var), so the helper's set_num_threads leaves the main
thread's alone, and one thread spins no OpenMP team against the serving engines' threads. The main
thread waits while the helper works. After READY the fast path's pieces run on the main thread (they
swap weights between two steps), with one torch thread: a helper lowered for good would hold the
engine's own requests while it waited for CPU behind the other models.

HOTSTART_LOAD_NICE (default 10) and HOTSTART_LOAD_THREADS (default 1; 0 = the main thread's count) are
the knobs `benchmarks/swap.py --variants` compares (docs/serving.md).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

NICE, THREADS = 10, 1


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class Background:
    """A helper thread at NICE with THREADS torch threads; run(fn, ...) runs FN there and waits for it."""

    def __init__(self, nice: int | None = None, threads: int | None = None) -> None:
        self.nice = _env_int("HOTSTART_LOAD_NICE", NICE) if nice is None else nice
        self.threads = _env_int("HOTSTART_LOAD_THREADS", THREADS) if threads is None else threads
        self._jobs: queue.Queue = queue.Queue()
        # The main thread's count, settled before the helper lowers its own: torch keeps one process-wide
        # count that a thread adopts at its first parallel op (at::internal::lazy_init_num_threads), so a
        # main thread that had not computed yet would take the helper's 1 and serve on one core for good.
        torch.set_num_threads(torch.get_num_threads())
        self._thread = threading.Thread(target=self._loop, name="background", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:  # lower only: never above the priority the engine was started with
            tid = threading.get_native_id()
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(now, min(19, self.nice)))
        except OSError:
            pass  # a priority we may not set: the thread count still applies
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        while (job := self._jobs.get()) is not None:
            job()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """FN(*ARGS, **KWARGS) on the helper thread; its result, or its exception raised here."""
        done = threading.Event()
        box: list = [None, None]

        def job() -> None:
            try:
                box[0] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box[1] = e
            finally:
                done.set()

        self._jobs.put(job)
        done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]

    @contextmanager
    def few_threads(self) -> Iterator[None]:
        """The calling thread computes with THREADS torch threads meanwhile (0: unchanged)."""
        before = torch.get_num_threads()
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def close(self) -> None:
        self._jobs.put(None)
