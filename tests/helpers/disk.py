"""Folders on a real disk, or on a small tmpfs, for the tests of eviction and disk pressure."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


@contextlib.contextmanager
def disk_backed_dir(tmp_path_factory, name: str):
    """A disk-backed directory to evict files from: pytest's tmp if it is not tmpfs, else one under
    /var/tmp (skips the test if that is memory too); removed afterwards."""
    from hotstart.boot import storage

    d = tmp_path_factory.mktemp(name)
    if storage.detect(d).kind == "memory":
        d = Path(tempfile.mkdtemp(prefix="hotstart-test-", dir="/var/tmp"))
        if storage.detect(d).kind == "memory":
            pytest.skip("no disk-backed directory to evict from")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str):
    """A tmpfs of SIZE on FOLDER, or a skip naming why (mounting needs root, and CI may forbid it)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
