"""Servers of the serving benchmarks (`hotstart bench serve`, over-time, load): what to launch, how to
wait for it and how to ask it.

hotstart runs from this checkout (labelled variants: extra flags each); vLLM, llama.cpp and `transformers
serve` run from the command lines `make peers` wrote (peers.py). Each server's request forces the full
output length its own way (force_fields):

  hotstart      ignore_eos: true; usage via stream_options.include_usage
  vLLM          ignore_eos: true and min_tokens = max_tokens; usage via stream_options.include_usage
  llama.cpp     min_tokens = max_tokens (llama-cpp-python masks the EOS token until then) and logit_bias
                -100 on the model's end tokens (eos_token_id, <|endoftext|>-like added tokens): its loop
                stops on any end-of-generation token (llama_vocab_is_eog: ids 0, 2 and 4 in this GGUF),
                min_tokens masks EOS (2) only; it has no ignore_eos and sends no usage in the stream:
                tokens are counted as content chunks (one token each)
  transformers  generation_config '{"min_new_tokens": N, "max_new_tokens": N, "do_sample": false}' (it
                answers 422 to unknown fields such as ignore_eos or stream_options); usage in its final chunk
  any other     ignore_eos: true (what `vllm bench serve --ignore-eos` sends)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from hotstart.bench import peers
from hotstart.bench.process import RunFailed, Server, free_port
from hotstart.errors import HotstartError
from hotstart.messages import FastPathState

REPO = Path(__file__).resolve().parents[2]
KINDS = ("hotstart", "vllm", "llamacpp", "transformers", "transformers-cb")
LABELS = {"vllm": "vLLM", "llamacpp": "llama.cpp", "transformers": "transformers serve",
          "transformers-cb": "transformers serve --continuous-batching"}
EOG_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "</s>")


@dataclass
class Spec:
    """One server to launch: table label, kind (KINDS), argv, extra environment, and its URL (None:
    read from its output, hotstart's `--port 0`)."""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    weights: str = ""  # what it serves, for the table: "bf16 safetensors", "Q4_1 GGUF", ...


def parse_variants(values: list[str] | None) -> list[tuple[str, str]]:
    """--hotstart-variant LABEL="FLAGS" (repeatable) -> [(label, flags)]; none: [("", "")]."""
    out = []
    for v in values or []:
        label, sep, flags = v.partition("=")
        if not sep or not label.strip():
            raise HotstartError(f"--hotstart-variant {v!r}: must be LABEL=FLAGS (FLAGS may be empty)")
        out.append((label.strip(), flags))
    return out or [("", "")]


def fast_path_built(fast: dict | None) -> bool:
    """hotstart's /startup fast_path is final: packing and compile each packed / ready, failed or off
    (FastPathState values; a missing fast_path = not reported yet)."""
    if not fast:
        return False
    final = {s.value for s in (FastPathState.PACKED, FastPathState.READY, FastPathState.FAILED,
                               FastPathState.OFF)}
    return fast.get("packing") in final and fast.get("compile") in final


def hotstart_spec(model: str | None, dtype: str, extra: list[str], max_num_seqs: int | None = None,
                  label: str = "", home: str | None = None, port: int | None = None) -> Spec:
    """`hotstart serve` from this checkout on PORT (default: a port it picks and prints). `home`: its
    HOTSTART_HOME (a private one starts with an empty compile cache; pass the model folder explicitly).
    Leading VAR=value words of EXTRA are its environment: PYTHONPATH=DIR runs another checkout."""
    own, extra = peers.leading_env(extra)
    if "PYTHONPATH" in own:  # `python -m` (also the forkserver's) would put the working directory
        own.setdefault("PYTHONSAFEPATH", "1")  # (this checkout) ahead of the other one (Python >= 3.11)
    argv = [sys.executable, "-m", "hotstart", "serve", *([model] if model else []), "--port", str(port or 0),
            "--dtype", dtype, *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []), *extra]
    env = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **({"HOTSTART_HOME": home} if home else {}), **own}
    return Spec(f"hotstart[{label}]" if label else "hotstart", "hotstart", argv, env,
                url=f"http://127.0.0.1:{port}" if port else None, weights=weights_label(model, dtype))


def weights_label(model: str | None, dtype: str) -> str:
    """What hotstart serves MODEL (None: the default model, its GGUF) as, for the table: "Q4_K_M GGUF"
    (the quantization named in the file's name), "GGUF", else "DTYPE safetensors"."""
    from hotstart.gguf_file import is_gguf  # noqa: PLC0415
    from hotstart.model.files import weight_files  # noqa: PLC0415

    folder = Path(model) if model is not None else None
    try:
        if folder is None:
            files = [Path(peers.default_gguf())]
        elif folder.is_dir() and not (folder / "config.json").exists():  # a folder holding one GGUF file
            files = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("mmproj"))
        else:
            files = weight_files(folder)
    except (OSError, HotstartError):
        files = []
    if len(files) == 1 and is_gguf(files[0]):
        quant = re.search(r"(?i)(?:^|[.\-_])((?:I?Q\d_[A-Z0-9_]+?|BF16|F16|F32))(?:\.gguf$|[.\-])",
                          files[0].name)
        return f"{quant.group(1).upper()} GGUF" if quant else "GGUF"
    return f"{dtype} safetensors"


def peer_spec(kind: str, model: str, dtype: str, extra: list[str], threads: int | None = None) -> Spec:
    """A peer from commands.env (transformers: the project venv's `transformers` CLI if `make peers`
    did not set one up), on a free port, with the benchmark's dtype / thread flags."""
    port = free_port()
    key = "transformers" if kind.startswith("transformers") else kind
    try:
        _, cmd = peers.known_peer(key)
    except HotstartError:
        if key != "transformers":
            raise
        exe = (shutil.which("transformers", path=str(Path(sys.executable).parent))
               or shutil.which("transformers"))
        if exe is None:
            raise HotstartError("transformers serve: not set up (run `make peers`)") from None
        cmd = f"HF_HUB_OFFLINE=1 {exe} serve --host 127.0.0.1 --port {{port}} {{model}}"
    env, words = peers.split_command(cmd, kind)
    gguf = peers.default_gguf() if peers.needs_gguf(words) else None
    argv = peers.fill(words, port, model, gguf)
    if kind == "vllm":
        argv += ["--dtype", dtype, *extra]
        weights = f"{dtype} safetensors"
    elif kind == "llamacpp":
        n = str(threads or os.cpu_count() or 1)
        # interrupt_requests (default true) makes every new request cut the stream in progress short:
        # off, concurrent streams queue (it serves one at a time) instead of failing.
        argv += ["--n_threads", n, "--n_threads_batch", n, "--interrupt_requests", "false", *extra]
        weights = "Q4_1 GGUF" if "Q4_1" in " ".join(argv) else "GGUF"
    else:  # flags before the model folder, which is its last word
        at = argv.index("serve") + 1 if "serve" in argv else len(argv)
        flags = ["--device", "cpu", "--dtype", dtype, *(["--continuous-batching"] if kind == "transformers-cb"
                                                        else []), *extra]
        argv[at:at] = flags
        weights = f"{dtype} safetensors"
    return Spec(LABELS[kind], kind, argv, env, url=f"http://127.0.0.1:{port}", weights=weights)


def eog_ids(model: str) -> list[int]:
    """End-of-generation token ids of a model folder: config/generation_config eos_token_id and the
    tokenizer's added tokens with the usual end names (what llama.cpp stops on for these models)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            eos = json.loads((Path(model) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    try:
        added = json.loads((Path(model) / "tokenizer.json").read_text()).get("added_tokens") or []
        ids.update(t["id"] for t in added if t.get("content") in EOG_NAMES)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return sorted(ids)


def force_fields(kind: str, max_tokens: int, eog: list[int] = ()) -> dict:
    """Request fields that make a KIND server generate all MAX_TOKENS (module docstring); a None value
    means "leave this field out" (transformers serve rejects it)."""
    if kind == "vllm":
        return {"ignore_eos": True, "min_tokens": max_tokens}
    if kind == "llamacpp":
        return {"min_tokens": max_tokens, "logit_bias": {str(i): -100.0 for i in eog}, "stream_options": None}
    if kind.startswith("transformers"):
        return {"model": None, "stream_options": None, "generation_config": json.dumps(
            {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False})}
    return {"ignore_eos": True}


def request_body(kind: str, prompt: str, max_tokens: int, model_id: str | None, eog: list[int] = ()) -> dict:
    """A streamed greedy chat request forced to max_tokens on that kind of server (module docstring)."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens,
            "stream": True, "model": model_id, "stream_options": {"include_usage": True}}
    body.update(force_fields(kind, max_tokens, eog))
    return {k: v for k, v in body.items() if v is not None}


def served_dtype(kind: str, output: str, model: str) -> str:
    """What `--dtype auto` became: as the server logged it (hotstart, vLLM), else the checkpoint's."""
    pattern = {"hotstart": r"on (?:cpu|cuda\S*) (float32|bfloat16|float16)",
               "vllm": r"dtype=torch\.(float32|bfloat16|float16)"}.get(kind)
    m = re.search(pattern, output) if pattern else None
    if m:
        return m.group(1)
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):  # a GGUF file, a folder without a config
        return "auto"
    return f"auto ({cfg.get('dtype') or cfg.get('torch_dtype')})"


def spawn(spec: Spec, ready_timeout: float = 300.0, env: dict | None = None) -> Server:
    """Launch SPEC (own session, output read into .lines) and wait for /health; a server that never
    gets there is stopped, its last output printed, and a one-line HotstartError raised."""
    srv = Server.launch(spec.argv, env={**os.environ, **spec.env, **(env or {})}, tag=spec.name, url=spec.url)
    try:
        srv.wait_healthy(srv.t_launch + ready_timeout)
    except BaseException as e:
        srv.stop()
        if isinstance(e, RunFailed):
            print("".join(srv.lines[-40:]), file=sys.stderr)
            raise HotstartError(f"{spec.name} did not start: {e} (its last output is above)") from None
        raise
    return srv


def wait_fast_path(get_json, timeout: float) -> dict:
    """Until hotstart's /startup fast_path is built (packed and compiled, or off / failed), GET_JSON(path)
    being the server's JSON getter: the rounds then measure the path it serves on for good, not the
    switch-over (over-time shows that). A server without /startup (not hotstart, or an older one) is
    not waited for."""
    t0 = time.monotonic()
    fast: dict = {}
    if timeout <= 0:
        return {"fast_path": None, "fast_path_wait_s": 0.0}
    while time.monotonic() - t0 < timeout:
        startup = get_json("/startup")
        if not startup or ("fast_path" not in startup and time.monotonic() - t0 > 5):
            break
        fast = startup.get("fast_path") or {}
        if fast_path_built(fast):
            break
        time.sleep(1.0)
    else:
        print(f"  fast path still being built after {timeout:.0f} s: {fast}", flush=True)
    keys = ("mode", "packing", "packing_detail", "compile", "compile_detail")
    return {"fast_path": {k: fast.get(k) for k in keys} if fast else None,
            "fast_path_wait_s": round(time.monotonic() - t0, 1)}


def server_pid_for(url: str) -> int | None:
    """The pid listening on URL's port (None if it cannot be seen, e.g. another user's process)."""
    import psutil

    port = urlsplit(url).port
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except psutil.AccessDenied:
        pass
    return None
