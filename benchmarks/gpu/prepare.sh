#!/usr/bin/env bash
# Prepare the one GPU run (no network on the GPU machine): wheels for Python 3.12 (manylinux x86_64) of
# everything hotstart needs that its image lacks (it has torch 2.11, transformers 5.17, numpy,
# tokenizers, safetensors, huggingface_hub), and the tokenizer files make-model needs, into .whl/
# (ignored by git; carried to the device with the run's `carry: [".whl"]`). Under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
mkdir -p "$OUT/tokenizer"
PKGS=(msgspec pyzmq fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
      anyio sniffio idna uvicorn h11 click prometheus_client jinja2 markupsafe psutil
      openai httpx httpcore certifi distro jiter tqdm)
"$PY" -m pip download -q --dest "$OUT" --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any --implementation cp "${PKGS[@]}"
MODEL=$("$PY" -c "from hotstart.bench.default_hf import ensure_default_model as e; print(e(quiet=True))")
cp "$MODEL"/{config.json,tokenizer.json,tokenizer_config.json,generation_config.json} "$OUT/tokenizer/"
cp "$MODEL"/chat_template.jinja "$OUT/tokenizer/" 2>/dev/null || true
du -sh "$OUT"
