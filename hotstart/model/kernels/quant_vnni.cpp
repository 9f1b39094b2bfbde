// AVX512-VNNI rows of ggml blocks times int8 activations, unpacked in registers (no scratch in memory).
//
// A row is taken 16 groups at a time (512 elements; 256 for Q6_K's groups of 16): their scales s and
// offsets o as two vectors (a gather of the 16 blocks' fp16 d / m, or a K-quant's 6-bit scales
// decoded with byte shuffles), then 64 elements per vector: the codes u unpacked from the blocks'
// nibbles (and high bits) into 64 bytes in x's order, vpdpbusd with each token's 64 int8 activations
// into 16 int32 sums (lane l: elements 4l .. 4l + 3, so one group's lanes are contiguous), converted and
// scaled lane by lane by s_g d_a(g) (a permute of the 16 groups' scales) into a float accumulator. The
// offsets' term is one fma of o with d_a * sum(q) per 16 groups. quant_matmul.cpp calls row_vnni for
// up to 4 tokens at a time; the arithmetic is quant.h's, so it equals the scratch-based kernels' sums.

#include "quant_vnni.h"

namespace hsq {
namespace {

// LANE[v][l]: the group among 16 that lane l of vector v holds (GS 32: 2 per vector, GS 16: 4)
alignas(64) const int32_t LANE32[8][16] = {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3}, {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}, {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
alignas(64) const int32_t LANE16[4][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
    {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}, {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
    {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};

template <int T, int MM>
VNNI void row(const uint8_t *r, int64_t K, const int8_t *const *q, const float *const *da, const float *const *sa,
              float *sums) {
    constexpr int GS = T == Q6_K ? 16 : 32, PER = 16 * GS / 64;  // vectors per 16 groups
    const int64_t groups = K / GS;
    __m512 acc[MM], acc2[MM];  // two chains per token: the fma's latency, not its throughput, bounds one
    for (int t = 0; t < MM; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c * 16 < groups; c++) {
        const int valid = groups - c * 16 < 16 ? (int)(groups - c * 16) : 16;
        __m512 s, o, scale[MM];
        scales<T>(r, c, valid, s, o);
        for (int t = 0; t < MM; t++) {
            scale[t] = _mm512_mul_ps(s, _mm512_loadu_ps(da[t] + c * 16));
            acc[t] = _mm512_fmadd_ps(o, _mm512_loadu_ps(sa[t] + c * 16), acc[t]);
        }
        const int vs = (valid * GS + 63) / 64;
        for (int v = 0; v < vs && v < PER; v++) {
            const __m512i u = codes<T>(r, c, v, GS == 32 && 2 * v + 1 >= valid);
            const __m512i idx = _mm512_load_si512(GS == 32 ? LANE32[v] : LANE16[v]);
            for (int t = 0; t < MM; t++) {
                const __m512i x = _mm512_loadu_si512(q[t] + c * 16 * GS + 64 * v);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
                if (v & 1)
                    acc2[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, scale[t]), acc2[t]);
                else
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, scale[t]), acc[t]);
            }
        }
    }
    for (int t = 0; t < MM; t++) sums[t] += _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
}

template <int T>
void rows_of(int mm, const uint8_t *r, int64_t K, const int8_t *const *q, const float *const *da,
             const float *const *sa, float *sums) {
    switch (mm) {
        case 1: row<T, 1>(r, K, q, da, sa, sums); break;
        case 2: row<T, 2>(r, K, q, da, sa, sums); break;
        case 3: row<T, 3>(r, K, q, da, sa, sums); break;
        default: row<T, 4>(r, K, q, da, sa, sums); break;
    }
}

}  // namespace

RowVnni row_vnni_for(int type) {
    switch (type) {
        case Q4_0: return rows_of<Q4_0>;
        case Q4_1: return rows_of<Q4_1>;
        case Q5_0: return rows_of<Q5_0>;
        case Q5_1: return rows_of<Q5_1>;
        case Q8_0: return rows_of<Q8_0>;
        case Q4_K: return rows_of<Q4_K>;
        case Q5_K: return rows_of<Q5_K>;
        case Q6_K: return rows_of<Q6_K>;
        default: return nullptr;
    }
}

}  // namespace hsq
