// Causal prefill attention over the paged KV cache, bfloat16 (AVX512-BF16): one call per layer for every
// sequence of a step that has several new tokens (a prompt, a chunk of one, a prompt after a cached
// prefix).
//
// torch's SDPA on this CPU runs its flash kernel at ~30-50 GMAC/s in bf16 (small GEMMs through MKL, which
// takes its float32 path on AMD); a 1,000-token prompt then spends as long in attention as in its linear
// layers. Here, flash attention's online softmax with the dot products on vdpbf16ps: a tile of up to 6
// query rows x 64 keys keeps 24 score accumulators in registers, then 6 rows x 64 output dims for P V.
// Keys and values are first repacked once per (sequence, KV head) into the pair layouts vdpbf16ps
// multiplies: K as [key block][D/2][64 keys] pairs of dims, V as [key block][32 key pairs][D] pairs of
// keys. Scores, softmax and the output accumulate in float32; P is rounded to bf16 for P V, as torch's
// bf16 flash attention rounds it.
//
// Layout (hotstart/model/attention.py): q, out: [T, H, D], the H query heads of KV head g being g * G ..
// g * G + G - 1; caches [KVH, slots, D], slot = block * block_size + offset. spans: [B, 3] per sequence
// (its first row in q, its rows, the position of its first row); row i of a sequence sees keys 0 .. its
// position (and, with a window W, only those > position - W).

#include <math.h>
#include <omp.h>

#include <vector>

#include "common.h"

namespace {

using hs::bf16x16;
using hs::exp16;

constexpr int KB = 64;  // keys per block: 4 vectors of 16 scores
constexpr int MB = 6;   // query rows per tile: 6 x 4 accumulators + 4 keys + 1 query = 29 registers

struct Args {
    const uint16_t *q;
    uint16_t *out;
    const uint16_t *k, *v;  // [KVH, slots, D]
    int64_t H, KVH, D, head_stride;
    const int64_t *spans;   // [B, 3]
    const int64_t *tables;  // [B, nb]
    int64_t nb, block_size;
    float scale;
    int64_t window;  // 0: none
};

struct Packed {                  // one (sequence, KV head): keys 0 .. context - 1, zero past it
    std::vector<uint32_t> kt;    // [blocks][D/2][KB]: pairs of dims of 64 keys
    std::vector<uint32_t> vp;    // [blocks][KB/2][D]: pairs of keys of each dim
};

void pack(const Args &a, int64_t b, int64_t g, Packed &p) {
    const int64_t ctx = a.spans[3 * b + 2] + a.spans[3 * b + 1], D2 = a.D / 2, blocks = (ctx + KB - 1) / KB;
    p.kt.assign(blocks * D2 * KB, 0);
    p.vp.assign(blocks * (KB / 2) * a.D, 0);
    for (int64_t j = 0; j < ctx; j++) {
        const int64_t slot = a.tables[b * a.nb + j / a.block_size] * a.block_size + j % a.block_size;
        const uint32_t *kr = (const uint32_t *)(a.k + g * a.head_stride + slot * a.D);
        const uint16_t *vr = a.v + g * a.head_stride + slot * a.D;
        uint32_t *kt = p.kt.data() + (j / KB) * D2 * KB + j % KB;
        for (int64_t dp = 0; dp < D2; dp++) kt[dp * KB] = kr[dp];
        uint16_t *vp = (uint16_t *)(p.vp.data() + (j / KB) * (KB / 2) * a.D + (j % KB) / 2 * a.D) + j % 2;
        for (int64_t d = 0; d < a.D; d++) vp[2 * d] = vr[d];
    }
}

// o[R][NV x 16 dims from d0] = o * alpha + P V over one key block (pairs of keys)
template <int R, int NV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void pv(const uint32_t *vp, int64_t D, int64_t d0, const uint16_t (*pbuf)[KB], const float *alpha, float *o) {
    __m512 acc[R][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++)
            acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * j), _mm512_set1_ps(alpha[r]));
    for (int kp = 0; kp < KB / 2; kp++) {
        __m512bh w[NV];
        for (int j = 0; j < NV; j++) w[j] = (__m512bh)_mm512_loadu_si512(vp + kp * D + d0 + 16 * j);
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, pbuf[r] + 2 * kp, 4);
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pb, w[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(o + r * D + d0 + 16 * j, acc[r][j]);
}

template <int R>
void pv_all(const uint32_t *vp, int64_t D, const uint16_t (*pbuf)[KB], const float *alpha, float *o) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv<R, 4>(vp, D, d0, pbuf, alpha, o);
    switch ((D - d0) / 16) {
        case 3: pv<R, 3>(vp, D, d0, pbuf, alpha, o); break;
        case 2: pv<R, 2>(vp, D, d0, pbuf, alpha, o); break;
        case 1: pv<R, 1>(vp, D, d0, pbuf, alpha, o); break;
        default: break;
    }
}

// R query rows (q rows, their positions) against their keys; out rows written in bf16
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void rows(const Args &a, const Packed &p, const uint16_t *const *q, const int64_t *pos,
          uint16_t *const *out) {
    const int64_t D = a.D, D2 = D / 2;
    float o[R * 256];  // D <= 256 (checked by the caller)
    float m[R], l[R], alpha[R];
    alignas(64) uint16_t pbuf[R][KB];
    int64_t first = pos[0], last = pos[0];
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        first = pos[r] < first ? pos[r] : first;
        last = pos[r] > last ? pos[r] : last;
        for (int64_t d = 0; d < D; d++) o[r * D + d] = 0.0f;
    }
    const int64_t lowest = a.window > 0 && first - a.window + 1 > 0 ? first - a.window + 1 : 0;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t kb = lowest / KB; kb <= last / KB; kb++) {
        __m512 s[R][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) s[r][j] = _mm512_setzero_ps();
        const uint32_t *kt = p.kt.data() + kb * D2 * KB;
        for (int64_t dp = 0; dp < D2; dp++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + dp * KB),
                           k1 = (__m512bh)_mm512_loadu_si512(kt + dp * KB + 16),
                           k2 = (__m512bh)_mm512_loadu_si512(kt + dp * KB + 32),
                           k3 = (__m512bh)_mm512_loadu_si512(kt + dp * KB + 48);
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, q[r] + 2 * dp, 4);
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)pair);
                s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
                s[r][2] = _mm512_dpbf16_ps(s[r][2], qb, k2);
                s[r][3] = _mm512_dpbf16_ps(s[r][3], qb, k3);
            }
        }
        for (int r = 0; r < R; r++) {  // mask, online softmax, P in bf16
            const __m512i hi = _mm512_set1_epi32((int)(pos[r] - kb * KB));  // keys <= pos
            const __m512i lo = _mm512_set1_epi32(a.window > 0 ? (int)(pos[r] - a.window + 1 - kb * KB) : -KB);
            float mx = -INFINITY;
            for (int j = 0; j < 4; j++) {
                const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * j));
                const __mmask16 in = _mm512_cmple_epi32_mask(key, hi) & _mm512_cmpge_epi32_mask(key, lo);
                s[r][j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), in, s[r][j], _mm512_set1_ps(a.scale));
                const float bm = _mm512_reduce_max_ps(s[r][j]);
                mx = bm > mx ? bm : mx;
            }
            const float mnew = mx > m[r] ? mx : m[r];
            if (mnew == -INFINITY) {  // nothing seen yet: this block adds nothing
                alpha[r] = 1.0f;
                memset(pbuf[r], 0, sizeof(pbuf[r]));
                continue;
            }
            alpha[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < 4; j++) {
                const __m512 e = exp16(_mm512_sub_ps(s[r][j], _mm512_set1_ps(mnew)));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(pbuf[r] + 16 * j), bf16x16(e));
            }
            l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
            m[r] = mnew;
        }
        pv_all<R>(p.vp.data() + kb * (KB / 2) * D, D, pbuf, alpha, o);
    }
    for (int r = 0; r < R; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(out[r] + d),
                                bf16x16(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), _mm512_set1_ps(inv))));
    }
}

using Rows = void (*)(const Args &, const Packed &, const uint16_t *const *, const int64_t *,
                     uint16_t *const *);
const Rows ROWS[MB] = {rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>};

struct Task {
    int64_t b, g, r0, n;  // sequence, KV head, first of its rows (position-major, head-minor), rows
};

}  // namespace

extern "C" {

// q, out: [T, H, D] bf16 contiguous; caches: [KVH, slots, D] bf16 (head_stride = slots * D); spans: [B, 3]
// long; tables: [B, nb] long. Needs AVX512-BF16 (the caller checks the CPU). Returns 0, or -1 for
// arguments it does not take (D not a multiple of 16 or above 256, H not a multiple of KVH).
int hs_prefill_attention(const void *q, void *out, const void *k, const void *v, int64_t B, int64_t H,
                         int64_t KVH, int64_t D, int64_t head_stride, const int64_t *spans,
                         const int64_t *tables, int64_t nb, int64_t block_size, float scale, int64_t window) {
    if (B < 1 || H < 1 || KVH < 1 || H % KVH != 0 || D < 16 || D % 16 != 0 || D > 256 || block_size < 1)
        return -1;
    const Args a{(const uint16_t *)q, (uint16_t *)out, (const uint16_t *)k, (const uint16_t *)v, H, KVH, D,
                 head_stride, spans, tables, nb, block_size, scale, window};
    const int64_t G = H / KVH;
    std::vector<Packed> packed(B * KVH);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < B * KVH; i++) pack(a, i / KVH, i % KVH, packed[i]);
    std::vector<Task> tasks;  // longest first: later rows see more keys
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < KVH; g++) {
            const int64_t n = spans[3 * b + 1] * G;
            for (int64_t r0 = (n - 1) / MB * MB; r0 >= 0; r0 -= MB)
                tasks.push_back({b, g, r0, n - r0 < MB ? n - r0 : MB});
        }
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t t = 0; t < tasks.size(); t++) {
        const Task &w = tasks[t];
        const int64_t *span = spans + 3 * w.b;
        const uint16_t *qs[MB];
        uint16_t *os[MB];
        int64_t pos[MB];
        for (int64_t r = 0; r < w.n; r++) {
            const int64_t i = (w.r0 + r) / G, h = w.g * G + (w.r0 + r) % G;
            qs[r] = a.q + ((span[0] + i) * H + h) * D;
            os[r] = a.out + ((span[0] + i) * H + h) * D;
            pos[r] = span[2] + i;
        }
        ROWS[w.n - 1](a, packed[w.b * KVH + w.g], qs, pos, os);
    }
    return 0;
}

}  // extern "C"
