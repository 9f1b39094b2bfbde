// Helpers shared by hotstart's CPU kernels (kernels/*.cpp): bfloat16 <-> float32 as torch converts them,
// rounding to a dtype as torch's ops do, AVX2 loads, stores, sums, e^x; e^x and bf16 rounding in AVX-512.

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace hs {

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does; NaN stays NaN
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t h) { return bf16_to_f32(h); }

inline void store(float *p, float v) { *p = v; }
inline void store(uint16_t *p, float v) { *p = f32_to_bf16(v); }

// v as a torch op of dtype T returns it: a bf16 op computes in float32 and rounds the result to bf16
template <typename T>
inline float rounded(float v);
template <>
inline float rounded<float>(float v) { return v; }
template <>
inline float rounded<uint16_t>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

__attribute__((target("avx2,fma"))) inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }

__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t *p) {  // 8 bf16 -> 8 float32
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 float32 -> the bf16 value each rounds to (nearest even; NaN stays NaN, as f32_to_bf16), as float32
__attribute__((target("avx2,fma"))) inline __m256 round_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), high = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)),
                                       high);
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x400000));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// v rounded as a torch op of dtype T rounds its result (rounded<T>, 8 lanes)
__attribute__((target("avx2,fma"))) inline __m256 rounded8(__m256 v, const float *) { return v; }
__attribute__((target("avx2,fma"))) inline __m256 rounded8(__m256 v, const uint16_t *) {
    return round_bf16(v);
}

__attribute__((target("avx2,fma"))) inline void store8(float *p, __m256 v) { _mm256_storeu_ps(p, v); }

__attribute__((target("avx2,fma"))) inline void store8(uint16_t *p, __m256 v) {  // rounded as store()
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (softmax after subtracting the max), ~2 ulp: x = n ln2 + r, e^r by a degree-6
// polynomial on |r| <= ln2 / 2, 2^n into the exponent; below -87 (e^x < 2^-126) it returns 0.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n * hi
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// e^x for x <= 0, as exp8, 16 lanes (AVX-512)
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 over = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(over, p, _mm512_castsi512_ps(e));  // below -87: 0 (and -inf: 0)
}

// 16 float32 -> 16 bf16, rounded to nearest even as torch rounds
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m256i bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

}  // namespace hs
