// ggml's blocks -> the quantized matmul's one form (quant.h: u per element, s and o per group), a segment
// of a row at a time. A portable version of each type (the reference) and an AVX2 one (32 elements per
// vector: one block of the 32-element types, a quarter of a K-quant's nibbles; both AVX2 and AVX-512
// hosts use it). Block layouts, as ggml-common.h lays them out (d, m: fp16):
//   Q8_0 d, q[32] int8            Q4_0 d, qs[16] (element j: qs[j] & 15, j + 16: qs[j] >> 4)
//   Q4_1 d, m, qs[16]             Q5_0 d, qh[4] (bit e: element e's 5th bit), qs[16]     Q5_1 d, m, qh[4], qs[16]
//   Q4_K d, dmin, scales[12] (8 6-bit scales and mins), qs[128]: 64 elements per 32 bytes, low then high
//        nibbles       Q5_K as Q4_K with qh[32] before qs (bit i of qh[l]: element 32 i + l's 5th bit)
//   Q6_K ql[128], qh[64], scales[16] int8 (per 16 elements), d; per half of 128: ql[64], qh[32]

#include "quant.h"

namespace hsq {
namespace {

// ---- portable ----------------------------------------------------------------------------------
void kscale(const uint8_t *q, int j, int &sc, int &m) {  // ggml's 6-bit scale and min j of a K-quant
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <int T>
void unpack_ref(const uint8_t *b, int64_t nb, Unpacked &seg) {
    Info in;
    info(T, in);
    for (int64_t i = 0; i < nb; i++, b += in.bytes) {
        uint8_t *u = seg.u + i * in.block;
        float *s = seg.s + i * (in.block / in.group), *o = seg.o + i * (in.block / in.group);
        if (T == Q8_0) {
            for (int e = 0; e < 32; e++) u[e] = (uint8_t)(b[2 + e] ^ 0x80);
            s[0] = fp16_at(b);
            o[0] = -128.0f * s[0];
        } else if (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
            const bool five = T == Q5_0 || T == Q5_1, minned = T == Q4_1 || T == Q5_1;
            const uint8_t *qs = b + 2 + (minned ? 2 : 0) + (five ? 4 : 0);
            uint32_t qh = 0;
            if (five) memcpy(&qh, b + 2 + (minned ? 2 : 0), 4);
            for (int j = 0; j < 16; j++) {
                u[j] = (uint8_t)((qs[j] & 0xf) | (((qh >> j) & 1) << 4));
                u[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
            }
            s[0] = fp16_at(b);
            o[0] = minned ? fp16_at(b + 2) : (five ? -16.0f : -8.0f) * s[0];
        } else if (T == Q4_K || T == Q5_K) {
            const float d = fp16_at(b), dmin = fp16_at(b + 2);
            const uint8_t *qh = b + 16, *qs = b + (T == Q5_K ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                kscale(b + 4, j, sc, m);
                s[j] = d * (float)sc;
                o[j] = -dmin * (float)m;
                for (int l = 0; l < 32; l++) {
                    const uint8_t q = qs[32 * (j / 2) + l];
                    const int high = T == Q5_K ? ((qh[l] >> j) & 1) << 4 : 0;
                    u[32 * j + l] = (uint8_t)(((j & 1) ? q >> 4 : q & 0xf) | high);
                }
            }
        } else {  // Q6_K
            const float d = fp16_at(b + 208);
            for (int g = 0; g < 16; g++) {
                s[g] = d * (float)(int8_t)b[192 + g];
                o[g] = -32.0f * s[g];
            }
            for (int n = 0; n < 2; n++) {
                const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
                uint8_t *y = u + 128 * n;
                for (int l = 0; l < 32; l++) {
                    y[l] = (uint8_t)((ql[l] & 0xf) | ((qh[l] & 3) << 4));
                    y[l + 32] = (uint8_t)((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4));
                    y[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    y[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
        }
    }
}

// ---- AVX2 ------------------------------------------------------------------------------------------
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

TARGET_AVX2 inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

TARGET_AVX2 inline void store_nibbles16(const uint8_t *qs, uint8_t *u, __m256i high) {  // 16 bytes -> 32 elements
    const __m128i x = _mm_loadu_si128((const __m128i *)qs), f = _mm_set1_epi8(0x0f);
    const __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), f), _mm_and_si128(x, f));
    _mm256_storeu_si256((__m256i *)u, _mm256_or_si256(v, high));
}

TARGET_AVX2 inline __m256i bits_to_16(uint32_t qh) {  // bit e of qh -> byte e: 16 if set, else 0
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

template <int T>
TARGET_AVX2 void unpack_avx2(const uint8_t *b, int64_t nb, Unpacked &seg) {
    Info in;
    info(T, in);
    const __m256i f = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; i++, b += in.bytes) {
        uint8_t *u = seg.u + i * in.block;
        float *s = seg.s + i * (in.block / in.group), *o = seg.o + i * (in.block / in.group);
        if (T == Q8_0) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
            _mm256_storeu_si256((__m256i *)u, _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
            s[0] = half(b);
            o[0] = -128.0f * s[0];
        } else if (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
            const bool five = T == Q5_0 || T == Q5_1, minned = T == Q4_1 || T == Q5_1;
            __m256i high = _mm256_setzero_si256();
            if (five) {
                uint32_t qh;
                memcpy(&qh, b + 2 + (minned ? 2 : 0), 4);
                high = bits_to_16(qh);
            }
            store_nibbles16(b + 2 + (minned ? 2 : 0) + (five ? 4 : 0), u, high);
            s[0] = half(b);
            o[0] = minned ? half(b + 2) : (five ? -16.0f : -8.0f) * s[0];
        } else if (T == Q4_K || T == Q5_K) {
            const float d = half(b), dmin = half(b + 2);
            const uint8_t *qs = b + (T == Q5_K ? 48 : 16);
            const __m256i qh = T == Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            const __m256i one = _mm256_set1_epi8(1);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                kscale(b + 4, j, sc, m);
                s[j] = d * (float)sc;
                o[j] = -dmin * (float)m;
            }
            for (int j = 0; j < 4; j++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                __m256i lo = _mm256_and_si256(q, f), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), f);
                if (T == Q5_K) {  // 16-bit shifts, then one bit per byte: nothing crosses a byte
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                                                 _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                                                 _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
                }
                _mm256_storeu_si256((__m256i *)(u + 64 * j), lo);
                _mm256_storeu_si256((__m256i *)(u + 64 * j + 32), hi);
            }
        } else {  // Q6_K
            const float d = half(b + 208);
            for (int g = 0; g < 16; g++) {
                s[g] = d * (float)(int8_t)b[192 + g];
                o[g] = -32.0f * s[g];
            }
            const __m256i three = _mm256_set1_epi8(3);
            for (int n = 0; n < 2; n++) {
                const __m256i q0 = _mm256_loadu_si256((const __m256i *)(b + 64 * n));
                const __m256i q1 = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
                const __m256i lows[4] = {_mm256_and_si256(q0, f), _mm256_and_si256(q1, f),
                                         _mm256_and_si256(_mm256_srli_epi16(q0, 4), f),
                                         _mm256_and_si256(_mm256_srli_epi16(q1, 4), f)};
                for (int k = 0; k < 4; k++) {
                    const __m256i hk = _mm256_and_si256(_mm256_srli_epi16(h, 2 * k), three);
                    _mm256_storeu_si256((__m256i *)(u + 128 * n + 32 * k),
                                        _mm256_or_si256(lows[k], _mm256_slli_epi16(hk, 4)));
                }
            }
        }
    }
}

template <int T>
Unpack pick(int isa) {
    return isa >= AVX2 ? unpack_avx2<T> : unpack_ref<T>;
}

}  // namespace

Unpack unpack_for(int type, int isa) {
    switch (type) {
        case Q4_0: return pick<Q4_0>(isa);
        case Q4_1: return pick<Q4_1>(isa);
        case Q5_0: return pick<Q5_0>(isa);
        case Q5_1: return pick<Q5_1>(isa);
        case Q8_0: return pick<Q8_0>(isa);
        case Q4_K: return pick<Q4_K>(isa);
        case Q5_K: return pick<Q5_K>(isa);
        case Q6_K: return pick<Q6_K>(isa);
        default: return nullptr;
    }
}

}  // namespace hsq
