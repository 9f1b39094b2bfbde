// Decode attention over the paged KV cache, reading each sequence's keys and values where they lie.
//
// The torch path (model/attention.py) gathers every sequence's blocks into fresh tensors per layer per
// step, then runs ~10 ops over them; at one stream that is mostly op overhead, at sixteen the gathers'
// writes and reads. Here one call per layer: for each (sequence, KV head), in parallel, the scores of
// its query heads against its keys (read in place through the block table), a softmax, and the
// weighted sum of its values, all in float32.
//
// Layout (hotstart/model/attention.py, engine/model_runner.py): a layer's cache is [KVH, slots, D],
// slot = block * block_size + offset; block 0 is the null block. q, out: [B, H, D], the H query heads
// of KV head g being g * G .. g * G + G - 1 (G = H / KVH).

#include <math.h>

#include <vector>

#include "common.h"

namespace {

using hs::exp8;
using hs::hsum256;
using hs::load8;
using hs::store;
using hs::to_f32;

struct Args {
    const void *q;
    void *out;
    const void *k, *v;  // [KVH, slots, D]
    int64_t B, H, KVH, D, head_stride;  // head_stride: slots * D
    const int64_t *tables;  // [B, nb]
    int64_t nb;
    const int64_t *context;  // [B] keys in context
    int64_t block_size;
    float scale, softcap;  // softcap 0: none
    int64_t window;        // 0: none; else keys >= context - window only
};

constexpr int64_t KEYS = 32;  // keys converted to float32 at a time (KEYS x D floats: in L1 for D <= 256)

// keys p0 .. p0 + n of head cache H (through the block table) -> float32 rows of D in BUF
template <typename T>
__attribute__((target("avx2,fma")))
void to_rows(const Args &a, const T *hc, const int64_t *table, int64_t p0, int64_t n, float *buf) {
    const int64_t D = a.D, D8 = D & ~(int64_t)7;
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = p0 + j;
        const T *src = hc + (table[p / a.block_size] * a.block_size + p % a.block_size) * D;
        float *dst = buf + j * D;
        for (int64_t d = 0; d < D8; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
        for (int64_t d = D8; d < D; d++) dst[d] = to_f32(src[d]);
    }
}

// q . k over D: 8 lanes in order of d, then their sum and the tail (every key's score rounds alike)
template <int N>
__attribute__((target("avx2,fma")))
inline void dots(const float *qh, const float *k, int64_t D, float *s) {
    const int64_t D8 = D & ~(int64_t)7;
    __m256 s8[N];
    for (int i = 0; i < N; i++) s8[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
        const __m256 q8 = _mm256_loadu_ps(qh + d);
        for (int i = 0; i < N; i++) s8[i] = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k + i * D + d), s8[i]);
    }
    for (int i = 0; i < N; i++) {
        float v = hsum256(s8[i]);
        for (int64_t d = D8; d < D; d++) v += qh[d] * k[i * D + d];
        s[i] = v;
    }
}

// one (sequence b, KV head g): its G query heads; scores: scratch of G * L floats, acc: G * D floats,
// rows: KEYS * D floats. Keys and values are converted to float32 once per block of KEYS for the G heads;
// a head's scores are taken 4 keys at a time (independent sums) and its output accumulates a block of
// keys in registers. Every score and output element sums in the same order as one key at a time would.
template <typename T>
__attribute__((target("avx2,fma")))
void one(const Args &a, int64_t b, int64_t g, std::vector<float> &scores, std::vector<float> &acc,
         std::vector<float> &rows) {
    const int64_t G = a.H / a.KVH, D = a.D, ctx = a.context[b];
    const int64_t lo = a.window > 0 && ctx - a.window > 0 ? ctx - a.window : 0;
    const int64_t L = ctx - lo;
    const T *q = (const T *)a.q + (b * a.H + g * G) * D;
    const T *kh = (const T *)a.k + g * a.head_stride;
    const T *vh = (const T *)a.v + g * a.head_stride;
    const int64_t *table = a.tables + b * a.nb;
    scores.resize(G * (L > 0 ? L : 1));
    acc.assign(G * D, 0.0f);
    rows.resize(KEYS * D);
    float qf[8 * 512];  // this head group's queries in float32 (G * D <= 4096: checked by the caller)
    for (int64_t i = 0; i < G * D; i++) qf[i] = to_f32(q[i]);
    const int64_t D8 = D & ~(int64_t)7;
    // scores = q . k * scale (capped)
    for (int64_t p0 = lo; p0 < ctx; p0 += KEYS) {
        const int64_t n = ctx - p0 < KEYS ? ctx - p0 : KEYS;
        to_rows(a, kh, table, p0, n, rows.data());
        for (int64_t h = 0; h < G; h++) {
            float *sh = scores.data() + h * L + p0 - lo;
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) dots<4>(qf + h * D, rows.data() + j * D, D, sh + j);
            for (; j < n; j++) dots<1>(qf + h * D, rows.data() + j * D, D, sh + j);
            for (j = 0; j < n; j++) {
                float s = sh[j] * a.scale;
                if (a.softcap > 0) s = tanhf(s / a.softcap) * a.softcap;
                sh[j] = s;
            }
        }
    }
    // softmax per head
    for (int64_t h = 0; h < G; h++) {
        float *s = scores.data() + h * L;
        float m = -INFINITY;
        for (int64_t i = 0; i < L; i++) m = s[i] > m ? s[i] : m;
        const __m256 m8 = _mm256_set1_ps(m);
        __m256 z8 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= L; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m8));
            _mm256_storeu_ps(s + i, e);
            z8 = _mm256_add_ps(z8, e);
        }
        float z = hsum256(z8);
        for (; i < L; i++) {
            s[i] = expf(s[i] - m);
            z += s[i];
        }
        const float inv = 1.0f / z;
        for (i = 0; i < L; i++) s[i] *= inv;
    }
    // out = probs . v: per head, 32 of its D outputs in registers over the block's keys (in order)
    for (int64_t p0 = lo; p0 < ctx; p0 += KEYS) {
        const int64_t n = ctx - p0 < KEYS ? ctx - p0 : KEYS;
        to_rows(a, vh, table, p0, n, rows.data());
        const float *v = rows.data();
        for (int64_t h = 0; h < G; h++) {
            const float *w = scores.data() + h * L + p0 - lo;
            float *o = acc.data() + h * D;
            int64_t d = 0;
            for (; d + 32 <= D8; d += 32) {
                __m256 o0 = _mm256_loadu_ps(o + d), o1 = _mm256_loadu_ps(o + d + 8);
                __m256 o2 = _mm256_loadu_ps(o + d + 16), o3 = _mm256_loadu_ps(o + d + 24);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 w8 = _mm256_set1_ps(w[j]);
                    const float *vj = v + j * D + d;
                    o0 = _mm256_fmadd_ps(w8, _mm256_loadu_ps(vj), o0);
                    o1 = _mm256_fmadd_ps(w8, _mm256_loadu_ps(vj + 8), o1);
                    o2 = _mm256_fmadd_ps(w8, _mm256_loadu_ps(vj + 16), o2);
                    o3 = _mm256_fmadd_ps(w8, _mm256_loadu_ps(vj + 24), o3);
                }
                _mm256_storeu_ps(o + d, o0), _mm256_storeu_ps(o + d + 8, o1);
                _mm256_storeu_ps(o + d + 16, o2), _mm256_storeu_ps(o + d + 24, o3);
            }
            for (; d < D8; d += 8) {
                __m256 o0 = _mm256_loadu_ps(o + d);
                for (int64_t j = 0; j < n; j++) o0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + j * D + d), o0);
                _mm256_storeu_ps(o + d, o0);
            }
            for (; d < D; d++)
                for (int64_t j = 0; j < n; j++) o[d] += w[j] * v[j * D + d];
        }
    }
    T *out = (T *)a.out + (b * a.H + g * G) * D;
    for (int64_t i = 0; i < G * D; i++) store(out + i, acc[i]);
}

template <typename T>
void run(const Args &a) {
    const int64_t items = a.B * a.KVH;
#pragma omp parallel
    {
        std::vector<float> scores, acc, rows;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) one<T>(a, it / a.KVH, it % a.KVH, scores, acc, rows);
    }
}

}  // namespace

extern "C" {

// dtype 1 bfloat16, 2 float32 (AVX2 + FMA: the caller checks the CPU). Every sequence has >= 1 key in
// context. Returns 0, or -1 for arguments it does not take (the caller keeps the torch path then).
int hs_decode_attention(int dtype, const void *q, void *out, const void *k_cache, const void *v_cache,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t head_stride,
                        const int64_t *tables, int64_t nb, const int64_t *context, int64_t block_size,
                        float scale, float softcap, int64_t window) {
    if (B < 1 || KVH < 1 || H % KVH != 0 || (H / KVH) * D > 8 * 512 || block_size < 1) return -1;
    const Args a{q, out, k_cache, v_cache, B, H, KVH, D, head_stride, tables, nb, context, block_size,
                 scale, softcap, window};
    if (dtype == 1)
        run<uint16_t>(a);
    else if (dtype == 2)
        run<float>(a);
    else
        return -1;
    return 0;
}

}  // extern "C"
