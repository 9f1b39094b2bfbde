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

// one (sequence b, KV head g): its G query heads; scores: scratch of G * L floats, acc: G * D floats
template <typename T>
__attribute__((target("avx2,fma")))
void one(const Args &a, int64_t b, int64_t g, std::vector<float> &scores, std::vector<float> &acc) {
    const int64_t G = a.H / a.KVH, D = a.D, ctx = a.context[b];
    const int64_t lo = a.window > 0 && ctx - a.window > 0 ? ctx - a.window : 0;
    const int64_t L = ctx - lo;
    const T *q = (const T *)a.q + (b * a.H + g * G) * D;
    const T *kh = (const T *)a.k + g * a.head_stride;
    const T *vh = (const T *)a.v + g * a.head_stride;
    const int64_t *table = a.tables + b * a.nb;
    scores.resize(G * (L > 0 ? L : 1));
    acc.assign(G * D, 0.0f);
    float qf[8 * 512];  // this head group's queries in float32 (G * D <= 4096: checked by the caller)
    for (int64_t i = 0; i < G * D; i++) qf[i] = to_f32(q[i]);
    const int64_t D8 = D & ~(int64_t)7;
    // scores = q . k * scale (capped), each key read once for the G heads
    for (int64_t p = lo; p < ctx; p++) {
        const T *k = kh + (table[p / a.block_size] * a.block_size + p % a.block_size) * D;
        for (int64_t h = 0; h < G; h++) {
            const float *qh = qf + h * D;
            __m256 s8 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D8; d += 8) s8 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(k + d), s8);
            float s = hsum256(s8);
            for (int64_t d = D8; d < D; d++) s += qh[d] * to_f32(k[d]);
            s *= a.scale;
            if (a.softcap > 0) s = tanhf(s / a.softcap) * a.softcap;
            scores[h * L + p - lo] = s;
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
    // out = probs . v, each value read once for the G heads
    for (int64_t p = lo; p < ctx; p++) {
        const T *v = vh + (table[p / a.block_size] * a.block_size + p % a.block_size) * D;
        for (int64_t h = 0; h < G; h++) {
            const float w = scores[h * L + p - lo];
            float *o = acc.data() + h * D;
            const __m256 w8 = _mm256_set1_ps(w);
            for (int64_t d = 0; d < D8; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w8, load8(v + d), _mm256_loadu_ps(o + d)));
            for (int64_t d = D8; d < D; d++) o[d] += w * to_f32(v[d]);
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
        std::vector<float> scores, acc;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) one<T>(a, it / a.KVH, it % a.KVH, scores, acc);
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
