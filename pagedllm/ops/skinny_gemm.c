/* Skinny GEMM: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), float32, for the few rows of a decode
 * step (M up to about a hundred; N and K the model's projections).
 *
 * Why our own: at a decode step's row counts the weight is read once per step and every weight
 * element feeds only M multiply-adds, so the step is bound by the weight stream and the FMA units
 * together; oneDNN's and MKL's kernels, tuned for large M, leave the memory idle while they compute
 * (benchmarks/skinny_gemm.py measures all three on the model's shapes, weights cold in cache).
 *
 * Layout: the weight is packed once (pagedllm/ops/skinny_gemm.py) into panels of SG_NR output
 * columns, each panel K rows of SG_NR contiguous floats (zero-padded past N), so one thread streams
 * one panel front to back and the hardware prefetcher sees a single sequential stream. The kernel
 * walks a panel once per tile of SG_MR rows of x: the first walk reads it from memory (with software
 * prefetch SG_PREFETCH_ROWS rows ahead, which runs on into the next panel), the later ones from L2
 * while they pull the next panel into L2 (prefetch, no loads: nothing waits on it).
 *
 * Numerics: every output element is bias + sum over k = 0..K-1, in that order, of x[m, k] * w[n, k],
 * each step one float32 fused multiply-add. The order does not depend on M, on the other rows of the
 * batch or on the thread count: a row's result is the same in any batch (batch-invariant), which the
 * tests check bit for bit.
 *
 * Built by pagedllm/native.py (-O3 -march=native -ffp-contract=fast, OpenMP on torch's libgomp).
 * The code is GCC vector extensions: 16 lanes (one AVX-512 register) where AVX-512F is there, 8 (one
 * AVX2 register) elsewhere, with the tile sized to the register file (32 or 16 registers).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define SKINNY_GEMM_ABI_VERSION 1

#if defined(__AVX512F__)
#define SG_W 16 /* lanes per vector */
#define SG_MR 8 /* rows of x per tile: SG_MR * SG_NB accumulators + SG_NB weights + 1 broadcast <= 32 */
#else
#define SG_W 8
#define SG_MR 4 /* 4 * 3 + 3 + 1 = 16 registers */
#endif
#define SG_NB 3                /* vectors of output columns per tile */
#define SG_NR (SG_W * SG_NB)   /* output columns per panel */
#define SG_PREFETCH_ROWS 32    /* panel rows read ahead on the first walk (6 KiB with AVX-512) */

typedef float sg_vec __attribute__((vector_size(SG_W * sizeof(float))));

static inline sg_vec sg_load(const float *p) {
    sg_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x in every lane: one vbroadcastss (GCC turns a lane-by-lane fill into one masked insert per lane). */
static inline sg_vec sg_splat(float x) {
#if defined(__AVX512F__)
    return (sg_vec)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (sg_vec)_mm256_set1_ps(x);
#else
    return x - (sg_vec){0}; /* the scalar is splatted; x - 0 is x for every x, -0 included */
#endif
}

int pagedllm_skinny_gemm_abi_version(void) { return SKINNY_GEMM_ABI_VERSION; }

/* Float32 lanes per vector of this build (16: AVX-512F; skinny_gemm.py turns the kernel on by
 * default only there, where it was measured). */
int pagedllm_skinny_gemm_vector_width(void) { return SG_W; }

/* Output columns per packed panel (the packing in skinny_gemm.py asks for it). */
int pagedllm_skinny_gemm_panel_width(void) { return SG_NR; }

/* One tile: rows [0, rows) of x times one panel, into out's columns [0, cols). rows and prefetch are
 * compile-time constants at every call site (the switch below), so acc stays in registers.
 * prefetch: this walk reads the panel from memory and prefetches it SG_PREFETCH_ROWS rows ahead.
 * Otherwise, when next is not NULL, each k pulls next_lines cache lines of [next, next_end) into L2. */
static inline __attribute__((always_inline)) void sg_tile(const float *x, ptrdiff_t x_stride, const float *panel,
                                                          int K, const float *bias, float *out,
                                                          ptrdiff_t out_stride, const int rows, int cols,
                                                          const int prefetch, const char *next,
                                                          const char *next_end, int next_lines) {
    sg_vec acc[SG_MR][SG_NB];
    for (int j = 0; j < SG_NB; j++) {
        const sg_vec b = bias ? sg_load(bias + j * SG_W) : sg_splat(0.0f);
        for (int r = 0; r < rows; r++)
            acc[r][j] = b;
    }
    for (int k = 0; k < K; k++) {
        const float *w = panel + (ptrdiff_t)k * SG_NR;
        if (prefetch) {
            for (int j = 0; j < SG_NB; j++)
                __builtin_prefetch(w + SG_PREFETCH_ROWS * SG_NR + j * SG_W, 0, 3);
        } else if (next) {
            for (int l = 0; l < next_lines; l++) {
                const char *line = next + ((ptrdiff_t)k * next_lines + l) * 64;
                if (line < next_end)
                    __builtin_prefetch(line, 0, 2);
            }
        }
        sg_vec wv[SG_NB];
        for (int j = 0; j < SG_NB; j++)
            wv[j] = sg_load(w + j * SG_W);
        for (int r = 0; r < rows; r++) {
            const sg_vec a = sg_splat(x[r * x_stride + k]);
            for (int j = 0; j < SG_NB; j++)
                acc[r][j] += a * wv[j]; /* one FMA (-ffp-contract=fast) */
        }
    }
    for (int r = 0; r < rows; r++) {
        if (cols == SG_NR) {
            memcpy(out + r * out_stride, acc[r], sizeof acc[r]);
        } else {
            memcpy(out + r * out_stride, acc[r], (size_t)cols * sizeof(float));
        }
    }
}

#define SG_TILE(R, PF) sg_tile(xr, x_stride, panel, K, b, o, out_stride, R, cols, PF, next, next_end, next_lines)
#define SG_ROWS_CASE(R)                                                                                            \
    case R:                                                                                                        \
        if (first) SG_TILE(R, 1); else SG_TILE(R, 0);                                                              \
        break;

/* out[m, n] = bias[n] + sum_k x[m, k] * w[n, k] for m < M, n < N.
 *   x: M rows of K floats, row stride x_stride (floats); out: M rows, stride out_stride (floats).
 *   packed: ceil(N / SG_NR) panels, each K rows of SG_NR floats (see the header comment).
 *   bias: NULL, or ceil(N / SG_NR) * SG_NR floats (zero-padded).
 *   num_threads: OpenMP threads; panels are split between them in contiguous ranges.
 * The caller checks shapes, strides and dtypes (skinny_gemm.py); nothing here is validated. */
void skinny_gemm_f32(const float *x, ptrdiff_t x_stride, const float *packed, const float *bias, float *out,
                     ptrdiff_t out_stride, int M, int N, int K, int num_threads) {
    const int panels = (N + SG_NR - 1) / SG_NR;
    const int tiles = (M + SG_MR - 1) / SG_MR;
    const ptrdiff_t panel_lines = ((ptrdiff_t)K * SG_NR * (ptrdiff_t)sizeof(float) + 63) / 64;
    /* The walks after the first read the panel from L2 and meanwhile pull the next panel (the same
     * thread's, the split being contiguous) into L2, its lines spread evenly over those walks: the
     * next first walk then finds it there instead of waiting on memory. */
    const int next_lines = tiles > 1 ? (int)((panel_lines + (ptrdiff_t)(tiles - 1) * K - 1) /
                                             ((ptrdiff_t)(tiles - 1) * K)) : 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int p = 0; p < panels; p++) {
        const float *panel = packed + (ptrdiff_t)p * K * SG_NR;
        const float *b = bias ? bias + (ptrdiff_t)p * SG_NR : NULL;
        const int cols = N - p * SG_NR < SG_NR ? N - p * SG_NR : SG_NR;
        const char *next_panel = p + 1 < panels ? (const char *)(panel + (ptrdiff_t)K * SG_NR) : NULL;
        const char *next_end = next_panel ? next_panel + panel_lines * 64 : NULL;
        for (int m0 = 0; m0 < M; m0 += SG_MR) {
            const float *xr = x + (ptrdiff_t)m0 * x_stride;
            float *o = out + (ptrdiff_t)m0 * out_stride + (ptrdiff_t)p * SG_NR;
            const int first = m0 == 0; /* the walk that reads the panel from memory prefetches */
            const char *next = first || !next_panel ? NULL
                                                    : next_panel + (ptrdiff_t)(m0 / SG_MR - 1) * K * next_lines * 64;
            switch (M - m0 < SG_MR ? M - m0 : SG_MR) {
#if SG_MR == 8
                SG_ROWS_CASE(8)
                SG_ROWS_CASE(7)
                SG_ROWS_CASE(6)
                SG_ROWS_CASE(5)
#endif
                SG_ROWS_CASE(4)
                SG_ROWS_CASE(3)
                SG_ROWS_CASE(2)
                default:
                    if (first) SG_TILE(1, 1); else SG_TILE(1, 0);
                    break;
            }
        }
    }
}
