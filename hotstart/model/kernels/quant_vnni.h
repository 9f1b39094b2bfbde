// AVX512-VNNI pieces of the quantized matmul shared by quant_vnni.cpp (rows of 1 token, in registers) and
// quant_tiles.cpp (steps of 2+ tokens, over each row transposed once): a row's scales and offsets 16 groups
// at a time, and its codes 64 elements at a time in x's order (quant.h's form, unpacked in registers).

#pragma once

#include "quant.h"

namespace hsq {

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx512vbmi,f16c,fma")))
#define VNNI_INLINE VNNI inline __attribute__((always_inline))  // per vector / chunk: no call in the loop

VNNI_INLINE __m512i both_halves(const void *p) {  // 32 bytes at P in each half: a broadcast load (no shuffle)
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

VNNI_INLINE float half_at(const uint8_t *p) {  // fp16 at P -> float (F16C: exact, as fp16_at)
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

VNNI inline __m512 halves(__m512i v) {  // the low fp16 of each 32-bit lane -> float32
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
}

// the 16 groups of chunk c: s and o vectors; groups past `valid` are 0
template <int T>
VNNI_INLINE void scales(const uint8_t *r, int64_t c, int valid, __m512 &s, __m512 &o) {
    Info in;
    info(T, in);
    const __mmask16 keep = (__mmask16)(valid >= 16 ? 0xffff : (1u << valid) - 1);
    if (T == Q6_K) {  // one super-block: 16 int8 sub-scales times d
        const uint8_t *b = r + c * in.bytes;
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
        s = _mm512_mul_ps(sc, _mm512_set1_ps(half_at(b + 208)));
        o = _mm512_mul_ps(s, _mm512_set1_ps(-(float)(1 << offset_shift(Q6_K))));
    } else if (T == Q4_K || T == Q5_K) {  // two super-blocks of 8 groups (the second absent past valid)
        // each super-block's first 16 bytes (d, dmin, scales[12]) in a 128-bit lane of its own, then per
        // lane: 12 scale bytes q -> bytes 0-7: 6-bit scales, 8-15: 6-bit mins (ggml's get_scale_min_k4)
        const uint8_t *b = r + 2 * c * in.bytes;
        const __m128i first = _mm_loadu_si128((const __m128i *)b);
        const __m256i q = _mm256_inserti128_si256(
            _mm256_castsi128_si256(first), valid > 8 ? _mm_loadu_si128((const __m128i *)(b + in.bytes)) : _mm_setzero_si128(), 1);
        const __m256i lo_idx = _mm256_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15,
                                                4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m256i hi_idx = _mm256_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11,
                                                -1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11);
        const __m256i mask6 = _mm256_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0,
                                               63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
        const __m256i top4 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15,
                                              0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
        const __m256i a = _mm256_shuffle_epi8(q, lo_idx), hb = _mm256_shuffle_epi8(q, hi_idx);
        const __m256i low = _mm256_or_si256(_mm256_and_si256(a, mask6), _mm256_and_si256(_mm256_srli_epi16(a, 4), top4));
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2), _mm256_set1_epi8(0x30));
        // [scales 0, mins 0 | scales 1, mins 1] -> [scales 0, scales 1 | mins 0, mins 1]
        const __m256i sm = _mm256_permute4x64_epi64(_mm256_or_si256(low, high), 0xd8);
        // d0, dmin0, d1, dmin1 (fp16, dwords 0 and 4) -> float, the mins' sign folded in
        const __m128i h = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)));
        const __m512 dd = _mm512_castps128_ps512(_mm_mul_ps(_mm_cvtph_ps(h), _mm_setr_ps(1.0f, -1.0f, 1.0f, -1.0f)));
        const __m512 ds = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), dd);
        const __m512 dm = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), dd);
        s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(sm))), ds);
        o = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(sm, 1))), dm);
    } else {  // 16 blocks: a gather of each block's first 4 bytes (d, and m or the next 2 bytes)
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(in.bytes));
        const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, at, r + c * 16 * in.bytes, 1);
        s = halves(g);
        if (T == Q4_1 || T == Q5_1)
            o = halves(_mm512_srli_epi32(g, 16));
        else
            o = _mm512_mul_ps(s, _mm512_set1_ps(-(float)(1 << offset_shift(T))));  // Q8_0, Q5_0, Q4_0
    }
}

// vector v of chunk c: 64 codes in x's order; half_only: block 2v + 1 of a 32-element type is past the row
template <int T>
VNNI_INLINE __m512i codes(const uint8_t *r, int64_t c, int v, bool half_only) {
    Info in;
    info(T, in);
    const __m512i f = _mm512_set1_epi8(0x0f);
    if (T == Q6_K) {  // v: half v / 2; even: low nibbles, qh bits 0-1 | 2-3; odd: high nibbles, bits 4-5 | 6-7
        const uint8_t *b = r + c * in.bytes;
        const __m512i ql = _mm512_loadu_si512(b + 64 * (v / 2));
        const __m512i h = both_halves(b + 128 + 32 * (v / 2));
        const int sh = 4 * (v & 1);
        const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16((short)sh), _mm256_set1_epi16((short)(sh + 2)), 1);
        const __m512i low = _mm512_and_si512(_mm512_srli_epi16(ql, sh), f);
        const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(h, shifts), _mm512_set1_epi8(3));
        return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
    }
    if (T == Q4_K || T == Q5_K) {  // v: super-block 2c + v / 4, its 32 bytes j = v % 4: low then high nibbles
        const uint8_t *b = r + (2 * c + v / 4) * in.bytes;
        const int j = v % 4;
        __m512i z = both_halves(b + (T == Q5_K ? 48 : 16) + 32 * j);
        z = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xffff0000u, z, 4), f);
        if (T == Q5_K) {  // bit 2j of qh[l]: element 64j + l's fifth bit; bit 2j + 1: element 64j + 32 + l's
            const __m512i h = both_halves(b + 16);
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * j))),
                                                   _mm256_set1_epi8((char)(1 << (2 * j + 1))), 1);
            z = _mm512_or_si512(z, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(h, bit), _mm512_set1_epi8(16)));
        }
        return z;
    }
    const int64_t blk = c * 16 + 2 * v;  // the 32-element types: blocks blk, blk + 1
    const uint8_t *a = r + blk * in.bytes, *b = a + in.bytes;
    if (T == Q8_0) {
        const __m256i qa = _mm256_loadu_si256((const __m256i *)(a + 2));
        const __m256i qb = half_only ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(b + 2));
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1), _mm512_set1_epi8((char)0x80));
    }
    const bool five = T == Q5_0 || T == Q5_1, minned = T == Q4_1 || T == Q5_1;
    const int qs = 2 + (minned ? 2 : 0) + (five ? 4 : 0);
    const __m128i xa = _mm_loadu_si128((const __m128i *)(a + qs));
    const __m128i xb = half_only ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)(b + qs));
    __m512i z = _mm512_castsi256_si512(_mm256_set_m128i(xb, xa));
    z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), z);  // xa, xa, xb, xb
    z = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xff00ff00u, z, 4), f);
    if (five) {
        uint32_t ha, hb = 0;
        memcpy(&ha, a + qs - 4, 4);
        if (!half_only) memcpy(&hb, b + qs - 4, 4);
        z = _mm512_or_si512(z, _mm512_maskz_mov_epi8(_cvtu64_mask64(ha | (uint64_t)hb << 32), _mm512_set1_epi8(16)));
    }
    return z;
}

}  // namespace hsq
