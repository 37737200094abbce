/* W8A8 int8 GEMM: out[M, N] = dequant(quant(x[M, K]) @ q[N, K]^T) (+ bias[N]), every row count.
 *
 * Activations are quantized here per row and group of `group` k (dynamic, symmetric; per-token-group
 * quantization, one group per row when group >= K): for group g of row m, sx[m, g] = max|x[m, g]| / 127
 * (1 for a zero group), xq = round-half-even(x / sx) clamped to [-127, 127]. Weights come quantized per
 * output channel (int8 in [-127, 127], scale sw[n]) and packed once (pagedllm/ops/int8_gemm.py) into
 * panels of I8_NR columns: for each group of 4 k, I8_NR columns of 4 consecutive bytes q + 128 (u8;
 * 128, i.e. q = 0, past N and K); q may be -128 (a checkpoint's symmetric int8). A group holding a NaN or an
 * infinity gets sx = NaN and codes 0, so its outputs are NaN (as a float matmul's would be). Each group's integer sum acc[m, n, g] is exact, and each output is
 *     f = 0; for g in order: f = f + (float)acc[m, n, g] * sx[m, g];  out = f * sw[n]  (+ bias[n])
 * each operation rounded on its own (built with -ffp-contract=off): the torch formula in
 * pagedllm/quantization/w8a8.py bit for bit, independent of M, the other rows, the thread count and the
 * ISA (batch-invariant).
 *
 * ISAs (chosen per call, never above what this build has):
 *   2 AVX512-VNNI: vpdpbusd on the weights' u8 (q + 128) times xq as s8; the offset's
 *     128 * sum_{k in g} xq[m, k] is each group's starting value, subtracted.
 *   1 AVX2: vpmaddubsw on |q| (u8, up to 128) times sign(xq, q) (s8, |xq| <= 127): pairs stay below
 *     2 * 128 * 127 (no saturation), then vpmaddwd against ones to int32.
 *   0 scalar: plain int32 sums, any x86-64 (or other) CPU.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "native_team.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INT8_GEMM_ABI_VERSION 2
#define I8_NR 64 /* output columns per panel: 4 zmm (or 8 ymm) */
#define I8_KG 4  /* k per group: one int32 lane holds 4 int8 */
#define I8_PREFETCH_GROUPS 16 /* k groups read ahead on a panel's first walk (16 KiB) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define I8_HAVE_VNNI 1
#define I8_VNNI_MR 4 /* rows per tile: 4 * 4 int32 accumulators + 4 weights + 1 broadcast in zmm; the float sums in L1 */
#else
#define I8_HAVE_VNNI 0
#endif
#if defined(__AVX2__)
#define I8_HAVE_AVX2 1
#define I8_AVX2_MR 4 /* 4 * 2 int32 accumulators + 2 weights + 2 |weights| + ones + temporaries <= 16 ymm */
#else
#define I8_HAVE_AVX2 0
#endif
#define I8_SCALAR_MR 4

enum { I8_ISA_SCALAR = 0, I8_ISA_AVX2 = 1, I8_ISA_VNNI = 2 };

int pagedllm_int8_gemm_abi_version(void) { return INT8_GEMM_ABI_VERSION; }

int pagedllm_int8_gemm_panel_width(void) { return I8_NR; }

/* The best ISA this build runs: 2 AVX512-VNNI, 1 AVX2, 0 scalar. */
int pagedllm_int8_gemm_best_isa(void) {
#if I8_HAVE_VNNI
    return I8_ISA_VNNI;
#elif I8_HAVE_AVX2
    return I8_ISA_AVX2;
#else
    return I8_ISA_SCALAR;
#endif
}

static inline int32_t i8_load4(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The activation rows as the kernels read them. */
struct i8_rows {
    int8_t *xq;    /* M rows of Kp s8, zero past K */
    float *sx;     /* M x groups scales */
    int32_t *corr; /* M x groups: 128 * the group's sum of xq (VNNI's weight offset) */
    ptrdiff_t stride;
    int groups;   /* activation groups per row */
    int group_kg; /* k groups (of I8_KG) per activation group */
};

/* Row x -> xq (Kp bytes, zero past K), sx and corr per group of `group` k; the torch path's formula. */
static void i8_quantize_row(const float *x, int K, int Kp, int group, int groups, int8_t *xq, float *sx,
                            int32_t *corr) {
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
        float amax = 0.0f;
        int finite = 1;
        for (int k = k0; k < k1; k++) {
            const float a = fabsf(x[k]);
            finite &= isfinite(a) != 0;
            amax = a > amax ? a : amax;
        }
        int32_t sum = 0;
        if (!finite) {
            memset(xq + k0, 0, (size_t)(k1 - k0));
            sx[g] = NAN;
            corr[g] = 0;
            continue;
        }
        const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        for (int k = k0; k < k1; k++) {
            float q = nearbyintf(x[k] / s); /* the default rounding mode: half to even, as torch.round */
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            xq[k] = (int8_t)q;
            sum += (int32_t)q;
        }
        sx[g] = s;
        corr[g] = 128 * sum;
    }
    memset(xq + K, 0, (size_t)(Kp - K));
}

/* The k groups [kg0, kg1) of activation group g. */
static inline void i8_group_range(const struct i8_rows *xr, int g, int kgroups, int *kg0, int *kg1) {
    *kg0 = g * xr->group_kg;
    *kg1 = *kg0 + xr->group_kg < kgroups ? *kg0 + xr->group_kg : kgroups;
}

static inline __attribute__((always_inline)) void i8_tile_scalar(const struct i8_rows *xr, int m0,
                                                                 const uint8_t *panel, int kgroups,
                                                                 const float *sw, const float *bias, float *out,
                                                                 ptrdiff_t out_stride, int cols, int rows) {
    for (int r = 0; r < rows; r++) {
        const int8_t *a = xr->xq + (ptrdiff_t)(m0 + r) * xr->stride;
        const float *sx = xr->sx + (ptrdiff_t)(m0 + r) * xr->groups;
        for (int c = 0; c < cols; c++) {
            float f = 0.0f;
            for (int g = 0; g < xr->groups; g++) {
                int kg0, kg1;
                i8_group_range(xr, g, kgroups, &kg0, &kg1);
                int32_t s = 0;
                for (int kg = kg0; kg < kg1; kg++) {
                    const uint8_t *w = panel + ((ptrdiff_t)kg * I8_NR + c) * I8_KG;
                    const int8_t *x = a + kg * I8_KG;
                    for (int i = 0; i < I8_KG; i++)
                        s += x[i] * ((int32_t)w[i] - 128);
                }
                f = f + (float)s * sx[g];
            }
            float v = f * sw[c];
            if (bias)
                v = v + bias[c];
            out[(ptrdiff_t)r * out_stride + c] = v;
        }
    }
}

#if I8_HAVE_AVX2
/* 16 columns (2 ymm) at a time across the panel; weights back to s8 by flipping their top bit, then |q| times
 * sign(xq, q). A group's int32 sums stay in registers, the float sums in a rows x 16 tile in L1 (as the VNNI
 * tile's). */
static inline __attribute__((always_inline)) void i8_tile_avx2(const struct i8_rows *xr, int m0,
                                                               const uint8_t *panel, int kgroups, const float *sw,
                                                               const float *bias, float *out, ptrdiff_t out_stride,
                                                               int cols, const int rows, const int prefetch) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const ptrdiff_t xs = xr->stride;
    const int8_t *xq = xr->xq + (ptrdiff_t)m0 * xs;
    for (int cb = 0; cb < I8_NR / 16 && cb * 16 < cols; cb++) {
        float f[I8_AVX2_MR * 16] __attribute__((aligned(32)));
        for (int i = 0; i < rows * 16; i++)
            f[i] = 0.0f;
        for (int g = 0; g < xr->groups; g++) {
            int kg0, kg1;
            i8_group_range(xr, g, kgroups, &kg0, &kg1);
            __m256i acc[I8_AVX2_MR][2];
            for (int r = 0; r < rows; r++)
                acc[r][0] = acc[r][1] = _mm256_setzero_si256();
            for (int kg = kg0; kg < kg1; kg++) {
                const uint8_t *w = panel + (ptrdiff_t)kg * I8_NR * I8_KG + cb * 64;
                if (prefetch && cb == 0)
                    for (int l = 0; l < I8_NR * I8_KG; l += 64)
                        __builtin_prefetch(w + (ptrdiff_t)I8_PREFETCH_GROUPS * I8_NR * I8_KG + l, 0, 3);
                const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)w), flip);
                const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 32)), flip);
                const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1); /* -128 -> 0x80 = 128 as u8 */
                for (int r = 0; r < rows; r++) {
                    const __m256i xv = _mm256_set1_epi32(i8_load4(xq + r * xs + kg * I8_KG));
                    const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0));
                    const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1));
                    acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
                    acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
                }
            }
            for (int r = 0; r < rows; r++) {
                const __m256 s = _mm256_set1_ps(xr->sx[(ptrdiff_t)(m0 + r) * xr->groups + g]);
                for (int j = 0; j < 2; j++)
                    _mm256_store_ps(f + r * 16 + j * 8, _mm256_add_ps(_mm256_load_ps(f + r * 16 + j * 8),
                                    _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][j]), s)));
            }
            __asm__ volatile("" ::: "memory"); /* f stays in memory (see i8_tile_vnni) */
        }
        const int n = cols - cb * 16 < 16 ? cols - cb * 16 : 16;
        for (int r = 0; r < rows; r++) {
            for (int j = 0; j < 2; j++) {
                __m256 v = _mm256_mul_ps(_mm256_load_ps(f + r * 16 + j * 8), _mm256_loadu_ps(sw + cb * 16 + j * 8));
                if (bias)
                    v = _mm256_add_ps(v, _mm256_loadu_ps(bias + cb * 16 + j * 8));
                _mm256_store_ps(f + r * 16 + j * 8, v);
            }
            memcpy(out + (ptrdiff_t)r * out_stride + cb * 16, f + r * 16, (size_t)n * sizeof(float));
        }
    }
}
#endif

#if I8_HAVE_VNNI
static inline __attribute__((always_inline)) void i8_tile_vnni(const struct i8_rows *xr, int m0,
                                                               const uint8_t *panel, int kgroups, const float *sw,
                                                               const float *bias, float *out, ptrdiff_t out_stride,
                                                               int cols, const int rows, const int prefetch) {
    const ptrdiff_t xs = xr->stride;
    const int8_t *xq = xr->xq + (ptrdiff_t)m0 * xs;
    /* the float sums live in a rows x 64 tile in L1, the registers hold a group's int32 sums */
    float f[I8_VNNI_MR * I8_NR] __attribute__((aligned(64)));
    for (int i = 0; i < rows * I8_NR; i++)
        f[i] = 0.0f;
    for (int g = 0; g < xr->groups; g++) {
        int kg0, kg1;
        i8_group_range(xr, g, kgroups, &kg0, &kg1);
        __m512i acc[I8_VNNI_MR][4];
        for (int r = 0; r < rows; r++) {
            const __m512i start = _mm512_set1_epi32(-xr->corr[(ptrdiff_t)(m0 + r) * xr->groups + g]);
            for (int j = 0; j < 4; j++)
                acc[r][j] = start;
        }
        for (int kg = kg0; kg < kg1; kg++) {
            const uint8_t *w = panel + (ptrdiff_t)kg * I8_NR * I8_KG;
            if (prefetch)
                for (int j = 0; j < 4; j++)
                    __builtin_prefetch(w + (ptrdiff_t)I8_PREFETCH_GROUPS * I8_NR * I8_KG + j * 64, 0, 3);
            __m512i wv[4];
            for (int j = 0; j < 4; j++)
                wv[j] = _mm512_loadu_si512((const void *)(w + j * 64));
            for (int r = 0; r < rows; r++) {
                const __m512i a = _mm512_set1_epi32(i8_load4(xq + r * xs + kg * I8_KG));
                for (int j = 0; j < 4; j++)
                    acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wv[j], a);
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m512 s = _mm512_set1_ps(xr->sx[(ptrdiff_t)(m0 + r) * xr->groups + g]);
            for (int j = 0; j < 4; j++)
                _mm512_store_ps(f + r * I8_NR + j * 16, _mm512_add_ps(_mm512_load_ps(f + r * I8_NR + j * 16),
                                _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][j]), s)));
        }
        /* a compiler barrier: without it GCC keeps f in registers and spills the int32 sums of the inner loop
         * instead */
        __asm__ volatile("" ::: "memory");
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4 && j * 16 < cols; j++) {
            const __mmask16 mask = cols - j * 16 >= 16 ? (__mmask16)0xffff
                                                       : (__mmask16)((1u << (cols - j * 16)) - 1);
            __m512 v = _mm512_mul_ps(_mm512_load_ps(f + r * I8_NR + j * 16), _mm512_loadu_ps(sw + j * 16));
            if (bias)
                v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * 16));
            _mm512_mask_storeu_ps(out + (ptrdiff_t)r * out_stride + j * 16, mask, v);
        }
}
#endif

/* Scratch for x's codes, scales and corrections (rows->*), in *buffer (the caller frees it). Returns -1 when the
 * allocation fails. */
static int i8_alloc_rows(int M, int K, int group, struct i8_rows *rows, void **buffer) {
    const int Kp = (K + I8_KG - 1) / I8_KG * I8_KG;
    const int groups = (K + group - 1) / group;
    const size_t row_bytes = (size_t)(Kp + 63) / 64 * 64;
    const size_t scale_bytes = ((size_t)M * (size_t)groups * sizeof(float) + 63) / 64 * 64;
    char *buf = aligned_alloc(64, row_bytes * (size_t)M + scale_bytes * 2);
    if (!buf)
        return -1;
    rows->xq = (int8_t *)buf;
    rows->sx = (float *)(buf + row_bytes * (size_t)M);
    rows->corr = (int32_t *)(buf + row_bytes * (size_t)M + scale_bytes);
    rows->stride = (ptrdiff_t)row_bytes;
    rows->groups = groups;
    rows->group_kg = group / I8_KG;
    *buffer = buf;
    return 0;
}

static void i8_quantize_rows(const float *x, ptrdiff_t x_stride, int m, int K, int group, const struct i8_rows *rows) {
    const int Kp = (K + I8_KG - 1) / I8_KG * I8_KG;
    i8_quantize_row(x + (ptrdiff_t)m * x_stride, K, Kp, group, rows->groups, rows->xq + (ptrdiff_t)m * rows->stride,
                    rows->sx + (ptrdiff_t)m * rows->groups, rows->corr + (ptrdiff_t)m * rows->groups);
}

static int i8_prepare_rows(const float *x, ptrdiff_t x_stride, int M, int K, int group, int num_threads,
                           struct i8_rows *rows, void **buffer) {
    if (i8_alloc_rows(M, K, group, rows, buffer))
        return -1;
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && (long)M * K >= 65536)
    for (int m = 0; m < M; m++)
        i8_quantize_rows(x, x_stride, m, K, group, rows);
    return 0;
}

#define I8_CASE(FN, R)                                                                                            \
    case R:                                                                                                        \
        if (m0 == 0) FN(xr, m0, panel, kgroups, sw, bias, out, out_stride, cols, R, 1);                           \
        else FN(xr, m0, panel, kgroups, sw, bias, out, out_stride, cols, R, 0);                                   \
        break;

/* The tile of rows [m0, m0 + rows) against one panel, written to out (rows x cols). */
static void i8_tile(const struct i8_rows *xr, int isa, const uint8_t *panel, int kgroups, const float *sw,
                    const float *bias, float *out, ptrdiff_t out_stride, int cols, int m0, int rows) {
#if I8_HAVE_VNNI
    if (isa == I8_ISA_VNNI) {
        switch (rows) {
            I8_CASE(i8_tile_vnni, 4)
            I8_CASE(i8_tile_vnni, 3)
            I8_CASE(i8_tile_vnni, 2)
            I8_CASE(i8_tile_vnni, 1)
        }
        return;
    }
#endif
#if I8_HAVE_AVX2
    if (isa == I8_ISA_AVX2) {
        switch (rows) {
            I8_CASE(i8_tile_avx2, 4)
            I8_CASE(i8_tile_avx2, 3)
            I8_CASE(i8_tile_avx2, 2)
            I8_CASE(i8_tile_avx2, 1)
        }
        return;
    }
#endif
    (void)isa;
    i8_tile_scalar(xr, m0, panel, kgroups, sw, bias, out, out_stride, cols, rows);
}

static int i8_tile_rows(int isa) {
#if I8_HAVE_VNNI
    if (isa == I8_ISA_VNNI)
        return I8_VNNI_MR;
#endif
#if I8_HAVE_AVX2
    if (isa == I8_ISA_AVX2)
        return I8_AVX2_MR;
#endif
    (void)isa;
    return I8_SCALAR_MR;
}

/* Panels [panel_begin, panel_end) against every x row (x quantized in xr). */
static void i8_panels(const struct i8_rows *xr, int isa, const uint8_t *packed, const float *w_scale,
                      const float *bias, float *out, ptrdiff_t out_stride, int M, int N, int K, int panel_begin,
                      int panel_end) {
    const int kgroups = (K + I8_KG - 1) / I8_KG, mr = i8_tile_rows(isa);
    const ptrdiff_t panel_bytes = (ptrdiff_t)kgroups * I8_NR * I8_KG;
    for (int p = panel_begin; p < panel_end; p++) {
        const int cols = N - p * I8_NR < I8_NR ? N - p * I8_NR : I8_NR;
        const uint8_t *panel = packed + (ptrdiff_t)p * panel_bytes;
        for (int m0 = 0; m0 < M; m0 += mr) {
            const int rows = M - m0 < mr ? M - m0 : mr;
            i8_tile(xr, isa, panel, kgroups, w_scale + p * I8_NR, bias ? bias + p * I8_NR : NULL,
                    out + (ptrdiff_t)m0 * out_stride + (ptrdiff_t)p * I8_NR, out_stride, cols, m0, rows);
        }
    }
}

/* out[m, n] for x (M, K) float32 (row stride x_stride) and the packed weight: ceil(N / 64) panels of
 * ceil(K / 4) groups x 64 columns x 4 bytes q + 128. w_scale and bias (NULL or not): ceil(N / 64) * 64
 * entries, zero-padded. group: k per activation scale, a positive multiple of 4 (>= K: one per row).
 * isa: 0, 1, 2 (see the header). Returns 0, -1 when isa is above pagedllm_int8_gemm_best_isa() or the
 * scratch rows cannot be allocated, -2 for a group that is not a positive multiple of 4 (nothing written). */
int int8_gemm_f32(const float *x, ptrdiff_t x_stride, const uint8_t *packed, const float *w_scale,
                  const float *bias, float *out, ptrdiff_t out_stride, int M, int N, int K, int group, int isa,
                  int num_threads) {
    if (isa < 0 || isa > pagedllm_int8_gemm_best_isa())
        return -1;
    if (group <= 0 || group % I8_KG)
        return -2;
    if (M <= 0 || N <= 0)
        return 0;
    struct i8_rows xr;
    void *buffer = NULL;
    if (i8_prepare_rows(x, x_stride, M, K, group, num_threads, &xr, &buffer))
        return -1;
    const int panels = (N + I8_NR - 1) / I8_NR;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1 && panels > 1)
    for (int p = 0; p < panels; p++)
        i8_panels(&xr, isa, packed, w_scale, bias, out, out_stride, M, N, K, p, p + 1);
    free(buffer);
    return 0;
}

/* int8_gemm_f32's arguments in order (its task form takes them as one struct). */
struct i8_gemm_args {
    const float *x;
    ptrdiff_t x_stride;
    const uint8_t *packed;
    const float *w_scale, *bias;
    float *out;
    ptrdiff_t out_stride;
    int M, N, K, group, isa, num_threads;
};

/* int8_gemm_f32's task form (native_team.h): thread ith quantizes every x row itself (O(M K), against its share's
 * O(M K N / nth) products) and computes its share of the panels. */
int int8_gemm_f32_task(const void *args, int ith, int nth) {
    const struct i8_gemm_args *a = args;
    if (a->isa < 0 || a->isa > pagedllm_int8_gemm_best_isa())
        return -1;
    if (a->group <= 0 || a->group % I8_KG)
        return -2;
    long long b, e;
    team_share((a->N + I8_NR - 1) / I8_NR, ith, nth, &b, &e);
    if (a->M <= 0 || b >= e)
        return 0;
    struct i8_rows xr;
    void *buffer = NULL;
    if (i8_alloc_rows(a->M, a->K, a->group, &xr, &buffer))
        return -1;
    for (int m = 0; m < a->M; m++)
        i8_quantize_rows(a->x, a->x_stride, m, a->K, a->group, &xr);
    i8_panels(&xr, a->isa, a->packed, a->w_scale, a->bias, a->out, a->out_stride, a->M, a->N, a->K, (int)b, (int)e);
    free(buffer);
    return 0;
}
