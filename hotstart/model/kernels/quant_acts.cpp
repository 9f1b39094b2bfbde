// x quantized for the quantized matmul (quant_matmul.cpp): int8 per 32 elements, scale d_a = max |x| /
// 127, rounded to nearest even (the AVX-512 and the scalar versions give the same bytes), as llama.cpp's
// vec_dot quantizes its activations; each group's d_a and d_a * sum(q) per group of 16 and of 32; and the
// layouts some kernels read: nibble order (quant_vnni.cpp's 4- and 5-bit rows), each 16-group chunk
// transposed (quant_tiles.cpp), 16 tokens a vector (quant_lanes.cpp).

#include <math.h>
#include <omp.h>

#include "quant.h"

namespace hsq {
namespace {

// one 32-element block of a token: q, d_a and the two halves' sums of q
template <typename T>
void quantize_block_ref(const T *x, int8_t *q, float &d, int &sum0, int &sum1) {
    float amax = 0.0f;
    for (int e = 0; e < 32; e++) amax = fmaxf(amax, fabsf(hs::to_f32(x[e])));
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    sum0 = sum1 = 0;
    for (int e = 0; e < 32; e++) {
        q[e] = (int8_t)nearbyintf(hs::to_f32(x[e]) * id);  // nearest even, as cvtps2dq
        (e < 16 ? sum0 : sum1) += q[e];
    }
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

template <typename T>
__attribute__((target("avx512f,avx512bw")))
void quantize_block_512(const T *x, int8_t *q, float &d, int &sum0, int &sum1) {  // equal to the _ref one
    const __m512 a = load16(x), b = load16(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    d = amax / 127.0f;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
    sum0 = _mm512_reduce_add_epi32(qa);
    sum1 = _mm512_reduce_add_epi32(qb);
}

template <typename T>
void quantize(const T *x, int64_t M, int64_t K, int isa, int tiles, Acts &a) {
    a.M = M;
    a.Kp = (K + 511) / 512 * 512;
    a.q.resize(M * a.Kp);
    for (auto *v : {&a.d16, &a.s16}) v->resize(M * a.Kp / 16);
    for (auto *v : {&a.d32, &a.s32}) v->resize(M * a.Kp / 32);
    const bool sums = tiles & 27;  // the tiles' folded offsets read the integer sums
    if (sums) {
        a.n16.assign(M * a.Kp / 16, 0);
        a.n32.assign(M * a.Kp / 32, 0);
    }
    for (int64_t m = 0; m < M && K < a.Kp; m++) {  // the padding: zeros
        memset(a.q.data() + m * a.Kp + K, 0, a.Kp - K);
        for (int64_t g = K / 16; g < a.Kp / 16; g++) a.d16[m * a.Kp / 16 + g] = a.s16[m * a.Kp / 16 + g] = 0.0f;
        for (int64_t g = K / 32; g < a.Kp / 32; g++) a.d32[m * a.Kp / 32 + g] = a.s32[m * a.Kp / 32 + g] = 0.0f;
    }
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < K / 32; b++) {
            float d;
            int s0, s1;
            int8_t *q = a.q.data() + m * a.Kp + 32 * b;
            if (isa == AVX512_VNNI)
                quantize_block_512(x + m * K + 32 * b, q, d, s0, s1);
            else
                quantize_block_ref(x + m * K + 32 * b, q, d, s0, s1);
            const int64_t g16 = m * a.Kp / 16 + 2 * b, g32 = m * a.Kp / 32 + b;
            a.d16[g16] = a.d16[g16 + 1] = a.d32[g32] = d;
            a.s16[g16] = d * (float)s0;
            a.s16[g16 + 1] = d * (float)s1;
            a.s32[g32] = d * (float)(s0 + s1);
            if (sums) {
                a.n16[g16] = s0;
                a.n16[g16 + 1] = s1;
                a.n32[g32] = s0 + s1;
            }
        }
    }
    if (tiles & 4) {
        a.qn.resize(M * a.Kp);
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < a.Kp / 32; b++)  // block b's halves to 16 (b % 4) of its 4-block set
                for (int h = 0; h < 2; h++)
                    memcpy(&a.qn[m * a.Kp + (b / 4) * 128 + 64 * h + 16 * (b % 4)], &a.q[m * a.Kp + 32 * b + 16 * h], 16);
    }
    for (int gs : {16, 32}) {
        if (!(tiles & (gs == 16 ? 1 : 2))) continue;
        std::vector<int8_t> &qt = gs == 16 ? a.qt16 : a.qt32;
        std::vector<float> &dt = gs == 16 ? a.dt16 : a.dt32, &st = gs == 16 ? a.st16 : a.st32;
        std::vector<int32_t> &nt = gs == 16 ? a.nt16 : a.nt32;
        qt.resize(M * a.Kp);
        dt.resize(M * a.Kp / gs);
        st.resize(M * a.Kp / gs);
        nt.resize(M * a.Kp / gs);
        transpose_acts(gs, M, a.Kp, a.q.data(), a.d(gs), a.s(gs), (gs == 16 ? a.n16 : a.n32).data(), qt.data(),
                       dt.data(), st.data(), nt.data());
    }
    if (tiles & 24) {  // 16 tokens a vector (quant_lanes.cpp)
        a.xl.resize((M + LANE_TOKENS - 1) / LANE_TOKENS * a.Kp / 4 * LANE_TOKENS);
        token_lanes(M, a.Kp, a.q.data(), a.xl.data());
    }
    for (int gs : {16, 32}) {
        if (!(tiles & (gs == 16 ? 8 : 16))) continue;
        std::vector<float> &dl = gs == 16 ? a.dl16 : a.dl32, &sl = gs == 16 ? a.sl16 : a.sl32;
        std::vector<int32_t> &nl = gs == 16 ? a.nl16 : a.nl32;
        const int64_t size = (M + LANE_TOKENS - 1) / LANE_TOKENS * (a.Kp / gs) * LANE_TOKENS;
        dl.resize(size);
        sl.resize(size);
        nl.resize(size);
        token_lanes(gs, M, a.Kp, a.d(gs), a.s(gs), (gs == 16 ? a.n16 : a.n32).data(), dl.data(), sl.data(),
                    nl.data());
    }
}

}  // namespace

void quantize_acts(const void *x, int xdtype, int64_t M, int64_t K, int isa, int tiles, Acts &a) {
    if (xdtype == 1)
        quantize((const uint16_t *)x, M, K, isa, tiles, a);
    else
        quantize((const float *)x, M, K, isa, tiles, a);
}

}  // namespace hsq
