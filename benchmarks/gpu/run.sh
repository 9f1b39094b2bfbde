#!/usr/bin/env bash
# The GPU check, on the lent machine (no network): install the carried wheels beside its torch, then run
# benchmarks/gpu_check.py. Results: $OUT/gpu_check.json and $OUT/gpu_check.log (the device tool brings
# back what is under $OUT). Usage: bash benchmarks/gpu/run.sh [extra gpu_check.py flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --find-links .whl .whl/*.whl 2>&1 | tail -3 || true
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "import torch, hotstart; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# Work on the local disk, not under the carried tree.
exec python3 benchmarks/gpu_check.py --out "$OUT" --work /tmp/gpu-check-work --tokenizer .whl/tokenizer "$@"
