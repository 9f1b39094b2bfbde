"""OpenAIServing's pieces called directly, without HTTP (torch-free, no model, no tokenizer files).

The engine handle is a small stand-in (ready / status / info / stats / timeline): these tests cover the
serving object's own logic; requests through the real engine are tested end to end elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from hotstart.boot.timeline import Timeline
from hotstart.errors import RequestError
from hotstart.frontend.client import EngineDeadError
from hotstart.frontend.generation import GenerationError
from hotstart.frontend.protocol import CompletionRequest
from hotstart.messages import EngineReady, EngineStats
from hotstart.server.api import ApiSettings, OpenAIServing


class EngineHandle:
    """The attributes OpenAIServing reads from an EngineClient (frontend/client.py); no generation."""

    def __init__(self, ready: bool = False, status: str = "loading weights") -> None:
        self.ready, self.status, self.info = ready, status, None
        self.fatal = self.fast_path = None
        self.stats = EngineStats()
        self.timeline = Timeline(time.time())

    def set_ready(self, max_model_len: int = 64) -> None:
        self.ready, self.status = True, "ready"
        self.info = EngineReady(pid=1, device="cpu", dtype="float32", max_model_len=max_model_len,
                                block_size=16, num_kv_blocks=8, max_num_seqs=4)


def serving(engine=None, **kw) -> OpenAIServing:
    settings = ApiSettings(served_model_names=["main", "alias"], **kw)
    return OpenAIServing(engine or EngineHandle(), None, settings)  # type: ignore[arg-type]


def answer(coro) -> tuple[int, dict]:
    r = asyncio.run(coro)
    return r.status_code, json.loads(r.body)


def completion(**kw) -> CompletionRequest:
    return msgspec.convert({"model": "alias", **kw}, CompletionRequest)


def test_needs_a_served_model_name():
    with pytest.raises(ValueError, match="served_model_names"):
        OpenAIServing(EngineHandle(), None, ApiSettings(served_model_names=[]))  # type: ignore[arg-type]


def test_check_model_reports_the_first_name():
    s = serving()
    assert s.check_model("main") == s.check_model("alias") == "main"
    with pytest.raises(RequestError) as e:
        s.check_model("other")
    assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")
    assert "main, alias" in e.value.message


def test_model_cards_take_max_model_len_from_the_engine_once_ready():
    engine = EngineHandle()
    s = serving(engine, max_model_len=32)
    card = s.model_card("alias")
    assert card["id"] == "alias" and card["root"] == "main" and card["max_model_len"] == 32
    engine.set_ready(max_model_len=64)
    status, body = answer(s.list_models())
    assert status == 200 and [m["id"] for m in body["data"]] == ["main", "alias"]
    assert {m["max_model_len"] for m in body["data"]} == {64}
    assert answer(s.get_model("main"))[1] == s.model_card("main")


def test_health_and_readiness_follow_the_engine_status():
    engine = EngineHandle(status="loading weights")
    s = serving(engine)
    assert answer(s.health()) == (503, {"status": "loading weights"})
    with pytest.raises(RequestError) as e:
        s.require_ready()
    assert (
        e.value.status == 503 and e.value.code == "engine_not_ready" and "loading weights" in e.value.message
    )
    engine.set_ready()
    assert answer(s.health()) == (200, {"status": "ready"})
    s.require_ready()


def test_startup_body_shows_prefetch_only_when_set():
    s = serving()
    assert "prefetch" not in s.startup_body(None)
    assert s.startup_body(lambda: {"state": "done"})["prefetch"] == {"state": "done"}
    s.mark_served("stop")
    s.mark_served("stop")
    names = [p["name"] for p in s.startup_body(None)["phases"]]
    assert names.count("first request served") == 1


def test_engine_errors_map_to_openai_errors():
    e = OpenAIServing.engine_error(EngineDeadError("engine process exited (code -9)"))
    assert (e.status, e.code) == (503, "engine_dead")
    e = OpenAIServing.engine_error(GenerationError("CUDA error"))
    assert (e.status, e.code) == (500, "engine_error")
    e = OpenAIServing.engine_error(KeyError("secret prompt text"))
    assert (e.status, e.code, e.message) == (500, "internal_error", "internal server error")


def test_prepare_completion_with_token_ids():
    engine = EngineHandle()
    s = serving(engine, vocab_size=100, sampling_defaults={"temperature": 0.5})
    with pytest.raises(RequestError) as e:
        s.prepare_completion(completion(prompt=[1, 2, 3]))
    assert e.value.status == 503  # checked, then refused until the engine is ready
    engine.set_ready(max_model_len=64)
    model, ids, params, echo = s.prepare_completion(completion(prompt=[1, 2, 3]))
    assert (model, ids, echo) == ("main", [1, 2, 3], "")
    assert params.max_tokens == 61 and params.temperature == 0.5
    with pytest.raises(RequestError) as e:
        s.prepare_completion(completion(prompt=[1, 100]))
    assert (e.value.status, e.value.param) == (400, "prompt")
    with pytest.raises(RequestError) as e:
        s.prepare_completion(completion(prompt=[1, 2], max_tokens=63))
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


def test_generation_config_fields_become_defaults_requests_override(tmp_path):
    from hotstart.frontend.sampling import read_generation_config, sampling_defaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "min_p": 0.1,
                "max_new_tokens": 99,
                "eos_token_id": [1, 2],
                "typical_p": 0.5,
            }
        )
    )
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.05}
    assert read_generation_config(tmp_path) == want == sampling_defaults(tmp_path, "auto")
    assert sampling_defaults(tmp_path, "none") == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 5, "top_p": "x", "top_k": True})
    )
    assert read_generation_config(tmp_path) == {}  # out of range or not numbers: ignored
    assert read_generation_config(tmp_path / "missing") == {}
    engine = EngineHandle()
    engine.set_ready(max_model_len=64)
    s = serving(engine, vocab_size=100, sampling_defaults=want)
    _, _, p, _ = s.prepare_completion(completion(prompt=[1, 2, 3]))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.8, 20, 0.1, 1.05)
    _, _, p, _ = s.prepare_completion(completion(prompt=[1, 2, 3], temperature=0, top_k=-1, min_p=0,
                                                 repetition_penalty=1.0, top_p=1.0))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)


def test_sampling_params_carry_every_feature():
    engine = EngineHandle()
    engine.set_ready(max_model_len=64)
    s = serving(engine, vocab_size=100)
    s.tokenizer = type("Tok", (), {"encode": lambda self, text, add_special_tokens: [1, 2, 3]})()
    _, _, p, _ = s.prepare_completion(completion(
        prompt="hi", n=3, logprobs=2, echo=True, presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias={"7": -100, " 9": 2.5}, min_tokens=4, max_tokens=10, seed=1))
    assert (p.n, p.logprobs, p.prompt_logprobs, p.presence_penalty, p.frequency_penalty) == (
        3,
        2,
        2,
        0.5,
        -0.5,
    )
    assert p.logit_bias == {7: -100.0, 9: 2.5} and p.min_tokens == 4 and p.needs_sampler_state
    _, _, p, _ = s.prepare_completion(completion(prompt=[1, 2, 3], n=2))
    assert p.n == 2 and not p.needs_sampler_state and p.prompt_logprobs is None  # n alone: the plain path
    with pytest.raises(RequestError) as e:
        s.prepare_completion(completion(prompt=[1, 2, 3], n=5))  # more than the engine's max_num_seqs (4)
    assert e.value.param == "n"
    with pytest.raises(RequestError) as e:
        s.prepare_completion(completion(prompt=[1, 2], logit_bias={"100": 1}))
    assert e.value.param == "logit_bias"
