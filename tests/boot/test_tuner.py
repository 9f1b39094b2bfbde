"""The prefetch thread tuner (hotstart/boot/tuner.py) against simulated disks: it climbs while more
threads read faster, stays where they do not, ignores loader-bound intervals, and keeps to its start
count while the imports page in."""

from __future__ import annotations

from hotstart.boot.tuner import ThreadTuner

GB = 1e9


def run(tuner: ThreadTuner, rate_of, seconds: float, waited=lambda t: False, importing=lambda t: False,
        step: float = 0.05) -> list[int]:
    """Drive TUNER for SECONDS of simulated time; RATE_OF(threads) is the disk's GB/s. -> threads per step."""
    t, done, seen = 0.0, 0.0, []
    threads = tuner.observe(t, 0, False, False)
    while t < seconds:
        t += step
        done += rate_of(threads) * GB * step
        threads = tuner.observe(t, int(done), waited(t), importing(t))
        seen.append(threads)
    return seen


def test_climbs_while_more_threads_read_faster_and_stops_where_they_do_not():
    tuner = ThreadTuner(start=2, most=8)
    seen = run(tuner, lambda n: min(n, 4) * 0.45, 8.0)  # 0.9 GB/s at 2 threads, 1.8 at 4 and more
    assert max(seen) <= 6  # probes one past the knee at most: five is never better than four
    assert tuner.best_threads == 4 and seen[-1] in (4, 5)
    assert sum(1 for n in seen[len(seen) // 2:] if n == 4) > len(seen) // 4  # it spends its time at 4


def test_a_disk_saturated_by_two_threads_keeps_two():
    tuner = ThreadTuner(start=2, most=8)
    seen = run(tuner, lambda n: 1.3, 8.0)
    assert tuner.best_threads == 2 and seen.count(2) > 0.7 * len(seen)
    assert max(seen) == 3  # a probe now and then, never further


def test_more_threads_that_read_slower_are_given_back():
    tuner = ThreadTuner(start=2, most=8)
    seen = run(tuner, lambda n: {2: 1.5, 3: 1.1}.get(n, 0.8), 8.0)  # contention: more is worse
    assert tuner.best_threads == 2 and seen[-1] in (2, 3) and max(seen) == 3


def test_loader_bound_intervals_and_imports_do_not_count():
    tuner = ThreadTuner(start=2, most=8)
    seen = run(tuner, lambda n: n * 0.5, 3.0, waited=lambda t: True)
    assert set(seen) == {2}  # waiting for the loader: the disk's rate is unknown, nothing changes
    tuner = ThreadTuner(start=2, most=8)
    seen = run(tuner, lambda n: n * 0.5, 6.0, importing=lambda t: t < 3.0)
    assert max(seen[: int(3.0 / 0.05) - 1]) == 2 and max(seen) > 2  # capped while importing, then climbs


def test_a_fixed_count_never_moves():
    tuner = ThreadTuner(start=3, most=3)
    assert set(run(tuner, lambda n: n * 0.5, 4.0)) == {3} and not tuner.adaptive and not tuner.trace
