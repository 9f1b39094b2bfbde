#!/usr/bin/env bash
# llama.cpp's own benchmarks, built from the llama.cpp source inside the llama-cpp-python sdist that
# benchmarks/peers/setup.sh installs (same version), portably (facts.md: a -march=native build crashed
# here): test-backend-ops (MUL_MAT perf: 4096 x 14336 weights, 1-8 and 512 tokens, every type, one thread
# on a 2-core host), llama-bench (tokens/s of a GGUF file) and llama-batched-bench (N parallel sequences).
# Compare with benchmarks/quant_matmul.py on the same shapes (below).
#
#   benchmarks/llamacpp_ops.sh build                 # ~5 min of both cores, niced; into $DIR (once)
#   benchmarks/llamacpp_ops.sh ops [TYPES]           # e.g. q4_1,q4_K,q8_0 (test-backend-ops perf)
#   benchmarks/llamacpp_ops.sh bench FILE.gguf       # llama-bench: tg64 and pp200, 2 threads
#   benchmarks/llamacpp_ops.sh batched FILE.gguf     # llama-batched-bench: 200-token prompts, 96 tokens, 1 / 16 seqs
set -euo pipefail

VERSION=$(sed -n 's/^LLAMACPP_VERSION=\([0-9.]*\).*/\1/p' "$(dirname "$0")/peers/setup.sh")
DIR=${LLAMACPP_OPS_DIR:-${HOTSTART_HOME:-$HOME/.cache/hotstart}/llamacpp-$VERSION}
PY=${PYTHON:-python3}
BIN=$DIR/build/bin

build() {
    mkdir -p "$DIR"
    if [[ ! -d $DIR/src ]]; then
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$DIR" "llama-cpp-python==$VERSION"
        tar -xzf "$DIR"/llama_cpp_python-"$VERSION".tar.gz -C "$DIR"
        mv "$DIR"/llama_cpp_python-"$VERSION"/vendor/llama.cpp "$DIR/src"
    fi
    nice -n 10 cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON \
        -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=OFF >/dev/null
    nice -n 10 cmake --build "$DIR/build" -j "$(nproc)" --target test-backend-ops llama-bench llama-batched-bench \
        >/dev/null
    echo "built into $BIN"
}

case ${1:-} in
    build) build ;;
    ops)
        types=${2:-q4_1,q4_K,q8_0}
        "$BIN/test-backend-ops" perf -o MUL_MAT -b CPU -p "type_a=(${types//,/|}),type_b=f32,m=4096,n=[0-9]+,k=14336,"
        echo "ours, same shapes, one thread:"
        echo "  python benchmarks/quant_matmul.py --model 4096x14336 --types ${types^^} --tokens 1,2,3,4,5,8 --threads 1" ;;
    bench) "$BIN/llama-bench" -m "$2" -t "$(nproc)" -p 200 -n 64 -r 3 ;;
    batched) "$BIN/llama-batched-bench" -m "$2" -t "$(nproc)" -c 8192 -b 2048 -ub 512 -npp 200 -ntg 96 -npl 1,16 ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
