"""Several models in one `hotstart serve`, end to end: real random-weight models, real engines forked on
demand from the one forkserver, the openai client (issue 24)."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from helpers.procs import no_torch_in
from helpers.server import Server, Stream, deploy_metric_names, serving
from openai import APIStatusError, NotFoundError, OpenAI

KEY = "test-key"
ENGINE = ["--max-model-len", "128", "--max-num-seqs", "4", "--dtype", "float32", "--zygote", "off"]
PROMPT = "The quick brown fox"


def make_model(out, seed: int):
    cmd = [sys.executable, "-m", "hotstart", "make-model", "--family", "qwen2", "--size", "tiny", "--dtype",
           "float32", "--seed", str(seed), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for i in (1, 2, 3):
        make_model(root / f"m{i}", seed=i)
    bad = make_model(root / "bad", seed=4)
    (bad / "config.json").write_text('{"architectures": ["NoSuchModel"], "model_type": "nope"}')
    return root


@pytest.fixture(scope="module")
def one_slot(model_dir):
    """m1, m2, m3 and a broken model; one engine at a time, kept loaded; an API key; 1 waiting request; room
    for a stream long enough to keep a model busy (test_waiting_bound...)."""
    engine = [*ENGINE[:1], "1024", *ENGINE[2:]]  # --max-model-len
    yield from serving("--model-dir", str(model_dir), "--max-loaded-models", "1", "--keep-alive", "-1",
                       "--max-waiting-requests", "1", "--api-key", KEY, *engine)


@pytest.fixture(scope="module")
def two_slots(model_dir):
    yield from serving(*(f"m{i}={model_dir / f'm{i}'}" for i in (1, 2, 3)), "--max-loaded-models", "2",
                       "--keep-alive", "-1", "--preload", "m3", *ENGINE)


def client(server: Server, key: str = KEY) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def answer(c: OpenAI, model: str, **extra) -> str:
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                             extra_body=extra or None)
    return r.choices[0].text


def states(server: Server, key: str = KEY) -> dict[str, str]:
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m["state"] for m in r.json()["data"]}


def engines(server: Server) -> list[psutil.Process]:
    """The engine processes: children of the server's forkserver."""
    return [e for fs in psutil.Process(server.proc.pid).children() for e in fs.children()]


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_nothing_loads_until_asked_and_each_answers_as_alone(one_slot, model_dir):
    assert states(one_slot) == {"bad": "unloaded", "m1": "unloaded", "m2": "unloaded", "m3": "unloaded"}
    assert engines(one_slot) == []
    c = client(one_slot)
    together = {m: answer(c, m) for m in ("m1", "m2")}
    assert together["m1"] != together["m2"]
    for m in ("m1", "m2"):
        alone = Server(str(model_dir / m), *ENGINE)
        try:
            assert answer(client(alone, "unused"), m) == together[m]
        finally:
            alone.stop()


def test_eviction_with_one_slot(one_slot):
    c = client(one_slot)
    answer(c, "m1")
    assert states(one_slot)["m1"] == "loaded"
    answer(c, "m2")
    s = states(one_slot)
    assert (s["m1"], s["m2"]) == ("unloaded", "loaded")
    assert len(engines(one_slot)) == 1


def test_broken_model_beside_good_ones(one_slot):
    c = client(one_slot)
    with pytest.raises(APIStatusError) as e:
        answer(c, "bad")
    assert e.value.status_code == 503
    err = e.value.body
    assert err["code"] == "model_load_failed" and "bad" in err["message"] and "NoSuchModel" in err["message"]
    t = time.monotonic()
    with pytest.raises(APIStatusError):  # within the backoff: answered at once, no new engine
        answer(c, "bad")
    assert time.monotonic() - t < 1.0
    assert answer(c, "m1")  # the others serve
    r = httpx.get(one_slot.url + "/v1/models/bad", headers={"Authorization": f"Bearer {KEY}"})
    assert r.json()["state"] == "failed" and "NoSuchModel" in r.json()["error"]


@pytest.mark.parametrize("name", ["../m1", "/etc", "m1/../m2", "./m1", "M1"])
def test_path_like_or_unknown_names_are_404(one_slot, model_dir, name):
    with pytest.raises(NotFoundError) as e:
        answer(client(one_slot), name)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(NotFoundError):
        answer(client(one_slot), str(model_dir / "m1"))


def test_waiting_bound_answers_503_with_retry_after(one_slot):
    auth = {"Authorization": f"Bearer {KEY}"}
    answer(client(one_slot), "m1")
    # m1 busy with a stream until this test hangs up: m2's load waits for room (one slot), and so does the one
    # request the bound (1) lets wait; three more are turned away, however loaded the machine
    hang_up, streamed = threading.Event(), []
    long = {"model": "m1", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}

    def hold_m1() -> None:
        with httpx.stream("POST", one_slot.url + "/v1/completions", json=long, headers=auth, timeout=60) as r:
            for line in r.iter_lines():
                streamed.append(line)
                if hang_up.is_set():
                    return

    def post():
        body = {"model": "m2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        return httpx.post(one_slot.url + "/v1/completions", json=body, headers=auth, timeout=120)

    def card(name: str) -> dict:
        return httpx.get(f"{one_slot.url}/v1/models/{name}", headers=auth, timeout=30).json()

    holder = threading.Thread(target=hold_m1, daemon=True)
    holder.start()
    with cf.ThreadPoolExecutor(4) as pool:
        try:
            wait_for(lambda: len(streamed) >= 3)
            first = pool.submit(post)
            wait_for(lambda: card("m2")["waiting"] == 1)
            assert card("m1")["state"] == "loaded" and card("m2")["state"] == "unloaded"
            busy = [f.result() for f in [pool.submit(post) for _ in range(3)]]
            assert holder.is_alive(), "m1's stream ended before the burst: it no longer keeps m2 waiting"
        finally:
            hang_up.set()
        assert first.result().status_code == 200, first.result().text  # m2 loaded once m1's stream ended
    holder.join(30)
    assert [r.status_code for r in busy] == [503] * 3, [r.text for r in busy]
    assert all(r.json()["error"]["code"] == "too_many_waiting" and int(r.headers["Retry-After"]) >= 1
               for r in busy), [r.text for r in busy]
    assert card("m2")["waiting"] == 0


def test_load_and_unload_endpoints_need_the_key(one_slot):
    url = one_slot.url + "/v1/models/m3"
    assert httpx.post(url + "/load", timeout=30).status_code == 401
    assert httpx.get(one_slot.url + "/health").status_code == 200  # open, no --preload to wait for
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/load", headers=auth, json={}, timeout=120)
    assert r.status_code == 200 and r.json()["state"] == "loaded" and r.json()["loaded_at"]
    r = httpx.post(url + "/unload", headers=auth, json={}, timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    assert httpx.post(one_slot.url + "/v1/models/nope/load", headers=auth, json={}).status_code == 404


def test_killed_engine_is_replaced_and_others_serve(one_slot):
    c = client(one_slot)
    before = answer(c, "m1")
    found = engines(one_slot)
    assert len(found) == 1, (states(one_slot), [(e.pid, e.status(), e.create_time()) for e in found])
    [engine] = found
    engine.kill()
    engine.wait(10)
    time.sleep(0.5)  # the supervisor polls the launcher every 0.1 s
    assert answer(c, "m1") == before  # replaced (a new generation), same answer
    assert answer(c, "m2")


def test_metrics_and_startup_per_model(one_slot):
    answer(client(one_slot), "m1")
    auth = {"Authorization": f"Bearer {KEY}"}
    text = httpx.get(one_slot.url + "/metrics", headers=auth).text
    assert 'hotstart_model_state{model="m1",state="loaded"} 1.0' in text
    assert 'model="m1"' in text and "hotstart_generation_tokens" in text
    body = httpx.get(one_slot.url + "/startup", headers=auth).json()
    assert body["models"]["m1"]["state"] == "loaded" and set(body["models"]) == {"bad", "m1", "m2", "m3"}


def test_lru_eviction_with_two_slots(two_slots):
    c = client(two_slots, "unused")
    assert states(two_slots, "unused")["m3"] == "loaded"  # --preload; /health waited for it
    answer(c, "m1")  # m3, m1 loaded
    answer(c, "m3")  # m1 is now the least recently used
    answer(c, "m2")
    s = states(two_slots, "unused")
    assert (s["m1"], s["m2"], s["m3"]) == ("unloaded", "loaded", "loaded")
    assert len(engines(two_slots)) == 2
    # engines that may run side by side yield idle OpenMP threads at once (forkserver/runtime.py)
    assert {e.environ().get("GOMP_SPINCOUNT") for e in engines(two_slots)} == {"2000"}


def test_one_engine_at_a_time_keeps_the_default_spin(one_slot):
    answer(client(one_slot), "m1")
    assert [e.environ().get("GOMP_SPINCOUNT") for e in engines(one_slot)] == [None]


def test_request_keep_alive(two_slots):
    c = client(two_slots, "unused")
    answer(c, "m1", keep_alive=0)
    wait_for(lambda: states(two_slots, "unused")["m1"] == "unloaded", 15)
    answer(c, "m1", keep_alive="1s")
    r = httpx.get(two_slots.url + "/v1/models/m1").json()
    assert r["state"] == "loaded" and r["keep_alive_until"] <= time.time() + 3
    wait_for(lambda: states(two_slots, "unused")["m1"] == "unloaded", 15)
    with pytest.raises(APIStatusError) as e:
        answer(c, "m1", keep_alive="soon")
    assert e.value.status_code == 400 and e.value.body["param"] == "keep_alive"


def test_sigterm_leaves_no_engine(two_slots):
    c = client(two_slots, "unused")
    answer(c, "m1")
    answer(c, "m2")
    pids = [e.pid for e in engines(two_slots)]
    assert len(pids) == 2
    two_slots.stop()  # fails if anything of the server is left after it exits
    assert not [p for p in pids if psutil.pid_exists(p)]


# the tiny model of `mixed` renders chats with its own template, so its ids differ from the default model's
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def mixed(default_model_dir, tmp_path_factory):
    """The default model (`smol`) and a tiny one with another chat template (`tiny`), no API key."""
    tiny = make_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=5)
    (tiny / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    yield from serving(f"smol={default_model_dir}", f"tiny={tiny}", "--keep-alive", "-1",
                       "--shutdown-timeout", "150", *ENGINE)


def test_tokenize_answers_with_the_named_models_tokenizer(mixed):
    def post(path: str, **body) -> httpx.Response:
        return httpx.post(mixed.url + path, json=body, timeout=120)

    tiny = post("/tokenize", model="tiny", messages=HI).json()
    plain = post("/tokenize", model="tiny", prompt="user: Hi\nassistant:", add_special_tokens=False).json()
    assert tiny["tokens"] == plain["tokens"] and tiny["max_model_len"] == 128
    smol = post("/tokenize", model="smol", messages=HI).json()
    assert smol["tokens"] != tiny["tokens"]
    assert post("/detokenize", model="tiny", tokens=tiny["tokens"]).json()["prompt"] == "user: Hi\nassistant:"
    assert "named SmolLM" in post("/detokenize", model="smol", tokens=smol["tokens"]).json()["prompt"]
    r = post("/tokenize", model="nope", prompt="x")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post("/detokenize", tokens=[1])
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_responses_answer_with_the_named_model_and_one_store(mixed):
    c = client(mixed, "unused")
    texts = {}
    for m in ("smol", "tiny"):
        r = c.responses.create(model=m, input="Hi", max_output_tokens=6, temperature=0)
        chat = c.chat.completions.create(model=m, messages=HI, max_tokens=6, temperature=0)
        assert r.model == m and r.output_text == chat.choices[0].message.content
        texts[m] = r
    assert texts["smol"].output_text != texts["tiny"].output_text
    said = {"role": "assistant", "content": texts["tiny"].output_text}
    turn = [*HI, said, {"role": "user", "content": "Go"}]
    follow = c.responses.create(model="tiny", input="Go", previous_response_id=texts["tiny"].id,
                                max_output_tokens=2, temperature=0)
    count = httpx.post(mixed.url + "/tokenize", json={"model": "tiny", "messages": turn}).json()["count"]
    assert follow.usage.input_tokens == count  # the stored conversation was continued
    # one store for the server: another model may continue it (as OpenAI lets a follow-up change `model`)
    other = c.responses.create(model="smol", input="Go", previous_response_id=texts["tiny"].id,
                               max_output_tokens=2, temperature=0)
    count = httpx.post(mixed.url + "/tokenize", json={"model": "smol", "messages": turn}).json()["count"]
    assert other.usage.input_tokens == count
    events = [e.type for e in c.responses.create(model="tiny", input="Hi", max_output_tokens=4, stream=True)]
    assert events[-1] in ("response.completed", "response.incomplete")
    r = httpx.post(mixed.url + "/v1/models/tiny/unload", json={}, timeout=30)  # 200: the lease has ended
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    with pytest.raises(NotFoundError):
        c.responses.create(model="nope", input="Hi")


def test_live_and_vllm_metrics_per_model(mixed):
    c = client(mixed, "unused")
    for m in ("smol", "tiny"):
        answer(c, m)
    assert httpx.get(mixed.url + "/live").json() == {"status": "alive"}
    text = httpx.get(mixed.url + "/metrics").text
    for m in ("smol", "tiny"):
        assert f'vllm:generation_tokens_total{{model_name="{m}"}}' in text
        assert f'vllm:num_requests_running{{model_name="{m}"}}' in text
        assert f'hotstart_model_state{{model="{m}",state="loaded"}} 1.0' in text
    names = {x.split("{")[0].split(" ")[0] for x in text.splitlines() if x and not x.startswith("#")}
    vllm = {n for n in deploy_metric_names() if n.startswith("vllm:")}
    assert vllm <= names, vllm - names
    assert "hotstart_draining 0.0" in text


def test_sigterm_drains_the_streams_of_every_model(mixed):
    body = {"model": "smol", "max_tokens": 24, "ignore_eos": True, "stream": True, "temperature": 0,
            "messages": HI}
    stream = Stream(mixed.url, body)
    stream.start()
    assert stream.started.wait(60), "the stream did not start"
    assert stream.is_alive(), "the stream ended before SIGTERM: make it longer"
    pids = [e.pid for e in engines(mixed)]
    stop: dict = {}
    stopper = threading.Thread(target=lambda: stop.update(s=mixed.stop(timeout=150)), daemon=True)
    stopper.start()
    with httpx.Client(timeout=5) as h:
        wait_for(lambda: h.get(mixed.url + "/health").status_code == 503, 5)
        r = h.post(mixed.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
        assert r.headers["retry-after"]
        assert h.get(mixed.url + "/live").status_code == 200
    stream.join(150)
    stopper.join(160)
    assert stream.error is None and stream.lines[-1] == "data: [DONE]", (stream.error, stream.lines[-3:])
    events = stream.events()
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "s" in stop and mixed.proc.returncode == 0
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_the_many_models_modules_do_not_import_torch():
    for module in ("hotstart.server.multi_launch", "hotstart.server.multi_api", "hotstart.frontend.router",
                   "hotstart.frontend.shared_launcher", "hotstart.frontend.model_specs",
                   "hotstart.frontend.keep_warm", "hotstart.model.kv_files"):
        ok, heavy = no_torch_in(module)
        assert ok, f"{module} imported {heavy}"
