"""frontend/crashes.py: which requests become poison, the backoff's delays, what a death's log line says."""

from __future__ import annotations

import time

from hotstart.frontend.crashes import BACKOFF_MAX_S, MAX_DEATHS, WINDOW_S, CrashLog, fingerprint
from hotstart.sampling_params import SamplingParams

A = ([1, 2, 3], SamplingParams(max_tokens=8))
B = ([1, 2, 4], SamplingParams(max_tokens=8))


def test_in_flight_at_two_deaths_in_a_row_is_poison_and_only_then():
    log = CrashLog(5.0)
    t = time.monotonic()  # the supervisor's clock, which the refusals read
    line = log.record("engine process exited (code -11)", {"r1": A, "r2": B}, t)
    assert log.refusal(*A) is None and log.refusal(*B) is None  # one death proves nothing
    assert line.startswith("hotstart: engine death 1: 2 requests in flight: r1 [") and fingerprint(*A) in line
    line = log.record("engine process exited (code -11)", {"r3": A}, t + 1)  # A's retry, at the next death
    refused = log.refusal(*A)
    assert refused.status == 422 and refused.code == "poison_request"
    assert "2 engine deaths in a row" in refused.message and "code -11" in refused.message
    assert log.refusal(*B) is None  # not at the second death: its streak is broken
    assert log.refusal([1, 2, 3], SamplingParams(max_tokens=9)) is None  # other parameters, another request
    assert line.endswith(f"poison (in flight at 2+ deaths in a row, refused for 600 s): {fingerprint(*A)}")
    log.record("killed", {}, t + 2)
    log.record("killed", {"r4": B}, t + 3)
    assert log.refusal(*B) is None  # deaths with B in flight, but not in a row


def test_the_backoff_grows_while_the_loop_goes_on_and_resets_after_a_served_window():
    log = CrashLog(2.0)
    t = 1000.0
    for i in range(MAX_DEATHS):
        log.record("x", {}, t + i)
        assert not log.crash_loop()
    log.record("x", {}, t + MAX_DEATHS)
    assert log.crash_loop()
    assert log.backoff(t + MAX_DEATHS) == 2.0 and log.retry_after(t + MAX_DEATHS + 0.5) == 1.5
    log.backoff_until = None  # the engine starts again; it dies before serving a window: the loop goes on
    log.ready(t + 10)
    log.record("x", {}, t + 11)
    assert log.crash_loop() and log.backoff(t + 11) == 4.0
    for _ in range(10):
        log.backoff(t + 12)
    assert log.backoff(t + 13) == BACKOFF_MAX_S
    log.backoff_until = None
    log.ready(t + 20)
    log.record("x", {}, t + 20 + WINDOW_S)  # it served a whole window: one death is no loop
    assert not log.crash_loop() and log.backoff(t + 21 + WINDOW_S) == 2.0
