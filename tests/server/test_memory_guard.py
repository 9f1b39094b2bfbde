"""Memory pressure (frontend/memory.py) on this machine's real /proc/meminfo: the flag's amounts, the guard's
admission and 503, the SIGKILL explanation. The e2e test is tests/server/test_pressure_e2e.py."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

import pytest

from hotstart.flags import memory_amount
from hotstart.frontend import memory
from hotstart.frontend.memory import MemoryGuard, Sampler, exit_cause, mem_total, min_free_bytes
from hotstart.system import available_memory


def test_amounts_of_the_flag():
    gib = 1 << 30
    assert min_free_bytes("512M") == 512 << 20
    assert min_free_bytes("1.5GiB") == int(1.5 * gib)
    assert min_free_bytes("2g") == 2 * gib
    assert min_free_bytes("4096") == 4096
    assert min_free_bytes("0") == 0
    assert min_free_bytes("10%", total=20 * gib) == 2 * gib
    assert min_free_bytes("auto", total=8 * gib) == int(0.05 * 8 * gib)  # 5% ...
    assert min_free_bytes("auto", total=1024 * gib) == gib  # ... at most 1 GiB
    assert min_free_bytes("auto") == min(int(0.05 * mem_total()), gib)  # this machine's
    for bad in ("lots", "101%", "-5M", "5 %x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_amount(bad)
    assert memory.memory_guard("0") is None


def test_the_guard_refuses_with_retry_after_when_the_threshold_is_above_what_is_free():
    total = mem_total()
    guard = MemoryGuard(total + 1, Sampler(), wait_s=0.3)  # never met: available <= total
    t = time.monotonic()
    err = asyncio.run(guard.admit())
    assert time.monotonic() - t >= 0.3  # it waited for memory first
    assert err.status == 503 and err.retry_after == memory.RETRY_AFTER_S
    assert err.code == "insufficient_memory" and "--min-free-memory" in err.message
    assert guard.refused == 1
    assert asyncio.run(MemoryGuard(1 << 20, Sampler()).admit()) is None  # 1 MiB free: admitted at once


def test_the_sampler_reads_meminfo_at_most_every_half_second():
    reads = []

    def read():
        reads.append(1)
        return available_memory()

    s = Sampler(read, every=0.5)
    for _ in range(100):
        assert s.available() > 0
    assert len(reads) == 1 and s.last[0] > 0


def test_a_sigkill_is_explained_and_other_exits_are_not():
    memory.prime()
    assert exit_cause(1, 123) == "" and exit_cause(-signal.SIGTERM, 123) == "" and exit_cause(None) == ""
    why = exit_cause(-signal.SIGKILL, 2**22 + 17)  # no such pid in the kernel's log
    assert "OOM killer" in why
    if "kernel:" not in why and "oom_kill count" not in why:
        assert why.startswith(": killed by SIGKILL (possibly the OOM killer: available memory was ")
