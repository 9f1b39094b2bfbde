// Small-batch linear layers on CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x.
//
// Decode at one to three sequences reads every weight once per token: the step is bound by memory
// bandwidth. Each thread streams whole rows of w, one after another (one sequential stream per
// thread: a row at a time reads at the bandwidth of a plain sum, several rows interleaved did not),
// and multiplies each row with every row of x (x stays in L1, or L2 for a 7B's long rows: taking those
// in pieces to keep 4 rows of x in L1 measured no faster). Measured against oneDNN's prepacked
// kernels (hotstart/model/gemv.py says where and by how much).
//
// Weights come as segments: the sibling projections of one input (q/k/v, gate/up) are separate
// tensors of the checkpoint, and one call computes them all, side by side in out's columns.
//
// Built by hotstart/model/gemv.py with `g++ -O3 -fopenmp -shared`; the OpenMP runtime it links is the
// one torch has already loaded (same soname), so torch.set_num_threads holds here too.

#include <omp.h>

#include "common.h"

namespace {

constexpr int64_t CHUNK = 16;  // rows of w per unit of parallel work
constexpr int MAX_M = 4;       // rows of x per pass over a chunk (more: another pass, w from cache)
constexpr int64_t PREFETCH = 2048;  // bf16 elements ahead of a row's read that steps of 2+ rows fetch

using hs::bf16_to_f32;
using hs::f32_to_bf16;
using hs::hsum256;

struct Segment {
    const void *w;     // [n, k] row-major, row stride ldw elements
    int64_t ldw, n;
    const void *bias;  // [n] or null, the weight's dtype
    int64_t col;       // first column of out
};

// ---- bfloat16, AVX512-BF16: 32 products per instruction ------------------------------------------
template <int MM>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void rows_bf16(const uint16_t *x, int64_t K, const Segment &s, int64_t n0, int64_t n1, void *out,
               int64_t ldo, bool out_f32) {
    const int64_t kfull = K & ~(int64_t)63;
    const uint16_t *w = (const uint16_t *)s.w;
    const uint16_t *bias = (const uint16_t *)s.bias;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * s.ldw;
        __m512 a[MM], b[MM];  // two accumulators per row of x: two independent chains
        for (int i = 0; i < MM; i++) a[i] = b[i] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < kfull; k += 64) {
            if (MM > 1) {  // more compute per byte: fetch 4 KB ahead (7B's shapes, 4 rows: 15.2 vs 12.2 GB/s)
                _mm_prefetch((const char *)(wr + k + PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(wr + k + PREFETCH + 32), _MM_HINT_T0);
            }
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
            for (int i = 0; i < MM; i++) {
                a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(x + i * K + k), w0);
                b[i] = _mm512_dpbf16_ps(b[i], (__m512bh)_mm512_loadu_si512(x + i * K + k + 32), w1);
            }
        }
        for (; k < K; k += 32) {  // the last 1-63 columns, masked past K
            const int64_t left = K - k < 32 ? K - k : 32;
            const __mmask32 m = (__mmask32)(left == 32 ? 0xffffffffu : ((1u << left) - 1));
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, wr + k);
            for (int i = 0; i < MM; i++)
                a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * K + k), w0);
        }
        const float bn = bias ? bf16_to_f32(bias[n]) : 0.0f;
        for (int i = 0; i < MM; i++) {
            const float v = _mm512_reduce_add_ps(_mm512_add_ps(a[i], b[i])) + bn;
            if (out_f32)
                ((float *)out)[i * ldo + s.col + n] = v;
            else
                ((uint16_t *)out)[i * ldo + s.col + n] = f32_to_bf16(v);
        }
    }
}

// ---- float32, AVX2 + FMA (any x86-64 of the last decade) -----------------------------------------
template <int MM>
__attribute__((target("avx2,fma")))
void rows_f32(const float *x, int64_t K, const Segment &s, int64_t n0, int64_t n1, void *out, int64_t ldo,
              bool) {
    const int64_t kfull = K & ~(int64_t)15;
    const float *w = (const float *)s.w;
    const float *bias = (const float *)s.bias;
    for (int64_t n = n0; n < n1; n++) {
        const float *wr = w + n * s.ldw;
        __m256 a[MM], b[MM];
        for (int i = 0; i < MM; i++) a[i] = b[i] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k < kfull; k += 16) {
            const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
            for (int i = 0; i < MM; i++) {
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), w0, a[i]);
                b[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k + 8), w1, b[i]);
            }
        }
        float tail[MM];
        for (int i = 0; i < MM; i++) tail[i] = 0.0f;
        for (; k < K; k++)
            for (int i = 0; i < MM; i++) tail[i] += x[i * K + k] * wr[k];
        const float bn = bias ? bias[n] : 0.0f;
        for (int i = 0; i < MM; i++)
            ((float *)out)[i * ldo + s.col + n] = hsum256(_mm256_add_ps(a[i], b[i])) + tail[i] + bn;
    }
}

template <typename T>
using Rows = void (*)(const T *, int64_t, const Segment &, int64_t, int64_t, void *, int64_t, bool);

template <typename T>
void run(const Rows<T> *rows, const T *x, int64_t M, int64_t K, const Segment *segs, int64_t nseg, void *out,
         int64_t ldo, bool out_f32) {
    int64_t chunks = 0;
    for (int64_t s = 0; s < nseg; s++) chunks += (segs[s].n + CHUNK - 1) / CHUNK;
    const size_t out_size = out_f32 ? 4 : sizeof(T);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t s = 0, first = c;  // chunk c is the first-th chunk of segment s
        while (first >= (segs[s].n + CHUNK - 1) / CHUNK) first -= (segs[s++].n + CHUNK - 1) / CHUNK;
        const int64_t n0 = first * CHUNK, n1 = n0 + CHUNK < segs[s].n ? n0 + CHUNK : segs[s].n;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int mm = M - m0 < MAX_M ? (int)(M - m0) : MAX_M;
            rows[mm - 1](x + m0 * K, K, segs[s], n0, n1, (char *)out + m0 * ldo * out_size, ldo, out_f32);
        }
    }
}

const Rows<uint16_t> BF16_ROWS[MAX_M] = {rows_bf16<1>, rows_bf16<2>, rows_bf16<3>, rows_bf16<4>};
const Rows<float> F32_ROWS[MAX_M] = {rows_f32<1>, rows_f32<2>, rows_f32<3>, rows_f32<4>};

}  // namespace

extern "C" {

// Which kernels this build holds, by dtype code (hotstart/model/gemv.py): 1 bfloat16, 2 float32.
int hs_gemv_abi(void) { return 1; }

// x: [M, K] contiguous, the weights' dtype; segment s: ws[s] [ns[s], K] with row stride lds[s], its bias
// biases[s] or null; out: [M, sum ns] (row stride ldo), float32 if out_f32 else the weights' dtype.
// dtype 1 needs AVX512-BF16, 2 AVX2+FMA: the caller checks the CPU. Returns 0, or -1 for a bad dtype.
int hs_gemv(int dtype, const void *x, int64_t M, int64_t K, int64_t nseg, const void *const *ws,
            const int64_t *lds, const int64_t *ns, const void *const *biases, void *out, int64_t ldo,
            int out_f32) {
    Segment segs[64];
    if (nseg < 1 || nseg > 64 || M < 1) return -1;
    int64_t col = 0;
    for (int64_t s = 0; s < nseg; s++) {
        segs[s] = Segment{ws[s], lds[s], ns[s], biases ? biases[s] : nullptr, col};
        col += ns[s];
    }
    if (dtype == 1) {
        run<uint16_t>(BF16_ROWS, (const uint16_t *)x, M, K, segs, nseg, out, ldo, out_f32 != 0);
    } else if (dtype == 2) {
        run<float>(F32_ROWS, (const float *)x, M, K, segs, nseg, out, ldo, true);
    } else {
        return -1;
    }
    return 0;
}

}  // extern "C"
