"""The order in which an engine's last words arrive (frontend/supervisor.py): an engine that cannot start
sends its reason (EngineFailed) on the output socket and then exits; the exit is told on the launcher's
socket, and the API may read it first. The real processes race (the many-models test saw both orders), so
here the supervisor is handed the two events in the unlucky order by a launcher that only queues them."""

from __future__ import annotations

import asyncio
import time

from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig
from hotstart.frontend import supervisor as sup
from hotstart.messages import EngineExited


class QueuedLauncher:
    """The few launcher members the death path reads; events are queued by the test."""

    generation, last_lost, use_forkserver = 0, "engine", False

    def __init__(self) -> None:
        self.events: list = []

    def poll_events(self) -> list:
        events, self.events = self.events, []
        return events


class Requests:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail_requests(self, message: str) -> None:
        self.failed.append(message)

    def in_flight(self) -> dict:
        return {}


def _supervisor() -> tuple[sup.EngineSupervisor, QueuedLauncher, list[str]]:
    launcher, told = QueuedLauncher(), []
    s = sup.EngineSupervisor(launcher, EngineConfig(model_path="unused"), Timeline(time.time()), Requests())
    s.on_fatal = told.append
    return s, launcher, told


def test_the_reason_read_after_the_exit_still_names_the_failure(monkeypatch):
    monkeypatch.setattr(sup, "EXIT_REASON_GRACE_S", 0.2)

    async def run() -> tuple[sup.EngineSupervisor, list[str]]:
        s, launcher, told = _supervisor()
        launcher.events.append(EngineExited(generation=0, rank=0, pid=1234, code=1))
        s.on_launcher_event()
        assert s.fatal is None  # not yet: the reason may be on its way
        await asyncio.sleep(0.05)
        s.fail("could not load the model: NoSuchModel is not a known architecture")  # EngineFailed
        await asyncio.sleep(0.4)  # past the grace: the exit's own message does not replace it
        return s, told

    s, told = asyncio.run(run())
    assert told == ["could not load the model: NoSuchModel is not a known architecture"]
    assert s.fatal == told[0] and s.status.startswith("failed: could not load")


def test_an_exit_without_a_reason_fails_after_the_grace(monkeypatch):
    monkeypatch.setattr(sup, "EXIT_REASON_GRACE_S", 0.2)

    async def run() -> list[str]:
        s, launcher, told = _supervisor()
        launcher.events.append(EngineExited(generation=0, rank=0, pid=1234, code=-9))
        s.on_launcher_event()
        await asyncio.sleep(0.4)
        return told

    told = asyncio.run(run())
    assert len(told) == 1 and told[0].startswith("engine process exited (code -9)")
