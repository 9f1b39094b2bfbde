"""bench/kernel_cache.py: a library seeded into a fresh $HOTSTART_HOME passes the same trust check the
server applies before loading it (trust.open_verified: private folders, bytes equal to the record)."""

from __future__ import annotations

import os
import stat

from hotstart.bench.kernel_cache import seed_home
from hotstart.diskio import publish_recorded
from hotstart.trust import record_path, verified_problem


def _library(home):
    (home / "kernels").mkdir(parents=True, mode=0o700)
    os.chmod(home, 0o700)
    tmp = home / "kernels" / "staging"
    tmp.write_bytes(b"\x7fELF not really a library, but bytes with a record")
    lib = home / "kernels" / "cpu-0123456789abcdef.so"
    publish_recorded(tmp, lib)
    return lib


def test_a_seeded_home_trusts_the_copied_library(tmp_path):
    lib = _library(tmp_path / "built")
    assert verified_problem(lib, tmp_path / "built") is None
    fresh = tmp_path / "round-0" / "home"
    seed_home(fresh, lib)
    copied = fresh / "kernels" / lib.name
    assert copied.read_bytes() == lib.read_bytes()
    assert record_path(copied).read_text() == record_path(lib).read_text()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert verified_problem(copied, fresh) is None
    seed_home(fresh, lib)  # again: already there, nothing changes
    assert sorted(p.name for p in (fresh / "kernels").iterdir()) == sorted([lib.name, record_path(lib).name])


def test_no_library_leaves_the_home_empty(tmp_path):
    seed_home(tmp_path / "home", None)
    assert not (tmp_path / "home").exists()


def test_a_tampered_copy_is_refused_as_the_server_would(tmp_path):
    lib = _library(tmp_path / "built")
    fresh = tmp_path / "home"
    seed_home(fresh, lib)
    (fresh / "kernels" / lib.name).write_bytes(b"other bytes")
    assert verified_problem(fresh / "kernels" / lib.name, fresh) is not None
