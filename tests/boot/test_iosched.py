"""The start's I/O schedule: import manifests (what a process's imports read), read first at t=0."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO
from helpers.disk import disk_backed_dir

from hotstart.boot import iosched, manifest
from hotstart.residency import FileMap, evict, resident_bytes


def _record_in_child(path: Path, module: str) -> list:
    code = (f"import pathlib, {module}; from hotstart.boot import manifest; "
            f"manifest.record(pathlib.Path({str(path)!r}))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
    return json.loads(path.read_text())["entries"]


def test_a_manifest_lists_module_files_whole_and_only_the_touched_pages_of_libraries(tmp_path):
    entries = _record_in_child(tmp_path / "m.json", "numpy")
    by_path = {e[0]: e for e in entries}
    import numpy

    pyc = [e for e in entries if e[0].endswith(".pyc") and "numpy" in e[0]]
    assert pyc and all(e[3] is None for e in pyc)  # module files: whole
    ext = [e for e in entries if e[0].endswith(".so") and "_multiarray_umath" in e[0]]
    assert ext, "the extension module's library is listed"
    path, size, _, runs = ext[0]
    assert runs and all(a % manifest.PAGE == 0 and n > 0 and a + n <= size + manifest.PAGE for a, n in runs)
    assert sum(n for _, n in runs) <= size
    assert os.path.dirname(os.path.realpath(numpy.__file__)) in " ".join(by_path)
    # in import order: the interpreter's own startup modules come before numpy's
    order = [e[0] for e in entries]
    assert order.index(pyc[0][0]) > min(i for i, p in enumerate(order) if p.endswith(".pyc"))


def test_load_drops_changed_files_and_asks_for_a_new_record_when_many_changed(tmp_path):
    files = []
    for i in range(20):
        f = tmp_path / f"f{i}.bin"
        f.write_bytes(os.urandom(5000))
        files.append(f)
    path = tmp_path / "m.json"
    entries = [[str(f), f.stat().st_size, f.stat().st_mtime_ns, None] for f in files]
    path.write_text(json.dumps({"entries": entries}))
    fresh, stale = manifest.load(path)
    assert len(fresh) == 20 and not stale
    files[0].write_bytes(b"changed")  # size and mtime differ: dropped
    fresh, stale = manifest.load(path)
    assert len(fresh) == 19 and not stale
    for f in files[1:5]:
        f.unlink()
    fresh, stale = manifest.load(path)
    assert len(fresh) == 15 and stale  # 25 % changed: record again
    assert manifest.load(tmp_path / "missing.json") == ([], True)
    (tmp_path / "bad.json").write_text("{not json")
    assert manifest.load(tmp_path / "bad.json") == ([], True)


def test_import_prefetch_reads_the_listed_runs_into_the_page_cache(tmp_path, tmp_path_factory):
    with disk_backed_dir(tmp_path_factory, "iosched") as folder:
        _prefetch_into(folder, tmp_path)


def _prefetch_into(folder: Path, tmp_path: Path) -> None:
    big, small = folder / "big.bin", folder / "small.bin"
    big.write_bytes(os.urandom(24 << 20))
    small.write_bytes(os.urandom(100_000))
    for f in (big, small):
        os.sync()
        evict(str(f))
    assert resident_bytes(str(big))[0] < (1 << 20)
    runs = [(4 << 20, 8 << 20), (16 << 20, 4 << 20)]
    path = tmp_path / "m.json"
    st_b, st_s = big.stat(), small.stat()
    path.write_text(json.dumps({"entries": [[str(big), st_b.st_size, st_b.st_mtime_ns, runs],
                                            [str(small), st_s.st_size, st_s.st_mtime_ns, None],
                                            [str(folder / "gone.bin"), 1, 1, None]]}))
    pre = iosched.ImportPrefetch({"forkserver": path}, threads=2).start()
    assert pre.done.wait(30)
    fd = os.open(big, os.O_RDONLY)
    try:
        with FileMap(fd, st_b.st_size) as fmap:
            pages = fmap.vector()
    finally:
        os.close(fd)
    page = manifest.PAGE
    for a, n in runs:  # every listed page resident
        assert all(pages[a // page:(a + n) // page]), (a, n)
    assert pre.stats()["files"] == 2 and pre.stats()["errors"] == 0  # the vanished file was dropped at load
    assert pre.to_record == ["forkserver"]  # one entry of three gone: over STALE_FRACTION


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="ioprio syscall numbers")
def test_set_io_class_sets_the_calling_threads_class():
    get = {"x86_64": 252, "aarch64": 31}[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    seen = {}

    def run():
        assert iosched.set_io_class(iosched.IOPRIO_CLASS_IDLE)
        seen["idle"] = libc.syscall(get, 1, 0) >> 13
        assert iosched.set_io_class(iosched.IOPRIO_CLASS_BE)
        seen["be"] = libc.syscall(get, 1, 0) >> 13

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert seen == {"idle": iosched.IOPRIO_CLASS_IDLE, "be": iosched.IOPRIO_CLASS_BE}
    assert libc.syscall(get, 1, 0) >> 13 != iosched.IOPRIO_CLASS_IDLE  # the main thread kept its class


def test_start_after_calls_once_the_gate_opens_or_the_timeout_passes():
    gate, calls = threading.Event(), []
    iosched.start_after(gate, 5.0, lambda: calls.append(time.monotonic()))
    time.sleep(0.1)
    assert calls == []
    gate.set()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 1
    iosched.start_after(threading.Event(), 0.05, lambda: calls.append(0))
    time.sleep(0.5)
    assert len(calls) == 2


def test_a_start_records_both_manifests_and_the_next_start_reads_them_first(tmp_path, default_model_dir):
    import httpx
    from helpers.server import Server

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    os.symlink(default_model_dir, home / "models" / default_model_dir.name)
    env = {"HOTSTART_HOME": str(home)}
    for start in range(2):
        s = Server(env=env)
        try:
            r = httpx.post(s.url + "/v1/completions", json={"model": default_model_dir.name, "prompt": "Hi",
                                                            "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
            phases = {p["name"]: p for p in httpx.get(s.url + "/startup", timeout=10).json()["phases"]}
        finally:
            s.stop()
        (io,) = (home / "io").iterdir()
        deadline = time.monotonic() + 10  # the forkserver records while idle, after its first fork
        while not (io / "forkserver.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        entries = {
            role: json.loads((io / f"{role}.json").read_text())["entries"] for role in ("api", "forkserver")
        }
        assert any("torch" in e[0] and e[0].endswith(".so") and e[3] for e in entries["forkserver"])
        assert any("fastapi" in e[0] for e in entries["api"])
        assert not any("/torch/" in e[0] for e in entries["api"])  # the API process never imports torch
        files = int(phases["imports prefetched"]["detail"].split(" files")[0].split()[-1])
        if start == 0:
            assert files == 0  # nothing recorded yet
        else:
            assert files >= len(entries["api"]) // 2  # read from both manifests, stale entries dropped
