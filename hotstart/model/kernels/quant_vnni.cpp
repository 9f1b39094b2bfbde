// AVX512-VNNI rows of ggml blocks times int8 activations, unpacked in registers (no scratch in memory).
//
// A row is taken 16 groups at a time (512 elements; 256 for Q6_K's groups of 16): their scales s and
// offsets o as two vectors (a gather of the 16 blocks' fp16 d / m, or a K-quant's 6-bit scales
// decoded with byte shuffles), then 64 elements per vector: the codes u unpacked from the blocks'
// nibbles (and high bits) into 64 bytes in x's order, vpdpbusd with each token's 64 int8 activations
// into 16 int32 sums (lane l: elements 4l .. 4l + 3, so one group's lanes are contiguous), converted and
// scaled lane by lane by s_g d_a(g) (a permute of the 16 groups' scales) into a float accumulator. The
// offsets' term is one fma of o with d_a * sum(q) per 16 groups. quant_matmul.cpp calls a row per token
// (steps of 2+ tokens: quant_tiles.cpp); the arithmetic is quant.h's, so it equals the scratch kernels'.

#include "quant_vnni.h"

namespace hsq {
namespace {

// how far ahead of the chunk in hand the weights are asked for (a prefetch never faults: past the matrix's
// end it is dropped). The hardware's streamers alone left a decode step's long rows (K = 18944) at 13-16
// GB/s on 2 threads; with it 19-22, and the 7B Q4_K_M's step went from 206 to 164 ms (docs/serving.md)
constexpr int64_t PREFETCH_BYTES = 2048;
// into L1, or for rows longer than this into L2 only: a row's x past ~8K elements (and its groups' d_a,
// d_a sum(q)) no longer fits L1 beside the weights fetched into it, and is read back from L2 for every row
// (K = 18944 streamed at 16-18 GB/s, 26-29 with x made L1-sized; weights fetched into L2 only: 0.82-0.94x
// the time there, but 1.2-1.3x at K = 3584, where x stays in L1 either way)
constexpr int64_t L1_ROW = 8192;
VNNI_INLINE void prefetch(const char *p, int64_t K) {
    if (K > L1_ROW)
        _mm_prefetch(p, _MM_HINT_T1);
    else
        _mm_prefetch(p, _MM_HINT_T0);
}

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

// R rows of the same length at once (R = 2: long rows, rows2 below): each vector of x loaded once for them
template <int T, int R>
VNNI void rows_of(const uint8_t *const *r, int64_t K, const int8_t *q, const float *da, const float *sa, float *out) {
    constexpr int GS = T == Q6_K ? 16 : 32, PER = 16 * GS / 64;  // vectors per 16 groups
    const int64_t groups = K / GS;
    __m512 acc[R], acc2[R];  // two chains per row: the fma's latency
    for (int i = 0; i < R; i++) acc[i] = acc2[i] = _mm512_setzero_ps();
    Info in;
    info(T, in);
    const int64_t chunk_bytes = 16 * GS / in.block * in.bytes;  // 16 groups' blocks
    for (int64_t c = 0; c * 16 < groups; c++) {
        const int valid = groups - c * 16 < 16 ? (int)(groups - c * 16) : 16;
        __m512 scale[R];
        for (int i = 0; i < R; i++) {
            for (int64_t p = 0; p < chunk_bytes; p += 64)  // PREFETCH_BYTES ahead: past a row's end, the next row
                prefetch((const char *)r[i] + (c * chunk_bytes + PREFETCH_BYTES + p), K);
            __m512 s, o;
            scales<T>(r[i], c, valid, s, o);
            scale[i] = _mm512_mul_ps(s, _mm512_loadu_ps(da + c * 16));
            acc[i] = _mm512_fmadd_ps(o, _mm512_loadu_ps(sa + c * 16), acc[i]);
        }
        const int vs = (valid * GS + 63) / 64;
        for (int v = 0; v < vs && v < PER; v++) {
            const __m512i x = _mm512_loadu_si512(q + c * 16 * GS + 64 * v);
            const __m512i idx = _mm512_load_si512(GS == 32 ? LANE32[v] : LANE16[v]);
            for (int i = 0; i < R; i++) {
                const __m512i u = codes<T>(r[i], c, v, GS == 32 && 2 * v + 1 >= valid);
                const __m512 y = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x));
                const __m512 sv = _mm512_permutexvar_ps(idx, scale[i]);
                if (v & 1)
                    acc2[i] = _mm512_fmadd_ps(y, sv, acc2[i]);
                else
                    acc[i] = _mm512_fmadd_ps(y, sv, acc[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc2[i]));
}

template <int T>
VNNI float row(const uint8_t *r, int64_t K, const int8_t *q, const float *da, const float *sa) {
    float out;
    rows_of<T, 1>(&r, K, q, da, sa, &out);
    return out;
}

template <int T>
VNNI void rows2(const uint8_t *r0, const uint8_t *r1, int64_t K, const int8_t *q, const float *da, const float *sa,
                float *out) {
    const uint8_t *r[2] = {r0, r1};
    rows_of<T, 2>(r, K, q, da, sa, out);
}

// Q4_0, Q4_1, Q5_0, Q5_1, four blocks at a time: their 64 bytes of nibbles picked out of the blocks by one
// vpermt2b, then the low nibbles (elements 0-15 of each block) and the high ones (16-31) are two vectors
// whose lanes 4i .. 4i + 3 both belong to block i: both vpdpbusd into one sum, one convert and scale per
// 128 elements. x comes in the same order (quant.h: nibble order).
template <int T>
VNNI float row_nibbles(const uint8_t *r, int64_t K, const int8_t *q, const float *da, const float *sa) {
    Info in;
    info(T, in);
    const bool five = T == Q5_0 || T == Q5_1, minned = T == Q4_1 || T == Q5_1;
    const int qs = 2 + (minned ? 2 : 0) + (five ? 4 : 0);
    alignas(64) uint8_t pick[64];  // byte 16 i + j: block i's qs[j] within the 4 blocks' window
    for (int i = 0; i < 64; i++) pick[i] = (uint8_t)(in.bytes * (i / 16) + qs + i % 16);
    const __m512i idx_pick = _mm512_load_si512(pick), f = _mm512_set1_epi8(0x0f);
    const int64_t blocks = K / 32;
    __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    for (int64_t c = 0; c * 16 < blocks; c++) {
        const int valid = blocks - c * 16 < 16 ? (int)(blocks - c * 16) : 16;
        for (int64_t p = 0; p < 16 * in.bytes; p += 64)
            prefetch((const char *)r + (c * 16 * in.bytes + PREFETCH_BYTES + p), K);
        __m512 s, o;
        scales<T>(r, c, valid, s, o);
        const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(da + c * 16));
        acc = _mm512_fmadd_ps(o, _mm512_loadu_ps(sa + c * 16), acc);
        for (int k = 0; 4 * k < valid; k++) {  // blocks 16 c + 4 k .. + 3 (fewer at the row's end)
            const int nb = valid - 4 * k < 4 ? valid - 4 * k : 4;
            const uint8_t *b = r + (c * 16 + 4 * k) * in.bytes;
            const int64_t len = nb * in.bytes;  // <= 96 bytes: a masked second load stays in the row
            const __m512i z0 = _mm512_maskz_loadu_epi8(len >= 64 ? ~0ull : (1ull << len) - 1, b);
            const __m512i z1 = _mm512_maskz_loadu_epi8(len > 64 ? (1ull << (len - 64)) - 1 : 0, b + 64);
            const __m512i z = _mm512_permutex2var_epi8(z0, idx_pick, z1);
            __m512i lo = _mm512_and_si512(z, f), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), f);
            if (five) {  // qh bit e of block i: element e's fifth bit (e < 16: lo, else hi)
                uint64_t mlo = 0, mhi = 0;
                for (int i = 0; i < nb; i++) {
                    uint32_t qh;
                    memcpy(&qh, b + i * in.bytes + qs - 4, 4);
                    mlo |= (uint64_t)(qh & 0xffff) << (16 * i);
                    mhi |= (uint64_t)(qh >> 16) << (16 * i);
                }
                lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_cvtu64_mask64(mlo), _mm512_set1_epi8(16)));
                hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_cvtu64_mask64(mhi), _mm512_set1_epi8(16)));
            }
            const int8_t *x = q + (c * 16 + 4 * k) * 32;
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
            dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(x + 64));
            const __m512i lane = _mm512_add_epi32(_mm512_set1_epi32(4 * k), _mm512_load_si512(LANE16[0]));
            const __m512 y = _mm512_cvtepi32_ps(dot), sv = _mm512_permutexvar_ps(lane, scale);
            if (k & 1)
                acc2 = _mm512_fmadd_ps(y, sv, acc2);
            else
                acc = _mm512_fmadd_ps(y, sv, acc);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
}

}  // namespace

RowsVnni rows2_vnni_for(int type) {
    switch (type) {
        case Q8_0: return rows2<Q8_0>;
        case Q4_K: return rows2<Q4_K>;
        case Q5_K: return rows2<Q5_K>;
        case Q6_K: return rows2<Q6_K>;
        default: return nullptr;  // the 4- and 5-bit block types: one row at a time (row_nibbles)
    }
}

RowVnni row_vnni_for(int type) {
    switch (type) {
        case Q4_0: return row_nibbles<Q4_0>;
        case Q4_1: return row_nibbles<Q4_1>;
        case Q5_0: return row_nibbles<Q5_0>;
        case Q5_1: return row_nibbles<Q5_1>;
        case Q8_0: return row<Q8_0>;
        case Q4_K: return row<Q4_K>;
        case Q5_K: return row<Q5_K>;
        case Q6_K: return row<Q6_K>;
        default: return nullptr;
    }
}

}  // namespace hsq
