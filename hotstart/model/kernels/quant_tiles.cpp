// Steps of 2+ tokens on AVX512-VNNI: each row unpacked once, transposed so that a lane holds one group.
//
// quant_vnni.cpp's rows give each vector 2 groups of 32 (8 lanes each), so every vector and token needs
// its own convert, scale permute and fma: 4 instructions per 64 products. Here a row's 16-group chunk
// (8 vectors of codes; 4 for groups of 16) is transposed once in registers (3 stages of vpermt2d, each
// swapping a bit of the vector index with a bit of the lane index) so that lane L of vector j holds
// dword j of group gamma(L): 8 vpdpbusd per token then sum whole groups in int32, and one convert and
// fma per 16 groups scale them. The activations are laid out the same way once per call
// (quant_matmul.cpp), so a token costs ~1.4 instructions per 64 products; the transposed row stays in
// L1 for every token of the step.
//
// What a chunk costs per row and token on Zen 4 (the 2-core EPYC hosts; measured with a loop of
// independent ops: a zmm vpdpbusd, vmulps and vfmadd share one issue slot a cycle, vcvtdq2ps issues
// beside them): 8 vpdpbusd (groups of 32; 4 for groups of 16) and an epilogue of a mul, an fma, and an
// fma for the offsets. Hence 4 rows x 3 tokens per call (7 loads per 12 vpdpbusd, against 6 per 8 for
// 4 x 2), and, for the types whose offset is a fixed multiple of the scale (Q8_0, Q4_0, Q5_0, Q6_K), the
// offsets folded into the integer sums (offset_shift): 2 epilogue ops instead of 3.

#include "quant_vnni.h"

namespace hsq {
namespace {

// SWAP[b][0 / 1][l]: vpermt2d's indices for the two outputs of a stage that swaps bit b of the vector
// index with bit b of the lane index: lane l comes from the pair's second vector where bit b of l is set
struct Swaps {
    alignas(64) int32_t at[3][2][16];
    constexpr Swaps() : at() {
        for (int b = 0; b < 3; b++)
            for (int l = 0; l < 16; l++) {
                at[b][0][l] = ((l >> b) & 1) * 16 + (l & ~(1 << b));
                at[b][1][l] = ((l >> b) & 1) * 16 + (l | (1 << b));
            }
    }
};
constexpr Swaps SWAP{};

// one stage over N vectors: swap bit B of the vector index with bit B of the lane index
template <int N, int B>
VNNI inline void swap_bits(__m512i *v) {
    const __m512i ilo = _mm512_load_si512(SWAP.at[B][0]), ihi = _mm512_load_si512(SWAP.at[B][1]);
    for (int i = 0; i < N; i++) {
        if (i & (1 << B)) continue;
        const __m512i x = v[i], y = v[i | (1 << B)];
        v[i] = _mm512_permutex2var_epi32(x, ilo, y);
        v[i | (1 << B)] = _mm512_permutex2var_epi32(x, ihi, y);
    }
}

// the row's codes and scales, chunk by chunk: PER vectors transposed, s and o in lane order (gamma)
template <int T>
VNNI void unpack_t(const uint8_t *r, int64_t K, uint8_t *u, float *s, float *o) {
    constexpr int GS = T == Q6_K ? 16 : 32, PER = 16 * GS / 64;
    const int64_t groups = K / GS;
    alignas(64) int32_t gamma[16];
    for (int l = 0; l < 16; l++) gamma[l] = gamma_of(GS, l);
    const __m512i perm = _mm512_load_si512(gamma);
    for (int64_t c = 0; c * 16 < groups; c++) {
        const int valid = groups - c * 16 < 16 ? (int)(groups - c * 16) : 16;
        __m512 sc, off;
        scales<T>(r, c, valid, sc, off);
        const bool full = valid == 16;  // a partial chunk stays in x's order (dot_t's tail)
        _mm512_storeu_ps(s + 16 * c, full ? _mm512_permutexvar_ps(perm, sc) : sc);
        _mm512_storeu_ps(o + 16 * c, full ? _mm512_permutexvar_ps(perm, off) : off);
        __m512i v[PER];
        const int vs = (valid * GS + 63) / 64;
        for (int i = 0; i < PER; i++)
            v[i] = i < vs ? codes<T>(r, c, i, GS == 32 && 2 * i + 1 >= valid) : _mm512_setzero_si512();
        if (full) {
            swap_bits<PER, 0>(v);
            swap_bits<PER, 1>(v);
            if (PER == 8) swap_bits<PER, 2>(v);
        }
        for (int i = 0; i < PER; i++) _mm512_storeu_si512(u + (c * PER + i) * 64, v[i]);
    }
}

// R rows (their transposed codes RS bytes apart, scales and offsets SS floats apart) times MM tokens:
// R x MM int32 sums per chunk in registers, each weight vector loaded once per chunk for MM tokens and
// each activation vector once for R rows (x is re-read from L2 once per R rows, not once per row). A
// last partial chunk (K = 576: 18 groups of 32) takes x's order: per vector, a convert and a permuted
// scale as quant_vnni.cpp's rows, instead of a whole chunk of zeros.
// SHIFT >= 0: the type's offset is -2^SHIFT times its scale (offset_shift), folded into the integer
// sums: each starts at -2^SHIFT sum(q) of its token's groups, and the chunk's float offset term is gone
template <int GS, int R, int MM, int SHIFT>
VNNI void dot_t(const Tile &a) {
    constexpr int PER = 16 * GS / 64;
    const int64_t full = a.groups / 16;
    __m512 acc[R][MM];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MM; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; c++) {
        __m512i isum[R][MM];
        for (int t = 0; t < MM; t++) {
            const __m512i start = SHIFT < 0 ? _mm512_setzero_si512()
                                            : _mm512_sub_epi32(_mm512_setzero_si512(),
                                                               _mm512_slli_epi32(_mm512_loadu_si512(a.nt[t] + 16 * c),
                                                                                 SHIFT < 0 ? 0 : SHIFT));
            for (int r = 0; r < R; r++) isum[r][t] = start;
        }
        for (int i = 0; i < PER; i++) {
            __m512i x[MM];
            for (int t = 0; t < MM; t++) x[t] = _mm512_loadu_si512(a.qt[t] + (c * PER + i) * 64);
            for (int r = 0; r < R; r++) {
                const __m512i w = _mm512_loadu_si512(a.u + r * a.rs + (c * PER + i) * 64);
                for (int t = 0; t < MM; t++) isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], w, x[t]);
            }
        }
        for (int r = 0; r < R; r++) {  // each row's scales and offsets loaded once for the MM tokens
            const __m512 s = _mm512_loadu_ps(a.s + r * a.ss + 16 * c), o = _mm512_loadu_ps(a.o + r * a.ss + 16 * c);
            for (int t = 0; t < MM; t++) {
                const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(a.dt[t] + 16 * c));
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][t]), scale, acc[r][t]);
                if (SHIFT < 0) acc[r][t] = _mm512_fmadd_ps(o, _mm512_loadu_ps(a.st[t] + 16 * c), acc[r][t]);
            }
        }
    }
    if (a.groups % 16) {
        const int64_t c = full;
        const int vs = (int)(((a.groups - 16 * c) * GS + 63) / 64);
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int t = 0; t < MM; t++) {
            const __m512 d = _mm512_loadu_ps(a.dn[t] + 16 * c), sx = _mm512_loadu_ps(a.sn[t] + 16 * c);
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(a.s + r * a.ss + 16 * c), d);
                acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(a.o + r * a.ss + 16 * c), sx, acc[r][t]);
                for (int v = 0; v < vs; v++) {  // lane l: group (64 v + 4 l) / GS of the chunk
                    const __m512i idx = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * v), iota),
                                                          GS == 32 ? 3 : 2);
                    const __m512i dot = _mm512_dpbusd_epi32(
                        _mm512_setzero_si512(), _mm512_loadu_si512(a.u + r * a.rs + (c * PER + v) * 64),
                        _mm512_loadu_si512(a.qn[t] + c * 16 * GS + 64 * v));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, scale), acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MM; t++) a.sums[r * a.ldsum + t] += _mm512_reduce_add_ps(acc[r][t]);
}

template <int GS, int R, int SHIFT>
void dots_r(int mm, const Tile &a) {  // mm: 1 .. TILE_MM (3)
    switch (mm) {
        case 1: dot_t<GS, R, 1, SHIFT>(a); break;
        case 2: dot_t<GS, R, 2, SHIFT>(a); break;
        default: dot_t<GS, R, TILE_MM, SHIFT>(a); break;
    }
}

template <int GS, int SHIFT>
void dots_t(int rows, int mm, const Tile &a) {
    switch (rows) {
        case 1: dots_r<GS, 1, SHIFT>(mm, a); break;
        case 2: dots_r<GS, 2, SHIFT>(mm, a); break;
        case 3: dots_r<GS, 3, SHIFT>(mm, a); break;
        default: dots_r<GS, 4, SHIFT>(mm, a); break;
    }
}

}  // namespace

// x's codes as the transposed rows: per token, each chunk's PER vectors through the same swap_bits
// network; its groups' d_a and d_a * sum(q) permuted to the lanes' order (gamma)
VNNI void transpose_acts(int gs, int64_t M, int64_t Kp, const int8_t *q, const float *d, const float *s,
                         const int32_t *n, int8_t *qt, float *dt, float *st, int32_t *nt) {
    const int64_t G = Kp / gs, per = 16 * gs / 64;
    alignas(64) int32_t gamma[16];
    for (int l = 0; l < 16; l++) gamma[l] = gamma_of(gs, l);
    const __m512i perm = _mm512_load_si512(gamma);
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < G / 16; c++) {
            const int64_t at = m * Kp + c * per * 64, g = m * G + c * 16;
            __m512i v[8];
            for (int i = 0; i < per; i++) v[i] = _mm512_loadu_si512(q + at + 64 * i);
            if (per == 8) {
                swap_bits<8, 0>(v);
                swap_bits<8, 1>(v);
                swap_bits<8, 2>(v);
            } else {
                swap_bits<4, 0>(v);
                swap_bits<4, 1>(v);
            }
            for (int i = 0; i < per; i++) _mm512_storeu_si512(qt + at + 64 * i, v[i]);
            _mm512_storeu_ps(dt + g, _mm512_permutexvar_ps(perm, _mm512_loadu_ps(d + g)));
            _mm512_storeu_ps(st + g, _mm512_permutexvar_ps(perm, _mm512_loadu_ps(s + g)));
            _mm512_storeu_si512(nt + g, _mm512_permutexvar_epi32(perm, _mm512_loadu_si512(n + g)));
        }
}

UnpackT unpack_t_for(int type) {
    switch (type) {
        case Q4_0: return unpack_t<Q4_0>;
        case Q4_1: return unpack_t<Q4_1>;
        case Q5_0: return unpack_t<Q5_0>;
        case Q5_1: return unpack_t<Q5_1>;
        case Q8_0: return unpack_t<Q8_0>;
        case Q4_K: return unpack_t<Q4_K>;
        case Q5_K: return unpack_t<Q5_K>;
        case Q6_K: return unpack_t<Q6_K>;
        default: return nullptr;
    }
}

DotT dot_t_for(int type) {
    switch (type) {
        case Q8_0: return dots_t<32, offset_shift(Q8_0)>;
        case Q5_0: return dots_t<32, offset_shift(Q5_0)>;
        case Q4_0: return dots_t<32, offset_shift(Q4_0)>;
        case Q6_K: return dots_t<16, offset_shift(Q6_K)>;
        default: {
            Info in;
            return info(type, in) && in.group == 16 ? dots_t<16, -1> : dots_t<32, -1>;
        }
    }
}

}  // namespace hsq
