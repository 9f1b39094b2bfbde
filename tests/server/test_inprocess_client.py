"""The in-process EngineClient (frontend/inprocess.py) over the real default model: concurrent requests
batched by one stepping thread, aborts, the factory, close."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers.api import engine_core

from hotstart.boot.timeline import Timeline
from hotstart.frontend.client import EngineDeadError
from hotstart.frontend.inprocess import InProcessEngineClient
from hotstart.sampling_params import SamplingParams


@pytest.fixture
def engine(default_model_dir):
    engine = InProcessEngineClient(engine_core(default_model_dir, max_model_len=256), Timeline(time.time()))
    engine.start_stepping()
    yield engine
    engine.stop()


async def collect(engine, rid, params, ids=(1, 2, 3)):
    return [out async for out in engine.generate(rid, list(ids), params)]


def test_concurrent_requests_are_batched(engine):
    batched = []
    step = engine.step

    def counting_step():
        outputs = step()
        batched.append(engine.stats.num_running)
        return outputs

    engine.step = counting_step

    async def main():
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        return await asyncio.gather(*(collect(engine, f"r{i}", greedy) for i in range(3)))

    results = asyncio.run(main())
    assert all(sum(len(o.new_token_ids) for o in outs) == 6 and outs[-1].finish_reason == "length"
               for outs in results)
    assert [o.new_token_ids for o in results[0]] == [o.new_token_ids for o in results[1]]  # same greedy text
    assert max(batched) == 3  # one step ran the three requests together
    assert not engine.core.requests


def test_errors_aborts_and_closing(engine):
    async def main():
        (err,) = await collect(engine, "bad", SamplingParams(max_tokens=1000))
        assert err.finish_reason == "error" and "maximum context length" in err.error
        it = engine.generate("long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        await it.__anext__()
        await it.aclose()  # closing early aborts in the engine
        for _ in range(100):
            if not engine.core.requests:
                break
            await asyncio.sleep(0.01)
        assert not engine.core.requests
        outs = await collect(engine, "n2", SamplingParams(max_tokens=4, n=2, ignore_eos=True, temperature=0))
        assert {o.index for o in outs if o.finish_reason == "length"} == {0, 1}
        await engine.close()
        with pytest.raises(EngineDeadError, match="not ready"):
            await collect(engine, "late", SamplingParams(max_tokens=1))

    asyncio.run(main())
