"""Several engines over one forkserver connection: generations unique across models, events routed to
the model whose engine they name (frontend/shared_launcher.py; a fake launcher, no process)."""

from __future__ import annotations

from hotstart.config import EngineConfig
from hotstart.frontend.shared_launcher import SharedLauncher
from hotstart.messages import EngineExited, EngineSpawned, ForkserverExited, Span, SpawnEngine, StopEngine


class FakeLauncher:
    ipc_dir, zygote_pid, last_lost = "/tmp/x", None, "forkserver"

    def __init__(self) -> None:
        self.sent, self.events, self.restarts, self.open = [], [], 0, True

    def send(self, msg) -> bool:
        self.sent.append(msg)
        return True

    def poll_events(self, all_generations: bool = False) -> list:
        assert all_generations
        events, self.events = self.events, []
        return events

    def fileno(self):
        return 3 if self.open else None

    def restart_server(self) -> None:
        self.restarts, self.open = self.restarts + 1, True


def spawned(gen: int, pid: int) -> EngineSpawned:
    return EngineSpawned(gen, 0, pid, Span("engine forked", 0.0, 0.0, "forkserver"))


def test_events_go_to_the_engine_they_name():
    real = FakeLauncher()
    shared = SharedLauncher(real)
    a, b = shared.view(), shared.view()
    a.spawn(EngineConfig("/m/a"))
    b.spawn(EngineConfig("/m/b"))
    assert [(m.generation, m.config.model_path) for m in real.sent] == [(1, "/m/a"), (2, "/m/b")]
    assert a.addresses() != b.addresses() and isinstance(real.sent[0], SpawnEngine)
    real.events = [spawned(1, 101), spawned(2, 202)]
    assert a.poll_events() == [spawned(1, 101)] and a.engine_pids == {0: 101}
    assert b.poll_events() == [spawned(2, 202)] and b.engine_pids == {0: 202}
    real.events = [EngineExited(1, 0, 101, -9)]
    assert b.poll_events() == [] and len(a.poll_events()) == 1 and a.engine_pids == {}
    a.spawn(EngineConfig("/m/a"), new_generation=True)  # the replacement: a new number
    assert a.generation == 3
    real.events = [EngineExited(1, 0, 101, 0), spawned(3, 303)]  # the old generation's news is dropped
    assert a.poll_events() == [spawned(3, 303)]
    b.stop_engine()
    assert real.sent[-1] == StopEngine(2)


def test_a_dead_forkserver_is_restarted_once():
    real = FakeLauncher()
    shared = SharedLauncher(real)
    a, b = shared.view(), shared.view()
    real.events, real.open = [ForkserverExited(None)], False
    assert a.poll_events() == [ForkserverExited(None)] and b.poll_events() == [ForkserverExited(None)]
    a.restart_server()
    b.restart_server()
    assert real.restarts == 1


def test_a_forkserver_dead_while_nothing_was_loaded_is_restarted_by_the_next_load():
    real = FakeLauncher()
    shared = SharedLauncher(real)
    real.events, real.open = [ForkserverExited(None)], False
    a = shared.view()
    a.spawn(EngineConfig("/m/a"))
    assert real.restarts == 1 and isinstance(real.sent[-1], SpawnEngine)
    assert a.poll_events() == []  # not reported as the new engine's death
    a.shutdown(0.1)
    assert a not in shared._all and real.sent[-1] == StopEngine(a.generation)


def test_an_engine_killed_at_shutdown_takes_its_children_with_it():
    # a real process standing in for an engine that does not stop in time, with a child of its own (as its
    # fast-path builder's g++): SIGKILL would leave the child orphaned, running on after the server
    import subprocess
    import sys
    import time

    from hotstart.procs import alive, descendants

    engine = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                               "subprocess.Popen(['sleep', '60']); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while not descendants(engine.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        [child] = descendants(engine.pid)
        view = SharedLauncher(FakeLauncher()).view()
        view.engine_pids = {0: engine.pid}
        view.shutdown(timeout=0.2)  # StopEngine goes to the fake launcher: nobody stops it
        assert engine.wait(5) == -9
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(child)
    finally:
        engine.kill()
