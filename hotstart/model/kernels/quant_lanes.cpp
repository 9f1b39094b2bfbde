// Steps of 8+ tokens on AVX512-VNNI: 16 tokens in a vector's lanes, each dword of a row broadcast to them.
//
// A row is unpacked once per call into its codes in element order (u) and its groups' scales and offsets
// (s, o), and stays in L1 / L2 for every token of the step; the activations are laid out once per call
// with 16 tokens a vector ([dword][token], quant_acts.cpp). A group of 32 (16) is then 8 (4) vpdpbusd
// per row, each with the row's dword broadcast, summing the group for 16 tokens in int32; one convert,
// a mul (the row's scale times the tokens' d_a), an fma (and, for the types with a min of their own, an
// fma for the offsets) scale it into the row's 16 float accumulators.
//
// Why lanes over tokens (Zen 4, the 2-core EPYC hosts, measured with loops of independent ops): a zmm
// vpdpbusd, vmulps, vfmadd, vpermt2d and a zmm store share one issue slot a cycle; a broadcast load, vpand,
// vpsrlw, a masked move and vcvtdq2ps issue beside them. quant_tiles.cpp's lanes over a row's groups
// transpose each row's chunk of 16 groups with 24 vpermt2d, and its 4 rows x 3 tokens load 7 vectors per
// 12 vpdpbusd; here nothing is transposed on the weights' side, and the inner loop (1 activation vector +
// 8 broadcast dwords per 8 vpdpbusd) ran at 215-233 GMAC/s a core against 230 for vpdpbusd alone (4 x 3
// with vector loads: 153-198). The epilogue stays: 2-3 ops per 8 vpdpbusd. Lanes cost what a step has
// not filled, so steps of up to 7 tokens keep quant_tiles.cpp (docs/serving.md has the crossover).

#include "quant_vnni.h"

namespace hsq {
namespace {

// the row's codes in element order (64 per vector) and its groups' s and o, 16 groups at a time
template <int T>
VNNI void unpack_l(const uint8_t *r, int64_t K, uint8_t *u, float *s, float *o) {
    constexpr int GS = T == Q6_K ? 16 : 32, PER = 16 * GS / 64;  // vectors per chunk of 16 groups
    const int64_t groups = K / GS;
    for (int64_t c = 0; c * 16 < groups; c++) {
        const int valid = groups - c * 16 < 16 ? (int)(groups - c * 16) : 16;
        __m512 sc, off;
        scales<T>(r, c, valid, sc, off);
        _mm512_storeu_ps(s + 16 * c, sc);
        _mm512_storeu_ps(o + 16 * c, off);
        const int vs = (valid * GS + 63) / 64;
        for (int i = 0; i < vs; i++)
            _mm512_storeu_si512(u + (c * PER + i) * 64, codes<T>(r, c, i, GS == 32 && 2 * i + 1 >= valid));
    }
}

// the vectors of L lanes: 16 (zmm), 8 (ymm) or 4 (xmm) for steps of up to 8 or 4 tokens: Zen 4 issues two
// ymm or xmm vpdpbusd a cycle against one zmm, so 8 lanes cost what 16 do per token and 4 half of what 8
// do; the narrow kernels read the low part of each 16-token vector
template <int L>
struct Lanes;
template <>
struct Lanes<16> {
    using I = __m512i;
    using F = __m512;
    static VNNI_INLINE I load(const int32_t *p) { return _mm512_loadu_si512(p); }
    static VNNI_INLINE I set1(int32_t v) { return _mm512_set1_epi32(v); }
    static VNNI_INLINE I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
    static VNNI_INLINE I start(const int32_t *nt, int shift) {  // -2^shift sum(q)
        return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_sll_epi32(load(nt), _mm_cvtsi32_si128(shift)));
    }
    static VNNI_INLINE F loadf(const float *p) { return _mm512_loadu_ps(p); }
    static VNNI_INLINE F set1f(float v) { return _mm512_set1_ps(v); }
    static VNNI_INLINE F zerof() { return _mm512_setzero_ps(); }
    static VNNI_INLINE F scaled(F acc, I sum, F scale) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc); }
    static VNNI_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static VNNI_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static VNNI_INLINE void store(float *p, F v) { _mm512_storeu_ps(p, v); }
};
template <>
struct Lanes<8> {
    using I = __m256i;
    using F = __m256;
    static VNNI_INLINE I load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
    static VNNI_INLINE I set1(int32_t v) { return _mm256_set1_epi32(v); }
    static VNNI_INLINE I dot(I acc, I w, I x) { return _mm256_dpbusd_epi32(acc, w, x); }
    static VNNI_INLINE I start(const int32_t *nt, int shift) {
        return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_sll_epi32(load(nt), _mm_cvtsi32_si128(shift)));
    }
    static VNNI_INLINE F loadf(const float *p) { return _mm256_loadu_ps(p); }
    static VNNI_INLINE F set1f(float v) { return _mm256_set1_ps(v); }
    static VNNI_INLINE F zerof() { return _mm256_setzero_ps(); }
    static VNNI_INLINE F scaled(F acc, I sum, F scale) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc); }
    static VNNI_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static VNNI_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static VNNI_INLINE void store(float *p, F v) { _mm256_storeu_ps(p, v); }
};

template <>
struct Lanes<4> {
    using I = __m128i;
    using F = __m128;
    static VNNI_INLINE I load(const int32_t *p) { return _mm_loadu_si128((const __m128i *)p); }
    static VNNI_INLINE I set1(int32_t v) { return _mm_set1_epi32(v); }
    static VNNI_INLINE I dot(I acc, I w, I x) { return _mm_dpbusd_epi32(acc, w, x); }
    static VNNI_INLINE I start(const int32_t *nt, int shift) {
        return _mm_sub_epi32(_mm_setzero_si128(), _mm_sll_epi32(load(nt), _mm_cvtsi32_si128(shift)));
    }
    static VNNI_INLINE F loadf(const float *p) { return _mm_loadu_ps(p); }
    static VNNI_INLINE F set1f(float v) { return _mm_set1_ps(v); }
    static VNNI_INLINE F zerof() { return _mm_setzero_ps(); }
    static VNNI_INLINE F scaled(F acc, I sum, F scale) { return _mm_fmadd_ps(_mm_cvtepi32_ps(sum), scale, acc); }
    static VNNI_INLINE F mul(F a, F b) { return _mm_mul_ps(a, b); }
    static VNNI_INLINE F fma(F a, F b, F c) { return _mm_fmadd_ps(a, b, c); }
    static VNNI_INLINE void store(float *p, F v) { _mm_storeu_ps(p, v); }
};

// R rows x L tokens over the whole row: per group, R int32 sums (started at -2^SHIFT sum(q) for the
// types whose offset is folded in: offset_shift), then R float accumulators scaled and summed. The
// next rows' blocks (a.fetch, a.fetch_bytes) are prefetched into L2 a share per group.
template <int GS, int R, int SHIFT, int L>
VNNI void dot_l(const LaneTile &a) {
    using V = Lanes<L>;
    constexpr int DW = GS / 4;  // dwords per group
    const int64_t per_group = (a.fetch_bytes / 64 + a.groups - 1) / a.groups;  // cache lines
    const uint8_t *fetch = a.fetch, *fetched = a.fetch + a.fetch_bytes;
    typename V::F acc[R];
    for (int r = 0; r < R; r++) acc[r] = V::zerof();
    for (int64_t g = 0; g < a.groups; g++) {
        for (int64_t i = 0; i < per_group && fetch < fetched; i++, fetch += 64)
            _mm_prefetch((const char *)fetch, _MM_HINT_T1);
        typename V::I isum[R];
        const typename V::I start = SHIFT < 0 ? V::set1(0) : V::start(a.nt + 16 * g, SHIFT);
        for (int r = 0; r < R; r++) isum[r] = start;
        for (int k = 0; k < DW; k++) {
            const int64_t d = g * DW + k;
            const typename V::I x = V::load(a.x + 16 * d);
            for (int r = 0; r < R; r++) {
                int32_t w;
                memcpy(&w, a.u + r * a.rs + 4 * d, 4);
                isum[r] = V::dot(isum[r], V::set1(w), x);
            }
        }
        const typename V::F dt = V::loadf(a.dt + 16 * g);
        const typename V::F st = SHIFT < 0 ? V::loadf(a.st + 16 * g) : V::zerof();
        for (int r = 0; r < R; r++) {
            acc[r] = V::scaled(acc[r], isum[r], V::mul(V::set1f(a.s[r * a.ss + g]), dt));
            if (SHIFT < 0) acc[r] = V::fma(V::set1f(a.o[r * a.ss + g]), st, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) V::store(a.sums + r * a.ldsum, acc[r]);
}

template <int GS, int SHIFT, int L>
void dots_l(int rows, const LaneTile &a) {
    switch (rows) {
        case 1: dot_l<GS, 1, SHIFT, L>(a); break;
        case 2: dot_l<GS, 2, SHIFT, L>(a); break;
        case 3: dot_l<GS, 3, SHIFT, L>(a); break;
        case 4: dot_l<GS, 4, SHIFT, L>(a); break;
        case 5: dot_l<GS, 5, SHIFT, L>(a); break;
        case 6: dot_l<GS, 6, SHIFT, L>(a); break;
        case 7: dot_l<GS, 7, SHIFT, L>(a); break;
        default: dot_l<GS, LANE_ROWS, SHIFT, L>(a); break;
    }
}

template <int GS, int SHIFT>
void dots_lanes(int rows, int tokens, const LaneTile &a) {
    if (tokens <= 4)
        dots_l<GS, SHIFT, 4>(rows, a);
    else if (tokens <= 8)
        dots_l<GS, SHIFT, 8>(rows, a);
    else
        dots_l<GS, SHIFT, 16>(rows, a);
}

}  // namespace

void token_lanes(int64_t M, int64_t Kp, const int8_t *q, int32_t *xt) {
    const int64_t dwords = Kp / 4;
    for (int64_t b = 0; b * LANE_TOKENS < M; b++) {
        int32_t *out = xt + b * dwords * LANE_TOKENS;
        for (int t = 0; t < LANE_TOKENS; t++) {
            const int64_t m = b * LANE_TOKENS + t;
            if (m >= M) {
                for (int64_t d = 0; d < dwords; d++) out[d * LANE_TOKENS + t] = 0;
                continue;
            }
            const int8_t *row = q + m * Kp;
            for (int64_t d = 0; d < dwords; d++) memcpy(&out[d * LANE_TOKENS + t], row + 4 * d, 4);
        }
    }
}

void token_lanes(int gs, int64_t M, int64_t Kp, const float *d, const float *s, const int32_t *n, float *dt,
                 float *st, int32_t *nt) {
    const int64_t G = Kp / gs;
    for (int64_t b = 0; b * LANE_TOKENS < M; b++)
        for (int t = 0; t < LANE_TOKENS; t++) {
            const int64_t m = b * LANE_TOKENS + t, at = b * G * LANE_TOKENS + t;
            for (int64_t g = 0; g < G; g++) {
                const bool in = m < M;
                dt[at + g * LANE_TOKENS] = in ? d[m * G + g] : 0.0f;
                st[at + g * LANE_TOKENS] = in ? s[m * G + g] : 0.0f;
                nt[at + g * LANE_TOKENS] = in ? n[m * G + g] : 0;
            }
        }
}

UnpackT unpack_l_for(int type) {
    switch (type) {
        case Q4_0: return unpack_l<Q4_0>;
        case Q4_1: return unpack_l<Q4_1>;
        case Q5_0: return unpack_l<Q5_0>;
        case Q5_1: return unpack_l<Q5_1>;
        case Q8_0: return unpack_l<Q8_0>;
        case Q4_K: return unpack_l<Q4_K>;
        case Q5_K: return unpack_l<Q5_K>;
        case Q6_K: return unpack_l<Q6_K>;
        default: return nullptr;
    }
}

DotL dot_l_for(int type) {
    switch (type) {
        case Q8_0: return dots_lanes<32, offset_shift(Q8_0)>;
        case Q5_0: return dots_lanes<32, offset_shift(Q5_0)>;
        case Q4_0: return dots_lanes<32, offset_shift(Q4_0)>;
        case Q6_K: return dots_lanes<16, offset_shift(Q6_K)>;
        default: {
            Info in;
            return info(type, in) && in.group == 16 ? dots_lanes<16, -1> : dots_lanes<32, -1>;
        }
    }
}

}  // namespace hsq
