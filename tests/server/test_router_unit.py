"""The model router's policy without processes: fake engines (frontend/router.py, frontend/model_specs.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from hotstart.errors import HotstartError, RequestError
from hotstart.frontend import router as router_mod
from hotstart.frontend.metrics import Metrics
from hotstart.frontend.model_specs import model_dir_specs, parse_duration, split_spec
from hotstart.frontend.router import ModelRecord, ModelRouter, RetryLater, State, transition
from hotstart.server.multi_api import merged


class FakeClient:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.ready, self.info = log, name, True, None

    async def close(self, timeout: float = 3.0) -> None:
        self.log.append(("close", self.name))


def make_router(names, *, max_loaded=1, budget=1 << 40, keep_alive=None, max_waiting=8, fail=(), cost=0,
                pinned=(), priority=None, aliases=None, free_memory=None):
    log: list = []

    async def start(rec):
        log.append(("start", rec.name))
        if rec.name in fail:
            raise RuntimeError(f"{rec.name} is broken")
        return FakeClient(log, rec.name)

    records = [ModelRecord(n, f"/models/{n}", cost=cost, pinned=n in pinned,
                           priority=(priority or {}).get(n, 0)) for n in names]
    r = ModelRouter(records, start, lambda rec: object(), max_loaded=max_loaded, budget=budget,
                    keep_alive=keep_alive, max_waiting=max_waiting, aliases=aliases, free_memory=free_memory)
    return r, log


def state(r: ModelRouter) -> dict[str, str]:
    return {n: rec.state.value for n, rec in r.records.items()}


def test_durations_like_ollama():
    assert parse_duration("5m") == 300 and parse_duration("30s") == 30 and parse_duration(12) == 12
    assert parse_duration("1h30m") == 5400 and parse_duration("0") == 0
    assert parse_duration(-1) is None and parse_duration("-5m") is None
    for bad in ("soon", "5x", "", True, None, float("nan")):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_specs_and_model_dir(tmp_path, monkeypatch):
    assert split_spec("a=/x") == split_spec("a=/x") and split_spec("a=/x").name == "a"
    assert split_spec("/p/a=b").name is None and split_spec("org/name").spec == "org/name"
    assert split_spec("n=s3://bucket/p").spec == "n=s3://bucket/p"
    (tmp_path / "x=y").mkdir()  # a folder whose name holds "=" is a folder
    assert split_spec(str(tmp_path / "x=y")).name is None
    monkeypatch.chdir(tmp_path)
    assert split_spec("x=y").name is None
    (tmp_path / "x=y").rmdir()
    for n in ("b", "a"):
        (tmp_path / n).mkdir()
        (tmp_path / n / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert [s.name for s in model_dir_specs(str(tmp_path))] == ["a", "b"]
    with pytest.raises(HotstartError):
        model_dir_specs(str(tmp_path / "empty"))


def test_transitions_are_checked():
    rec = ModelRecord("m", "/m")
    with pytest.raises(RuntimeError):
        transition(rec, State.LOADED)
    transition(rec, State.LOADING)
    transition(rec, State.FAILED, "boom")
    assert rec.error == "boom" and rec.retry_at > time.time()
    transition(rec, State.LOADING)
    assert rec.error is None


def test_lru_eviction_and_in_flight_never_evicted():
    async def main():
        r, log = make_router(["a", "b", "c"], max_loaded=2)
        for n in ("a", "b", "a"):
            r.release(await r.acquire(n))
        r.release(await r.acquire("c"))  # b is the least recently used
        assert state(r) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        held = await r.acquire("a")  # in flight: never evicted
        r.release(await r.acquire("b"))  # evicts c, not a
        assert state(r)["c"] == "unloaded" and state(r)["a"] == "loaded"
        r.release(held)
        await r.close_all()
        return log

    log = asyncio.run(main())
    assert ("close", "b") in log and log.index(("close", "b")) < log.index(("close", "c"))


def test_a_waiting_request_gets_room_when_the_busy_one_ends():
    async def main():
        r, _ = make_router(["a", "b"], max_loaded=1)
        held = await r.acquire("a")
        waiter = asyncio.ensure_future(r.acquire("b"))
        await asyncio.sleep(0.1)
        assert not waiter.done() and r.waiting == 1
        with pytest.raises(RetryLater):  # the bound: only 8 here, so fill it
            r.max_waiting = 1
            await r.acquire("b")
        r.release(held)
        rec = await asyncio.wait_for(waiter, 5)
        assert rec.name == "b" and state(r) == {"a": "unloaded", "b": "loaded"}
        await r.close_all()

    asyncio.run(main())


def test_memory_budget_evicts():
    async def main():
        r, _ = make_router(["a", "b"], max_loaded=5, budget=150, cost=100)
        r.release(await r.acquire("a"))
        r.release(await r.acquire("b"))
        assert state(r) == {"a": "unloaded", "b": "loaded"}
        r.records["a"].cost = 200  # alone over the budget: refused, with the reason
        with pytest.raises(RetryLater) as e:
            await r.acquire("a")
        assert "more than" in e.value.message and state(r)["b"] == "loaded"
        await r.close_all()

    asyncio.run(main())


def test_eviction_by_the_memory_free_now():
    async def main():
        total = 250  # bytes the machine has for models; each loaded model takes its cost (100)
        r, _ = make_router(["a", "b", "c"], max_loaded=5, cost=100, free_memory=lambda: total - 100 * sum(
            rec.state is State.LOADED for rec in r.records.values()))
        for n in ("a", "b"):
            r.release(await r.acquire(n))
        assert state(r) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        r.release(await r.acquire("c"))  # 50 free: the least recently used goes first, and enough
        assert state(r) == {"a": "unloaded", "b": "loaded", "c": "loaded"} and r.records["a"].evictions == 1
        await r.close_all()

    asyncio.run(main())


def test_pins_priorities_and_aliases(monkeypatch):
    monkeypatch.setattr(router_mod, "REAP_S", 0.02)

    async def main():
        r, _ = make_router(["p", "hi", "lo", "x"], max_loaded=3, keep_alive=0.05, pinned={"p"},
                           priority={"hi": 5}, aliases={"fast": "hi"})
        assert r.preload == ["p"] and r.lookup("fast") is r.records["hi"]
        assert r.records["hi"].aliases == ["fast"]
        reaper = asyncio.ensure_future(r.reap())
        r.release(await r.acquire("p"), 0)  # a request's keep_alive 0 does not unload a pinned model
        r.release(await r.acquire("lo"), None)
        r.release(await r.acquire("fast"), None)  # hi, by its alias: the most recently used
        await asyncio.sleep(0.1)
        assert state(r) == {"p": "loaded", "hi": "loaded", "lo": "loaded", "x": "unloaded"}
        r.release(await r.acquire("x"), None)  # evicts lo (priority 0) before hi (5); never p
        assert state(r) == {"p": "loaded", "hi": "loaded", "lo": "unloaded", "x": "loaded"}
        held = [await r.acquire("hi"), await r.acquire("x")]
        waiter = asyncio.ensure_future(r.acquire("lo"))  # busy or pinned: it waits, p is never evicted
        await asyncio.sleep(0.1)
        assert not waiter.done() and r.records["p"].state is State.LOADED
        r.release(held[1], None)
        r.release(await asyncio.wait_for(waiter, 5), None)
        assert state(r) == {"p": "loaded", "hi": "loaded", "lo": "loaded", "x": "unloaded"}
        r.release(held[0])
        reaper.cancel()
        await r.close_all()

    asyncio.run(main())


def test_pin_alias_and_priority_flags_are_checked():
    from hotstart.frontend.model_specs import ModelsConfig

    m = ModelsConfig(pin=("a,b",), alias=("x=a", "y = b"), priority=("b=-2",))
    assert m.pin_names() == ["a", "b"] and m.alias_map(["a", "b"]) == {"x": "a", "y": "b"}
    assert m.priorities(["a", "b"]) == {"b": -2}
    for bad in (ModelsConfig(alias=("x=c",)), ModelsConfig(alias=("a=b",)), ModelsConfig(alias=("x",)),
                ModelsConfig(alias=("x=a", "x=b")), ModelsConfig(alias=("x y=a",))):
        with pytest.raises(HotstartError):
            bad.alias_map(["a", "b"])
    for bad in (ModelsConfig(priority=("c=1",)), ModelsConfig(priority=("a=high",))):
        with pytest.raises(HotstartError):
            bad.priorities(["a", "b"])


def test_failed_load_backs_off_and_others_serve(monkeypatch):
    async def main():
        r, log = make_router(["a", "bad"], max_loaded=2, fail={"bad"})
        with pytest.raises(RetryLater) as e:
            await r.acquire("bad")
        assert "`bad` failed to load: bad is broken" in e.value.message and e.value.retry_after >= 1
        with pytest.raises(RetryLater):
            await r.acquire("bad")
        assert log.count(("start", "bad")) == 1  # not retried on every request
        r.release(await r.acquire("a"))
        r.records["bad"].retry_at = 0  # the backoff is over
        with pytest.raises(RetryLater):
            await r.acquire("bad")
        assert log.count(("start", "bad")) == 2 and r.records["bad"].failures == 2
        with pytest.raises(RequestError) as e:
            await r.acquire("../a")
        assert e.value.status == 404
        await r.close_all()

    asyncio.run(main())


def test_keep_alive_zero_and_expiry(monkeypatch):
    monkeypatch.setattr(router_mod, "REAP_S", 0.05)

    async def main():
        r, _ = make_router(["a", "b"], max_loaded=2, keep_alive=None)
        reaper = asyncio.ensure_future(r.reap())
        r.release(await r.acquire("a"), 0)
        r.release(await r.acquire("b"), 0.2)
        await asyncio.sleep(0.05)
        assert state(r) == {"a": "unloaded", "b": "loaded"}
        await asyncio.sleep(0.4)
        assert state(r)["b"] == "unloaded"
        reaper.cancel()
        await r.close_all()

    asyncio.run(main())


def test_metrics_get_a_model_label_and_each_family_once():
    from prometheus_client.parser import text_string_to_metric_families

    server, a, b = Metrics(), Metrics("a"), Metrics("b")
    for m in (a, b):
        m.generation_tokens.inc(2)
        m.vllm.generation_tokens.labels(m.model_name).inc(3)
    text = merged([(server.render(), None), (a.render(), "a"), (b.render(), "b")])
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)) and text.count("# TYPE hotstart_draining gauge") == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    assert samples[("hotstart_generation_tokens_total", (("model", "a"),))] == 2
    assert samples[("hotstart_generation_tokens_total", ())] == 0  # the server's own, unlabelled
    assert samples[("vllm:generation_tokens_total", (("model_name", "b"),))] == 3  # vLLM's label alone
