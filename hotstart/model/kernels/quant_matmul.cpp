// Linear layers over ggml's quantized blocks (quant.h): out[m, n] = sum_k x[m, k] w[n, k], float32 out.
//
// x is quantized once per call (quant_acts.cpp). Each thread then takes chunks of rows, one sequential
// stream of blocks per thread, and per block of TOKEN_BLOCK tokens:
//   AVX512-VNNI: one token, a row at a time in registers (quant_vnni.cpp); 2-7 tokens, rows transposed
//     once per call (each chunk's rows for all its tokens), 4 rows x 3 tokens per register tile
//     (quant_tiles.cpp); 8+ tokens, rows unpacked in element order once per call, 8 rows x 16 tokens
//     per register tile, the tokens in a vector's lanes (quant_lanes.cpp);
//   AVX2, one token: a row at a time in registers (quant_avx2.cpp);
//   AVX2 (2+ tokens) and portable: a segment of a row unpacked into quant.h's one form (in L1), then
//     multiplied with up to 4 tokens per pass (their accumulators in registers). AVX2: vpmaddubsw + vpmaddwd, 32
//     elements per vector (Q8_0's u up to 255 would saturate vpmaddubsw's int16 pairs: widened to int16
//     and vpmaddwd instead); portable: the same integer sums in scalar code (the reference the SIMD
//     paths are tested against). Lanes 4l .. 4l + 3 of a vector sum to lane l: each lane is scaled by
//     its group's s_g d_a(g) (a permute of 8 groups' scales); the offsets' term sum_g o_g d_a(g)
//     sum(q_g) is a dot product of 8 groups at a time.

#include <omp.h>

#include <vector>

#include "quant.h"

namespace hsq {
namespace {

constexpr int64_t CHUNK = 16;        // rows per unit of parallel work
constexpr int64_t TOKEN_BLOCK = 64;  // tokens per pass over a chunk's weights (their int8 rows in L2)
// steps of this many tokens or more take the token lanes (quant_lanes.cpp), fewer the transposed tiles
// (quant_tiles.cpp): measured alternating the two on a 7B's shapes, the lanes took 0.71-0.84x the tiles'
// time at 16 tokens, 0.73-0.82x at 64 and 256, about the same at 8, 1.2-1.9x at 2-5 (lanes they leave empty)
constexpr int64_t LANE_MIN = 8;
// a longer step is multiplied STEP_BLOCK tokens at a time, each a call of its own: its quantized x stays
// within L3 while every chunk of rows passes over it (a 2,048-token prefill's x for a 7B's down
// projection is 39 MB, streamed from memory for every 16 rows: 7B layers at 2,048 tokens ran ~16 % slower
// than at 256)
constexpr int64_t STEP_BLOCK = 256;
constexpr int MAX_MM = 4;            // tokens per pass over a segment (accumulators in registers)
// one token and rows longer than this: the threads take chunks in turn (their reads side by side) rather
// than a contiguous half each: K = 18944 (a 7B's down projection) streamed at ~23 against ~20 GB/s; short
// rows keep the halves (interleaved, they lost ~20 %)
constexpr int64_t LONG_ROW = 8192;

// the tokens of one pass: int8 rows, their groups' d_a and d_a * sum(q), at the segment's start
struct Pass {
    const int8_t *q[MAX_MM];
    const float *d[MAX_MM], *s[MAX_MM];
};

// ---- AVX512-VNNI -------------------------------------------------------------------------------------
// LANES<GS>.at[v][l]: the group (of the 8 a pass takes) that lane l of vector v holds: elements
// 32 v + 4 l .. + 3
template <int GS>
struct Lanes {
    alignas(32) int32_t at[8 * GS / 32][8];
    constexpr Lanes() : at() {
        for (int v = 0; v < 8 * GS / 32; v++)
            for (int l = 0; l < 8; l++) at[v][l] = (32 * v + 4 * l) / GS;
    }
};
template <int GS>
constexpr Lanes<GS> LANES{};

// ---- AVX2 ----------------------------------------------------------------------------------------------
template <int GS, bool WIDE, int MM>
__attribute__((target("avx2,fma")))
void dot_avx2(const Unpacked &w, int64_t n, const Pass &p, float *sums) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MM];
    for (int t = 0; t < MM; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; c += 8 * GS) {
        const int64_t g = c / GS;
        const __m256 s = _mm256_load_ps(w.s + g), o = _mm256_load_ps(w.o + g);
        __m256 scale[MM];
        for (int t = 0; t < MM; t++) {
            scale[t] = _mm256_mul_ps(s, _mm256_loadu_ps(p.d[t] + g));
            acc[t] = _mm256_fmadd_ps(o, _mm256_loadu_ps(p.s[t] + g), acc[t]);
        }
        const int vs = n - c >= 8 * GS ? 8 * GS / 32 : (int)((n - c) / 32);
        for (int v = 0; v < vs; v++) {
            const __m256i u = _mm256_load_si256((const __m256i *)(w.u + c + 32 * v));
            const __m256i idx = _mm256_load_si256((const __m256i *)LANES<GS>.at[v]);
            for (int t = 0; t < MM; t++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(p.q[t] + c + 32 * v));
                __m256i dot;
                if (WIDE) {  // a vector is one group of 32 (Q8_0): which lane sums what does not matter
                    const __m256i lo = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u)),
                                                         _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)));
                    const __m256i hi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1)),
                                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)));
                    dot = _mm256_add_epi32(lo, hi);
                } else {  // u <= 63: a pair of products stays within int16
                    dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones);
                }
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(scale[t], idx), acc[t]);
            }
        }
    }
    for (int t = 0; t < MM; t++) sums[t] += hs::hsum256(acc[t]);
}

// ---- portable ------------------------------------------------------------------------------------------
template <int GS, int MM>
void dot_ref(const Unpacked &w, int64_t n, const Pass &p, float *sums) {
    for (int t = 0; t < MM; t++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < n / GS; g++) {
            int32_t dot = 0;
            for (int e = 0; e < GS; e++) dot += (int32_t)w.u[g * GS + e] * p.q[t][g * GS + e];
            acc += w.s[g] * p.d[t][g] * (float)dot + w.o[g] * p.s[t][g];
        }
        sums[t] += acc;
    }
}

using Dot = void (*)(const Unpacked &, int64_t, const Pass &, float *);

template <int GS, bool WIDE>
void dots(int isa, Dot *out) {  // the kernels of 1 .. MAX_MM tokens for this host
    const Dot avx2[MAX_MM] = {dot_avx2<GS, WIDE, 1>, dot_avx2<GS, WIDE, 2>, dot_avx2<GS, WIDE, 3>,
                              dot_avx2<GS, WIDE, 4>};
    const Dot ref[MAX_MM] = {dot_ref<GS, 1>, dot_ref<GS, 2>, dot_ref<GS, 3>, dot_ref<GS, 4>};
    for (int i = 0; i < MAX_MM; i++) out[i] = isa == AVX2 ? avx2[i] : ref[i];  // AVX512-VNNI: quant_vnni.cpp
}

struct Weight {
    const uint8_t *w;  // [n, row bytes], rows ldw bytes apart
    int64_t ldw, n, col;
    Info in;
    Unpack unpack;
    Dot dot[MAX_MM];
    RowVnni vnni;  // AVX512-VNNI: the row in registers instead of unpack + dot (1 token)
    RowsVnni vnni2;  // and two rows at once (rows longer than LONG_ROW)
    RowVnni avx2;  // AVX2: likewise for a pass of 1 token (quant_avx2.cpp)
    bool nibbles;  // vnni takes x in nibble order (quant.h)
    UnpackT unpack_t;  // and for 2-7 tokens, transposed once (quant_tiles.cpp)
    DotT dot_t;
    UnpackT unpack_l;  // 8+ tokens: in element order, 16 tokens a vector (quant_lanes.cpp)
    DotL dot_l;
};

struct Scratch {  // a thread's: one segment for unpack + dot, a chunk's rows transposed for the tiles
    Unpacked seg;
    std::vector<uint8_t> u;
    std::vector<float> s, o;
};

// steps of 2+ tokens on AVX512-VNNI: rows from .. to unpacked into scratch (transposed, or for the token
// lanes in element order), row n at n - base
void unpack_rows(const Weight &W, int64_t from, int64_t to, int64_t base, const Acts &a, int64_t K,
                 Scratch &scratch, bool lanes) {
    const UnpackT unpack = lanes ? W.unpack_l : W.unpack_t;
    for (int64_t n = from; n < to; n++)
        unpack(W.w + n * W.ldw, K, scratch.u.data() + (n - base) * a.Kp,
               scratch.s.data() + (n - base) * (a.Kp / 16), scratch.o.data() + (n - base) * (a.Kp / 16));
}

// a chunk's sums[r][m - m0] (rows < CHUNK) -> out[m * ldo + r], token by token: each token's rows are one
// run of the output's row (written row by row, the tokens' lines were each touched once per row: ~10 % of a
// prefill's time sat on those stores)
void write_out(const float (*sums)[TOKEN_BLOCK], int64_t rows, int64_t m0, int64_t m1, float *out, int64_t ldo) {
    for (int64_t m = m0; m < m1; m++)
        for (int64_t r = 0; r < rows; r++) out[m * ldo + r] = sums[r][m - m0];
}

// rows n0 .. n1 (one chunk) times tokens m0 .. m1 (2+), TILE_R rows x TILE_MM tokens per call
// (quant_tiles.cpp): out[m, col + n]. unpacked: the chunk's rows are in scratch already (a call of more
// than one block of tokens unpacks them once for all its blocks: a prefill of 2,048 tokens once, not 32
// times); else each tile's rows are unpacked just before its dots (they are in L1 for the first token)
void tile_rows(const Weight &W, int64_t n0, int64_t n1, const Acts &a, int64_t m0, int64_t m1, int64_t K, float *out,
               int64_t ldo, Scratch &scratch, bool unpacked) {
    const int gs = W.in.group;
    const int64_t G = a.Kp / gs;  // groups per token
    float sums[CHUNK][TOKEN_BLOCK];  // the chunk's rows, written out token by token at the end
    Tile tile;
    tile.rs = a.Kp, tile.ss = a.Kp / 16, tile.groups = K / gs, tile.ldsum = TOKEN_BLOCK;
    const int8_t *qt = (gs == 16 ? a.qt16 : a.qt32).data();
    const float *dt = (gs == 16 ? a.dt16 : a.dt32).data(), *st = (gs == 16 ? a.st16 : a.st32).data();
    const int32_t *nt = (gs == 16 ? a.nt16 : a.nt32).data();
    for (int64_t r0 = n0; r0 < n1; r0 += TILE_R) {
        const int nr = n1 - r0 < TILE_R ? (int)(n1 - r0) : TILE_R;
        const int64_t base = unpacked ? n0 : r0;  // scratch's first row
        if (!unpacked) unpack_rows(W, r0, r0 + nr, base, a, K, scratch, false);
        tile.u = scratch.u.data() + (r0 - base) * tile.rs;
        tile.s = scratch.s.data() + (r0 - base) * tile.ss, tile.o = scratch.o.data() + (r0 - base) * tile.ss;
        for (int r = 0; r < nr; r++)
            for (int64_t m = m0; m < m1; m++) sums[r0 - n0 + r][m - m0] = 0.0f;
        // the next tile's rows (this thread's next ones) fetched into L2 while this tile's dots run, a
        // share before each call: at 2-64 tokens its unpack would otherwise wait for memory with the
        // dot products idle
        const uint8_t *fetch = W.w + (r0 + nr) * W.ldw;
        const uint8_t *fetched = W.w + (r0 + nr + TILE_R < W.n ? r0 + nr + TILE_R : W.n) * W.ldw;
        const int64_t share = (fetched - fetch) / ((m1 - m0 + TILE_MM - 1) / TILE_MM) + 64;  // bytes per call
        for (int64_t m = m0; m < m1; m += TILE_MM) {
            const int mm = m1 - m < TILE_MM ? (int)(m1 - m) : TILE_MM;
            if (!unpacked)
                for (const uint8_t *end = fetch + share; fetch < end && fetch < fetched; fetch += 64)
                    _mm_prefetch((const char *)fetch, _MM_HINT_T1);
            for (int t = 0; t < mm; t++) {
                tile.qt[t] = qt + (m + t) * a.Kp;
                tile.qn[t] = a.q.data() + (m + t) * a.Kp;
                tile.dt[t] = dt + (m + t) * G;
                tile.st[t] = st + (m + t) * G;
                tile.nt[t] = nt + (m + t) * G;
                tile.dn[t] = a.d(gs) + (m + t) * G;
                tile.sn[t] = a.s(gs) + (m + t) * G;
            }
            tile.sums = &sums[r0 - n0][m - m0];
            W.dot_t(nr, mm, tile);
        }
    }
    write_out(sums, n1 - n0, m0, m1, out + W.col + n0, ldo);
}

// rows n0 .. n1 (one chunk) times tokens m0 .. m1 (m0 a multiple of 16) in 16-token lanes, LANE_ROWS rows
// per call (quant_lanes.cpp): out[m, col + n]; unpacked as for tile_rows
void lane_rows(const Weight &W, int64_t n0, int64_t n1, const Acts &a, int64_t m0, int64_t m1, int64_t K, float *out,
               int64_t ldo, Scratch &scratch, bool unpacked) {
    const int gs = W.in.group;
    const int64_t G = a.Kp / gs;  // groups per token
    alignas(64) float sums[CHUNK][TOKEN_BLOCK];  // the chunk's rows, written out token by token at the end
    LaneTile tile;
    tile.rs = a.Kp, tile.ss = a.Kp / 16, tile.groups = K / gs, tile.ldsum = TOKEN_BLOCK;
    const float *dl = (gs == 16 ? a.dl16 : a.dl32).data(), *sl = (gs == 16 ? a.sl16 : a.sl32).data();
    const int32_t *nl = (gs == 16 ? a.nl16 : a.nl32).data();
    const int64_t vectors = (m1 - m0 + LANE_TOKENS - 1) / LANE_TOKENS;
    for (int64_t r0 = n0; r0 < n1; r0 += LANE_ROWS) {
        const int nr = n1 - r0 < LANE_ROWS ? (int)(n1 - r0) : LANE_ROWS;
        const int64_t base = unpacked ? n0 : r0;  // scratch's first row
        if (!unpacked) unpack_rows(W, r0, r0 + nr, base, a, K, scratch, true);
        tile.u = scratch.u.data() + (r0 - base) * tile.rs;
        tile.s = scratch.s.data() + (r0 - base) * tile.ss, tile.o = scratch.o.data() + (r0 - base) * tile.ss;
        // the next rows fetched into L2 while this tile's dots run, a share per call spread over its groups
        // (a burst of them before one call of a 16-token step was mostly lost: 9 against 11 GB/s)
        const uint8_t *fetch = W.w + (r0 + nr) * W.ldw;
        const uint8_t *fetched = W.w + (r0 + nr + LANE_ROWS < W.n ? r0 + nr + LANE_ROWS : W.n) * W.ldw;
        const int64_t share = (fetched - fetch) / vectors + 64;  // bytes per call
        for (int64_t m = m0; m < m1; m += LANE_TOKENS) {
            tile.fetch = fetch;
            tile.fetch_bytes = unpacked ? 0 : fetched - fetch < share ? fetched - fetch : share;
            fetch += tile.fetch_bytes;
            const int64_t b = m / LANE_TOKENS;  // the activations' block of 16 tokens
            tile.x = a.xl.data() + b * (a.Kp / 4) * LANE_TOKENS;
            tile.dt = dl + b * G * LANE_TOKENS;
            tile.st = sl + b * G * LANE_TOKENS;
            tile.nt = nl + b * G * LANE_TOKENS;
            tile.sums = &sums[r0 - n0][m - m0];
            W.dot_l(nr, m1 - m < LANE_TOKENS ? (int)(m1 - m) : LANE_TOKENS, tile);
        }
    }
    write_out(sums, n1 - n0, m0, m1, out + W.col + n0, ldo);
}

// rows n0 .. n1 of weight W times tokens m0 .. m1 without the tiles: one token on AVX512-VNNI or AVX2
// (a row in registers), AVX2's 2+ tokens and the portable path (a segment unpacked, then up to MAX_MM
// tokens per pass): out[m, col + n]
void rows(const Weight &W, int64_t n0, int64_t n1, const Acts &a, int64_t m0, int64_t m1, int64_t K, float *out,
          int64_t ldo, Scratch &scratch) {
    Unpacked &seg = scratch.seg;
    const int gs = W.in.group;
    const int64_t G = a.Kp / gs;  // groups per token
    float sums[TOKEN_BLOCK];
    int64_t n = n0;
    if (W.vnni2 && m1 - m0 == 1 && K > LONG_ROW)  // one token, long rows: two at a time, x read once for both
        for (; n + 1 < n1; n += 2) {
            float two[2];
            W.vnni2(W.w + n * W.ldw, W.w + (n + 1) * W.ldw, K, a.q.data() + m0 * a.Kp, a.d(gs) + m0 * G,
                    a.s(gs) + m0 * G, two);
            out[m0 * ldo + W.col + n] = two[0];
            out[m0 * ldo + W.col + n + 1] = two[1];
        }
    for (; n < n1; n++) {
        const uint8_t *row = W.w + n * W.ldw;
        for (int64_t m = m0; m < m1; m++) sums[m - m0] = 0.0f;
        const bool one = W.avx2 && m1 - m0 == 1;  // AVX2, one token: the row in registers
        if (W.vnni)  // one token (steps of 2+ take tile_rows())
            sums[0] = W.vnni(row, K, (W.nibbles ? a.qn : a.q).data() + m0 * a.Kp, a.d(gs) + m0 * G,
                             a.s(gs) + m0 * G);
        else if (one)
            sums[0] = W.avx2(row, K, a.q.data() + m0 * a.Kp, a.d(gs) + m0 * G, a.s(gs) + m0 * G);
        for (int64_t e0 = 0; !W.vnni && !one && e0 < K; e0 += SEG) {
            // past len: u to a multiple of 64, s and o to one of 16 groups, zeros
            const int64_t len = K - e0 < SEG ? K - e0 : SEG, padded = (len + 63) / 64 * 64;
            if (n + 1 < W.n) {  // the next row's segment fetched into L2 while this one's passes run
                const uint8_t *at = row + W.ldw + e0 / W.in.block * W.in.bytes;
                for (int64_t b = 0; b < len / W.in.block * W.in.bytes; b += 64)
                    _mm_prefetch((const char *)(at + b), _MM_HINT_T1);
            }
            W.unpack(row + e0 / W.in.block * W.in.bytes, len / W.in.block, seg);
            memset(seg.u + len, 0, padded - len);
            for (int64_t g = len / gs; g < (len / gs + 15) / 16 * 16; g++) seg.s[g] = seg.o[g] = 0.0f;
            for (int64_t m = m0; m < m1; m += MAX_MM) {
                const int mm = m1 - m < MAX_MM ? (int)(m1 - m) : MAX_MM;
                Pass p;
                for (int t = 0; t < mm; t++) {
                    p.q[t] = a.q.data() + (m + t) * a.Kp + e0;
                    p.d[t] = a.d(gs) + (m + t) * G + e0 / gs;
                    p.s[t] = a.s(gs) + (m + t) * G + e0 / gs;
                }
                W.dot[mm - 1](seg, padded, p, &sums[m - m0]);
            }
        }
        for (int64_t m = m0; m < m1; m++) out[m * ldo + W.col + n] = sums[m - m0];
    }
}

}  // namespace
}  // namespace hsq

extern "C" {

// x: [M, K] contiguous (xdtype 1 bf16, 2 float32); weight i: ws[i] [ns[i], K / block * bytes] of ggml type
// types[i], rows lds[i] bytes apart; out: [M, sum ns] float32 (row stride ldo), the weights side by side.
// isa: 2 AVX512-VNNI, 1 AVX2 + FMA + F16C, 0 portable (the caller checks the CPU). Returns 0, or -1 for
// bad arguments (an unknown type, K not a multiple of a type's block).
int hs_quant_matmul(int isa, int xdtype, const void *x, int64_t M, int64_t K, int64_t nw, const void *const *ws,
                    const int64_t *lds, const int64_t *ns, const int *types, float *out, int64_t ldo) {
    using namespace hsq;
    if (M < 1 || K < 32 || nw < 1 || nw > 16 || (xdtype != 1 && xdtype != 2) || isa < 0 || isa > 2) return -1;
    if (M > STEP_BLOCK) {
        const int64_t row = K * (xdtype == 1 ? 2 : 4);  // bytes of one token of x
        for (int64_t m = 0; m < M; m += STEP_BLOCK) {
            const int rc = hs_quant_matmul(isa, xdtype, (const char *)x + m * row, M - m < STEP_BLOCK ? M - m : STEP_BLOCK,
                                           K, nw, ws, lds, ns, types, out + m * ldo, ldo);
            if (rc != 0) return rc;
        }
        return 0;
    }
    Weight W[16];
    int64_t col = 0, chunks = 0;
    int tiles = 0;  // the transposed layouts of x the weights need (2+ tokens, AVX512-VNNI)
    for (int64_t i = 0; i < nw; i++) {
        W[i].w = (const uint8_t *)ws[i];
        W[i].ldw = lds[i];
        W[i].n = ns[i];
        W[i].col = col;
        if (!info(types[i], W[i].in) || K % W[i].in.block != 0 || ns[i] < 0) return -1;
        W[i].unpack = unpack_for(types[i], isa);
        W[i].vnni = isa == AVX512_VNNI ? row_vnni_for(types[i]) : nullptr;
        W[i].vnni2 = isa == AVX512_VNNI ? rows2_vnni_for(types[i]) : nullptr;
        W[i].avx2 = isa == AVX2 ? row_avx2_for(types[i]) : nullptr;
        W[i].nibbles = nibble_order(types[i]);
        if (W[i].vnni && W[i].nibbles && M % TOKEN_BLOCK == 1 && M < LANE_MIN) tiles |= 4;  // a 1-token pass needs x so
        W[i].unpack_t = isa == AVX512_VNNI ? unpack_t_for(types[i]) : nullptr;
        W[i].dot_t = dot_t_for(types[i]);
        W[i].unpack_l = isa == AVX512_VNNI ? unpack_l_for(types[i]) : nullptr;
        W[i].dot_l = dot_l_for(types[i]);
        if (W[i].in.group == 16)
            dots<16, false>(isa, W[i].dot);
        else if (W[i].in.wide)
            dots<32, true>(isa, W[i].dot);
        else
            dots<32, false>(isa, W[i].dot);
        if (isa == AVX512_VNNI && M >= LANE_MIN)
            tiles |= W[i].in.group == 16 ? 8 : 16;
        else if (isa == AVX512_VNNI && M >= 2)
            tiles |= W[i].in.group == 16 ? 1 : 2;
        col += ns[i];
        chunks += (ns[i] + CHUNK - 1) / CHUNK;
    }
    static thread_local Acts caller;  // the calling thread's buffers (the team's threads have their own)
    Acts &acts = caller;
    quantize_acts(x, xdtype, M, K, isa, tiles, acts);
#pragma omp parallel
    {
        Scratch scratch;
        const bool tiled = isa == AVX512_VNNI && M >= 2, lanes = isa == AVX512_VNNI && M >= LANE_MIN;
        const bool once = tiled && M > TOKEN_BLOCK;  // a chunk's rows unpacked once for its blocks of tokens
        if (tiled) {  // a chunk's rows (once), else a tile's
            const int64_t held = once ? CHUNK : lanes ? LANE_ROWS : TILE_R;
            scratch.u.resize(held * acts.Kp);
            scratch.s.resize(held * acts.Kp / 16);
            scratch.o.resize(held * acts.Kp / 16);
        }
        auto chunk = [&](int64_t c) {
            int64_t i = 0, first = c;  // chunk c is the first-th chunk of weight i
            while (first >= (W[i].n + CHUNK - 1) / CHUNK) first -= (W[i].n + CHUNK - 1) / CHUNK, i++;
            const int64_t n0 = first * CHUNK, n1 = n0 + CHUNK < W[i].n ? n0 + CHUNK : W[i].n;
            if (once) unpack_rows(W[i], n0, n1, n0, acts, K, scratch, lanes);
            for (int64_t m0 = 0; m0 < M; m0 += TOKEN_BLOCK) {
                const int64_t m1 = M - m0 < TOKEN_BLOCK ? M : m0 + TOKEN_BLOCK;
                if (lanes)
                    lane_rows(W[i], n0, n1, acts, m0, m1, K, out, ldo, scratch, once);
                else if (tiled && m1 - m0 >= 2)
                    tile_rows(W[i], n0, n1, acts, m0, m1, K, out, ldo, scratch, once);
                else  // one token (a last block of 1): the row in registers
                    rows(W[i], n0, n1, acts, m0, m1, K, out, ldo, scratch);
            }
        };
        if (M == 1 && K > LONG_ROW) {  // the threads' chunks side by side: one region of memory streamed
#pragma omp for schedule(static, 1)
            for (int64_t c = 0; c < chunks; c++) chunk(c);
        } else {
#pragma omp for schedule(static)
            for (int64_t c = 0; c < chunks; c++) chunk(c);
        }
    }
    return 0;
}

}  // extern "C"
