"""`hotstart serve` with a $HOTSTART_HOME that takes no writes (a file in the way of the folder; a tmpfs
nearly full, where this user may mount one): one warning line, nothing written there, the model served,
the compile cache's buckets left eager with the reason in /startup."""

from __future__ import annotations

import time

import httpx
import pytest
from helpers.disk import small_tmpfs
from helpers.server import Server

pytestmark = pytest.mark.e2e
PROBLEMS = ("WARNING", "could not", "cannot write", "failed", "Traceback")


@pytest.mark.parametrize("home_kind", ["file-in-the-way", "full-tmpfs"])
def test_an_unwritable_home_warns_once_and_serving_goes_on(default_model_dir, tmp_path, home_kind):
    if home_kind == "file-in-the-way":
        (tmp_path / "blocker").write_text("a file where the folder should be")
        home = tmp_path / "blocker" / "home"
        context = None
    else:
        context = small_tmpfs(tmp_path / "home", "4m")  # below diskio.MIN_FREE_BYTES: full
        home = context.__enter__()
    try:
        s = Server(
            str(default_model_dir),
            "--max-model-len",
            "256",
            "--compile",
            "graphs",
            env={"HOTSTART_HOME": str(home)},
        )
        try:
            r = httpx.post(
                s.url + "/v1/completions",
                json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 30  # the fast path is planned behind READY
            while (fast := httpx.get(s.url + "/startup").json().get("fast_path") or {}).get(
                "compile"
            ) != "failed":
                assert time.monotonic() < deadline, fast
                time.sleep(0.2)
            assert fast["buckets"] and all("takes no writes" in detail for *_, detail in fast["buckets"]), (
                fast
            )
        finally:
            s.stop()
        problems = [line for line in s.output.splitlines() if any(p in line for p in PROBLEMS)]
        assert len(problems) == 1, s.output[-3000:]
        assert problems[0].startswith(f"hotstart: WARNING: $HOTSTART_HOME ({home}) "), problems
        if context is not None:
            assert list(home.iterdir()) == []  # nothing was written, not even a temporary file
    finally:
        if context is not None:
            context.__exit__(None, None, None)
