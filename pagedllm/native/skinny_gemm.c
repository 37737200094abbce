/* Skinny GEMM: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), float32, for the few rows of a decode step:
 * the weight stream, not the FMAs, bounds it, which kernels tuned for large M do not serve.
 *
 * Layout: the weight is packed once (pagedllm/ops/skinny_gemm.py) into panels of SG_NR output columns,
 * each K rows of SG_NR contiguous floats (zero-padded past N); a panel is walked once per tile of SG_MR
 * rows of x, the first walk from memory, the later ones from L2.
 * Numerics: each output is bias + sum over k = 0..K-1, in that order, of float32 FMAs: independent of M,
 * the other rows and the thread count (batch-invariant).
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include "native_simd.h"
#include "native_team.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define SG_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SG_AMX 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SG_DP 1 /* the bfloat16 dot-product kernel (vdpbf16ps) */
#else
#define SG_DP 0
#endif

#define SKINNY_GEMM_ABI_VERSION 4

#if defined(__AVX512F__)
#define SG_W 16 /* lanes per vector */
#define SG_MR 8 /* rows of x per tile: SG_MR * SG_NB accumulators + SG_NB weights + 1 broadcast <= 32 */
#else
#define SG_W 8
#define SG_MR 4 /* 4 * 3 + 3 + 1 = 16 registers */
#endif
#define SG_NB 3                /* vectors of output columns per tile */
#define SG_NR (SG_W * SG_NB)   /* output columns per panel */
/* Off on AVX2: with 16 registers the per-k pull loop costs more issue slots than it saves. */
#ifndef SG_PULL_NEXT
#if defined(__AVX512F__)
#define SG_PULL_NEXT 1
#else
#define SG_PULL_NEXT 0
#endif
#endif
#ifndef SG_PREFETCH_ROWS
#define SG_PREFETCH_ROWS 32    /* panel rows read ahead on the first walk (6 KiB with AVX-512) */
#endif

typedef float sg_vec __attribute__((vector_size(SG_W * sizeof(float))));

static inline sg_vec sg_load(const float *p) {
    sg_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x in every lane as one vbroadcastss (GCC turns a lane-by-lane fill into one insert per lane). */
static inline sg_vec sg_splat(float x) {
#if defined(__AVX512F__)
    return (sg_vec)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (sg_vec)_mm256_set1_ps(x);
#else
    return x - (sg_vec){0};
#endif
}

int pagedllm_skinny_gemm_abi_version(void) { return SKINNY_GEMM_ABI_VERSION; }

int pagedllm_skinny_gemm_vector_width(void) { return SG_W; }

int pagedllm_skinny_gemm_panel_width(void) { return SG_NR; }

/* The prefetch schedule of both kernels: the walks after the first pull the next panel into L2,
 * sg_next_lines cache lines per k step. */
static inline int sg_next_lines(ptrdiff_t panel_lines, int tiles, int steps) {
#if SG_PULL_NEXT == 0
    (void)panel_lines, (void)tiles, (void)steps;
    return 0;
#endif
    return tiles > 1 ? (int)((panel_lines + (ptrdiff_t)(tiles - 1) * steps - 1) / ((ptrdiff_t)(tiles - 1) * steps))
                     : 0;
}

/* Where walk `walk` starts pulling the next panel; NULL for the first walk or without a next panel. */
static inline const char *sg_next_start(const char *next_panel, int walk, int steps, int next_lines) {
    return walk == 0 || !next_panel ? NULL : next_panel + (ptrdiff_t)(walk - 1) * steps * next_lines * 64;
}

static inline __attribute__((always_inline)) void sg_pull_next(const char *next, const char *next_end, int k,
                                                               int next_lines) {
    for (int l = 0; l < next_lines; l++) {
        const char *line = next + ((ptrdiff_t)k * next_lines + l) * 64;
        if (line < next_end)
            __builtin_prefetch(line, 0, 2);
    }
}

/* One tile: rows [0, rows) of x times one panel, into out's columns [0, cols); rows and prefetch are
 * compile-time constants so acc stays in registers. prefetch: this walk reads from memory. */
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
            sg_pull_next(next, next_end, k, next_lines);
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

#define SG_TILE(R, PF) \
    sg_tile(x + (ptrdiff_t)m0 * x_stride, x_stride, panel, K, pp.bias, o, out_stride, R, pp.cols, PF, next, \
            pp.next_end, walk.next_lines)
#define SG_ROWS_CASE(R)                                                                                            \
    case R:                                                                                                        \
        if (m0 == 0) SG_TILE(R, 1); else SG_TILE(R, 0); /* the first walk reads from memory: it prefetches */      \
        break;

/* Panels per grab of the dynamic schedule (about SG_GRABS per thread, so a preempted thread does not
 * hold the team); which thread computes a panel changes no bits. */
#ifndef SG_GRABS
#define SG_GRABS 8
#endif
static inline int sg_chunk(int panels, int num_threads) {
    const int chunk = panels / (SG_GRABS * (num_threads > 0 ? num_threads : 1));
    return chunk > 0 ? chunk : 1;
}

/* A walk over a packed weight: N columns in panels of nr, `steps` k steps per tile of mr rows. */
struct sg_walk {
    int panels, next_lines, chunk;
    ptrdiff_t panel_bytes, panel_lines;
};

static inline __attribute__((always_inline)) struct sg_walk sg_walk(int M, int N, int nr, int mr,
                                                                    ptrdiff_t panel_bytes, int steps,
                                                                    int num_threads) {
    struct sg_walk w;
    w.panels = (N + nr - 1) / nr;
    w.panel_bytes = panel_bytes;
    w.panel_lines = (panel_bytes + 63) / 64;
    w.next_lines = sg_next_lines(w.panel_lines, (M + mr - 1) / mr, steps);
    w.chunk = sg_chunk(w.panels, num_threads);
    return w;
}

/* Panel p's bias (NULL without), its columns and the next panel's bytes [next, next_end) (NULL after the last). */
struct sg_panel {
    const float *bias;
    int cols;
    const char *next, *next_end;
};

static inline __attribute__((always_inline)) struct sg_panel sg_panel(const void *packed, const float *bias,
                                                                      struct sg_walk w, int N, int nr, int p) {
    struct sg_panel pp;
    pp.bias = bias ? bias + (ptrdiff_t)p * nr : NULL;
    pp.cols = N - p * nr < nr ? N - p * nr : nr;
    pp.next = p + 1 < w.panels ? (const char *)packed + (ptrdiff_t)(p + 1) * w.panel_bytes : NULL;
    pp.next_end = pp.next ? pp.next + w.panel_lines * 64 : NULL;
    return pp;
}

/* out[m, n] = bias[n] + sum_k x[m, k] * w[n, k]. x, out: row strides in floats; packed: ceil(N / SG_NR)
 * panels; bias: NULL or ceil(N / SG_NR) * SG_NR floats (zero-padded). The caller validates everything. */
void skinny_gemm_f32(const float *x, ptrdiff_t x_stride, const float *packed, const float *bias, float *out,
                     ptrdiff_t out_stride, int M, int N, int K, int num_threads) {
    const struct sg_walk walk = sg_walk(M, N, SG_NR, SG_MR, (ptrdiff_t)K * SG_NR * (ptrdiff_t)sizeof(float), K,
                                        num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, walk.chunk) if (num_threads > 1)
    for (int p = 0; p < walk.panels; p++) {
        const float *panel = packed + (ptrdiff_t)p * K * SG_NR;
        const struct sg_panel pp = sg_panel(packed, bias, walk, N, SG_NR, p);
        for (int m0 = 0; m0 < M; m0 += SG_MR) {
            float *o = out + (ptrdiff_t)m0 * out_stride + (ptrdiff_t)p * SG_NR;
            const char *next = sg_next_start(pp.next, m0 / SG_MR, K, walk.next_lines);
            switch (M - m0 < SG_MR ? M - m0 : SG_MR) {
#if SG_MR == 8
                SG_ROWS_CASE(8) SG_ROWS_CASE(7) SG_ROWS_CASE(6) SG_ROWS_CASE(5)
#endif
                SG_ROWS_CASE(4) SG_ROWS_CASE(3) SG_ROWS_CASE(2) SG_ROWS_CASE(1)
            }
        }
    }
}

/* ---- bfloat16 on AMX: out (bfloat16) = x (bfloat16) @ w^T (+ bias, float32), float32 accumulation in
 * tiles (tdpbf16ps), rounded once to bfloat16 (torch's rounding). K a multiple of 32, x rows a multiple
 * of 16 (the caller pads). Packed weight: panels of 32 columns; per block of 32 k two B tiles (columns
 * 0-15, 16-31) of 16 rows of 64 bytes, row r holding w[c, 2r], w[c, 2r + 1] for c = 0..15.
 * Linux grants the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, else SIGILL):
 * skinny_gemm_amx_init asks. */
#define SG_AMX_NR 32
#define SG_AMX_KB 32

/* 1: the tile state is granted; 0: not on this build or host. */
int pagedllm_skinny_gemm_amx_init(void) {
#if SG_AMX
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

#if SG_AMX
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} sg_tile_config;

/* Tiles 0-3: C (row block i, column tile j) at 2 * i + j; 4-5: A (row block 0, 1); 6-7: B (column tile 0, 1). */
static void sg_amx_configure(void) {
    sg_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* acc: 32 x 32 float32 -> bias added, rounded to bfloat16, rows [0, rows) x columns [0, cols) to out. */
static void sg_amx_store(const float *acc, const float *bias, uint16_t *out, ptrdiff_t out_stride, int rows,
                         int cols) {
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < 2; j++) {
            v16f v = load_f32(acc + r * SG_AMX_NR + 16 * j);
            if (bias)
                v += load_f32(bias + 16 * j);
            uint16_t *o = out + r * out_stride + 16 * j;
            if (16 * (j + 1) <= cols) {
                store_bf16(o, v);
            } else {
                for (int c = 16 * j; c < cols; c++)
                    o[c - 16 * j] = f32_to_bf16(v[c - 16 * j]);
            }
        }
    }
}

#define SG_AMX_PREFETCH_BYTES 8192 /* B stream read ahead (4 k blocks) */

static inline __attribute__((always_inline)) void sg_amx_walk(const uint16_t *x, ptrdiff_t x_stride,
                                                              const uint16_t *panel, int K, int two) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const ptrdiff_t a_stride = x_stride * 2; /* bytes */
    for (int kb = 0; kb < K / SG_AMX_KB; kb++) {
        const uint16_t *b = panel + (ptrdiff_t)kb * 2 * 16 * 32;
        for (int l = 0; l < 2 * 16 * 64; l += 64)
            __builtin_prefetch((const char *)b + SG_AMX_PREFETCH_BYTES + l, 0, 3);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 16 * 32, 64);
        _tile_loadd(4, x + kb * SG_AMX_KB, a_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * x_stride + kb * SG_AMX_KB, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}
#endif

/* out[m, n] = round_bf16(bias[n] + sum_k x[m, k] * w[n, k]). x: ceil(M / 16) * 16 rows, stride in
 * elements; packed: ceil(N / 32) panels; bias: NULL or ceil(N / 32) * 32 float32. Returns 0, or -1
 * when this build has no AMX (nothing written). */
int skinny_gemm_bf16_amx(const uint16_t *x, ptrdiff_t x_stride, const uint16_t *packed, const float *bias,
                         uint16_t *out, ptrdiff_t out_stride, int M, int N, int K, int num_threads) {
#if SG_AMX
    const int panels = (N + SG_AMX_NR - 1) / SG_AMX_NR;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        sg_amx_configure();
        float acc[32 * SG_AMX_NR] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, sg_chunk(panels, num_threads))
        for (int p = 0; p < panels; p++) {
            const uint16_t *panel = packed + (ptrdiff_t)p * K * SG_AMX_NR;
            const float *b = bias ? bias + (ptrdiff_t)p * SG_AMX_NR : NULL;
            const int cols = N - p * SG_AMX_NR < SG_AMX_NR ? N - p * SG_AMX_NR : SG_AMX_NR;
            for (int m0 = 0; m0 < M; m0 += 32) {
                const int two = M - m0 > 16;
                sg_amx_walk(x + (ptrdiff_t)m0 * x_stride, x_stride, panel, K, two);
                _tile_stored(0, acc, SG_AMX_NR * 4);
                _tile_stored(1, acc + 16, SG_AMX_NR * 4);
                if (two) {
                    _tile_stored(2, acc + 16 * SG_AMX_NR, SG_AMX_NR * 4);
                    _tile_stored(3, acc + 16 * SG_AMX_NR + 16, SG_AMX_NR * 4);
                }
                const int rows = M - m0 < 32 ? M - m0 : 32;
                sg_amx_store(acc, b, out + (ptrdiff_t)m0 * out_stride + (ptrdiff_t)p * SG_AMX_NR, out_stride, rows,
                             cols);
            }
        }
        _tile_release();
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)M, (void)N, (void)K,
        (void)num_threads;
    return -1;
#endif
}


/* ---- bfloat16 on AVX512-BF16 (no AMX): vdpbf16ps does two k steps per instruction. K must be even.
 * Packed weight: panels of SG_NR = 48 columns, K / 2 rows of 48 (k, k + 1) pairs (row k2: w[c, 2 k2],
 * w[c, 2 k2 + 1]). Each output is bias + the float32 sum over k2 in order, rounded once to bfloat16:
 * batch-invariant. vdpbf16ps flushes subnormals (Intel SDM), far below bfloat16's resolution. */
#if SG_DP
#define SG_DP_NB 3
#define SG_DP_NR (16 * SG_DP_NB) /* = SG_NR of the AVX-512 build: the walks share its prefetch schedule */
#define SG_DP_MR 8

static inline __attribute__((always_inline)) void sg_dp_tile(const uint16_t *x, ptrdiff_t x_stride,
                                                             const uint16_t *panel, int K2, const float *bias,
                                                             void *out, ptrdiff_t out_stride, const int rows,
                                                             int cols, const int prefetch, const char *next,
                                                             const char *next_end, int next_lines, const int out_f32) {
    __m512 acc[SG_DP_MR][SG_DP_NB];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < SG_DP_NB; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int k2 = 0; k2 < K2; k2++) {
        const uint16_t *w = panel + (ptrdiff_t)k2 * 2 * SG_DP_NR;
        if (prefetch) {
            for (int j = 0; j < SG_DP_NB; j++)
                __builtin_prefetch(w + SG_PREFETCH_ROWS * 2 * SG_DP_NR + j * 32, 0, 3);
        } else if (next) {
            sg_pull_next(next, next_end, k2, next_lines);
        }
        __m512bh wv[SG_DP_NB];
        for (int j = 0; j < SG_DP_NB; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + j * 32));
        for (int r = 0; r < rows; r++) {
            uint32_t pair; /* x[r, 2 k2] and x[r, 2 k2 + 1], broadcast to every lane */
            memcpy(&pair, x + r * x_stride + 2 * k2, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < SG_DP_NB; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, wv[j]);
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < SG_DP_NB && 16 * j < cols; j++) {
            v16f v = (v16f)acc[r][j];
            if (bias)
                v += load_f32(bias + 16 * j);
            const int n = cols - 16 * j < 16 ? cols - 16 * j : 16;
            if (out_f32) { /* the float32 sum itself, not rounded */
                memcpy((float *)out + r * out_stride + 16 * j, &v, (size_t)n * sizeof(float));
            } else {
                uint16_t *o = (uint16_t *)out + r * out_stride + 16 * j;
                if (n == 16) {
                    store_bf16(o, v);
                } else {
                    for (int c = 0; c < n; c++)
                        o[c] = f32_to_bf16(v[c]);
                }
            }
        }
    }
}

#define SG_DP_TILE(R, PF) \
    sg_dp_tile(x + (ptrdiff_t)m0 * x_stride, x_stride, panel, K / 2, pp.bias, o, out_stride, R, pp.cols, PF, next, \
               pp.next_end, walk.next_lines, out_f32)
#define SG_DP_ROWS_CASE(R)                                                                                         \
    case R:                                                                                                        \
        if (m0 == 0) SG_DP_TILE(R, 1); else SG_DP_TILE(R, 0);                                                      \
        break;
#endif

/* 1: this build has the AVX512-BF16 kernel; 0: skinny_gemm_bf16_dp returns -1. */
int pagedllm_skinny_gemm_bf16_dp_available(void) { return SG_DP; }

#if SG_DP
/* The driver of both entry points below; out_f32 is a run-time flag (GCC outlines OpenMP regions first). */
static inline __attribute__((always_inline)) void sg_dp_gemm(const uint16_t *x, ptrdiff_t x_stride,
                                                             const uint16_t *packed, const float *bias, void *out,
                                                             ptrdiff_t out_stride, int M, int N, int K,
                                                             int num_threads, const int out_f32) {
    const int K2 = K / 2;
    const size_t out_elem = out_f32 ? sizeof(float) : sizeof(uint16_t);
    const struct sg_walk walk = sg_walk(M, N, SG_DP_NR, SG_DP_MR,
                                        (ptrdiff_t)K * SG_DP_NR * (ptrdiff_t)sizeof(uint16_t), K2, num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, walk.chunk) if (num_threads > 1)
    for (int p = 0; p < walk.panels; p++) {
        const uint16_t *panel = packed + (ptrdiff_t)p * K * SG_DP_NR;
        const struct sg_panel pp = sg_panel(packed, bias, walk, N, SG_DP_NR, p);
        for (int m0 = 0; m0 < M; m0 += SG_DP_MR) {
            void *o = (char *)out + ((ptrdiff_t)m0 * out_stride + (ptrdiff_t)p * SG_DP_NR) * (ptrdiff_t)out_elem;
            const char *next = sg_next_start(pp.next, m0 / SG_DP_MR, K2, walk.next_lines);
            switch (M - m0 < SG_DP_MR ? M - m0 : SG_DP_MR) {
                SG_DP_ROWS_CASE(8) SG_DP_ROWS_CASE(7) SG_DP_ROWS_CASE(6) SG_DP_ROWS_CASE(5)
                SG_DP_ROWS_CASE(4) SG_DP_ROWS_CASE(3) SG_DP_ROWS_CASE(2) SG_DP_ROWS_CASE(1)
            }
        }
    }
}
#endif

#if SG_DP
#define SG_DP_BODY(OUT_F32)                                                                                        \
    sg_dp_gemm(x, x_stride, packed, bias, out, out_stride, M, N, K, num_threads, OUT_F32);                         \
    return 0;
#else
#define SG_DP_BODY(OUT_F32)                                                                                        \
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)M, (void)N, (void)K,   \
        (void)num_threads;                                                                                         \
    return -1;
#endif

/* out[m, n] = round_bf16(bias[n] + sum_k x[m, k] * w[n, k]). packed: ceil(N / 48) panels; bias: NULL or
 * ceil(N / 48) * 48 float32. Returns 0, or -1 when this build has no AVX512-BF16 (nothing written). */
int skinny_gemm_bf16_dp(const uint16_t *x, ptrdiff_t x_stride, const uint16_t *packed, const float *bias,
                        uint16_t *out, ptrdiff_t out_stride, int M, int N, int K, int num_threads) {
    SG_DP_BODY(0)
}

/* The same sums as float32, unrounded: bfloat16 logits would tie tokens closer than 1/128 relative. */
int skinny_gemm_bf16_dp_f32out(const uint16_t *x, ptrdiff_t x_stride, const uint16_t *packed, const float *bias,
                               float *out, ptrdiff_t out_stride, int M, int N, int K, int num_threads) {
    SG_DP_BODY(1)
}

/* The task forms (native_team.h): thread ith computes its share of the panels, as one call on those panels alone. */
struct sg_gemm_args {
    const void *x;
    ptrdiff_t x_stride;
    const void *packed;
    const float *bias;
    void *out;
    ptrdiff_t out_stride;
    int M, N, K, num_threads;
};

/* Thread ith's panels [*first, first + count) of nr columns, and its column count; 0 for none. */
static int sg_share(const struct sg_gemm_args *a, int nr, int ith, int nth, long long *first) {
    long long b, e;
    team_share((a->N + nr - 1) / nr, ith, nth, &b, &e);
    *first = b;
    if (b >= e)
        return 0;
    const long long cols = a->N - b * nr;
    return (int)(cols < (e - b) * nr ? cols : (e - b) * nr);
}

int skinny_gemm_f32_task(const void *args, int ith, int nth) {
    const struct sg_gemm_args *a = args;
    long long p;
    const int cols = sg_share(a, SG_NR, ith, nth, &p);
    if (cols)
        skinny_gemm_f32(a->x, a->x_stride, (const float *)a->packed + p * a->K * SG_NR,
                        a->bias ? a->bias + p * SG_NR : NULL, (float *)a->out + p * SG_NR, a->out_stride, a->M, cols,
                        a->K, 1);
    return 0;
}

#if SG_DP
#define SG_DP_TASK(NAME, OUT_T)                                                                                    \
    int NAME##_task(const void *args, int ith, int nth) {                                                         \
        const struct sg_gemm_args *a = args;                                                                      \
        long long p;                                                                                              \
        const int cols = sg_share(a, SG_DP_NR, ith, nth, &p);                                                     \
        if (!cols)                                                                                                \
            return 0;                                                                                             \
        return NAME(a->x, a->x_stride, (const uint16_t *)a->packed + p * a->K * SG_DP_NR,                         \
                    a->bias ? a->bias + p * SG_DP_NR : NULL, (OUT_T *)a->out + p * SG_DP_NR, a->out_stride, a->M, \
                    cols, a->K, 1);                                                                               \
    }
SG_DP_TASK(skinny_gemm_bf16_dp, uint16_t)
SG_DP_TASK(skinny_gemm_bf16_dp_f32out, float)
#undef SG_DP_TASK
#else
int skinny_gemm_bf16_dp_task(const void *args, int ith, int nth) { return -1; }
int skinny_gemm_bf16_dp_f32out_task(const void *args, int ith, int nth) { return -1; }
#endif
