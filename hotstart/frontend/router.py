"""Several models behind one API: per-model records, on-demand loads, keep-alive, LRU eviction
(torch-free; everything runs on the event loop's thread).

A ModelRecord's state is a State, changed only by transition(): unloaded -> loading -> loaded ->
unloaded (idle past its keep-alive, evicted, or unloaded by POST /v1/models/{name}/unload), and
loading / loaded -> failed (the engine could not start: the supervisor gave up; an engine in a crash
loop is not failed: its supervisor backs off and starts it again, its requests get 503 meanwhile). A
failed model is loaded again by the first request after a backoff that doubles per failure; requests
before that get the failure at once. An engine that dies while loaded is replaced by its
supervisor (frontend/supervisor.py) as with one model; its requests wait for the replacement.

Room: at most --max-loaded-models engines (those being stopped count), at most the memory budget
(each model's weight bytes + KV-cache estimate), and, where the memory free now (free_memory(): the
effective limit, cgroup-aware) is short of the new model's cost, idle models are unloaded until it is
not (or none is left to unload). Evicted first: the lowest --priority, then the least recently used;
never a model with requests in flight, never a pinned one (--pin: loaded at start, kept through
keep-alive, unloaded only by POST .../unload). Loads are admitted one at a time (no two loads wait for
each other's room), then run concurrently. Requests for a model that is not serving wait, at most
--max-waiting-requests of them in all; one more gets 503 with Retry-After. Aliases (--alias
NAME=TARGET) are other names of a record.

On CUDA an unload stops the engine process, which frees its device memory; a "sleep" level that keeps
the weights in pinned host memory (the next load an H2D copy, as vLLM's /sleep level 1) would slot in
between loaded and unloaded here. The CPU path is what runs and is tested today.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hotstart.errors import RequestError

log = logging.getLogger("hotstart")
LOAD_TIMEOUT_S = 600.0  # a load (room + engine start) that takes longer fails
CLOSE_TIMEOUT_S = 3.0
BACKOFF_S, BACKOFF_MAX_S = 5.0, 300.0  # retry of a failed load: 5 s, then doubling
REAP_S = 0.2  # keep-alive deadlines are checked this often
UNSET: Any = object()  # a request without keep_alive


class State(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


_NEXT = {
    State.UNLOADED: {State.LOADING, State.FAILED},
    State.LOADING: {State.LOADED, State.FAILED, State.UNLOADED},
    State.LOADED: {State.UNLOADED, State.FAILED},
    State.FAILED: {State.LOADING, State.UNLOADED},
}


class RetryLater(RequestError):
    """A 503 answered with Retry-After: SECONDS."""

    def __init__(self, seconds: float, message: str, code: str, param: str | None = None) -> None:
        super().__init__(503, message, code=code, param=param, retry_after=max(1, int(seconds + 0.999)))


@dataclass(eq=False)
class ModelRecord:
    name: str
    path: str
    cost: int = 0  # bytes: weights + KV-cache estimate
    state: State = State.UNLOADED
    client: Any = None  # its EngineClient (one supervisor each) while loading / loaded
    tokenizer: Any = None  # loaded at the first load, kept across unloads
    serving: Any = None  # the OpenAIServing over client + tokenizer while loaded
    last_used: float = 0.0
    in_flight: int = 0
    waiting: int = 0
    loaded_at: float | None = None
    keep_alive_until: float | None = None  # None: no deadline (never, or requests in flight)
    error: str | None = None
    failures: int = 0
    retry_at: float = 0.0
    loads: int = 0
    evictions: int = 0
    load_seconds: float | None = None
    pinned: bool = False  # never evicted, never unloaded by keep-alive
    priority: int = 0  # evicted first: the lowest
    aliases: list[str] = field(default_factory=list)
    task: asyncio.Task | None = None
    extra: dict = field(default_factory=dict)


def transition(rec: ModelRecord, new: State, error: str | None = None) -> None:
    """The one place a record's state changes (and the fields that go with it)."""
    if new not in _NEXT[rec.state]:
        raise RuntimeError(f"model {rec.name}: {rec.state.value} -> {new.value} is not a transition")
    now = time.time()
    log.info("hotstart: model %s: %s -> %s%s", rec.name, rec.state.value, new.value,
             f" ({error})" if error else "")
    rec.state = new
    if new is State.LOADING:
        rec.error, rec.loaded_at, rec.keep_alive_until = None, None, None
    elif new is State.LOADED:
        rec.loaded_at, rec.failures, rec.loads = now, 0, rec.loads + 1
    elif new is State.FAILED:
        rec.error, rec.failures = error or "unknown error", rec.failures + 1
        rec.retry_at = now + min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (rec.failures - 1))
        rec.serving, rec.loaded_at, rec.keep_alive_until = None, None, None
    else:
        rec.serving, rec.client, rec.loaded_at, rec.keep_alive_until = None, None, None, None


class ModelRouter:
    """The models of one server. START_ENGINE(rec) -> EngineClient (spawned and started, hooks set by
    the caller); MAKE_SERVING(rec) -> the OpenAIServing of a loaded record."""

    def __init__(self, records: list[ModelRecord], start_engine: Callable, make_serving: Callable, *,
                 max_loaded: int, budget: int, keep_alive: float | None, max_waiting: int,
                 preload: list[str] = (), aliases: dict[str, str] | None = None,
                 free_memory: Callable[[], int | None] | None = None) -> None:
        self.records = {r.name: r for r in records}
        self.start_engine, self.make_serving = start_engine, make_serving
        self.max_loaded, self.budget, self.keep_alive = max_loaded, budget, keep_alive
        self.max_waiting = max_waiting
        self.preload = list(dict.fromkeys([*preload, *(r.name for r in records if r.pinned)]))
        self.aliases = dict(aliases or {})  # alias -> record name
        for alias, target in self.aliases.items():
            self.records[target].aliases.append(alias)
        self.free_memory = free_memory or (lambda: None)  # bytes free now (None: unknown)
        self.waiting = 0
        self._closing: dict[int, int] = {}  # id -> cost of engines being stopped
        self._changed = asyncio.Event()
        self._admit = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.on_preloaded: Callable[[], None] | None = None

    # --- lookups -------------------------------------------------------------------------------
    def lookup(self, name: str) -> ModelRecord:
        """The record named NAME (a dict lookup: a path in `model` is never a file lookup), or 404."""
        rec = self.records.get(self.aliases.get(name, name)) if isinstance(name, str) else None
        if rec is None:
            raise RequestError(404, f"The model `{name}` does not exist. Served: {', '.join(self.records)}",
                               param="model", code="model_not_found")
        return rec

    @staticmethod
    def usable(rec: ModelRecord) -> bool:
        return rec.state is State.LOADED and rec.client is not None and rec.client.ready

    def preloaded(self) -> bool:
        return all(self.records[n].state is State.LOADED for n in self.preload)

    def load_error(self, rec: ModelRecord) -> RetryLater:
        wait = max(0.0, rec.retry_at - time.time())
        return RetryLater(wait, f"model `{rec.name}` failed to load: {rec.error} (retried in {wait:.0f} s)",
                          "model_load_failed", "model")

    def notify(self) -> None:
        """Wake whoever waits for a state change (a load, an unload, a request's end, an engine ready)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def load_soon(self, rec: ModelRecord) -> None:
        """Start loading REC unless it is loading or loaded already (--preload)."""
        if rec.state in (State.UNLOADED, State.FAILED) and (rec.task is None or rec.task.done()):
            rec.task = self._spawn(self._load(rec))

    async def _wait_change(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
        except asyncio.TimeoutError:
            pass
        return True

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # --- requests ------------------------------------------------------------------------------
    async def acquire(self, name: str) -> ModelRecord:
        """NAME's record, serving, with this request counted in flight (release() it); loads it if need
        be. 404 unknown, 503 + Retry-After when too many wait or its load failed."""
        rec = self.lookup(name)
        if not self.usable(rec):
            if rec.state is State.FAILED and time.time() < rec.retry_at:
                raise self.load_error(rec)
            if self.waiting >= self.max_waiting:
                raise RetryLater(1, f"too many requests are waiting for models to load ({self.waiting}); "
                                    "retry later", "too_many_waiting", "model")
            self.waiting, rec.waiting = self.waiting + 1, rec.waiting + 1
            try:
                await self._until_usable(rec)
            finally:
                self.waiting, rec.waiting = self.waiting - 1, rec.waiting - 1
        rec.in_flight += 1
        rec.last_used, rec.keep_alive_until = time.time(), None
        return rec

    async def _until_usable(self, rec: ModelRecord) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not self.usable(rec):
            if rec.state is State.FAILED and time.time() < rec.retry_at:
                raise self.load_error(rec)
            self.load_soon(rec)
            if not await self._wait_change(deadline):
                raise RetryLater(5, f"model `{rec.name}` is not ready after {LOAD_TIMEOUT_S:.0f} s",
                                 "model_not_ready", "model")

    def release(self, rec: ModelRecord, keep_alive: Any = UNSET) -> None:
        """A request of REC is over; KEEP_ALIVE (seconds, None = forever; UNSET: the server's) sets how
        long REC stays loaded once idle (the last request to end decides, as in Ollama)."""
        rec.in_flight -= 1
        rec.last_used = time.time()
        ka = self.keep_alive if keep_alive is UNSET else keep_alive
        if rec.pinned:
            ka = None
        if rec.in_flight == 0 and rec.extra.pop("unload_when_idle", False):  # POST .../unload meanwhile
            ka = 0
        if rec.in_flight == 0 and rec.state is State.LOADED:
            rec.keep_alive_until = None if ka is None else rec.last_used + ka
            if ka == 0:
                self._spawn(self.unload(rec, "keep_alive 0"))
        self.notify()

    # --- loading and unloading -----------------------------------------------------------------
    async def _load(self, rec: ModelRecord) -> None:
        t0 = time.time()
        try:
            async with self._admit:
                await self._make_room(rec)
                transition(rec, State.LOADING)
            rec.extra["room_s"] = time.time() - t0  # a swap's first part: evictions (benchmarks/swap.py)
            self.notify()
            client = await self.start_engine(rec)
            if rec.state is not State.LOADING:  # its engine failed while it started (engine_fatal)
                self._spawn(self._close(client, rec.cost))
                return
            rec.client = client
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while rec.state is State.LOADING and not rec.client.ready:
                if not await self._wait_change(deadline):
                    raise TimeoutError(f"the engine was not ready within {LOAD_TIMEOUT_S:.0f} s")
            if rec.state is State.LOADING:
                rec.serving = self.make_serving(rec)
                rec.load_seconds = time.time() - t0
                transition(rec, State.LOADED)
                ka = None if rec.pinned else self.keep_alive
                rec.keep_alive_until = None if ka is None else time.time() + ka
                if self.on_preloaded is not None and rec.name in self.preload and self.preloaded():
                    self.on_preloaded()
        except Exception as e:  # noqa: BLE001 - any failure is this model's, never the server's
            reason = str(e) or type(e).__name__
            if rec.state in (State.LOADING, State.UNLOADED):
                transition(rec, State.FAILED, reason)
            self._close_later(rec)
        finally:
            self.notify()

    async def _make_room(self, rec: ModelRecord) -> None:
        if rec.cost > self.budget:
            raise ValueError(f"it needs {rec.cost / 2**30:.1f} GiB (weights + KV cache), more than the "
                             f"{self.budget / 2**30:.1f} GiB the models may use (--models-memory)")
        deadline, logged = time.monotonic() + LOAD_TIMEOUT_S, False
        while True:
            active = [r for r in self.records.values() if r is not rec and r.state in (State.LOADING,
                                                                                       State.LOADED)]
            n = len(active) + len(self._closing)
            used = sum(r.cost for r in active) + sum(self._closing.values())
            idle = [r for r in active if r.state is State.LOADED and r.in_flight == 0 and not r.pinned]
            fits = n < self.max_loaded and used + rec.cost <= self.budget
            free = self.free_memory()
            short = free is not None and free < rec.cost  # what is free now does not hold it
            if fits and (not short or not (idle or self._closing)):  # short, nothing to unload: go on
                return
            if idle:
                victim = min(idle, key=lambda r: (r.priority, r.last_used))
                victim.evictions += 1
                why = "room" if not fits else f"memory ({(free or 0) / 2**30:.1f} GiB free)"
                await self.unload(victim, f"evicted to make {why} for {rec.name}")
            else:
                if not logged:
                    log.info("hotstart: model %s waits for room: %d of %d engines, %.1f of %.1f GiB, every "
                             "loaded model busy or pinned", rec.name, n, self.max_loaded, used / 2**30,
                             self.budget / 2**30)
                    logged = True
                if not await self._wait_change(deadline):
                    raise TimeoutError(f"no room for it within {LOAD_TIMEOUT_S:.0f} s "
                                       "(every loaded model busy or pinned)")

    async def unload(self, rec: ModelRecord, why: str) -> bool:
        """Stop REC's engine if it is loaded and idle (True when it was)."""
        if rec.state is not State.LOADED or rec.in_flight:
            return False
        client = rec.client
        log.info("hotstart: unloading model %s (%s)", rec.name, why)
        transition(rec, State.UNLOADED)
        await self._close(client, rec.cost)
        return True

    async def _close(self, client: Any, cost: int) -> None:
        if client is None:
            return
        self._closing[id(client)] = cost
        try:
            await client.close(CLOSE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - stopping: best effort, logged
            log.warning("hotstart: WARNING: stopping an engine: %s", e)
        finally:
            self._closing.pop(id(client), None)
            self.notify()

    def _close_later(self, rec: ModelRecord) -> None:
        client, rec.client = rec.client, None
        if client is not None:
            self._spawn(self._close(client, rec.cost))

    def engine_fatal(self, rec: ModelRecord, message: str) -> None:
        """The supervisor gave up on REC's engine (it could not start, or --no-restart)."""
        if rec.state in (State.LOADING, State.LOADED):
            transition(rec, State.FAILED, message)
            self._close_later(rec)
        self.notify()

    async def reap(self) -> None:
        """Unload idle models past their keep-alive (a task for the server's lifetime)."""
        while True:
            await asyncio.sleep(REAP_S)
            now = time.time()
            for rec in list(self.records.values()):
                if (rec.state is State.LOADED and not rec.in_flight and not rec.pinned
                        and rec.keep_alive_until is not None and rec.keep_alive_until <= now):
                    await self.unload(rec, "keep-alive expired")

    async def close_all(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        clients = [r.client for r in self.records.values() if r.client is not None]
        for r in self.records.values():
            r.client = None
        await asyncio.gather(*(self._close(c, 0) for c in clients), return_exceptions=True)
