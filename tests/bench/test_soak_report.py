"""`hotstart bench soak`'s report and checks without a server (fast tier): percentiles per window, fault
windows and recovery, RSS / descriptor growth from the first window, the goals, and the request kinds'
bodies and answer checks (hotstart/bench/soak_workload.py, soak_checks.py, soak_report.py)."""

from __future__ import annotations

import random

import pytest

from hotstart.bench import soak_checks as checks
from hotstart.bench import soak_report as sr
from hotstart.bench import soak_workload as workload
from hotstart.errors import HotstartError


def rec(t0, t1, outcome="ok", kind="chat", model="a", ttft=None):
    return {
        "kind": kind,
        "variant": "",
        "model": model,
        "t0": t0,
        "t1": t1,
        "ttft": ttft,
        "status": 200,
        "outcome": outcome,
        "error": None if outcome in ("ok", "hangup") else outcome,
    }


def sample(t, procs, kv=None):
    return {
        "t": t,
        "procs": {pid: {"role": role, "rss_mb": rss, "fds": fds} for pid, (role, rss, fds) in procs.items()},
        "kv": kv or {},
    }


def test_window_percentiles_counts_and_the_last_window_takes_the_tail():
    # 100 good requests ending in window 0 with totals 0.01 .. 1.00 s, TTFT half of it
    records = [rec(0.0, i / 100, ttft=i / 200, kind="chat_stream") for i in range(1, 101)]
    records += [rec(5.0, 6.0, outcome="5xx"), rec(9.0, 25.0, kind="text")]  # the last ends after the run
    samples = [
        sample(1.0, {1: ("api", 100.0, 10)}, {"a": 0.25}),
        sample(4.0, {1: ("api", 101.0, 11)}, {"a": 0.5}),
        sample(12.0, {1: ("api", 102.0, 9)}, {"a": 0.0}),
    ]
    w = sr.windows(records, samples, [], 5.0, 10.0)
    assert [(x["t0"], x["t1"], x["requests"], x["ok"]) for x in w] == [(0, 5.0, 100, 100), (5.0, 10.0, 2, 1)]
    assert w[0]["total"] == {"p50": 0.505, "p90": 0.9, "p99": 0.99}
    assert w[0]["ttft"] == {"p50": 0.2525, "p90": 0.45, "p99": 0.495}
    assert w[0]["kinds"] == {"chat_stream": 100} and w[1]["kinds"] == {"chat": 1, "text": 1}
    assert w[1]["errors"]["outside"]["5xx"] == 1 and w[1]["ttft"]["p50"] is None
    assert w[0]["kv_usage_max"] == {"a": 0.5} and (w[0]["rss_mb"], w[0]["fds"]) == (101.0, 11)
    assert (w[1]["rss_mb"], w[1]["fds"]) == (102.0, 9)  # the end sample, after the run, is the last window's


def test_kill_recovery_is_the_first_answer_of_the_model_it_hit():
    records = [
        rec(0.0, 10.5, outcome="failed", model="a"),  # in flight on the killed engine: cut
        rec(10.2, 10.3, outcome="5xx", model="a"),  # replacement not ready
        rec(10.4, 11.0, model="b"),  # another model, untouched
        rec(10.6, 12.0, model="a"),  # the recovery
        rec(12.0, 13.0, model="a"),
        rec(20.0, 21.0, outcome="5xx", model="a"),  # long after: outside the window
    ]
    [f] = sr.recovery([{"t": 10.0, "kind": "kill", "pid": 7}], records, grace=2.0, end=30.0)
    assert f["models_hit"] == ["a"] and f["recovered_at"] == 12.0 and f["recovery_s"] == 2.0
    assert f["until"] == 14.0 and f["errors"] == 2 and f["hung"] == 0
    t = sr.totals(records, [f])
    assert t["errors"]["during_faults"] == {"5xx": 1, "failed": 1, "not_4xx": 0, "hung": 0}
    assert t["errors"]["outside"] == {"5xx": 1, "failed": 0, "not_4xx": 0, "hung": 0}
    assert t["good_ok"] == 3 and t["by_kind"]["chat"]["ok"] == 3


def test_a_freeze_recovers_when_the_stalled_model_answers_and_unrecovered_faults_say_so():
    records = [
        rec(9.0, 40.5, model="a"),
        rec(9.5, 10.5, model="b"),
        rec(11.0, 12.0, model="b"),
        rec(12.0, 41.0, model="a"),
    ]
    [f] = sr.recovery([{"t": 10.0, "kind": "freeze", "pid": 7}], records, grace=1.0, end=60.0)
    assert f["models_hit"] == ["a", "b"] and f["recovery_s"] == 31.0  # a's first answer after it
    [g] = sr.recovery([{"t": 10.0, "kind": "kill", "pid": 7}], [rec(9.0, 10.2, outcome="failed")], 1.0, 60.0)
    assert g["recovery_s"] is None and g["until"] == 60.0


def test_growth_from_each_process_first_window():
    samples = [
        sample(0.0, {1: ("api", 100.0, 20), 2: ("engine", 500.0, 12)}),
        sample(10.0, {1: ("api", 110.0, 30), 2: ("engine", 600.0, 13)}),  # base: first window is 10 s
        sample(15.0, {1: ("api", 112.0, 31), 3: ("engine", 300.0, 12)}),  # 2 killed, 3 replaces it
        sample(26.0, {1: ("api", 121.0, 29), 3: ("engine", 320.0, 24), 4: ("engine child", 50.0, 3)}),
        sample(31.0, {1: ("api", 121.0, 29), 3: ("engine", 352.0, 13), 4: ("engine child", 50.0, 3)}),
    ]
    g = sr.growth(samples, 10.0)
    assert g["1"] == {
        "role": "api",
        "first_seen": 0.0,
        "gone": False,
        "rss_max": 121.0,
        "fds_max": 31,
        "rss_end": 121.0,
        "fds_end": 29,
        "checked": True,
        "base_t": 10.0,
        "rss_base": 110.0,
        "fds_base": 30,
        "rss_growth_pct": 10.0,
        "fds_growth": -1,
    }
    assert g["2"]["gone"] and not g["2"]["checked"]  # its base would be its last sample
    # the replacement's base is a window after its birth
    assert (g["3"]["base_t"], g["3"]["rss_growth_pct"], g["3"]["fds_growth"]) == (26.0, 10.0, -11)
    assert not g["4"]["checked"] and g["4"]["first_seen"] == 26.0  # lived < a window


def _result(records, samples, faults, width=10.0, end=30.0):
    faults = sr.recovery(faults, records, 1.0, end)
    return {
        "clients": 2,
        "duration": end,
        "models": ["a"],
        "totals": sr.totals(records, faults),
        "faults": faults,
        "windows": sr.windows(records, samples, faults, width, end),
        "processes": sr.growth(samples, width),
        "server_alive": True,
        "left_stopped": [],
    }


def test_goals_pass_clean_and_name_each_failure():
    procs = {1: ("api", 100.0, 20)}
    clean = _result(
        [rec(1.0, 2.0), rec(3.0, 4.0, kind="bad")],
        [sample(0, procs), sample(10, procs), sample(31, procs)],
        [],
    )
    assert sr.goals(clean, 15.0, 8) == []
    assert "api 1" in sr.table(clean) and "errors outside faults: 5xx 0" in sr.table(clean)

    grown = {1: ("api", 120.0, 30)}
    records = [
        rec(1.0, 2.0),
        rec(3.0, 4.0, outcome="5xx"),
        rec(4.0, 5.0, outcome="failed"),
        rec(5.0, 6.0, outcome="not_4xx", kind="bad"),
        rec(6.0, 26.0, outcome="hung"),
    ]
    bad = _result(
        records,
        [sample(0, procs), sample(10, procs), sample(31, grown)],
        [{"t": 20.0, "kind": "kill", "pid": 9}],
    )
    bad["server_alive"], bad["left_stopped"] = False, [9]
    why = sr.goals(bad, 15.0, 8)
    assert why == [
        "1 5xx answers outside fault windows",
        "1 failed good requests outside fault windows",
        "1 bad requests not answered 4xx outside fault windows",
        "1 requests hung (no answer within the request timeout)",
        "RSS of api (pid 1) grew 20.0 % (100.0 -> 120.0 MB; limit 15 %)",
        "descriptors of api (pid 1) grew by 10 (20 -> 30; slack 8)",
        "kill of pid 9 at 20.0 s: never recovered",
        "the server died",
        "processes found stopped at the end (resumed): [9]",
    ]
    assert (
        sr.goals(_result([rec(1, 2, outcome="failed")], [], []), 15.0, 8)[-1] == "no good request succeeded"
    )


def test_deck_sends_every_kind_within_one_deck():
    mix = workload.parse_mix(
        "chat=2,chat_stream=3,text=1,text_stream=2,n=1,json_schema=1,tools=1,hangup=1,bad=1"
    )
    deck = workload.Deck(mix, random.Random(0))
    first = [deck.draw() for _ in range(13)]
    assert sorted(set(first)) == sorted(workload.KINDS) and first.count("chat_stream") == 3
    assert workload.parse_mix("bad") == {"bad": 1}
    for spec, msg in (("chat=x", "must be an integer"), ("nope=1", "unknown kind"), ("chat=0", "no kind")):
        with pytest.raises(HotstartError, match=msg):
            workload.parse_mix(spec)


def test_request_bodies_of_each_kind():
    rng = random.Random(1)
    reqs = {k: workload.make_request(k, "m", rng, 4, 8) for k in workload.KINDS}
    assert reqs["chat_stream"].stream and reqs["chat_stream"].body["stream_options"] == {
        "include_usage": True
    }
    assert reqs["hangup"].stream and 1 <= reqs["hangup"].extra["after"] <= 4
    assert reqs["text"].path == workload.TEXT and "prompt" in reqs["text"].body
    assert reqs["n"].body["n"] == 2 and reqs["tools"].body["tool_choice"]["function"]["name"] == "get_weather"
    assert reqs["json_schema"].body["response_format"]["json_schema"]["schema"] == workload.COLOR_SCHEMA
    bad = [workload.make_request("bad", "m", rng, 4, 8, i) for i in range(len(workload.BAD_VARIANTS))]
    assert [r.variant for r in bad] == list(workload.BAD_VARIANTS) and bad[0].raw.startswith(b'{"model": "m"')
    assert len(set(workload.BAD_VARIANTS)) == 7


def _answer(content=None, finish="stop", n=1, tool_calls=None, text=None):
    msg = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
    choice = {"text": text} if text is not None else {"message": msg}
    return {
        "choices": [{"index": i, "finish_reason": finish, **choice} for i in range(n)],
        "usage": {"completion_tokens": 3},
    }


def test_answer_checks():
    rng = random.Random(0)
    js, tools, n = (workload.make_request(k, "m", rng, 4, 8) for k in ("json_schema", "tools", "n"))
    assert checks.answer_problem(js, 200, _answer('{"color": "red"}')) is None
    assert "not of the schema" in checks.answer_problem(js, 200, _answer('{"color": "pink"}'))
    assert "not JSON" in checks.answer_problem(js, 200, _answer('{"color": "re'))
    cut = _answer('{"color": "re', finish="length")
    assert checks.answer_problem(js, 200, cut) is None  # cut: shape only
    call = [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}
    ]
    assert checks.answer_problem(tools, 200, _answer(tool_calls=call, finish="tool_calls")) is None
    assert "without a call" in checks.answer_problem(tools, 200, _answer("hello"))
    assert checks.answer_problem(n, 200, _answer("x", n=2)) is None
    assert "expected 2 choices" in checks.answer_problem(n, 200, _answer("x"))
    text = workload.make_request("text", "m", rng, 4, 8)
    assert checks.answer_problem(text, 200, _answer(text="ok")) is None
    assert checks.answer_problem(text, 503, {"error": {}}).startswith("HTTP 503")
    assert checks.bad_problem(400, {"error": {"message": "m"}}) is None
    assert "expected 4xx" in checks.bad_problem(200, _answer("x"))
    assert "error object" in checks.bad_problem(422, {"detail": "x"})


@pytest.mark.parametrize(
    "kind,status,error,outcome",
    [
        ("chat", 200, None, "ok"),
        ("hangup", 200, None, "hangup"),
        ("chat", 503, "HTTP 503", "5xx"),
        ("chat", 200, "error event", "failed"),
        ("chat", None, "ConnectError", "failed"),
        ("chat", None, "timeout after 5 s", "hung"),
        ("bad", 400, None, "ok"),
        ("bad", 200, "HTTP 200", "not_4xx"),
        ("bad", 500, "HTTP 500", "5xx"),
        ("bad", 422, "no error object", "failed"),
    ],
)
def test_classify(kind, status, error, outcome):
    assert checks.classify(kind, status, error) == outcome
