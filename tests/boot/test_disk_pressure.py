"""Disk pressure without a server (hotstart/diskio.py and the readers that verify): real failed writes (a
file-size limit makes the kernel refuse them mid-file; a tmpfs filled up where this user may mount one),
no temporary file left behind, torn cache entries not trusted. The server under it:
tests/boot/test_disk_pressure_e2e.py."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import zipfile
from pathlib import Path

import pytest
from helpers.disk import small_tmpfs

from hotstart import diskio
from hotstart.bench.default_hf import COMPLETE_MARKER, is_converted


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past NBYTES fail with EFBIG (the kernel's RLIMIT_FSIZE; SIGXFSZ ignored meanwhile)."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "cache.json"
    diskio.write_atomic(target, b"old")
    with file_size_limit(1000), pytest.raises(OSError) as e:
        diskio.write_atomic(target, b"x" * 100_000)
    assert e.value.errno == errno.EFBIG and diskio.is_disk_error(e.value)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]

    def writer(path: Path) -> None:  # a writer that fails half-way (as a compiler's package write would)
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        diskio.write_atomic(target, writer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def test_home_problems_are_found_and_told_once(tmp_path, capsys, monkeypatch):
    assert diskio.home_problem(tmp_path / "new" / "home") is None  # created on the first write
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    assert "is not a folder" in diskio.home_problem(blocker / "home")
    monkeypatch.delenv(diskio.HOME_ENV, raising=False)
    assert diskio.home_writable()
    why = diskio.check_home(blocker / "home")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hotstart: WARNING: $HOTSTART_HOME (") and why in lines[0]
    assert not diskio.home_writable() and os.environ[diskio.HOME_ENV] == why
    assert diskio.check_home(tmp_path) is None and diskio.home_writable()


def test_a_nearly_full_tmpfs_is_a_full_home_and_enospc_leaves_nothing(tmp_path):
    with small_tmpfs(tmp_path / "home", "4m") as home:
        assert "is full" in diskio.home_problem(home)  # 4 MiB < diskio.MIN_FREE_BYTES
        with pytest.raises(OSError) as e:
            diskio.write_atomic(home / "big", b"x" * (8 << 20))
        assert e.value.errno == errno.ENOSPC and diskio.is_disk_error(e.value)
        assert list(home.iterdir()) == []


def test_torn_compile_packages_are_not_trusted_and_removed(tmp_path, monkeypatch):
    from hotstart.engine.fastpath.cache import usable

    monkeypatch.delenv(diskio.HOME_ENV, raising=False)
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    staged = tmp_path / "staged.pt2"
    with zipfile.ZipFile(staged, "w") as z:
        z.writestr("data/aotinductor/model.so", b"\0" * 4096)
    good = tmp_path / "layers-T1.pt2"
    diskio.publish_recorded(staged, good)  # as the compile worker publishes: its sha256 beside it
    assert usable(good)
    torn = tmp_path / "layers-T2.pt2"
    torn.write_bytes(good.read_bytes()[:2000])  # cut before the central directory
    assert not usable(torn) and not torn.exists()
    assert not usable(tmp_path / "layers-T4.pt2")  # absent


def test_a_converted_model_whose_files_do_not_match_its_marker_is_not_trusted(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w" * 100)
    (model / COMPLETE_MARKER).write_text("converted from x.gguf\nmodel.safetensors 100\n")
    assert is_converted(model)
    (model / "model.safetensors").write_bytes(b"w" * 10)  # renamed into place before its data was on disk
    assert not is_converted(model)
    (model / COMPLETE_MARKER).write_text("converted from x.gguf\n")  # an older marker: no sizes listed
    assert is_converted(model)
