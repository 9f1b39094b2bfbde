// Linear layers for steps of a few to a few dozen tokens, bfloat16 (AVX512-BF16): out = x w^T (+ bias).
//
// Between the GEMV (gemv.cpp: up to 4 tokens, bound by the weights' read) and prefill-sized matmuls
// (oneDNN: ~200 GMAC/s on 2 cores at 200 tokens), oneDNN's prepacked kernels reach 45-85 GMAC/s at 8-32
// tokens on the 2-core AVX512-BF16 EPYC, against a peak of ~220. Here the weights are repacked once so
// that 16 output features x 2 inputs fill one vector: [N/64][K/2][64][2] (pairs along K, as vdpbf16ps
// multiplies them), read front to back by one stream per 64 outputs. A tile of up to 6 tokens x 64
// outputs keeps 24 accumulators in registers; each step over K loads 4 weight vectors, broadcasts one
// pair of inputs per token, and issues 24 dot products: no horizontal sums, no reloads of x per output.
//
// Packed by hotstart/model/cpu_kernels.py (Tiles): N padded to 64 and K to even with zeros.

#include <omp.h>

#include "common.h"

namespace {

constexpr int MAX_MB = 6;  // tokens per tile: 6 x 4 accumulators + 4 weights + 1 input = 29 registers

struct Call {
    const uint16_t *x;  // [M, K]
    int64_t M, K;
    const uint16_t *w;  // packed [N/64][K2][64][2], K2 = ceil(K / 2)
    int64_t N;
    const uint16_t *bias;  // [N] or null
    void *out;             // [M, ldo] float32 or bf16
    int64_t ldo;
    bool out_f32;
};

template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void tile(const Call &c, int64_t m0, int64_t nb) {
    const int64_t K2 = (c.K + 1) / 2, kfull = c.K / 2;
    const uint16_t *w = c.w + nb * K2 * 128;
    const uint16_t *x = c.x + m0 * c.K;
    __m512 acc[MB][4];
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K2; kp++) {
        const uint16_t *wk = w + kp * 128;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
        for (int m = 0; m < MB; m++) {
            int32_t pair;  // x[m, 2kp] in the low half, x[m, 2kp + 1] (0 past K) in the high one
            if (kp < kfull)
                memcpy(&pair, x + m * c.K + 2 * kp, 4);
            else
                pair = x[m * c.K + 2 * kp];
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xb, w2);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xb, w3);
        }
    }
    for (int j = 0; j < 4; j++) {
        const int64_t col = nb * 64 + j * 16;
        if (col >= c.N) break;
        const int64_t left = c.N - col < 16 ? c.N - col : 16;
        const __mmask16 mask = (__mmask16)(left == 16 ? 0xffff : (1u << left) - 1);
        __m512 b = _mm512_setzero_ps();
        if (c.bias != nullptr)
            b = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, c.bias + col)), 16));
        for (int m = 0; m < MB; m++) {
            const __m512 v = _mm512_add_ps(acc[m][j], b);
            if (c.out_f32)
                _mm512_mask_storeu_ps((float *)c.out + (m0 + m) * c.ldo + col, mask, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)c.out + (m0 + m) * c.ldo + col, mask, hs::bf16x16(v));
        }
    }
}

using Tile = void (*)(const Call &, int64_t, int64_t);
const Tile TILES[MAX_MB] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

}  // namespace

extern "C" {

// x: [M, K] bf16 contiguous; w: packed (above); bias: [N] bf16 or null; out: [M, ldo], float32 if out_f32
// else bf16. Needs AVX512-BF16 (the caller checks the CPU). Returns 0, or -1 for bad arguments.
int hs_tiles(const void *x, int64_t M, int64_t K, const void *w, int64_t N, const void *bias, void *out,
             int64_t ldo, int out_f32) {
    if (M < 1 || K < 1 || N < 1) return -1;
    const Call c{(const uint16_t *)x, M, K, (const uint16_t *)w, N, (const uint16_t *)bias, out, ldo,
                 out_f32 != 0};
    const int64_t blocks = (N + 63) / 64;
    const int64_t tiles = (M + MAX_MB - 1) / MAX_MB, base = M / tiles, extra = M % tiles;  // sizes within 1
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t mb = base + (t < extra ? 1 : 0);
            TILES[mb - 1](c, m0, nb);
            m0 += mb;
        }
    }
    return 0;
}

}  // extern "C"
