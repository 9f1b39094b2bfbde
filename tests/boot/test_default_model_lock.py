"""Two starts at once convert the default model's bf16 copy once (hotstart/bench/default_hf.py, the copy
benchmarks and tests use): a start that finds another holding the conversion's lock waits for it, then uses
its folder, and never removes it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from hotstart.bench.default_hf import COMPLETE_MARKER, ensure_default_model
from hotstart.boot.default_model import DEFAULT_MODEL_NAME

# another start, converting: holds the lock, then renames its finished folder into place
CONVERTING = textwrap.dedent(f"""
    import fcntl, os, sys, time
    models = sys.argv[1]
    os.makedirs(models, exist_ok=True)
    fd = os.open(os.path.join(models, ".{DEFAULT_MODEL_NAME}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(1.5)
    tmp = os.path.join(models, ".tmp-other")
    os.mkdir(tmp)
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
        f.write(b"w" * 100)
    with open(os.path.join(tmp, "{COMPLETE_MARKER}"), "w") as f:
        f.write("converted by the other start\\nmodel.safetensors 100\\n")
    os.replace(tmp, os.path.join(models, "{DEFAULT_MODEL_NAME}"))
""")


def test_a_start_waits_for_the_other_conversion_and_keeps_its_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    other = subprocess.Popen([sys.executable, "-c", CONVERTING, str(tmp_path / "models")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        t = time.monotonic()
        target = ensure_default_model(timeout=60)
        waited = time.monotonic() - t
    finally:
        other.wait(30)
    assert target == tmp_path / "models" / DEFAULT_MODEL_NAME
    assert waited >= 1.0, waited  # it waited for the lock rather than converting beside the other
    assert "converted by the other start" in (target / COMPLETE_MARKER).read_text()  # the other's, kept
    err = capsys.readouterr().err
    assert "waiting for another start's conversion" in err and "converting the default model" not in err
