"""A bf16 safetensors copy of the default model, for benchmarks and tests of the bf16 path (the server
serves the shipped GGUF itself: hotstart/boot/default_model.py; nothing here runs when it starts).

The GGUF is converted once by transformers into a Hugging Face folder (bf16 safetensors + tokenizer +
chat template) under $HOTSTART_HOME/models (default ~/.cache/hotstart). The conversion runs in a
subprocess (`python -m hotstart.bench.default_hf`) because it needs torch and transformers. It writes
into a temporary folder beside the target, fsyncs it and renames it
into place, so an interrupted conversion or a full disk never leaves a half-written model behind; the
marker written last lists every file's size, and a folder whose files do not match is converted again.
Starts that find it unconverted take a lock (flock on models/.NAME.lock) and look again once they hold
it, so two at once (two test workers, two benchmark runs on one cache) convert it once, and neither
removes the folder the other renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hotstart.boot.default_model import DEFAULT_MODEL_NAME, find_gguf
from hotstart.diskio import fsync_dir, fsync_tree, is_disk_error
from hotstart.errors import HotstartError
from hotstart.system import hotstart_home

COMPLETE_MARKER = ".hotstart-complete"
LOCK_POLL_S = 0.1


def default_model_dir() -> Path:
    return hotstart_home() / "models" / DEFAULT_MODEL_NAME


def is_converted(path: Path) -> bool:
    """The folder is a finished conversion: its marker (written last) is there, and every file it lists
    has the size it lists (a folder renamed into place before its files reached the disk is not)."""
    try:
        lines = (path / COMPLETE_MARKER).read_text().splitlines()[1:]
        for line in lines:
            name, _, size = line.rpartition(" ")
            if (path / name).stat().st_size != int(size):
                return False
    except (OSError, ValueError):
        return False
    return True


def ensure_default_model(quiet: bool = False, timeout: float = 900.0) -> Path:
    """Return the converted default model folder, converting it first (in a subprocess) if needed."""
    target = default_model_dir()
    if is_converted(target):
        return target
    find_gguf()  # fail fast, with the install hint, before starting a subprocess
    deadline = time.monotonic() + timeout
    with conversion_lock(target, deadline, quiet):
        if is_converted(target):  # another start converted it while this one waited
            return target
        if not quiet:
            print(
                f"hotstart: converting the default model {DEFAULT_MODEL_NAME} into {target} (once)",
                file=sys.stderr,
            )
        cmd = [sys.executable, "-m", "hotstart.bench.default_hf", str(target)]
        returncode, reason = _run_converter(cmd, quiet, max(1.0, deadline - time.monotonic()))
    if returncode != 0:
        raise HotstartError(reason or "default model: conversion failed")
    if not is_converted(target):
        raise HotstartError(f"default model: conversion did not produce {target}")
    return target


@contextlib.contextmanager
def conversion_lock(target: Path, deadline: float, quiet: bool):
    """Hold models/.NAME.lock (flock: released when the holder exits, however it exits) until DEADLINE
    (time.monotonic()); where the folder takes no writes there is nothing to convert into, and the
    conversion's own error says why."""
    from hotstart.trust import make_private_dir  # noqa: PLC0415 - stdlib only

    try:
        make_private_dir(target.parent)
        fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HotstartError("default model: another start has been converting it for too long "
                                        f"(it holds {target.parent}/.{target.name}.lock)") from None
                if not told and not quiet:
                    print("hotstart: waiting for another start's conversion of the default model",
                          file=sys.stderr, flush=True)
                    told = True
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _run_converter(cmd: list[str], quiet: bool, timeout: float) -> tuple[int, str]:
    """Run the conversion subprocess: (exit code, its one-line `hotstart: ...` reason or "").

    Its progress is passed through to stderr unless QUIET; its reason is held back, to become the one
    `hotstart: error:` line the CLI prints."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace"
    )
    reason: list[str] = []

    def pump() -> None:
        for line in proc.stderr:
            if line.startswith("hotstart: "):
                reason[:] = [line.strip().removeprefix("hotstart: ")]
            elif not quiet:
                sys.stderr.write(line)
                sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise HotstartError(f"default model: conversion took longer than {timeout:.0f} s") from None
    finally:
        if proc.poll() is None:  # KeyboardInterrupt: the converter got the same SIGINT
            proc.wait()
    reader.join(5)
    return returncode, reason[0] if reason else ""


def _step(msg: str, t0: float) -> None:
    print(f"  [{time.perf_counter() - t0:5.1f} s] {msg}", file=sys.stderr, flush=True)


def convert(target: Path) -> None:
    """GGUF (Q4_1) -> bf16 safetensors + tokenizer files in TARGET, atomically."""
    import torch  # noqa: PLC0415 - heavy, conversion subprocess only
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    t0 = time.perf_counter()
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _step(f"reading tokenizer from {gguf.name}", t0)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _step("dequantising weights (Q4_1 -> bf16)", t0)
        # float32 is the fast dequantisation path; the copy into the bf16 model casts once.
        quantised = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(quantised.state_dict(), strict=True)
        model.generation_config = quantised.generation_config
        _step("writing safetensors", t0)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.chmod(0o755)
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        listing = "".join(f"{p.name} {p.stat().st_size}\n" for p in files)
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf}\n{listing}")
        fsync_tree(tmp)  # every file on disk before the folder is renamed into place
        if target.exists():  # a stale, incomplete folder from an older conversion
            shutil.rmtree(target)
        os.replace(tmp, target)
        fsync_dir(target.parent)
        _step(f"done: {target}", t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main() -> int:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default_model_dir()
    try:
        convert(target)
    except HotstartError as e:
        print(f"hotstart: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - OSError, safetensors' SafetensorError (not an OSError), ...
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            reason = (
                f"no space left on device in {target.parent} (the model needs ~300 MB; set HOTSTART_HOME)"
            )
        elif is_disk_error(e):
            reason = f"cannot write {target.parent} ({getattr(e, 'strerror', None) or e}; set HOTSTART_HOME)"
        else:
            reason = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"hotstart: default model conversion failed: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
