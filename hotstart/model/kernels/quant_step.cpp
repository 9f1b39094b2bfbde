// A decode step through a GGUF model's Llama-shaped layers in one call (model/quant_step.py drives it).
//
// A one-stream step of a small model (the 135M default: 30 layers of a few hundred KB each) spends as
// long in Python and torch's dispatch around the kernels as in them: per layer ~10 kernel calls, each
// with its wrapper's checks, ctypes' argument conversion, torch.empty, and for the quantized products a
// float32 -> dtype conversion, llama's q/k row order put back and biases added by torch ops. Here the
// same kernels run in the same order from C++, over buffers kept between calls:
//
//   hs_add_rmsnorm -> q/k/v (hs_quant_matmul, then finish) -> hs_rope_kv -> hs_decode_attention
//   -> o_proj -> hs_add_rmsnorm -> gate/up -> hs_silu_mul -> down -> ... -> the final hs_add_rmsnorm
//
// `finish` is QuantLinear.finish (model/quant.py): the float32 product in the file's row order -> the
// checkpoint's order (llama.cpp's converter interleaved each q / k head's rotary halves), rounded to the
// serving dtype, + bias rounded again. So the output equals model/layer_ops.py's step bit for bit.

#include "common.h"

#include <utility>
#include <vector>

extern "C" {
int hs_add_rmsnorm(int dtype, const void *x, const void *delta, const void *weight, float eps, int64_t rows,
                   int64_t n, void *out, void *sum);
int hs_rope_kv(int dtype, const void *y, int64_t tokens, int64_t ld, int64_t H, int64_t KVH, int64_t D,
               int64_t R, const void *cos, const void *sin, const int64_t *slots, void *k_cache, void *v_cache,
               int64_t head_stride, void *q);
int hs_silu_mul(int dtype, const void *gu, int64_t rows, int64_t n, void *out);
int hs_decode_attention(int dtype, const void *q, void *out, const void *k_cache, const void *v_cache,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t head_stride,
                        const int64_t *tables, int64_t nb, const int64_t *context, int64_t block_size,
                        float scale, float softcap, int64_t window);
int hs_quant_matmul(int isa, int xdtype, const void *x, int64_t M, int64_t K, int64_t nw, const void *const *ws,
                    const int64_t *lds, const int64_t *ns, const int *types, float *out, int64_t ldo);

constexpr int HS_STEP_PARTS = 4;  // weights of one product at most (q, k, v; gate, up)

// One product: its weights side by side (model/quant.py's QuantLinear each) and how each part's output is
// finished. Layout shared with model/quant_step.py's ctypes Structure.
struct HsStepProduct {
    int64_t parts;
    const void *ws[HS_STEP_PARTS];
    int64_t lds[HS_STEP_PARTS];  // bytes between rows
    int64_t ns[HS_STEP_PARTS];   // rows (outputs)
    int32_t types[HS_STEP_PARTS];  // ggml types
    int64_t heads[HS_STEP_PARTS];  // > 0: rows interleaved per head as llama.cpp writes q and k; 0: as is
    const void *bias[HS_STEP_PARTS];  // [ns] in the serving dtype, or null
};

struct HsStepLayer {
    const void *norm1, *norm2;  // [hidden] RMSNorm weights, serving dtype
    float eps1, eps2;
    HsStepProduct qkv, o, gate_up, down;
    void *k_cache, *v_cache;  // [KVH, slots, D]
    int64_t head_stride;
    float scale, softcap;  // softcap 0: none
    int64_t window;        // 0: none
};
}

namespace {

using hs::rounded;
using hs::store;
using hs::to_f32;

int64_t outputs(const HsStepProduct &p) {
    int64_t n = 0;
    for (int64_t i = 0; i < p.parts; i++) n += p.ns[i];
    return n;
}

constexpr int64_t PARALLEL_MIN = 1 << 15;  // elements from which `finish` splits its tokens over threads

// y: [T, N] float32 (the parts side by side, file order) -> out: [T, N] in T's dtype, checkpoint order
template <typename T>
void finish(const HsStepProduct &p, const float *y, int64_t tokens, T *out) {
    const int64_t n = outputs(p);
#pragma omp parallel for if (tokens > 1 && tokens * n >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *yt = y + t * n;
        T *ot = out + t * n;
        int64_t col = 0;
        for (int64_t i = 0; i < p.parts; i++) {
            const int64_t rows = p.ns[i];
            const T *bias = (const T *)p.bias[i];
            const int64_t d = p.heads[i] > 0 ? rows / p.heads[i] : 0, half = d / 2;
            for (int64_t j = 0; j < rows; j++) {
                int64_t src = j;
                if (d > 0) {  // out [h, 2, D/2] from the file's [h, D/2, 2]
                    const int64_t h = j / d, r = j % d;
                    src = h * d + (r % half) * 2 + r / half;
                }
                const float v = yt[col + src];
                if (bias != nullptr)
                    store(ot + col + j, rounded<T>(v) + to_f32(bias[j]));
                else
                    store(ot + col + j, v);
            }
            col += rows;
        }
    }
}

struct Buffers {  // the calling thread's, kept between steps
    std::vector<uint8_t> x0, x1, normed, delta, yd, q, qs, o, os, act;
    std::vector<float> yf;
};

template <typename T>
int step(int isa, int dtype, int64_t L, const HsStepLayer *layers, int64_t tokens, int64_t hidden, int64_t H,
         int64_t KVH, int64_t D, int64_t R, const void *x_in, const void *cos, const void *sin,
         const int64_t *slots, const int64_t *order, const int64_t *tables, int64_t nb, const int64_t *context,
         int64_t block_size, const void *final_norm, float final_eps, void *out) {
    int64_t widest = hidden, inter = 0;
    for (int64_t l = 0; l < L; l++) {
        const HsStepLayer &ly = layers[l];
        const int64_t n[] = {outputs(ly.qkv), outputs(ly.o), outputs(ly.gate_up), outputs(ly.down)};
        if (n[0] != (H + 2 * KVH) * D || n[1] != hidden || n[2] % 2 != 0 || n[3] != hidden) return -1;
        for (int64_t v : n) widest = v > widest ? v : widest;
        inter = n[2] / 2 > inter ? n[2] / 2 : inter;
    }
    static thread_local Buffers b;
    const size_t e = sizeof(T);
    auto fit = [](auto &v, size_t n) {
        if (v.size() < n) v.resize(n);
        return v.data();
    };
    T *xa = (T *)fit(b.x0, tokens * hidden * e), *xb = (T *)fit(b.x1, tokens * hidden * e);
    T *normed = (T *)fit(b.normed, tokens * hidden * e), *delta = (T *)fit(b.delta, tokens * hidden * e);
    T *yd = (T *)fit(b.yd, tokens * widest * e), *act = (T *)fit(b.act, tokens * inter * e);
    T *q = (T *)fit(b.q, tokens * H * D * e), *o = (T *)fit(b.o, tokens * H * D * e);
    T *qs = order ? (T *)fit(b.qs, tokens * H * D * e) : q, *os = order ? (T *)fit(b.os, tokens * H * D * e) : o;
    float *yf = fit(b.yf, tokens * widest);

    auto product = [&](const HsStepProduct &p, const T *x, int64_t k, T *dst) {
        const int64_t n = outputs(p);
        if (hs_quant_matmul(isa, dtype, x, tokens, k, p.parts, p.ws, p.lds, p.ns, p.types, yf, n) != 0) return -1;
        finish(p, yf, tokens, dst);
        return 0;
    };
    memcpy(xa, x_in, tokens * hidden * e);
    T *x = xa, *spare = xb;
    bool carried = false;  // delta holds what the last block adds to x
    for (int64_t l = 0; l < L; l++) {
        const HsStepLayer &ly = layers[l];
        // x + delta -> the residual stream; its norm -> q | k | v
        if (hs_add_rmsnorm(dtype, x, carried ? delta : nullptr, ly.norm1, ly.eps1, tokens, hidden, normed,
                           spare) != 0)
            return -1;
        if (carried) std::swap(x, spare);
        if (product(ly.qkv, normed, hidden, yd) != 0) return -1;
        if (hs_rope_kv(dtype, yd, tokens, (H + 2 * KVH) * D, H, KVH, D, R, cos, sin, slots, ly.k_cache,
                       ly.v_cache, ly.head_stride, q) != 0)
            return -1;
        if (order != nullptr)  // the decode group's order (longest context first)
            for (int64_t i = 0; i < tokens; i++) memcpy(qs + i * H * D, q + order[i] * H * D, H * D * e);
        if (hs_decode_attention(dtype, qs, os, ly.k_cache, ly.v_cache, tokens, H, KVH, D, ly.head_stride, tables,
                                nb, context, block_size, ly.scale, ly.softcap, ly.window) != 0)
            return -1;
        if (order != nullptr)
            for (int64_t i = 0; i < tokens; i++) memcpy(o + order[i] * H * D, os + i * H * D, H * D * e);
        if (product(ly.o, o, H * D, delta) != 0) return -1;
        if (hs_add_rmsnorm(dtype, x, delta, ly.norm2, ly.eps2, tokens, hidden, normed, spare) != 0) return -1;
        std::swap(x, spare);
        if (product(ly.gate_up, normed, hidden, yd) != 0) return -1;
        const int64_t i_n = outputs(ly.gate_up) / 2;
        if (hs_silu_mul(dtype, yd, tokens, i_n, act) != 0) return -1;
        if (product(ly.down, act, i_n, delta) != 0) return -1;
        carried = true;
    }
    return hs_add_rmsnorm(dtype, x, carried ? delta : nullptr, final_norm, final_eps, tokens, hidden, out, spare);
}

}  // namespace

extern "C" {

// layers: L of them; x_in: [T, hidden] the embeddings (dtype 1 bf16, 2 float32), one token per sequence;
// cos, sin: [T, R]; slots: [T]; order: null (the decode group holds the tokens in order) or [T], the flat
// token of each of the group's rows; tables: [T, nb], context: [T] (the group's order); out: [T, hidden]
// the final norm's output. Returns 0, or -1 for arguments a kernel refused (the caller raises).
int hs_quant_step(int isa, int dtype, int64_t L, const HsStepLayer *layers, int64_t T, int64_t hidden,
                  int64_t H, int64_t KVH, int64_t D, int64_t R, const void *x_in, const void *cos,
                  const void *sin, const int64_t *slots, const int64_t *order, const int64_t *tables,
                  int64_t nb, const int64_t *context, int64_t block_size, const void *final_norm,
                  float final_eps, void *out) {
    if (L < 1 || T < 1 || hidden < 1 || H < 1 || KVH < 1 || D < 1) return -1;
    for (int64_t l = 0; l < L; l++)
        for (const HsStepProduct *p : {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down})
            if (p->parts < 1 || p->parts > HS_STEP_PARTS) return -1;
    if (dtype == 1)
        return step<uint16_t>(isa, dtype, L, layers, T, hidden, H, KVH, D, R, x_in, cos, sin, slots, order,
                              tables, nb, context, block_size, final_norm, final_eps, out);
    if (dtype == 2)
        return step<float>(isa, dtype, L, layers, T, hidden, H, KVH, D, R, x_in, cos, sin, slots, order, tables,
                           nb, context, block_size, final_norm, final_eps, out);
    return -1;
}

}  // extern "C"
