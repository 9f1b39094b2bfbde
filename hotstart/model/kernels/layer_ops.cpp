// The small ops between a decode step's matmuls in a Llama-shaped layer, one call each.
//
// At a few tokens per step the matmuls read the weights (gemv.cpp) and attention reads the cache
// (decode_attention.cpp); what is left is ~15 torch ops per layer over a few thousand numbers each (the
// residual add, two RMSNorms, RoPE on q and k, the K/V write, SiLU x up), each costing more in dispatch
// than in arithmetic. These do the same arithmetic in three calls (model/layer_ops.py drives them):
//
//   hs_add_rmsnorm  s = x + delta; out = weight * rmsnorm(s)      (the residual stream and the next norm)
//   hs_rope_kv      q, k rotated (RoPE); k and v written to their cache slots; q returned
//   hs_silu_mul     silu(gate) * up
//
// Each rounds where torch's op sequence rounds (a bf16 op computes in float32 and rounds its result:
// rounded<T>), so bf16 results equal the torch path's but for the last bit of a norm's or a SiLU's
// float32 arithmetic; float32 results equal it to accumulation order. The loops run 8 lanes at a time
// (AVX2): prefill-sized steps (hundreds of rows) then cost less here than in torch's ops. Elementwise
// float32 RoPE is written without FMA (compiled for baseline x86-64): x * cos + x' * sin rounds as two
// products and a sum, as torch's three ops do; bf16 RoPE rounds each product before the sum.

#include <math.h>

#include "common.h"

namespace {

using hs::rounded;
using hs::store;
using hs::to_f32;

constexpr int64_t PARALLEL_MIN = 1 << 15;  // elements from which a call splits its rows over threads

// rows x n: s = x + delta (delta null: s = x, not written), out = weight * rmsnorm(s); 8 lanes at a time
// (the sum of squares in 8 partial sums: float32 results differ from torch's in accumulation order only)
template <typename T>
__attribute__((target("avx2,fma")))
void add_rmsnorm(const T *x, const T *delta, const T *weight, float eps, int64_t rows, int64_t n, T *out,
                 T *sum) {
    const int64_t n8 = n & ~(int64_t)7;
#pragma omp parallel for if (rows * n >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * n;
        const T *src = xr;
        if (delta != nullptr) {
            const T *dr = delta + r * n;
            T *sr = sum + r * n;
            for (int64_t i = 0; i < n8; i += 8)
                hs::store8(sr + i, _mm256_add_ps(hs::load8(xr + i), hs::load8(dr + i)));
            for (int64_t i = n8; i < n; i++) store(sr + i, to_f32(xr[i]) + to_f32(dr[i]));
            src = sr;
        }
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n8; i += 8) {
            const __m256 v = hs::load8(src + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hs::hsum256(acc);
        for (int64_t i = n8; i < n; i++) {
            const float v = to_f32(src[i]);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        const __m256 inv8 = _mm256_set1_ps(inv);
        T *o = out + r * n;
        for (int64_t i = 0; i < n8; i += 8)
            hs::store8(o + i, _mm256_mul_ps(hs::load8(weight + i),
                                            hs::rounded8(_mm256_mul_ps(hs::load8(src + i), inv8), src)));
        for (int64_t i = n8; i < n; i++) store(o + i, to_f32(weight[i]) * rounded<T>(to_f32(src[i]) * inv));
    }
}

// one head of D values, its first R rotated: dst = src * cos + roll(src, R / 2) * sin (the sin table
// carries rotate_half's sign: layers.RotaryEmbedding), the rest copied
template <typename T>
inline void rotate(const T *src, const T *cos, const T *sin, int64_t R, int64_t D, T *dst) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < R; i++) {
        const int64_t j = i < half ? i + half : i - half;
        const float a = rounded<T>(to_f32(src[i]) * to_f32(cos[i]));
        const float b = rounded<T>(to_f32(src[j]) * to_f32(sin[i]));
        store(dst + i, a + b);
    }
    for (int64_t i = R; i < D; i++) dst[i] = src[i];
}

// bf16, 8 lanes at a time where R / 2 is a multiple of 8: each product rounds before the sum, so no FMA
// can fuse them (float32 keeps the scalar loop above, compiled without FMA)
__attribute__((target("avx2,fma")))
inline void rotate(const uint16_t *src, const uint16_t *cos, const uint16_t *sin, int64_t R, int64_t D,
                   uint16_t *dst) {
    const int64_t half = R / 2;
    if (half % 8 != 0) {
        rotate<uint16_t>(src, cos, sin, R, D, dst);
        return;
    }
    for (int64_t i = 0; i < R; i += 8) {
        const int64_t j = i < half ? i + half : i - half;  // 8 lanes never straddle half
        const __m256 a = hs::round_bf16(_mm256_mul_ps(hs::load8(src + i), hs::load8(cos + i)));
        const __m256 b = hs::round_bf16(_mm256_mul_ps(hs::load8(src + j), hs::load8(sin + i)));
        hs::store8(dst + i, _mm256_add_ps(a, b));
    }
    for (int64_t i = R; i < D; i++) dst[i] = src[i];
}

// y: [T, ld] rows of q | k | v (H, KVH, KVH heads of D); cos, sin: [T, R]; slots: [T];
// caches: [KVH, slots, D] (head_stride = slots * D); q: [T, H, D]
template <typename T>
void rope_kv(const T *y, int64_t tokens, int64_t ld, int64_t H, int64_t KVH, int64_t D, int64_t R,
             const T *cos, const T *sin, const int64_t *slots, T *k_cache, T *v_cache, int64_t head_stride,
             T *q) {
#pragma omp parallel for if (tokens * (H + 2 * KVH) * D >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const T *yt = y + t * ld, *c = cos + t * R, *s = sin + t * R;
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < H; h++) rotate(yt + h * D, c, s, R, D, q + (t * H + h) * D);
        for (int64_t g = 0; g < KVH; g++) {
            rotate(yt + (H + g) * D, c, s, R, D, k_cache + g * head_stride + slot * D);
            const T *v = yt + (H + KVH + g) * D;
            T *dst = v_cache + g * head_stride + slot * D;
            for (int64_t i = 0; i < D; i++) dst[i] = v[i];
        }
    }
}

// gu: [rows, 2 * n] (gate | up) -> out: [rows, n] = silu(gate) * up, silu rounded as its own op
template <typename T>
__attribute__((target("avx2,fma")))
void silu_mul(const T *gu, int64_t rows, int64_t n, T *out) {
#pragma omp parallel for if (rows * n >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gu + r * 2 * n, *u = g + n;
        T *o = out + r * n;
        const int64_t n8 = n & ~(int64_t)7;
        for (int64_t i = 0; i < n8; i += 8) {
            // sigmoid from e^-|x| <= 1 (no overflow): 1 / (1 + e) for x >= 0, e / (1 + e) below
            const __m256 x = hs::load8(g + i);
            const __m256 minus_abs = _mm256_or_ps(x, _mm256_set1_ps(-0.0f));  // -|x|
            const __m256 e = hs::exp8(minus_abs);
            const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, x);  // x's sign bit picks e
            const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            hs::store8(o + i, _mm256_mul_ps(hs::rounded8(_mm256_mul_ps(x, sig), g), hs::load8(u + i)));
        }
        for (int64_t i = n8; i < n; i++) {
            const float xv = to_f32(g[i]);
            store(o + i, rounded<T>(xv / (1.0f + expf(-xv))) * to_f32(u[i]));
        }
    }
}

}  // namespace

extern "C" {

// dtype 1 bfloat16, 2 float32; every tensor contiguous. Returns 0, or -1 for a dtype it does not take.
int hs_add_rmsnorm(int dtype, const void *x, const void *delta, const void *weight, float eps, int64_t rows,
                   int64_t n, void *out, void *sum) {
    if (dtype == 1)
        add_rmsnorm((const uint16_t *)x, (const uint16_t *)delta, (const uint16_t *)weight, eps, rows, n,
                    (uint16_t *)out, (uint16_t *)sum);
    else if (dtype == 2)
        add_rmsnorm((const float *)x, (const float *)delta, (const float *)weight, eps, rows, n, (float *)out,
                    (float *)sum);
    else
        return -1;
    return 0;
}

int hs_rope_kv(int dtype, const void *y, int64_t tokens, int64_t ld, int64_t H, int64_t KVH, int64_t D,
               int64_t R, const void *cos, const void *sin, const int64_t *slots, void *k_cache, void *v_cache,
               int64_t head_stride, void *q) {
    if (R > D || R % 2 != 0) return -1;
    if (dtype == 1)
        rope_kv((const uint16_t *)y, tokens, ld, H, KVH, D, R, (const uint16_t *)cos, (const uint16_t *)sin,
                slots, (uint16_t *)k_cache, (uint16_t *)v_cache, head_stride, (uint16_t *)q);
    else if (dtype == 2)
        rope_kv((const float *)y, tokens, ld, H, KVH, D, R, (const float *)cos, (const float *)sin, slots,
                (float *)k_cache, (float *)v_cache, head_stride, (float *)q);
    else
        return -1;
    return 0;
}

int hs_silu_mul(int dtype, const void *gu, int64_t rows, int64_t n, void *out) {
    if (dtype == 1)
        silu_mul((const uint16_t *)gu, rows, n, (uint16_t *)out);
    else if (dtype == 2)
        silu_mul((const float *)gu, rows, n, (float *)out);
    else
        return -1;
    return 0;
}

}  // extern "C"
