// ggml's quantized blocks (the layouts of ggml-common.h), shared by the quantized matmul's two sources.
//
// Every block type is an affine code per group of 16 or 32 elements: w = s_g * u + o_g with u an unsigned
// 4- to 8-bit integer. Q8_0's signed q becomes u = q + 128 (o = -128 d), Q4_0's u = nibble (o = -8 d),
// Q4_1's o = m, the K-quants' s = d * sub-scale, o = -dmin * sub-min (Q6_K: o = -32 s, groups of 16).
// quant_unpack.cpp turns a row's blocks into that one form, a segment of SEG elements at a time (in L1);
// quant_matmul.cpp multiplies it with activations quantized to int8 per 32 elements, for any type:
//   sum_e w_e x_e ~= sum_g [ s_g d_a(g) dot(u_g, q_g) + o_g d_a(g) sum(q_g) ]
// with x_e ~= d_a q_e (d_a = max |x| / 127 over x's 32-element block, as llama.cpp's Q8_0 / Q8_1).

#pragma once

#include <vector>

#include "common.h"

namespace hsq {

enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum Isa : int { PORTABLE = 0, AVX2 = 1, AVX512_VNNI = 2 };

constexpr int64_t SEG = 1024;  // elements of a row unpacked at a time: 1 KB of u + 512 B of scales

struct Info {
    int block;  // elements per block
    int bytes;  // bytes per block
    int group;  // elements per scale (16 or 32)
    bool wide;  // u reaches 255 (Q8_0): AVX2's maddubs would saturate
};

inline bool info(int type, Info &out) {
    switch (type) {
        case Q4_0: out = {32, 18, 32, false}; return true;
        case Q4_1: out = {32, 20, 32, false}; return true;
        case Q5_0: out = {32, 22, 32, false}; return true;
        case Q5_1: out = {32, 24, 32, false}; return true;
        case Q8_0: out = {32, 34, 32, true}; return true;
        case Q4_K: out = {256, 144, 32, false}; return true;
        case Q5_K: out = {256, 176, 32, false}; return true;
        case Q6_K: out = {256, 210, 16, false}; return true;
        default: return false;
    }
}

// one segment of a row, unpacked: element e of group g = e / group is s[g] * u[e] + o[g]; past the
// row's end u, s and o are 0 up to the next multiple of 16 groups
struct Unpacked {
    alignas(64) uint8_t u[SEG];
    alignas(64) float s[SEG / 16];
    alignas(64) float o[SEG / 16];
};

// unpack NBLOCKS blocks of TYPE (nblocks * block <= SEG) into seg from its start
using Unpack = void (*)(const uint8_t *blocks, int64_t nblocks, Unpacked &seg);
Unpack unpack_for(int type, int isa);  // quant_unpack.cpp; null for an unknown type

// AVX512-VNNI, in registers (quant_vnni.cpp): row . x for one token; q: its int8 activations (Q4_0,
// Q4_1, Q5_0, Q5_1: in nibble order, below), da / sa: its groups' d_a and d_a * sum(q) (groups of the
// type's size), all zero-padded to a multiple of 512 elements
using RowVnni = float (*)(const uint8_t *row, int64_t K, const int8_t *q, const float *da, const float *sa);
RowVnni row_vnni_for(int type);  // null for an unknown type
// two rows of K at once, x loaded once for both (rows longer than fit L1 with their x): out[0], out[1]
using RowsVnni = void (*)(const uint8_t *r0, const uint8_t *r1, int64_t K, const int8_t *q, const float *da,
                          const float *sa, float *out);
RowsVnni rows2_vnni_for(int type);  // null where a type takes one row at a time
RowVnni row_avx2_for(int type);  // AVX2, the same for one token, x in its own order (quant_avx2.cpp)
// nibble order: per 4 blocks of 32, elements 0-15 of each block, then elements 16-31 of each
inline bool nibble_order(int type) { return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1; }

// steps of 2+ tokens on AVX512-VNNI (quant_tiles.cpp): rows unpacked and transposed once each into u (K
// bytes padded to whole chunks of 16 groups) and s, o (16 per chunk), then TILE_R rows x TILE_MM tokens
// per dot_t call over activations laid out alike (lane L of a chunk's vector j: dword j of group
// gamma(L)); sums[r * ldsum + t] += row r . token t. TILE_R x TILE_MM: 12 int32 sums + 12 float
// accumulators + 3 activation vectors + 1 weight vector = 28 of the 32 registers.
constexpr int TILE_R = 4, TILE_MM = 3;
// the types whose offset is a constant multiple of the scale (o = -2^shift s): their offset term is
// folded into the integer sums (each token's group sums of q, shifted, start them), saving a float fma
// per row, token and chunk; -1 for the types with a min of their own (Q4_1, Q5_1, Q4_K, Q5_K)
constexpr int offset_shift(int type) {
    return type == Q8_0 ? 7 : type == Q6_K ? 5 : type == Q5_0 ? 4 : type == Q4_0 ? 3 : -1;
}
using UnpackT = void (*)(const uint8_t *row, int64_t K, uint8_t *u, float *s, float *o);
struct Tile {
    const uint8_t *u;  // rows' transposed codes, rs bytes apart
    int64_t rs;
    const float *s, *o;  // their scales and offsets, ss floats apart
    int64_t ss, groups;  // groups per row
    const int8_t *qt[TILE_MM], *qn[TILE_MM];  // tokens' activations transposed, and in x's order (the tail)
    const float *dt[TILE_MM], *st[TILE_MM], *dn[TILE_MM], *sn[TILE_MM];  // d_a and d_a * sum(q), likewise
    const int32_t *nt[TILE_MM];  // sum(q) per group, transposed (the folded offsets: offset_shift)
    float *sums;  // sums[r * ldsum + t] += row r . token t
    int64_t ldsum;
};
using DotT = void (*)(int rows, int mm, const Tile &a);
UnpackT unpack_t_for(int type);  // null for an unknown type
DotT dot_t_for(int type);
void transpose_acts(int gs, int64_t M, int64_t Kp, const int8_t *q, const float *d, const float *s,
                    const int32_t *n, int8_t *qt, float *dt, float *st, int32_t *nt);
inline int gamma_of(int gs, int lane) { return gs == 32 ? 2 * (lane & 7) + (lane >> 3) : 4 * (lane & 3) + (lane >> 2); }

// steps of 8+ tokens on AVX512-VNNI (quant_lanes.cpp): rows unpacked once each into u (their codes in
// element order, K bytes) and s, o (one per group), then LANE_ROWS rows x 16 tokens per dot_l call: a
// vector's lanes are 16 tokens (the activations laid out [dword][token] once per call, Acts::xl), each
// dword of a row broadcast to them. LANE_ROWS = 8: 8 int32 sums + 8 float accumulators + 1 activation
// vector + the broadcast dword and the scales (12 rows were no faster, and a chunk of 16 rows is two).
constexpr int LANE_ROWS = 8, LANE_TOKENS = 16;
struct LaneTile {
    const uint8_t *u;  // rows' codes in element order, rs bytes apart
    int64_t rs;
    const float *s, *o;  // their groups' scales and offsets, ss floats apart
    int64_t ss, groups;  // groups per row
    const int32_t *x;    // 16 tokens' activations: [dword][16 tokens] (int8 x 4 per lane)
    const float *dt, *st;  // [group][16 tokens]: d_a and d_a * sum(q)
    const int32_t *nt;   // [group][16 tokens]: sum(q) (the folded offsets: offset_shift)
    float *sums;         // sums[r * ldsum + t] = row r . token t, t < 16
    int64_t ldsum;
    const uint8_t *fetch;  // bytes to prefetch into L2 while the dots run (the next rows), or null
    int64_t fetch_bytes;
};
using DotL = void (*)(int rows, int tokens, const LaneTile &a);  // tokens: how many of the 16 lanes count
UnpackT unpack_l_for(int type);  // null for an unknown type
DotL dot_l_for(int type);
// q [M, Kp] -> xl [ceil(M / 16)][Kp / 4][16] int32 (tokens past M: 0); per group (of gs) d, s, n [M, Kp / gs]
// -> dl, sl, nl [ceil(M / 16)][Kp / gs][16] (0 past M)
void token_lanes(int64_t M, int64_t Kp, const int8_t *q, int32_t *xl);
void token_lanes(int gs, int64_t M, int64_t Kp, const float *d, const float *s, const int32_t *n, float *dl,
                 float *sl, int32_t *nl);

// x quantized (quant_acts.cpp); K padded with zeros to Kp (a multiple of 512)
struct Acts {
    int64_t M, Kp;
    std::vector<int8_t> q;            // [M, Kp]
    std::vector<float> d16, s16;      // [M, Kp / 16]: d_a of each group of 16, d_a * sum(q) over it
    std::vector<float> d32, s32;      // [M, Kp / 32]: the same per group of 32
    // steps of 2+ tokens on AVX512-VNNI (quant_tiles.cpp): the same, each 16-group chunk transposed
    std::vector<int8_t> qt16, qt32;
    std::vector<int8_t> qn;  // [M, Kp] in nibble order (above), for 1-token rows of the 4- and 5-bit types
    std::vector<float> dt16, st16, dt32, st32;
    std::vector<int32_t> n16, n32, nt16, nt32;  // sum(q) per group of 16 / 32, and transposed likewise
    // steps of 8+ tokens on AVX512-VNNI (quant_lanes.cpp): q and the groups' numbers, 16 tokens a vector
    std::vector<int32_t> xl;
    std::vector<float> dl16, sl16, dl32, sl32;
    std::vector<int32_t> nl16, nl32;
    const float *d(int gs) const { return gs == 16 ? d16.data() : d32.data(); }
    const float *s(int gs) const { return gs == 16 ? s16.data() : s32.data(); }
};

// x [M, K] (xdtype 1 bf16, 2 float32) -> a; TILES bit 0 / 1: the transposed layouts of groups of 16 / 32,
// bit 2: nibble order, bit 3 / 4: the token lanes of groups of 16 / 32 (and xl)
void quantize_acts(const void *x, int xdtype, int64_t M, int64_t K, int isa, int tiles, Acts &a);

inline float fp16_to_f32(uint16_t h) {  // IEEE half -> float, exactly (subnormals, inf, NaN)
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: man * 2^-24
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_f32(h);
}

}  // namespace hsq
