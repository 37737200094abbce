/* W8A8 int8 GEMM for a decode step's rows: out[M, N] = dequant(quant(x[M, K]) @ q[N, K]^T) (+ bias[N]).
 *
 * Activations are quantized here per row (dynamic, symmetric): sx = max|x[m]| / 127 (1 for a zero row),
 * xq = round-half-even(x / sx) clamped to [-127, 127]. Weights come quantized per output channel
 * (int8 in [-127, 127], scale sw[n]) and packed once (pagedllm/quantization/w8a8.py) into panels of
 * I8_NR columns: for each group of 4 k, I8_NR columns of 4 consecutive int8 (zero past N and K).
 * Integer sums are exact, so the order of k does not matter; each output is then
 *     out = (float)acc * (sx[m] * sw[n])  (+ bias[n])
 * rounded in that order (built with -ffp-contract=off): the same formula, bit for bit, as the torch path
 * in w8a8.py, independent of M, the other rows, the thread count and the ISA (batch-invariant).
 *
 * ISAs (chosen per call, never above what this build has):
 *   2 AVX512-VNNI: vpdpbusd on (xq + 128) as u8 times w as s8; the offset's 128 * sum_k w[n, k] (colsum
 *     argument) is subtracted per column.
 *   1 AVX2: vpmaddubsw on |xq| (u8) times sign(w, xq) (s8): pairs stay below 2 * 127 * 127 (no
 *     saturation), then vpmaddwd against ones to int32.
 *   0 scalar: plain int32 sums, any x86-64 (or other) CPU.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INT8_GEMM_ABI_VERSION 1
#define I8_NR 64 /* output columns per panel: 4 zmm (or 8 ymm) of int32 accumulators */
#define I8_KG 4  /* k per group: one int32 lane holds 4 int8 */
#define I8_PREFETCH_GROUPS 16 /* k groups read ahead on a panel's first walk (16 KiB) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define I8_HAVE_VNNI 1
#define I8_VNNI_MR 6 /* rows per tile: 6 * 4 accumulators + 4 weights + 1 broadcast <= 32 zmm */
#else
#define I8_HAVE_VNNI 0
#endif
#if defined(__AVX2__)
#define I8_HAVE_AVX2 1
#define I8_AVX2_MR 4 /* 4 * 2 accumulators + 2 weights + ones + 4 temporaries <= 16 ymm */
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

/* Row m of x -> xq[m] (Kp bytes, zero past K) and sx[m]; the torch path's formula (w8a8.py). */
static void i8_quantize_row(const float *x, int K, int Kp, int8_t *xq, float *sx) {
    float amax = 0.0f;
    for (int k = 0; k < K; k++) {
        const float a = fabsf(x[k]);
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int k = 0; k < K; k++) {
        float q = nearbyintf(x[k] / s); /* the default rounding mode: half to even, as torch.round */
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        xq[k] = (int8_t)q;
    }
    memset(xq + K, 0, (size_t)(Kp - K));
    *sx = s;
}

/* acc: rows x I8_NR int32 sums of one tile -> out's columns [0, cols), rescaled (see the header); the
 * vector forms round exactly as the scalar one (two IEEE operations, no fused multiply-add). */
static void i8_epilogue(const int32_t *acc, int rows, int cols, const int32_t *comp, const float *sx,
                        const float *sw, const float *bias, float *out, ptrdiff_t out_stride) {
    for (int r = 0; r < rows; r++) {
        int c = 0;
        float *o = out + (ptrdiff_t)r * out_stride;
        const int32_t *a = acc + r * I8_NR;
#if defined(__AVX512F__)
        const __m512 vsx = _mm512_set1_ps(sx[r]);
        for (; c < cols; c += 16) {
            const __mmask16 mask = cols - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - c)) - 1);
            __m512i v = _mm512_loadu_si512((const void *)(a + c));
            if (comp)
                v = _mm512_sub_epi32(v, _mm512_loadu_si512((const void *)(comp + c)));
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(vsx, _mm512_loadu_ps(sw + c)));
            if (bias)
                f = _mm512_add_ps(f, _mm512_loadu_ps(bias + c));
            _mm512_mask_storeu_ps(o + c, mask, f);
        }
#elif defined(__AVX2__)
        const __m256 vsx = _mm256_set1_ps(sx[r]);
        for (; c + 8 <= cols; c += 8) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(a + c));
            if (comp)
                v = _mm256_sub_epi32(v, _mm256_loadu_si256((const __m256i *)(comp + c)));
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(vsx, _mm256_loadu_ps(sw + c)));
            if (bias)
                f = _mm256_add_ps(f, _mm256_loadu_ps(bias + c));
            _mm256_storeu_ps(o + c, f);
        }
#endif
        for (; c < cols; c++) {
            const float scale = sx[r] * sw[c];
            float v = (float)(a[c] - (comp ? comp[c] : 0)) * scale;
            if (bias)
                v = v + bias[c];
            o[c] = v;
        }
    }
}

static inline __attribute__((always_inline)) void i8_tile_scalar(const int8_t *xq, ptrdiff_t xs,
                                                                 const int8_t *panel, int groups, int32_t *acc,
                                                                 int rows) {
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < I8_NR; c++) {
            int32_t s = 0;
            for (int g = 0; g < groups; g++) {
                const int8_t *w = panel + ((ptrdiff_t)g * I8_NR + c) * I8_KG;
                const int8_t *a = xq + r * xs + g * I8_KG;
                s += a[0] * w[0] + a[1] * w[1] + a[2] * w[2] + a[3] * w[3];
            }
            acc[r * I8_NR + c] = s;
        }
    }
}

#if I8_HAVE_AVX2
/* xq: s8 rows; xa: |xq| rows (u8); 16 columns (2 ymm) at a time across the panel. */
static inline __attribute__((always_inline)) void i8_tile_avx2(const int8_t *xq, const uint8_t *xa, ptrdiff_t xs,
                                                               const int8_t *panel, int groups, int32_t *acc_out,
                                                               const int rows, const int prefetch) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int cb = 0; cb < I8_NR / 16; cb++) {
        __m256i acc[I8_AVX2_MR][2];
        for (int r = 0; r < rows; r++)
            acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int g = 0; g < groups; g++) {
            const int8_t *w = panel + (ptrdiff_t)g * I8_NR * I8_KG + cb * 64;
            if (prefetch && cb == 0)
                for (int l = 0; l < I8_NR * I8_KG; l += 64)
                    __builtin_prefetch(w + (ptrdiff_t)I8_PREFETCH_GROUPS * I8_NR * I8_KG + l, 0, 3);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            for (int r = 0; r < rows; r++) {
                const __m256i a = _mm256_set1_epi32(i8_load4(xa + r * xs + g * I8_KG));
                const __m256i sg = _mm256_set1_epi32(i8_load4(xq + r * xs + g * I8_KG));
                const __m256i p0 = _mm256_maddubs_epi16(a, _mm256_sign_epi8(w0, sg));
                const __m256i p1 = _mm256_maddubs_epi16(a, _mm256_sign_epi8(w1, sg));
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
            }
        }
        for (int r = 0; r < rows; r++) {
            _mm256_storeu_si256((__m256i *)(acc_out + r * I8_NR + cb * 16), acc[r][0]);
            _mm256_storeu_si256((__m256i *)(acc_out + r * I8_NR + cb * 16 + 8), acc[r][1]);
        }
    }
}
#endif

#if I8_HAVE_VNNI
/* xu: (xq + 128) rows as u8. */
static inline __attribute__((always_inline)) void i8_tile_vnni(const uint8_t *xu, ptrdiff_t xs, const int8_t *panel,
                                                               int groups, int32_t *acc_out, const int rows,
                                                               const int prefetch) {
    __m512i acc[I8_VNNI_MR][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = _mm512_setzero_si512();
    for (int g = 0; g < groups; g++) {
        const int8_t *w = panel + (ptrdiff_t)g * I8_NR * I8_KG;
        if (prefetch)
            for (int j = 0; j < 4; j++)
                __builtin_prefetch(w + (ptrdiff_t)I8_PREFETCH_GROUPS * I8_NR * I8_KG + j * 64, 0, 3);
        __m512i wv[4];
        for (int j = 0; j < 4; j++)
            wv[j] = _mm512_loadu_si512((const void *)(w + j * 64));
        for (int r = 0; r < rows; r++) {
            const __m512i a = _mm512_set1_epi32(i8_load4(xu + r * xs + g * I8_KG));
            for (int j = 0; j < 4; j++)
                acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], a, wv[j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++)
            _mm512_storeu_si512((void *)(acc_out + r * I8_NR + j * 16), acc[r][j]);
}
#endif

/* The activation rows as each ISA reads them: s8 (scalar, AVX2), |s8| (AVX2), s8 + 128 (VNNI). */
struct i8_rows {
    int8_t *xq;
    uint8_t *xa;
    float *sx;
    ptrdiff_t stride;
};

static int i8_prepare_rows(const float *x, ptrdiff_t x_stride, int M, int K, int isa, int num_threads,
                           struct i8_rows *rows, void **buffer) {
    const int Kp = (K + I8_KG - 1) / I8_KG * I8_KG;
    const size_t row_bytes = (size_t)(Kp + 63) / 64 * 64;
    char *buf = aligned_alloc(64, row_bytes * (size_t)M * 2 + ((size_t)M * sizeof(float) + 63) / 64 * 64);
    if (!buf)
        return -1;
    rows->xq = (int8_t *)buf;
    rows->xa = (uint8_t *)(buf + row_bytes * (size_t)M);
    rows->sx = (float *)(buf + row_bytes * (size_t)M * 2);
    rows->stride = (ptrdiff_t)row_bytes;
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && (long)M * K >= 65536)
    for (int m = 0; m < M; m++) {
        int8_t *q = rows->xq + (ptrdiff_t)m * rows->stride;
        i8_quantize_row(x + (ptrdiff_t)m * x_stride, K, Kp, q, rows->sx + m);
        uint8_t *a = rows->xa + (ptrdiff_t)m * rows->stride;
        if (isa == I8_ISA_VNNI) {
            for (int k = 0; k < Kp; k++)
                a[k] = (uint8_t)(q[k] + 128);
        } else if (isa == I8_ISA_AVX2) {
            for (int k = 0; k < Kp; k++)
                a[k] = (uint8_t)(q[k] < 0 ? -q[k] : q[k]);
        }
    }
    *buffer = buf;
    return 0;
}

#define I8_CASE(FN, R, ...)                                                                                       \
    case R:                                                                                                        \
        if (m0 == 0) FN(__VA_ARGS__, R, 1); else FN(__VA_ARGS__, R, 0);                                           \
        break;

/* The tile of rows [m0, m0 + rows) against panel p into acc (rows x I8_NR int32). */
static void i8_tile(const struct i8_rows *xr, int isa, const int8_t *panel, int groups, int32_t *acc, int m0,
                    int rows) {
    const ptrdiff_t off = (ptrdiff_t)m0 * xr->stride, xs = xr->stride;
    (void)off, (void)xs;
#if I8_HAVE_VNNI
    if (isa == I8_ISA_VNNI) {
        switch (rows) {
            I8_CASE(i8_tile_vnni, 6, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_vnni, 5, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_vnni, 4, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_vnni, 3, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_vnni, 2, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_vnni, 1, xr->xa + off, xs, panel, groups, acc)
        }
        return;
    }
#endif
#if I8_HAVE_AVX2
    if (isa == I8_ISA_AVX2) {
        switch (rows) {
            I8_CASE(i8_tile_avx2, 4, xr->xq + off, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_avx2, 3, xr->xq + off, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_avx2, 2, xr->xq + off, xr->xa + off, xs, panel, groups, acc)
            I8_CASE(i8_tile_avx2, 1, xr->xq + off, xr->xa + off, xs, panel, groups, acc)
        }
        return;
    }
#endif
    i8_tile_scalar(xr->xq + off, xs, panel, groups, acc, rows);
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

/* out[m, n] for x (M, K) float32 (row stride x_stride) and the packed weight: ceil(N / 64) panels of
 * ceil(K / 4) groups x 64 columns x 4 int8. colsum: 128 * sum_k q[n, k], w_scale and bias (NULL or not):
 * ceil(N / 64) * 64 entries, zero-padded. isa: 0, 1, 2 (see the header). Returns 0, or -1 when isa is
 * above pagedllm_int8_gemm_best_isa() or the scratch rows cannot be allocated (nothing written). */
int int8_gemm_f32(const float *x, ptrdiff_t x_stride, const int8_t *packed, const int32_t *colsum,
                  const float *w_scale, const float *bias, float *out, ptrdiff_t out_stride, int M, int N, int K,
                  int isa, int num_threads) {
    if (isa < 0 || isa > pagedllm_int8_gemm_best_isa())
        return -1;
    if (M <= 0 || N <= 0)
        return 0;
    struct i8_rows xr;
    void *buffer = NULL;
    if (i8_prepare_rows(x, x_stride, M, K, isa, num_threads, &xr, &buffer))
        return -1;
    const int groups = (K + I8_KG - 1) / I8_KG, panels = (N + I8_NR - 1) / I8_NR, mr = i8_tile_rows(isa);
    const ptrdiff_t panel_bytes = (ptrdiff_t)groups * I8_NR * I8_KG;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1 && panels > 1)
    for (int p = 0; p < panels; p++) {
        int32_t acc[8 * I8_NR] __attribute__((aligned(64)));
        const int cols = N - p * I8_NR < I8_NR ? N - p * I8_NR : I8_NR;
        const int8_t *panel = packed + (ptrdiff_t)p * panel_bytes;
        for (int m0 = 0; m0 < M; m0 += mr) {
            const int rows = M - m0 < mr ? M - m0 : mr;
            i8_tile(&xr, isa, panel, groups, acc, m0, rows);
            i8_epilogue(acc, rows, cols, isa == I8_ISA_VNNI ? colsum + p * I8_NR : NULL, xr.sx + m0,
                        w_scale + p * I8_NR, bias ? bias + p * I8_NR : NULL,
                        out + (ptrdiff_t)m0 * out_stride + (ptrdiff_t)p * I8_NR, out_stride);
        }
    }
    free(buffer);
    return 0;
}
