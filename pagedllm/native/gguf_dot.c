/* GGUF block dot products: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) with W kept in its GGUF block
 * bytes (one row of blocks per output n, as the file stores it) and x quantized per row to int8 once per call
 * (gguf_quantize_rows), in the manner of ggml's vec_dot kernels (written here, not copied).
 *
 * Activations: per 32 consecutive k, float d = max|x| / 127, int8 q = round(x / d) (nearest, ties to even),
 * and s = d * sum(q), the term every block with a minimum or an offset needs. One format for every weight
 * type: a K-quant's sub-block of 32 (Q4_K, Q5_K) or pair of 16s (Q6_K) meets one activation block.
 * Weights (ggml's layouts; w = the weight, q its code):
 *   Q8_0 (34 B / 32): f16 d, int8 q[32];                       w = d * q
 *   Q4_0 (18 B / 32): f16 d, nibbles q[16] (j low, j + 16 high); w = d * (q - 8)
 *   Q4_1 (20 B / 32): f16 d, f16 m, nibbles;                   w = d * q + m
 *   Q5_0 (22 B / 32): f16 d, uint32 qh (bit j: 5th bit of j), nibbles; w = d * (q - 16)
 *   Q5_1 (24 B / 32): f16 d, f16 m, qh, nibbles;               w = d * q + m
 *   Q4_K (144 B / 256): f16 d, f16 dmin, 12 bytes of 6-bit scale/min pairs for 8 sub-blocks of 32, 128 bytes of
 *         nibbles (per 64: 32 low = sub-block 2p, 32 high = 2p + 1); w = d * sc_j * q - dmin * m_j
 *   Q5_K (176 B / 256): as Q4_K plus qh[32] before the nibbles (bit j of qh[l]: 5th bit of sub-block j's l)
 *   Q6_K (210 B / 256): ql[128], qh[64], int8 scales[16] (per 16), f16 d; w = d * sc * (q - 32)
 * Numerics: each block's integer dot is exact; blocks are summed in k order into fixed lanes, the lanes and
 * the min terms in a fixed order at the end: an output depends only on its weight row and its x row, never
 * on M, the other rows or the thread count (batch-invariant). Paths (gguf_dot_isa_available): 2 = AVX512-VNNI
 * (256-bit vectors, vpdpbusd), 1 = AVX2 (vpmaddubsw + vpmaddwd), 0 = portable C; each is compiled here with
 * its own target attribute and chosen at run time, so one build runs on every x86-64 kind. The paths round
 * their float sums in different orders (ulps apart), so a process uses one path throughout. The SIMD paths are one
 * body (the end of this file), included twice by this file under two target pragmas.
 */
#ifndef GD_FN /* the main pass; the SIMD pass (the end of this file) is this file included by itself */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define GGUF_DOT_ABI_VERSION 1
#define GD_QK 32   /* activation block */
#define GD_QKK 256 /* K-quant super-block */
#define GD_MR 4    /* x rows per tile: a weight block is unpacked once per tile */

enum gd_type { GD_Q8_0 = 8, GD_Q4_0 = 2, GD_Q4_1 = 3, GD_Q5_0 = 6, GD_Q5_1 = 7, GD_Q4_K = 12, GD_Q5_K = 13,
               GD_Q6_K = 14 }; /* ggml's type ids */

int pagedllm_gguf_dot_abi_version(void) { return GGUF_DOT_ABI_VERSION; }

/* Bytes of one block of `type` and weights per block; 0 for a type this file does not handle. */
static int gd_block_bytes(int type) {
    switch (type) {
    case GD_Q8_0: return 34;
    case GD_Q4_0: return 18;
    case GD_Q4_1: return 20;
    case GD_Q5_0: return 22;
    case GD_Q5_1: return 24;
    case GD_Q4_K: return 144;
    case GD_Q5_K: return 176;
    case GD_Q6_K: return 210;
    default: return 0;
    }
}

static int gd_block_weights(int type) { return type == GD_Q4_K || type == GD_Q5_K || type == GD_Q6_K ? GD_QKK : GD_QK; }

int pagedllm_gguf_dot_block_bytes(int type) { return gd_block_bytes(type); }

int pagedllm_gguf_dot_block_weights(int type) { return gd_block_bytes(type) ? gd_block_weights(type) : 0; }

/* IEEE half to float, exact (subnormals, inf, NaN). */
static inline float gd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void gd_scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ---- activations ---- */

static inline float gd_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One row of K values (K a multiple of 32) to q[K], d[K / 32], s[K / 32]. */
static inline void gd_quantize_row(const float *x, int K, int8_t *q, float *d, float *s) {
    for (int b = 0; b < K / GD_QK; b++) {
        const float *xb = x + b * GD_QK;
        float amax = 0.0f;
        for (int i = 0; i < GD_QK; i++)
            amax = fmaxf(amax, fabsf(xb[i]));
        const float db = amax / 127.0f;
        const float id = db > 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < GD_QK; i++) {
            const int v = (int)nearbyintf(xb[i] * id);
            q[b * GD_QK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

/* x (M, K) float32 (bf16: uint16 bits when is_bf16), rows x_stride elements apart, K a multiple of 32. */
void gguf_quantize_rows(const void *x, ptrdiff_t x_stride, int is_bf16, int M, int K, int8_t *q, float *d,
                        float *s, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int m = 0; m < M; m++) {
        const ptrdiff_t nb = K / GD_QK;
        if (is_bf16) {
            float row[K];
            const uint16_t *xr = (const uint16_t *)x + (ptrdiff_t)m * x_stride;
            for (int k = 0; k < K; k++)
                row[k] = gd_bf16(xr[k]);
            gd_quantize_row(row, K, q + (ptrdiff_t)m * K, d + m * nb, s + m * nb);
        } else {
            gd_quantize_row((const float *)x + (ptrdiff_t)m * x_stride, K, q + (ptrdiff_t)m * K, d + m * nb,
                            s + m * nb);
        }
    }
}

/* ---- dequantization (prefill panels and tests) ---- */

static void gd_dequantize_row(int type, const uint8_t *w, int K, float *y) {
    const int nb = K / gd_block_weights(type), bb = gd_block_bytes(type);
    for (int b = 0; b < nb; b++, w += bb) {
        switch (type) {
        case GD_Q8_0: {
            const float dw = gd_f16(w);
            for (int i = 0; i < 32; i++)
                y[i] = dw * (float)(int8_t)w[2 + i];
            y += 32;
            break;
        }
        case GD_Q4_0: case GD_Q4_1: case GD_Q5_0: case GD_Q5_1: {
            const float dw = gd_f16(w);
            const int has_min = type == GD_Q4_1 || type == GD_Q5_1, five = type == GD_Q5_0 || type == GD_Q5_1;
            const float mw = has_min ? gd_f16(w + 2) : 0.0f;
            const uint8_t *qs = w + 2 + 2 * has_min + 4 * five;
            uint32_t qh = 0;
            if (five)
                memcpy(&qh, w + 2 + 2 * has_min, 4);
            const int offset = has_min ? 0 : (five ? 16 : 8);
            for (int i = 0; i < 16; i++) {
                const int lo = (qs[i] & 0xF) | (int)(((qh >> i) & 1) << 4);
                const int hi = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
                y[i] = dw * (float)(lo - offset) + mw;
                y[i + 16] = dw * (float)(hi - offset) + mw;
            }
            y += 32;
            break;
        }
        case GD_Q4_K: case GD_Q5_K: {
            const float dw = gd_f16(w), dmin = gd_f16(w + 2);
            const int five = type == GD_Q5_K;
            const uint8_t *qh = w + 16, *qs = w + 16 + 32 * five;
            for (int j = 0; j < 8; j++) {
                int sc, m;
                gd_scale_min_k4(j, w + 4, &sc, &m);
                const float dl = dw * (float)sc, ml = dmin * (float)m;
                const uint8_t *q = qs + 32 * (j / 2);
                for (int l = 0; l < 32; l++) {
                    int v = (j & 1) ? q[l] >> 4 : q[l] & 0xF;
                    if (five)
                        v |= ((qh[l] >> j) & 1) << 4;
                    y[l] = dl * (float)v - ml;
                }
                y += 32;
            }
            break;
        }
        case GD_Q6_K: {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            const float dw = gd_f16(w + 208);
            for (int h = 0; h < 2; h++) {
                for (int u = 0; u < 4; u++) {
                    const uint8_t *L = ql + h * 64 + (u & 1) * 32, *H = qh + h * 32;
                    for (int l = 0; l < 32; l++) {
                        const int lo = (u >> 1) ? L[l] >> 4 : L[l] & 0xF;
                        const int v = (lo | (((H[l] >> (2 * u)) & 3) << 4)) - 32;
                        y[l] = dw * (float)sc[(h * 4 + u) * 2 + l / 16] * (float)v;
                    }
                    y += 32;
                }
            }
            break;
        }
        }
    }
}

/* Rows [0, N) of blocks `w` (rows row_bytes apart) as float32 out (N, K), rows out_stride apart. Returns -1 for
 * an unknown type or a K that is not a multiple of its block. */
int gguf_dequantize_rows(int type, const uint8_t *w, ptrdiff_t row_bytes, int N, int K, float *out,
                         ptrdiff_t out_stride, int num_threads) {
    if (!gd_block_bytes(type) || K % gd_block_weights(type))
        return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int n = 0; n < N; n++)
        gd_dequantize_row(type, w + (ptrdiff_t)n * row_bytes, K, out + (ptrdiff_t)n * out_stride);
    return 0;
}

/* ---- portable dot products (path 0) ---- */

struct gd_x { /* a tile's activation rows */
    const int8_t *q[GD_MR];
    const float *d[GD_MR], *s[GD_MR];
};

static inline int gd_dot32(const int8_t *a, const int8_t *b) {
    int sum = 0;
    for (int i = 0; i < 32; i++)
        sum += (int)a[i] * (int)b[i];
    return sum;
}

/* One weight row against R rows: sums of per-block float terms in block order. */
static void gd_row_scalar(int type, const uint8_t *w, int K, const struct gd_x *x, int R, float *out) {
    int8_t wq[GD_QKK];
    float scale[GD_QKK / 16], offs[GD_QKK / GD_QK];
    const int per = gd_block_weights(type), nb = K / per, bb = gd_block_bytes(type);
    float acc[GD_MR] = {0}, accm[GD_MR] = {0};
    for (int b = 0; b < nb; b++, w += bb) {
        /* the block as signed codes wq, a scale per 16 codes, an offset per 32 (times the x block's s) */
        const int nsub = per / GD_QK;
        switch (type) {
        case GD_Q8_0:
            memcpy(wq, w + 2, 32);
            scale[0] = scale[1] = gd_f16(w);
            offs[0] = 0.0f;
            break;
        case GD_Q4_0: case GD_Q4_1: case GD_Q5_0: case GD_Q5_1: {
            const int has_min = type == GD_Q4_1 || type == GD_Q5_1, five = type == GD_Q5_0 || type == GD_Q5_1;
            const uint8_t *qs = w + 2 + 2 * has_min + 4 * five;
            uint32_t qh = 0;
            if (five)
                memcpy(&qh, w + 2 + 2 * has_min, 4);
            for (int i = 0; i < 16; i++) {
                wq[i] = (int8_t)((qs[i] & 0xF) | (((qh >> i) & 1) << 4));
                wq[i + 16] = (int8_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
            }
            const float dw = gd_f16(w);
            scale[0] = scale[1] = dw;
            offs[0] = has_min ? gd_f16(w + 2) : -(float)(five ? 16 : 8) * dw;
            break;
        }
        case GD_Q4_K: case GD_Q5_K: {
            const float dw = gd_f16(w), dmin = gd_f16(w + 2);
            const int five = type == GD_Q5_K;
            const uint8_t *qh = w + 16, *qs = w + 16 + 32 * five;
            for (int j = 0; j < 8; j++) {
                int sc, m;
                gd_scale_min_k4(j, w + 4, &sc, &m);
                scale[2 * j] = scale[2 * j + 1] = dw * (float)sc;
                offs[j] = -dmin * (float)m;
                for (int l = 0; l < 32; l++) {
                    int v = (j & 1) ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 0xF;
                    if (five)
                        v |= ((qh[l] >> j) & 1) << 4;
                    wq[32 * j + l] = (int8_t)v;
                }
            }
            break;
        }
        case GD_Q6_K: {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            const float dw = gd_f16(w + 208);
            for (int c = 0; c < 8; c++) {
                const int h = c / 4, u = c % 4;
                const uint8_t *L = ql + h * 64 + (u & 1) * 32, *H = qh + h * 32;
                for (int l = 0; l < 32; l++) {
                    const int lo = (u >> 1) ? L[l] >> 4 : L[l] & 0xF;
                    wq[32 * c + l] = (int8_t)((lo | (((H[l] >> (2 * u)) & 3) << 4)) - 32);
                }
                offs[c] = 0.0f;
            }
            for (int i = 0; i < 16; i++)
                scale[i] = dw * (float)sc[i];
            break;
        }
        }
        for (int r = 0; r < R; r++) {
            const int bx = b * nsub; /* first x block of this weight block */
            for (int j = 0; j < nsub; j++) {
                const int8_t *a = x->q[r] + (ptrdiff_t)(bx + j) * GD_QK;
                const float da = x->d[r][bx + j];
                int lo = 0, hi = 0;
                for (int i = 0; i < 16; i++) {
                    lo += (int)wq[32 * j + i] * a[i];
                    hi += (int)wq[32 * j + 16 + i] * a[16 + i];
                }
                acc[r] += ((float)lo * scale[2 * j] + (float)hi * scale[2 * j + 1]) * da;
                accm[r] += offs[j] * x->s[r][bx + j];
            }
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = acc[r] + accm[r];
}

/* ---- SIMD paths: the same code compiled for AVX2 (GD_VNNI 0) and AVX512-VNNI (GD_VNNI 1) ---- */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GD_SIMD 1

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define GD_VNNI 0
#define GD_FN(name) name##_avx2
#include "gguf_dot.c"
#undef GD_VNNI
#undef GD_FN
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#define GD_VNNI 1
#define GD_FN(name) name##_vnni
#include "gguf_dot.c"
#undef GD_VNNI
#undef GD_FN
#pragma GCC pop_options
#else
#define GD_SIMD 0
#endif

/* Whether path `isa` (0 portable, 1 AVX2, 2 AVX512-VNNI) runs on this CPU. */
int gguf_dot_isa_available(int isa) {
    if (isa == 0)
        return 1;
#if GD_SIMD
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == 1)
        return avx2;
    if (isa == 2)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

/* Output rows per grab of the dynamic schedule (which thread computes a row changes no bits). */
static inline int gd_chunk(int N, int num_threads) {
    const int chunk = N / (8 * (num_threads > 0 ? num_threads : 1));
    return chunk > 0 ? chunk : 1;
}

/* out[m, n] = bias[n] + sum_k x[m, k] * W[n, k] for m < M, n < N: w rows row_bytes apart, x as
 * gguf_quantize_rows wrote it (q (M, K), d and s (M, K / 32)), out rows out_stride floats apart. Returns -1 for an
 * unknown type, a K that is not a multiple of its block, or a path this CPU cannot run. */
int gguf_dot_rows(int type, const uint8_t *w, ptrdiff_t row_bytes, int N, int K, const int8_t *xq,
                  const float *xd, const float *xs, int M, const float *bias, float *out, ptrdiff_t out_stride,
                  int isa, int num_threads) {
    if (!gd_block_bytes(type) || K % gd_block_weights(type) || !gguf_dot_isa_available(isa))
        return -1;
    const int nbx = K / GD_QK;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, gd_chunk(N, num_threads)) if (num_threads > 1)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (ptrdiff_t)n * row_bytes;
        for (int m0 = 0; m0 < M; m0 += GD_MR) {
            const int R = M - m0 < GD_MR ? M - m0 : GD_MR;
            struct gd_x x;
            for (int r = 0; r < R; r++) {
                x.q[r] = xq + (ptrdiff_t)(m0 + r) * K;
                x.d[r] = xd + (ptrdiff_t)(m0 + r) * nbx;
                x.s[r] = xs + (ptrdiff_t)(m0 + r) * nbx;
            }
            float res[GD_MR];
#if GD_SIMD
            if (isa == 2)
                gd_row_vnni(type, wr, K, &x, R, res);
            else if (isa == 1)
                gd_row_avx2(type, wr, K, &x, R, res);
            else
#endif
                gd_row_scalar(type, wr, K, &x, R, res);
            for (int r = 0; r < R; r++)
                out[(ptrdiff_t)(m0 + r) * out_stride + n] = bias ? res[r] + bias[n] : res[r];
        }
    }
    return 0;
}
#else /* GD_FN: the SIMD pass, compiled once per path; GD_VNNI picks the u8 x s8 dot instruction */
#define GD_INLINE static inline __attribute__((always_inline))

/* Sums of 4 adjacent u8 x s8 products per int32 lane (no saturation for u <= 63: AVX2's int16 pairs hold it). */
GD_INLINE __m256i GD_FN(gd_dot_us)(__m256i u, __m256i s) {
#if GD_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* s8 x s8: |w| times a with w's sign (|-128| is 128 as u8; pairs of 128 * 127 fit int16). */
GD_INLINE __m256i GD_FN(gd_dot_ss)(__m256i w, __m256i a) {
    return GD_FN(gd_dot_us)(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

/* Lanes 0..7 summed in a fixed order: (i + i + 4), then (0 + 2) + (1 + 3). */
GD_INLINE float GD_FN(gd_hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

GD_INLINE float GD_FN(gd_h)(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

GD_INLINE __m256i GD_FN(gd_load)(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 32 nibbles: 16 bytes' low nibbles (elements 0..15), then their high nibbles (16..31). */
GD_INLINE __m256i GD_FN(gd_nibbles)(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* Byte i = 0x10 where bit i of the 32 bits at p is set, else 0. */
GD_INLINE __m256i GD_FN(gd_bit4)(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i is_set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(is_set, _mm256_set1_epi8(0x10));
}

#define GD_ACC_INIT                      \
    __m256 acc[GD_MR];                   \
    float accm[GD_MR];                   \
    for (int r = 0; r < R; r++) {        \
        acc[r] = _mm256_setzero_ps();    \
        accm[r] = 0.0f;                  \
    }
#define GD_ACC_OUT                                   \
    for (int r = 0; r < R; r++)                      \
        out[r] = GD_FN(gd_hsum)(acc[r]) + accm[r];

/* Q8_0 */
GD_INLINE void GD_FN(gd_q8_0)(const uint8_t *w, int nb, const struct gd_x *x, const int R, float *out) {
    GD_ACC_INIT
    for (int b = 0; b < nb; b++, w += 34) {
        const float dw = GD_FN(gd_h)(w);
        const __m256i q = GD_FN(gd_load)(w + 2);
        for (int r = 0; r < R; r++) {
            const __m256i p = GD_FN(gd_dot_ss)(q, GD_FN(gd_load)(x->q[r] + b * GD_QK));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * x->d[r][b]), acc[r]);
        }
    }
    GD_ACC_OUT
}

/* Q4_0, Q4_1, Q5_0, Q5_1: unsigned codes; the offset (-8 d, -16 d) or the min m times the x block's s. */
GD_INLINE void GD_FN(gd_q4_5)(const uint8_t *w, int nb, const struct gd_x *x, const int R, float *out,
                              const int has_min, const int five) {
    const int bb = 18 + 2 * has_min + 4 * five;
    GD_ACC_INIT
    for (int b = 0; b < nb; b++, w += bb) {
        const float dw = GD_FN(gd_h)(w);
        const float off = has_min ? GD_FN(gd_h)(w + 2) : -(float)(five ? 16 : 8) * dw;
        __m256i q = GD_FN(gd_nibbles)(w + 2 + 2 * has_min + 4 * five);
        if (five)
            q = _mm256_or_si256(q, GD_FN(gd_bit4)(w + 2 + 2 * has_min));
        for (int r = 0; r < R; r++) {
            const __m256i p = GD_FN(gd_dot_us)(q, GD_FN(gd_load)(x->q[r] + b * GD_QK));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * x->d[r][b]), acc[r]);
            accm[r] += off * x->s[r][b];
        }
    }
    GD_ACC_OUT
}

/* Q4_K, Q5_K: 8 sub-blocks of 32 per 256, each one x block. */
GD_INLINE void GD_FN(gd_q45_k)(const uint8_t *w, int nb, const struct gd_x *x, const int R, float *out,
                               const int five) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    GD_ACC_INIT
    for (int b = 0; b < nb; b++, w += 144 + 32 * five) {
        const float dw = GD_FN(gd_h)(w), dmin = GD_FN(gd_h)(w + 2);
        float dsc[8], dm[8];
        for (int j = 0; j < 8; j++) {
            int sc, m;
            gd_scale_min_k4(j, w + 4, &sc, &m);
            dsc[j] = dw * (float)sc;
            dm[j] = dmin * (float)m;
        }
        const uint8_t *qs = w + 16 + 32 * five;
        const __m256i hb = five ? GD_FN(gd_load)(w + 16) : _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i v = GD_FN(gd_load)(qs + 32 * p);
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p), one), 4));
                hi = _mm256_or_si256(hi,
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p + 1), one), 4));
            }
            const int j = b * 8 + 2 * p; /* x block of the low half */
            for (int r = 0; r < R; r++) {
                const int8_t *a = x->q[r] + (ptrdiff_t)j * GD_QK;
                const __m256i p0 = GD_FN(gd_dot_us)(lo, GD_FN(gd_load)(a));
                const __m256i p1 = GD_FN(gd_dot_us)(hi, GD_FN(gd_load)(a + GD_QK));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(dsc[2 * p] * x->d[r][j]), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(dsc[2 * p + 1] * x->d[r][j + 1]),
                                         acc[r]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 8; j++)
                accm[r] -= dm[j] * x->s[r][b * 8 + j];
    }
    GD_ACC_OUT
}

/* Q6_K: codes - 32 signed; a scale per 16 codes (lanes 0..3 and 4..7 of one x block's dot). */
GD_INLINE void GD_FN(gd_q6_k)(const uint8_t *w, int nb, const struct gd_x *x, const int R, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    GD_ACC_INIT
    for (int b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        const float dw = GD_FN(gd_h)(w + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i L0 = GD_FN(gd_load)(w + h * 64), L1 = GD_FN(gd_load)(w + h * 64 + 32);
            const __m256i H = GD_FN(gd_load)(w + 128 + h * 32);
            for (int u = 0; u < 4; u++) {
                const __m256i L = (u & 1) ? L1 : L0;
                const __m256i lo = (u >> 1) ? _mm256_and_si256(_mm256_srli_epi16(L, 4), m4) : _mm256_and_si256(L, m4);
                const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2 * u), m2), 4);
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), k32);
                const int c = h * 4 + u, j = b * 8 + c;
                const __m256 sv = _mm256_set_m128(_mm_set1_ps(dw * (float)sc[2 * c + 1]),
                                                  _mm_set1_ps(dw * (float)sc[2 * c]));
                for (int r = 0; r < R; r++) {
                    const __m256i p = GD_FN(gd_dot_ss)(q, GD_FN(gd_load)(x->q[r] + (ptrdiff_t)j * GD_QK));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv, _mm256_set1_ps(x->d[r][j])),
                                             acc[r]);
                }
            }
        }
    }
    GD_ACC_OUT
}

#define GD_BY_ROWS(CALL_R)          \
    switch (R) {                    \
    case 1: CALL_R(1); break;       \
    case 2: CALL_R(2); break;       \
    case 3: CALL_R(3); break;       \
    default: CALL_R(4); break;      \
    }

static void GD_FN(gd_row)(int type, const uint8_t *w, int K, const struct gd_x *x, int R, float *out) {
    const int nb = K / gd_block_weights(type);
#define GD_Q8_0_R(RR) GD_FN(gd_q8_0)(w, nb, x, RR, out)
#define GD_Q4_0_R(RR) GD_FN(gd_q4_5)(w, nb, x, RR, out, 0, 0)
#define GD_Q4_1_R(RR) GD_FN(gd_q4_5)(w, nb, x, RR, out, 1, 0)
#define GD_Q5_0_R(RR) GD_FN(gd_q4_5)(w, nb, x, RR, out, 0, 1)
#define GD_Q5_1_R(RR) GD_FN(gd_q4_5)(w, nb, x, RR, out, 1, 1)
#define GD_Q4_K_R(RR) GD_FN(gd_q45_k)(w, nb, x, RR, out, 0)
#define GD_Q5_K_R(RR) GD_FN(gd_q45_k)(w, nb, x, RR, out, 1)
#define GD_Q6_K_R(RR) GD_FN(gd_q6_k)(w, nb, x, RR, out)
    switch (type) {
    case GD_Q8_0: GD_BY_ROWS(GD_Q8_0_R); break;
    case GD_Q4_0: GD_BY_ROWS(GD_Q4_0_R); break;
    case GD_Q4_1: GD_BY_ROWS(GD_Q4_1_R); break;
    case GD_Q5_0: GD_BY_ROWS(GD_Q5_0_R); break;
    case GD_Q5_1: GD_BY_ROWS(GD_Q5_1_R); break;
    case GD_Q4_K: GD_BY_ROWS(GD_Q4_K_R); break;
    case GD_Q5_K: GD_BY_ROWS(GD_Q5_K_R); break;
    case GD_Q6_K: GD_BY_ROWS(GD_Q6_K_R); break;
    }
#undef GD_Q8_0_R
#undef GD_Q4_0_R
#undef GD_Q4_1_R
#undef GD_Q5_0_R
#undef GD_Q5_1_R
#undef GD_Q4_K_R
#undef GD_Q5_K_R
#undef GD_Q6_K_R
}
#undef GD_BY_ROWS
#undef GD_ACC_INIT
#undef GD_ACC_OUT
#undef GD_INLINE
#endif
