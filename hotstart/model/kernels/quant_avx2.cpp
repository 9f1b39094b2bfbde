// AVX2 rows of ggml blocks times one token's int8 activations, unpacked in registers (no scratch).
//
// The AVX2 path of 2+ tokens unpacks a segment of a row into quant.h's one form in L1 and multiplies
// it with up to 4 tokens (quant_matmul.cpp): for one token that is a second pass over every weight
// (a store and a load of each code, its group's scale and offset as floats). Here each block's codes
// are unpacked in registers, 32 per vector in x's order, and multiplied at once: vpmaddubsw (u8 x s8,
// pairs summed to int16) and vpmaddwd with ones (to int32: lane l sums elements 4l .. 4l + 3), one
// convert, and one fma with the block's s d_a broadcast (Q6_K: two groups of 16 per vector, their two
// scales in the two halves). The offsets' term o d_a sum(q) is a scalar fma per group. Q8_0's codes
// are signed: vpmaddubsw takes |w| and q with w's sign (u = w + 128 would overflow its int16 pairs);
// every other type's u is at most 63, so a pair of products stays within int16. The arithmetic is
// quant.h's (integer dot products per group, then s d_a and o d_a sum(q) in float), so the results
// equal the scratch kernels' up to float32 rounding. Weights are asked for PREFETCH_BYTES ahead, as the
// AVX512-VNNI rows do: a decode step streams every row once, longer than the prefetchers follow alone.

#include "quant.h"

namespace hsq {
namespace {

#define AVX2_ROW __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2_ROW inline __attribute__((always_inline))

constexpr int64_t PREFETCH_BYTES = 2048;

AVX2_INLINE float half(const uint8_t *p) {  // fp16 at P -> float (F16C: exact)
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// u (each byte <= 127) times q: 8 int32 lanes, lane l the sum of elements 4l .. 4l + 3, as floats
AVX2_INLINE __m256 dot32(__m256i u, __m256i q) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1)));
}

// 16 bytes of nibbles -> 32 codes: the low nibbles (elements 0-15), then the high ones (16-31)
AVX2_INLINE __m256i nibbles(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0f));
}

// bit j of h -> byte j = 16 (a fifth bit), else 0
AVX2_INLINE __m256i fifth_bits(uint32_t h) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

AVX2_INLINE float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

AVX2_INLINE void prefetch(const uint8_t *p, int64_t bytes) {  // a prefetch never faults (past the end: dropped)
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + PREFETCH_BYTES + o, _MM_HINT_T0);
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32, one scale (and a min for _1) each; da, sa per block
template <int T>
AVX2_ROW float row32(const uint8_t *r, int64_t K, const int8_t *q, const float *da, const float *sa) {
    Info in;
    info(T, in);
    const bool five = T == Q5_0 || T == Q5_1, minned = T == Q4_1 || T == Q5_1;
    const int qs = 2 + (minned ? 2 : 0) + (five ? 4 : 0);
    const float shift = minned || T == Q8_0 ? 0.0f : -(float)(1 << offset_shift(T));  // Q4_0, Q5_0: o = shift d
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();  // two chains: the fma's latency
    float off = 0.0f;
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = r + b * in.bytes;
        if (b % 4 == 0) prefetch(blk, 4 * in.bytes);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const float d = half(blk);
        __m256 y;
        if (T == Q8_0) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            y = dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));  // |w| . (x with w's sign)
        } else {
            __m256i u = nibbles(blk + qs);
            if (five) {
                uint32_t h;
                memcpy(&h, blk + qs - 4, 4);
                u = _mm256_or_si256(u, fifth_bits(h));
            }
            y = dot32(u, x);
            off += (minned ? half(blk + 2) : shift * d) * sa[b];
        }
        if (b & 1)
            acc2 = _mm256_fmadd_ps(y, _mm256_set1_ps(d * da[b]), acc2);
        else
            acc = _mm256_fmadd_ps(y, _mm256_set1_ps(d * da[b]), acc);
    }
    return hsum(_mm256_add_ps(acc, acc2)) + off;
}

// ggml's get_scale_min_k4: the 8 six-bit scales and mins of a Q4_K / Q5_K super-block
inline void scales_mins(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0x0f) | ((q[j] >> 6) << 4);
        mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

// Q4_K, Q5_K: super-blocks of 256 (d, dmin, 12 bytes of scales and mins, [qh 32,] qs 128): per 64
// elements 32 bytes of qs, low nibbles the first 32, high the next; Q5_K's fifth bits: qh[l] bit 2p for
// element 64p + l, bit 2p + 1 for 64p + 32 + l. da, sa per group of 32.
template <int T>
AVX2_ROW float row_k(const uint8_t *r, int64_t K, const int8_t *q, const float *da, const float *sa) {
    Info in;
    info(T, in);
    const bool five = T == Q5_K;
    const __m256i f = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    float off = 0.0f;
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *blk = r + sb * in.bytes;
        prefetch(blk, in.bytes);
        const float d = half(blk), dmin = half(blk + 2);
        uint8_t sc[8], mn[8];
        scales_mins(blk + 4, sc, mn);
        const uint8_t *qs = blk + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const int64_t g = sb * 8 + 2 * p;  // the two groups of these 64 elements
            const __m256i z = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            __m256i lo = _mm256_and_si256(z, f), hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), f);
            if (five) {
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * p))), b1 = _mm256_set1_epi8((char)(2 << (2 * p)));
                const __m256i sixteen = _mm256_set1_epi8(16);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
            }
            const __m256 ylo = dot32(lo, _mm256_loadu_si256((const __m256i *)(q + 32 * g)));
            const __m256 yhi = dot32(hi, _mm256_loadu_si256((const __m256i *)(q + 32 * g + 32)));
            acc = _mm256_fmadd_ps(ylo, _mm256_set1_ps(d * sc[2 * p] * da[g]), acc);
            acc2 = _mm256_fmadd_ps(yhi, _mm256_set1_ps(d * sc[2 * p + 1] * da[g + 1]), acc2);
            off -= dmin * (mn[2 * p] * sa[g] + mn[2 * p + 1] * sa[g + 1]);
        }
    }
    return hsum(_mm256_add_ps(acc, acc2)) + off;
}

// Q6_K: super-blocks of 256 (ql 128, qh 64, 16 int8 scales, d): per 128 elements n, 32 bytes ql0 =
// ql[64n..], ql1 = ql[64n + 32..], qh = qh[32n..]; element 128n + 32i + l: low / high nibble of ql0 / ql1
// and bits 2i, 2i + 1 of qh[l]; each 32 two groups of 16 (scales 8n + 2i, + 1); u - 32 = w. da, sa per 16.
AVX2_ROW float row_q6k(const uint8_t *r, int64_t K, const int8_t *q, const float *da, const float *sa) {
    const __m256i f = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    float off = 0.0f;
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *blk = r + sb * 210;
        prefetch(blk, 210);
        const float d = half(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int n = 0; n < 2; n++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m256i u[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, f), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4)),
                _mm256_or_si256(_mm256_and_si256(ql1, f),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), f),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), f),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4))};
            for (int i = 0; i < 4; i++) {
                const int64_t g = sb * 16 + 8 * n + 2 * i;  // groups of 16: g, g + 1
                const float s0 = d * sc[8 * n + 2 * i], s1 = d * sc[8 * n + 2 * i + 1];
                const __m256 y = dot32(u[i], _mm256_loadu_si256((const __m256i *)(q + 16 * g)));
                const __m256 s = _mm256_set_m128(_mm_set1_ps(s1 * da[g + 1]), _mm_set1_ps(s0 * da[g]));
                if (i & 1)
                    acc2 = _mm256_fmadd_ps(y, s, acc2);
                else
                    acc = _mm256_fmadd_ps(y, s, acc);
                off -= (float)(1 << offset_shift(Q6_K)) * (s0 * sa[g] + s1 * sa[g + 1]);
            }
        }
    }
    return hsum(_mm256_add_ps(acc, acc2)) + off;
}

}  // namespace

RowVnni row_avx2_for(int type) {
    switch (type) {
        case Q4_0: return row32<Q4_0>;
        case Q4_1: return row32<Q4_1>;
        case Q5_0: return row32<Q5_0>;
        case Q5_1: return row32<Q5_1>;
        case Q8_0: return row32<Q8_0>;
        case Q4_K: return row_k<Q4_K>;
        case Q5_K: return row_k<Q5_K>;
        case Q6_K: return row_q6k;
        default: return nullptr;
    }
}

}  // namespace hsq
