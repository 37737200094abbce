/* GGUF block dot products: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) with W kept in its GGUF block
 * bytes (one row of blocks per output n, as the file stores it) and x quantized per row to int8 once per call
 * (gguf_quantize_rows), in the manner of ggml's vec_dot kernels (written here, not copied).
 *
 * Activations: per 32 consecutive k, float d = max|x| / 127, int8 q = round(x / d) (nearest, ties to even),
 * s = d * sum(q) and s16 = d * the sum of each 16 q, the terms of blocks with a min or an offset. One format for every weight
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
 * Each weight row is unpacked once per call (codes, a scale per 16 codes, a min per 32) and read by every x row.
 * Numerics: each block's integer dot is exact; blocks are summed in k order into fixed lanes (two accumulators,
 * even and odd blocks or block pairs), the lanes and the min terms in a fixed order at the end: an output depends
 * only on its weight row and its x row, never on M, the other rows or the thread count (batch-invariant).
 * Paths (gguf_dot_isa_available): 2 = AVX512-VNNI (unsigned codes against the signed x codes, 512-bit vpdpbusd,
 * each type's offset folded into a min per 16 codes against x's per-16 sums), 1 = AVX2 (signed codes, vpsignb +
 * vpmaddubsw + vpmaddwd), 0 = portable C; each is compiled here under its own target pragma and chosen at run
 * time, so one build runs on every x86-64 kind. The paths round their float sums in different orders (ulps
 * apart), so a process uses one path throughout. The SIMD paths are one body (the end of this file), included
 * twice by this file itself.
 */
#ifndef GD_FN /* the main pass; the SIMD pass (the end of this file) is this file included by itself */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_team.h"

#define GGUF_DOT_ABI_VERSION 5
#define GD_QK 32   /* activation block */
#define GD_QKK 256 /* K-quant super-block */
#define GD_MR 4      /* x rows per tile (portable C, AVX2): a weight row is unpacked once and read per tile */
#define GD_MR_VNNI 8 /* x rows per tile on the AVX512-VNNI path (32 vector registers) */

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
static inline void gd_quantize_row(const float *x, int K, int8_t *q, float *d, float *s, float *s16) {
    for (int b = 0; b < K / GD_QK; b++) {
        const float *xb = x + b * GD_QK;
        float amax = 0.0f;
        for (int i = 0; i < GD_QK; i++)
            amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float db = amax / 127.0f;
        const float id = db > 0.0f ? 1.0f / db : 0.0f;
        int sum[2] = {0, 0};
        for (int i = 0; i < GD_QK; i++) {
            const int v = (int)nearbyintf(xb[i] * id);
            q[b * GD_QK + i] = (int8_t)v;
            sum[i / 16] += v;
        }
        d[b] = db;
        s[b] = db * (float)(sum[0] + sum[1]);
        s16[2 * b] = db * (float)sum[0];
        s16[2 * b + 1] = db * (float)sum[1];
    }
}

typedef void (*gd_quantize_fn)(const float *x, int K, int8_t *q, float *d, float *s, float *s16);
static gd_quantize_fn gd_quantizer(int isa); /* defined after the SIMD passes */

/* x (M, K) float32 (bf16: uint16 bits when is_bf16), rows x_stride elements apart, K a multiple of 32, to q (M, K),
 * d and s (M, K / 32), s16 (M, K / 16): d times the sum of each 16 codes. isa: the path (0 portable C, 1 or 2 the
 * SIMD body; one this CPU cannot run takes portable C): every path writes the same bits. */
static void gd_quantize_one_row(gd_quantize_fn quantize, const void *x, ptrdiff_t x_stride, int is_bf16, int m, int K,
                            int8_t *q, float *d, float *s, float *s16) {
    const ptrdiff_t nb = K / GD_QK;
    if (is_bf16) {
        float row[K];
        const uint16_t *xr = (const uint16_t *)x + (ptrdiff_t)m * x_stride;
        for (int k = 0; k < K; k++)
            row[k] = gd_bf16(xr[k]);
        quantize(row, K, q + (ptrdiff_t)m * K, d + m * nb, s + m * nb, s16 + 2 * m * nb);
    } else {
        quantize((const float *)x + (ptrdiff_t)m * x_stride, K, q + (ptrdiff_t)m * K, d + m * nb, s + m * nb,
                 s16 + 2 * m * nb);
    }
}

void gguf_quantize_rows(const void *x, ptrdiff_t x_stride, int is_bf16, int M, int K, int8_t *q, float *d,
                        float *s, float *s16, int isa, int num_threads) {
    const gd_quantize_fn quantize = gd_quantizer(isa);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int m = 0; m < M; m++)
        gd_quantize_one_row(quantize, x, x_stride, is_bf16, m, K, q, d, s, s16);
}

/* gguf_quantize_rows' and gguf_dot_rows' arguments in order, for their task forms (native_team.h). */
struct gd_quantize_args {
    const void *x;
    ptrdiff_t x_stride;
    int is_bf16, M, K;
    int8_t *q;
    float *d, *s, *s16;
    int isa, num_threads;
};
struct gd_dot_args {
    int type;
    const uint8_t *w;
    ptrdiff_t row_bytes;
    int N, K;
    const int8_t *xq;
    const float *xd, *xs, *xs16;
    int M;
    const float *bias;
    float *out;
    ptrdiff_t out_stride;
    int isa, num_threads;
};

/* Thread ith's share of the rows. */
int gguf_quantize_rows_task(const void *args, int ith, int nth) {
    const struct gd_quantize_args *a = args;
    const gd_quantize_fn quantize = gd_quantizer(a->isa);
    long long b, e;
    team_share(a->M, ith, nth, &b, &e);
    for (long long m = b; m < e; m++)
        gd_quantize_one_row(quantize, a->x, a->x_stride, a->is_bf16, (int)m, a->K, a->q, a->d, a->s, a->s16);
    return 0;
}

/* ---- weights: float32 rows to Q8_0 blocks (gguf.quants.quantize's rule) ---- */

/* float to IEEE half, round to nearest even (overflow to inf, NaN kept a NaN). */
static inline uint16_t gd_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or NaN */
        return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0);
    if (abs >= 0x477ff000u) /* rounds past the largest half */
        return sign | 0x7c00;
    if (abs < 0x38800000u) { /* a half subnormal (or zero): add 0.5 so the FPU rounds the shifted-out bits */
        float a, r;
        memcpy(&a, &abs, 4);
        r = a + 0.5f;
        uint32_t bits;
        memcpy(&bits, &r, 4);
        return sign | (uint16_t)(bits - 0x3f000000u);
    }
    const uint32_t mant_odd = (abs >> 13) & 1;
    return sign | (uint16_t)((abs + 0xc8000fffu + mant_odd) >> 13);
}

/* x (N, K) float32 rows (x_stride apart), K a multiple of 32, to Q8_0 blocks out (N, K / 32 * 34): per 32,
 * d = max|x| / 127, q = round(x / d) halves away from zero, d stored as half (gguf.quants' Q8_0 rule: a tensor
 * dequantized from Q8_0 comes back as its own blocks). */
void gguf_quantize_q8_0(const float *x, ptrdiff_t x_stride, int N, int K, uint8_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int n = 0; n < N; n++) {
        const float *xr = x + (ptrdiff_t)n * x_stride;
        uint8_t *o = out + (ptrdiff_t)n * (K / GD_QK) * 34;
        for (int b = 0; b < K / GD_QK; b++, o += 34) {
            float amax = 0.0f;
            for (int i = 0; i < GD_QK; i++)
                amax = fabsf(xr[b * GD_QK + i]) > amax ? fabsf(xr[b * GD_QK + i]) : amax;
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t h = gd_to_f16(d);
            memcpy(o, &h, 2);
            for (int i = 0; i < GD_QK; i++)
                o[2 + i] = (uint8_t)(int8_t)roundf(xr[b * GD_QK + i] * id);
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

/* ---- one weight row unpacked (every path): the dot kernels read this, not the blocks ---- */

/* A weight row as signed codes c[K] (w = scale * c + min), per x block of 32: 8 scales (lanes 0..3 for codes
 * 0..15, 4..7 for 16..31: only Q6_K's differ) and one min (zero-padded to a multiple of 8 blocks), has_min
 * when any min is not structurally zero. Built once per weight row, read for every x row. */
struct gd_unpacked {
    int8_t *c;
    float *scale, *min;
    int has_min;
    float *min16; /* the VNNI path: codes unsigned (u8), min and offset per 16 codes (zero-padded to 16s) */
};

static void gd_unpack_row(int type, const uint8_t *w, int K, struct gd_unpacked *u) {
    const int per = gd_block_weights(type), nb = K / per, bb = gd_block_bytes(type);
    int8_t *c = u->c;
    float *sc8 = u->scale, *mn = u->min;
    u->has_min = type == GD_Q4_1 || type == GD_Q5_1 || type == GD_Q4_K || type == GD_Q5_K;
    for (int b = 0; b < nb; b++, w += bb) {
        switch (type) {
        case GD_Q8_0: {
            const float dw = gd_f16(w);
            memcpy(c, w + 2, 32);
            for (int i = 0; i < 8; i++)
                sc8[i] = dw;
            *mn++ = 0.0f;
            c += 32, sc8 += 8;
            break;
        }
        case GD_Q4_0: case GD_Q4_1: case GD_Q5_0: case GD_Q5_1: {
            const int has_min = type == GD_Q4_1 || type == GD_Q5_1, five = type == GD_Q5_0 || type == GD_Q5_1;
            const uint8_t *qs = w + 2 + 2 * has_min + 4 * five;
            uint32_t qh = 0;
            if (five)
                memcpy(&qh, w + 2 + 2 * has_min, 4);
            const int offset = has_min ? 0 : (five ? 16 : 8);
            for (int i = 0; i < 16; i++) {
                c[i] = (int8_t)(((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) - offset);
                c[i + 16] = (int8_t)(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - offset);
            }
            const float dw = gd_f16(w);
            for (int i = 0; i < 8; i++)
                sc8[i] = dw;
            *mn++ = has_min ? gd_f16(w + 2) : 0.0f;
            c += 32, sc8 += 8;
            break;
        }
        case GD_Q4_K: case GD_Q5_K: {
            const float dw = gd_f16(w), dmin = gd_f16(w + 2);
            const int five = type == GD_Q5_K;
            const uint8_t *qh = w + 16, *qs = w + 16 + 32 * five;
            for (int j = 0; j < 8; j++) {
                int s, m;
                gd_scale_min_k4(j, w + 4, &s, &m);
                const uint8_t *q = qs + 32 * (j / 2);
                const int shift = 4 * (j & 1);
                for (int l = 0; l < 32; l++)
                    c[l] = (int8_t)(((q[l] >> shift) & 0xF) | (five ? ((qh[l] >> j) & 1) << 4 : 0));
                const float dl = dw * (float)s;
                for (int i = 0; i < 8; i++)
                    sc8[i] = dl;
                *mn++ = -(dmin * (float)m);
                c += 32, sc8 += 8;
            }
            break;
        }
        case GD_Q6_K: {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *s = (const int8_t *)(w + 192);
            const float dw = gd_f16(w + 208);
            for (int j = 0; j < 8; j++) {
                const int h = j / 4, v = j % 4;
                const uint8_t *L = ql + h * 64 + (v & 1) * 32, *H = qh + h * 32;
                const int shift = 4 * (v >> 1);
                for (int l = 0; l < 32; l++)
                    c[l] = (int8_t)((((L[l] >> shift) & 0xF) | (((H[l] >> (2 * v)) & 3) << 4)) - 32);
                for (int i = 0; i < 4; i++) {
                    sc8[i] = dw * (float)s[2 * j];
                    sc8[4 + i] = dw * (float)s[2 * j + 1];
                }
                *mn++ = 0.0f;
                c += 32, sc8 += 8;
            }
            break;
        }
        }
    }
    for (int b = K / GD_QK; b % 8; b++)
        *mn++ = 0.0f;
}

/* Rows [0, N) of blocks `w` (rows row_bytes apart) as unsigned codes (N, K) uint8 with a scale and a min per 16 codes
 * (N, K / 16) float32 each: w = scale * code + min (the offset of Q8_0, Q4_0, Q5_0 and Q6_K folded into the min,
 * which stays exact: an offset times a half scale). The input of native/gguf_repack.c. Returns -1 for an unknown
 * type or a K that is not a multiple of its block. */
int gguf_unpack_rows(int type, const uint8_t *w, ptrdiff_t row_bytes, int N, int K, uint8_t *codes, float *scale16,
                     float *min16, int num_threads) {
    if (!gd_block_bytes(type) || K % gd_block_weights(type))
        return -1;
    const int offset = type == GD_Q8_0 ? 128 : type == GD_Q4_0 ? 8 : type == GD_Q5_0 ? 16 : type == GD_Q6_K ? 32 : 0;
    const int nbx = K / GD_QK, padded = (nbx + 7) / 8 * 8;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int8_t c[K];
        float scales[8 * nbx], mins[padded];
        struct gd_unpacked u = {c, scales, mins, 0, NULL};
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            gd_unpack_row(type, w + (ptrdiff_t)n * row_bytes, K, &u);
            uint8_t *cn = codes + (ptrdiff_t)n * K;
            float *sn = scale16 + (ptrdiff_t)n * (K / 16), *mn = min16 + (ptrdiff_t)n * (K / 16);
            for (int k = 0; k < K; k++)
                cn[k] = (uint8_t)(c[k] + offset);
            for (int h = 0; h < K / 16; h++) {
                sn[h] = scales[4 * h];
                mn[h] = mins[h / 2] - (float)offset * sn[h];
            }
        }
    }
    return 0;
}

struct gd_x { /* a tile's activation rows; d8: each block's scale repeated 8 times (the VNNI path's lanes) */
    const int8_t *q[GD_MR_VNNI];
    const float *d[GD_MR_VNNI], *s[GD_MR_VNNI], *s16[GD_MR_VNNI], *d8[GD_MR_VNNI];
};

/* Path 0: per x block, the two 16-code halves' integer dots times their scales, then the min, in block order. */
static void gd_dot_scalar(const struct gd_unpacked *u, int K, const struct gd_x *x, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f, accm = 0.0f;
        for (int b = 0; b < K / GD_QK; b++) {
            const int8_t *a = x->q[r] + (ptrdiff_t)b * GD_QK, *c = u->c + (ptrdiff_t)b * GD_QK;
            int lo = 0, hi = 0;
            for (int i = 0; i < 16; i++) {
                lo += (int)c[i] * a[i];
                hi += (int)c[16 + i] * a[16 + i];
            }
            acc += ((float)lo * u->scale[8 * b] + (float)hi * u->scale[8 * b + 4]) * x->d[r][b];
            if (u->has_min)
                accm += u->min[b] * x->s[r][b];
        }
        out[r] = acc + accm;
    }
}

/* ---- SIMD paths: one body (the end of this file) compiled for AVX2 (GD_VNNI 0) and AVX512-VNNI (GD_VNNI 1) ---- */
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

static void gd_quantize_row_c(const float *x, int K, int8_t *q, float *d, float *s, float *s16) {
    gd_quantize_row(x, K, q, d, s, s16);
}

/* Path isa's quantizer: the 256-bit SIMD body (the AVX2 pass's) for 1 and 2 where AVX2 runs. */
static gd_quantize_fn gd_quantizer(int isa) {
#if GD_SIMD
    static int avx2 = -1;
    if (avx2 < 0)
        avx2 = gguf_dot_isa_available(1);
    return isa >= 1 && avx2 ? gd_quantize_row_avx2 : gd_quantize_row_c;
#else
    (void)isa;
    return gd_quantize_row_c;
#endif
}

/* Output rows per grab of the dynamic schedule (which thread computes a row changes no bits). */
static inline int gd_chunk(int N, int num_threads) {
    const int chunk = N / (8 * (num_threads > 0 ? num_threads : 1));
    return chunk > 0 ? chunk : 1;
}

/* out[m, n] = bias[n] + sum_k x[m, k] * W[n, k] for m < M, n < N: w rows row_bytes apart, x as
 * gguf_quantize_rows wrote it (q (M, K), d and s (M, K / 32), s16 (M, K / 16)), out rows out_stride floats apart. Returns -1 for an
 * unknown type, a K that is not a multiple of its block, or a path this CPU cannot run; -2 when the VNNI path
 * cannot allocate its copy of the activation scales. */
int gguf_dot_rows(int type, const uint8_t *w, ptrdiff_t row_bytes, int N, int K, const int8_t *xq,
                  const float *xd, const float *xs, const float *xs16, int M, const float *bias, float *out,
                  ptrdiff_t out_stride, int isa, int num_threads) {
    if (!gd_block_bytes(type) || K % gd_block_weights(type) || !gguf_dot_isa_available(isa))
        return -1;
    const int nbx = K / GD_QK, padded = (nbx + 7) / 8 * 8, mr = isa == 2 ? GD_MR_VNNI : GD_MR;
    float *xd8 = NULL;
    if (isa == 2) { /* x's scales as the VNNI path's lanes, once per call (every weight row reads them) */
        xd8 = malloc(sizeof(float) * 8 * (size_t)nbx * (size_t)(M > 0 ? M : 1));
        if (!xd8)
            return -2;
        for (ptrdiff_t i = 0; i < (ptrdiff_t)M * nbx; i++)
            for (int l = 0; l < 8; l++)
                xd8[8 * i + l] = xd[i];
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int8_t codes[K];
        float scales[8 * nbx], mins[padded], mins16[2 * padded];
        struct gd_unpacked u = {codes, scales, mins, 0, mins16};
#pragma omp for schedule(dynamic, gd_chunk(N, num_threads))
        for (int n = 0; n < N; n++) {
            const uint8_t *wr = w + (ptrdiff_t)n * row_bytes;
#if GD_SIMD
            /* one tile of rows: reading the blocks straight beats unpacking them first; more tiles share one
             * unpacked row (both give the same bits) */
            const int direct = isa == 2 && M <= GD_MR_VNNI && gd_is_legacy_vnni(type);
            if (direct)
                ; /* read straight from the blocks (gd_dot_direct_vnni) */
            else if (isa == 2)
                gd_unpack_vnni(type, wr, K, &u);
            else if (isa == 1)
                gd_unpack_avx2(type, wr, K, &u);
            else
#endif
                gd_unpack_row(type, wr, K, &u);
            for (int m0 = 0; m0 < M; m0 += mr) {
                const int R = M - m0 < mr ? M - m0 : mr;
                struct gd_x x;
                for (int r = 0; r < R; r++) {
                    x.q[r] = xq + (ptrdiff_t)(m0 + r) * K;
                    x.d[r] = xd + (ptrdiff_t)(m0 + r) * nbx;
                    x.s[r] = xs + (ptrdiff_t)(m0 + r) * nbx;
                    x.s16[r] = xs16 + (ptrdiff_t)(m0 + r) * 2 * nbx;
                    x.d8[r] = xd8 ? xd8 + (ptrdiff_t)(m0 + r) * 8 * nbx : NULL;
                }
                float res[GD_MR_VNNI];
#if GD_SIMD
                if (direct)
                    gd_dot_direct_vnni(type, wr, K, &x, R, res, mins16);
                else if (isa == 2)
                    gd_dot_vnni(&u, K, &x, R, res);
                else if (isa == 1)
                    gd_dot_avx2(&u, K, &x, R, res);
                else
#endif
                    gd_dot_scalar(&u, K, &x, R, res);
                for (int r = 0; r < R; r++)
                    out[(ptrdiff_t)(m0 + r) * out_stride + n] = bias ? res[r] + bias[n] : res[r];
            }
        }
    }
    free(xd8);
    return 0;
}

/* Thread ith's share of the outputs (whole weight rows), each as gguf_dot_rows computes it. */
int gguf_dot_rows_task(const void *args, int ith, int nth) {
    const struct gd_dot_args *a = args;
    long long b, e;
    team_share(a->N, ith, nth, &b, &e);
    if (b >= e)
        return 0;
    return gguf_dot_rows(a->type, a->w + b * a->row_bytes, a->row_bytes, (int)(e - b), a->K, a->xq, a->xd, a->xs,
                         a->xs16, a->M, a->bias ? a->bias + b : NULL, a->out + b, a->out_stride, a->isa, 1);
}

/* Rows [0, N) of blocks `w` (rows row_bytes apart) dequantized on path `isa`'s unpacking: float32 out (N, K) or,
 * with out_bf16, bfloat16 bits (round to nearest even), rows out_stride elements apart. The same values as
 * gguf_dequantize_rows (bfloat16: those values rounded). Returns -1 for an unknown type, a K that is not a multiple
 * of its block, or a path this CPU cannot run. */
int gguf_dequantize_rows_isa(int type, const uint8_t *w, ptrdiff_t row_bytes, int N, int K, void *out,
                             ptrdiff_t out_stride, int out_bf16, int isa, int num_threads) {
    if (!gd_block_bytes(type) || K % gd_block_weights(type) || !gguf_dot_isa_available(isa))
        return -1;
    const int nbx = K / GD_QK, padded = (nbx + 7) / 8 * 8;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int8_t codes[K];
        float scales[8 * nbx], mins[padded], mins16[2 * padded], row[K];
        struct gd_unpacked u = {codes, scales, mins, 0, mins16};
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const uint8_t *wr = w + (ptrdiff_t)n * row_bytes;
            float *y32 = out_bf16 ? NULL : (float *)out + (ptrdiff_t)n * out_stride;
            uint16_t *y16 = out_bf16 ? (uint16_t *)out + (ptrdiff_t)n * out_stride : NULL;
#if GD_SIMD
            if (isa == 2) {
                gd_unpack_vnni(type, wr, K, &u);
                gd_values_vnni(&u, K, y32, y16);
                continue;
            }
            if (isa == 1) {
                gd_unpack_avx2(type, wr, K, &u);
                gd_values_avx2(&u, K, y32, y16);
                continue;
            }
#endif
            gd_dequantize_row(type, wr, K, y32 ? y32 : row);
            if (y16)
                for (int k = 0; k < K; k++) {
                    uint32_t b;
                    memcpy(&b, row + k, 4);
                    y16[k] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
                }
        }
    }
    return 0;
}

#else /* GD_FN: the SIMD pass, compiled once per path; GD_VNNI picks the u8 x s8 dot instruction */
#define GD_INLINE static inline __attribute__((always_inline))

/* Sums of 4 adjacent s8 x s8 products per int32 lane: |c| times a with c's sign (|-128| is 128 as u8; the
 * int16 pairs AVX2 forms hold 2 * 128 * 127). */
GD_INLINE __m256i GD_FN(gd_dot_ss)(__m256i c, __m256i a) {
    const __m256i u = _mm256_sign_epi8(c, c), s = _mm256_sign_epi8(a, c);
#if GD_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
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

/* 32 nibbles: 16 bytes' low nibbles (codes 0..15), then their high nibbles (16..31). */
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

GD_INLINE void GD_FN(gd_store)(int8_t *c, __m256i v) { _mm256_storeu_si256((__m256i *)c, v); }

#if GD_VNNI
/* The VNNI path's row: unsigned codes (vpdpbusd's u8 operand; the x codes are its s8 one), each offset folded
 * into a min per 16 codes (min16 * x's s16), so a block costs one vpdpbusd per x row and no sign fix-ups. */
static void GD_FN(gd_unpack)(int type, const uint8_t *w, int K, struct gd_unpacked *u) {
    const int per = gd_block_weights(type), nb = K / per, bb = gd_block_bytes(type);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    int8_t *c = u->c;
    float *sc8 = u->scale, *mn = u->min16;
    u->has_min = 1;
    for (int b = 0; b < nb; b++, w += bb) {
        switch (type) {
        case GD_Q8_0: {
            const float dw = GD_FN(gd_h)(w);
            GD_FN(gd_store)(c, _mm256_xor_si256(GD_FN(gd_load)(w + 2), _mm256_set1_epi8((char)0x80)));
            _mm256_storeu_ps(sc8, _mm256_set1_ps(dw));
            mn[0] = mn[1] = -128.0f * dw;
            c += 32, sc8 += 8, mn += 2;
            break;
        }
        case GD_Q4_0: case GD_Q4_1: case GD_Q5_0: case GD_Q5_1: {
            const int has_min = type == GD_Q4_1 || type == GD_Q5_1, five = type == GD_Q5_0 || type == GD_Q5_1;
            __m256i q = GD_FN(gd_nibbles)(w + 2 + 2 * has_min + 4 * five);
            if (five)
                q = _mm256_or_si256(q, GD_FN(gd_bit4)(w + 2 + 2 * has_min));
            GD_FN(gd_store)(c, q);
            const float dw = GD_FN(gd_h)(w);
            _mm256_storeu_ps(sc8, _mm256_set1_ps(dw));
            mn[0] = mn[1] = has_min ? GD_FN(gd_h)(w + 2) : -(float)(five ? 16 : 8) * dw;
            c += 32, sc8 += 8, mn += 2;
            break;
        }
        case GD_Q4_K: case GD_Q5_K: {
            const float dw = GD_FN(gd_h)(w), dmin = GD_FN(gd_h)(w + 2);
            const int five = type == GD_Q5_K;
            const uint8_t *qs = w + 16 + 32 * five;
            const __m256i hb = five ? GD_FN(gd_load)(w + 16) : _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
            for (int p = 0; p < 4; p++) {
                const __m256i v = GD_FN(gd_load)(qs + 32 * p);
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (five) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p), one), 4));
                    hi = _mm256_or_si256(
                        hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p + 1), one), 4));
                }
                GD_FN(gd_store)(c + 64 * p, lo);
                GD_FN(gd_store)(c + 64 * p + 32, hi);
            }
            for (int j = 0; j < 8; j++) {
                int s, m;
                gd_scale_min_k4(j, w + 4, &s, &m);
                _mm256_storeu_ps(sc8 + 8 * j, _mm256_set1_ps(dw * (float)s));
                mn[2 * j] = mn[2 * j + 1] = -(dmin * (float)m);
            }
            c += 256, sc8 += 64, mn += 16;
            break;
        }
        case GD_Q6_K: {
            const int8_t *s = (const int8_t *)(w + 192);
            const float dw = GD_FN(gd_h)(w + 208);
            const __m256i m2 = _mm256_set1_epi8(3);
            for (int h = 0; h < 2; h++) {
                const __m256i L0 = GD_FN(gd_load)(w + h * 64), L1 = GD_FN(gd_load)(w + h * 64 + 32);
                const __m256i H = GD_FN(gd_load)(w + 128 + h * 32);
                for (int v = 0; v < 4; v++) {
                    const __m256i L = (v & 1) ? L1 : L0;
                    const __m256i lo = (v >> 1) ? _mm256_and_si256(_mm256_srli_epi16(L, 4), m4) : _mm256_and_si256(L, m4);
                    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2 * v), m2), 4);
                    GD_FN(gd_store)(c + 32 * (4 * h + v), _mm256_or_si256(lo, hi));
                }
            }
            for (int j = 0; j < 8; j++) {
                const float lo = dw * (float)s[2 * j], hi = dw * (float)s[2 * j + 1];
                _mm256_storeu_ps(sc8 + 8 * j, _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)));
                mn[2 * j] = -32.0f * lo;
                mn[2 * j + 1] = -32.0f * hi;
            }
            c += 256, sc8 += 64, mn += 16;
            break;
        }
        }
    }
    for (int h = 2 * (K / GD_QK); h % 16; h++)
        *mn++ = 0.0f;
}

GD_INLINE float GD_FN(gd_hsum16)(__m512 v) {
    return GD_FN(gd_hsum)(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* One x row's block pair: acc += dot(c, a) * (scale * d8), 512 bits (lanes 0..7: block b, 8..15: b + 1; d8 is x's
 * scale repeated per lane, so the product is one multiply). */
#define GD_ROW_PAIR(acc, c_, sc_, a, d8)                                                                           \
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c_, a)),               \
                          _mm512_mul_ps(sc_, d8), acc)

/* The tile's rows (R, e, o, qs, ds in scope) against two block pairs (c0, s0: accumulators e; c1, s1: o) at x
 * codes qb and lane scales db; one pair (e); an odd last block, masked to its 8 lanes (o). */
#define GD_ROWS_TWO_PAIRS(c0, s0, c1, s1, qb, db)                                                                   \
    for (int r = 0; r < R; r++) {                                                                                 \
        GD_ROW_PAIR(e[r], c0, s0, _mm512_loadu_si512((qb) + r * qs), _mm512_loadu_ps((db) + r * ds));            \
        GD_ROW_PAIR(o[r], c1, s1, _mm512_loadu_si512((qb) + r * qs + 64), _mm512_loadu_ps((db) + r * ds + 16));  \
    }
#define GD_ROWS_PAIR(c0, s0, qb, db)                                                                              \
    for (int r = 0; r < R; r++)                                                                                   \
        GD_ROW_PAIR(e[r], c0, s0, _mm512_loadu_si512((qb) + r * qs), _mm512_loadu_ps((db) + r * ds))
#define GD_ROWS_LAST(c0, s0, qb, db)                                                                              \
    for (int r = 0; r < R; r++)                                                                                   \
        GD_ROW_PAIR(o[r], c0, s0, _mm512_maskz_loadu_epi8(0xFFFFFFFFull, (qb) + r * qs),                         \
                    _mm512_maskz_loadu_ps(0xFF, (db) + r * ds))

/* Each row's output: its two accumulators, then the mins (min16 * s16, 16 per vector; the mins zero-padded, x's
 * s16 past nh never read) in the same lanes, one reduction. */
GD_INLINE void GD_FN(gd_tile_finish)(const __m512 *e, const __m512 *o, const float *min16, const float *s16,
                                     ptrdiff_t ss, int nh, const int R, float *out) {
    for (int r = 0; r < R; r++) {
        __m512 acc = _mm512_add_ps(e[r], o[r]);
        const float *sr = s16 + r * ss;
        int h = 0;
        for (; h + 16 <= nh; h += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(min16 + h), _mm512_loadu_ps(sr + h), acc);
        if (h < nh)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(min16 + h),
                                  _mm512_maskz_loadu_ps((__mmask16)((1u << (nh - h)) - 1), sr + h), acc);
        out[r] = GD_FN(gd_hsum16)(acc);
    }
}

/* R x rows (a compile-time count up to GD_MR_VNNI) against one unpacked row: block pairs alternate between two
 * accumulators per row, an odd last block runs masked to its 8 lanes, then the mins (min16 * s16, 16 per
 * vector) join the same lanes and one reduction gives the output. Each row's operations and their order are
 * the same for any R (batch-invariant). */
GD_INLINE void GD_FN(gd_dot_tile)(const struct gd_unpacked *u, int K, const struct gd_x *x, const int R,
                                  float *out) {
    const int nb = K / GD_QK, nh = 2 * nb;
    /* the tile's rows are consecutive rows of x: one base and one stride each (fewer live pointers) */
    const int8_t *q = x->q[0];
    const float *d8 = x->d8[0], *s16 = x->s16[0];
    const ptrdiff_t qs = R > 1 ? x->q[1] - x->q[0] : 0, ds = R > 1 ? x->d8[1] - x->d8[0] : 0;
    const ptrdiff_t ss = R > 1 ? x->s16[1] - x->s16[0] : 0;
    __m512 e[GD_MR_VNNI], o[GD_MR_VNNI];
    for (int r = 0; r < R; r++)
        e[r] = o[r] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 4 <= nb; b += 4) {
        const __m512i c0 = _mm512_loadu_si512(u->c + 32 * b), c1 = _mm512_loadu_si512(u->c + 32 * b + 64);
        const __m512 s0 = _mm512_loadu_ps(u->scale + 8 * b), s1 = _mm512_loadu_ps(u->scale + 8 * b + 16);
        const int8_t *qb = q + 32 * b;
        const float *db = d8 + 8 * b;
        GD_ROWS_TWO_PAIRS(c0, s0, c1, s1, qb, db);
    }
    if (b + 2 <= nb) {
        const __m512i c0 = _mm512_loadu_si512(u->c + 32 * b);
        const __m512 s0 = _mm512_loadu_ps(u->scale + 8 * b);
        GD_ROWS_PAIR(c0, s0, q + 32 * b, d8 + 8 * b);
        b += 2;
    }
    if (b < nb) { /* lanes 8..15 load zeros and add 0 * 0 */
        const __m512i c0 = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, u->c + 32 * b);
        const __m512 s0 = _mm512_maskz_loadu_ps(0xFF, u->scale + 8 * b);
        GD_ROWS_LAST(c0, s0, q + 32 * b, d8 + 8 * b);
    }
    GD_FN(gd_tile_finish)(e, o, u->min16, s16, ss, nh, R, out);
}

/* The legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): block b's 32 unsigned codes, its scale and its min, the
 * values gd_unpack stores for it (the same expressions, so the same floats). */
GD_INLINE __m256i GD_FN(gd_block_codes)(int type, const uint8_t *w, float *d, float *mn) {
    *d = GD_FN(gd_h)(w);
    if (type == GD_Q8_0) {
        *mn = -128.0f * *d;
        return _mm256_xor_si256(GD_FN(gd_load)(w + 2), _mm256_set1_epi8((char)0x80));
    }
    const int has_min = type == GD_Q4_1 || type == GD_Q5_1, five = type == GD_Q5_0 || type == GD_Q5_1;
    __m256i q = GD_FN(gd_nibbles)(w + 2 + 2 * has_min + 4 * five);
    if (five)
        q = _mm256_or_si256(q, GD_FN(gd_bit4)(w + 2 + 2 * has_min));
    *mn = has_min ? GD_FN(gd_h)(w + 2) : -(float)(five ? 16 : 8) * *d;
    return q;
}

static int GD_FN(gd_is_legacy)(int type) {
    return type == GD_Q8_0 || type == GD_Q4_0 || type == GD_Q4_1 || type == GD_Q5_0 || type == GD_Q5_1;
}

/* gd_dot_tile for a legacy-type weight row read straight from its blocks: each block pair's codes and scales are
 * built in registers for the tile instead of stored by gd_unpack and read back, and only the mins go through
 * memory (min16, 2 * ceil(K / 256) * 8 floats of scratch). The same operations in the same order as gd_dot_tile
 * on the unpacked row: bit-identical results. */
GD_INLINE void GD_FN(gd_dot_direct_tile)(int type, const uint8_t *w, int K, const struct gd_x *x, const int R,
                                         float *out, float *min16) {
    const int nb = K / GD_QK, nh = 2 * nb, bb = gd_block_bytes(type);
    const int8_t *q = x->q[0];
    const float *d8 = x->d8[0], *s16 = x->s16[0];
    const ptrdiff_t qs = R > 1 ? x->q[1] - x->q[0] : 0, ds = R > 1 ? x->d8[1] - x->d8[0] : 0;
    const ptrdiff_t ss = R > 1 ? x->s16[1] - x->s16[0] : 0;
    __m512 e[GD_MR_VNNI], o[GD_MR_VNNI];
    for (int r = 0; r < R; r++)
        e[r] = o[r] = _mm512_setzero_ps();
    float dv[4], mv[4];
    int b = 0;
#define GD_CODES2(i) _mm512_inserti64x4(_mm512_castsi256_si512(GD_FN(gd_block_codes)(type, w + bb * (b + (i)), dv + (i), mv + (i))), \
                                        GD_FN(gd_block_codes)(type, w + bb * (b + (i) + 1), dv + (i) + 1, mv + (i) + 1), 1)
#define GD_SCALE2(i) _mm512_insertf32x8(_mm512_set1_ps(dv[i]), _mm256_set1_ps(dv[(i) + 1]), 1)
    for (; b + 4 <= nb; b += 4) {
        const __m512i c0 = GD_CODES2(0), c1 = GD_CODES2(2);
        const __m512 s0 = GD_SCALE2(0), s1 = GD_SCALE2(2);
        for (int i = 0; i < 4; i++)
            min16[2 * (b + i)] = min16[2 * (b + i) + 1] = mv[i];
        const int8_t *qb = q + 32 * b;
        const float *db = d8 + 8 * b;
        GD_ROWS_TWO_PAIRS(c0, s0, c1, s1, qb, db);
    }
    if (b + 2 <= nb) {
        const __m512i c0 = GD_CODES2(0);
        const __m512 s0 = GD_SCALE2(0);
        min16[2 * b] = min16[2 * b + 1] = mv[0];
        min16[2 * b + 2] = min16[2 * b + 3] = mv[1];
        GD_ROWS_PAIR(c0, s0, q + 32 * b, d8 + 8 * b);
        b += 2;
    }
#undef GD_CODES2
#undef GD_SCALE2
    if (b < nb) { /* as gd_dot_tile's masked last block: the upper lanes are zero */
        const __m512i c0 = _mm512_zextsi256_si512(GD_FN(gd_block_codes)(type, w + bb * b, dv, mv));
        const __m512 s0 = _mm512_zextps256_ps512(_mm256_set1_ps(dv[0]));
        min16[2 * b] = min16[2 * b + 1] = mv[0];
        GD_ROWS_LAST(c0, s0, q + 32 * b, d8 + 8 * b);
    }
    for (int h = nh; h % 16; h++)
        min16[h] = 0.0f;
    GD_FN(gd_tile_finish)(e, o, min16, s16, ss, nh, R, out);
}

static void GD_FN(gd_dot_direct)(int type, const uint8_t *w, int K, const struct gd_x *x, int R, float *out,
                                 float *min16) {
    switch (R) {
    case 1: GD_FN(gd_dot_direct_tile)(type, w, K, x, 1, out, min16); break;
    case 2: GD_FN(gd_dot_direct_tile)(type, w, K, x, 2, out, min16); break;
    case 3: GD_FN(gd_dot_direct_tile)(type, w, K, x, 3, out, min16); break;
    case 4: GD_FN(gd_dot_direct_tile)(type, w, K, x, 4, out, min16); break;
    case 5: GD_FN(gd_dot_direct_tile)(type, w, K, x, 5, out, min16); break;
    case 6: GD_FN(gd_dot_direct_tile)(type, w, K, x, 6, out, min16); break;
    case 7: GD_FN(gd_dot_direct_tile)(type, w, K, x, 7, out, min16); break;
    default: GD_FN(gd_dot_direct_tile)(type, w, K, x, 8, out, min16); break;
    }
}

static void GD_FN(gd_dot)(const struct gd_unpacked *u, int K, const struct gd_x *x, int R, float *out) {
    switch (R) {
    case 1: GD_FN(gd_dot_tile)(u, K, x, 1, out); break;
    case 2: GD_FN(gd_dot_tile)(u, K, x, 2, out); break;
    case 3: GD_FN(gd_dot_tile)(u, K, x, 3, out); break;
    case 4: GD_FN(gd_dot_tile)(u, K, x, 4, out); break;
    case 5: GD_FN(gd_dot_tile)(u, K, x, 5, out); break;
    case 6: GD_FN(gd_dot_tile)(u, K, x, 6, out); break;
    case 7: GD_FN(gd_dot_tile)(u, K, x, 7, out); break;
    default: GD_FN(gd_dot_tile)(u, K, x, 8, out); break;
    }
}
#undef GD_ROW_PAIR
#undef GD_ROWS_TWO_PAIRS
#undef GD_ROWS_PAIR
#undef GD_ROWS_LAST
#else /* the AVX2 path: signed codes, vpsignb fix-ups, the min per 32 */
/* gd_unpack_row's result (bit for bit), with vector code unpacking. */
static void GD_FN(gd_unpack)(int type, const uint8_t *w, int K, struct gd_unpacked *u) {
    const int per = gd_block_weights(type), nb = K / per, bb = gd_block_bytes(type);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    int8_t *c = u->c;
    float *sc8 = u->scale, *mn = u->min;
    u->has_min = type == GD_Q4_1 || type == GD_Q5_1 || type == GD_Q4_K || type == GD_Q5_K;
    for (int b = 0; b < nb; b++, w += bb) {
        switch (type) {
        case GD_Q8_0:
            GD_FN(gd_store)(c, GD_FN(gd_load)(w + 2));
            _mm256_storeu_ps(sc8, _mm256_set1_ps(GD_FN(gd_h)(w)));
            *mn++ = 0.0f;
            c += 32, sc8 += 8;
            break;
        case GD_Q4_0: case GD_Q4_1: case GD_Q5_0: case GD_Q5_1: {
            const int has_min = type == GD_Q4_1 || type == GD_Q5_1, five = type == GD_Q5_0 || type == GD_Q5_1;
            __m256i q = GD_FN(gd_nibbles)(w + 2 + 2 * has_min + 4 * five);
            if (five)
                q = _mm256_or_si256(q, GD_FN(gd_bit4)(w + 2 + 2 * has_min));
            if (!has_min)
                q = _mm256_sub_epi8(q, _mm256_set1_epi8(five ? 16 : 8));
            GD_FN(gd_store)(c, q);
            _mm256_storeu_ps(sc8, _mm256_set1_ps(GD_FN(gd_h)(w)));
            *mn++ = has_min ? GD_FN(gd_h)(w + 2) : 0.0f;
            c += 32, sc8 += 8;
            break;
        }
        case GD_Q4_K: case GD_Q5_K: {
            const float dw = GD_FN(gd_h)(w), dmin = GD_FN(gd_h)(w + 2);
            const int five = type == GD_Q5_K;
            const uint8_t *qs = w + 16 + 32 * five;
            const __m256i hb = five ? GD_FN(gd_load)(w + 16) : _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
            for (int p = 0; p < 4; p++) {
                const __m256i v = GD_FN(gd_load)(qs + 32 * p);
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (five) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p), one), 4));
                    hi = _mm256_or_si256(
                        hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p + 1), one), 4));
                }
                GD_FN(gd_store)(c + 64 * p, lo);
                GD_FN(gd_store)(c + 64 * p + 32, hi);
            }
            for (int j = 0; j < 8; j++) {
                int s, m;
                gd_scale_min_k4(j, w + 4, &s, &m);
                _mm256_storeu_ps(sc8 + 8 * j, _mm256_set1_ps(dw * (float)s));
                mn[j] = -(dmin * (float)m);
            }
            c += 256, sc8 += 64, mn += 8;
            break;
        }
        case GD_Q6_K: {
            const int8_t *s = (const int8_t *)(w + 192);
            const float dw = GD_FN(gd_h)(w + 208);
            const __m256i m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                const __m256i L0 = GD_FN(gd_load)(w + h * 64), L1 = GD_FN(gd_load)(w + h * 64 + 32);
                const __m256i H = GD_FN(gd_load)(w + 128 + h * 32);
                for (int v = 0; v < 4; v++) {
                    const __m256i L = (v & 1) ? L1 : L0;
                    const __m256i lo = (v >> 1) ? _mm256_and_si256(_mm256_srli_epi16(L, 4), m4) : _mm256_and_si256(L, m4);
                    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2 * v), m2), 4);
                    GD_FN(gd_store)(c + 32 * (4 * h + v), _mm256_sub_epi8(_mm256_or_si256(lo, hi), k32));
                }
            }
            for (int j = 0; j < 8; j++) {
                _mm256_storeu_ps(sc8 + 8 * j, _mm256_set_m128(_mm_set1_ps(dw * (float)s[2 * j + 1]),
                                                              _mm_set1_ps(dw * (float)s[2 * j])));
                mn[j] = 0.0f;
            }
            c += 256, sc8 += 64, mn += 8;
            break;
        }
        }
    }
    for (int b = K / GD_QK; b % 8; b++)
        *mn++ = 0.0f;
}

/* One x row's block: acc += dot(c, a) * (scale * d). */
#define GD_ROW_BLOCK(acc, a, d)                                                                                    \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(GD_FN(gd_dot_ss)(c_, GD_FN(gd_load)(a))),                            \
                          _mm256_mul_ps(sc_, _mm256_broadcast_ss(d)), acc)

/* The tile's rows (up to 4, R a compile-time count) for the block at c / scale, x rows at qa / qa + qs (and qb,
 * qb + qs: rows 2 and 3), their scales at da / da + ds (db, db + ds). */
#define GD_BLOCK(A0, A1, A2, A3)                                                                                   \
    do {                                                                                                          \
        const __m256i c_ = GD_FN(gd_load)(c);                                                                     \
        const __m256 sc_ = _mm256_loadu_ps(scale);                                                                \
        GD_ROW_BLOCK(A0, qa, da);                                                                                 \
        if (R > 1) GD_ROW_BLOCK(A1, qa + qs, da + ds);                                                            \
        if (R > 2) GD_ROW_BLOCK(A2, qb, db);                                                                      \
        if (R > 3) GD_ROW_BLOCK(A3, qb + qs, db + ds);                                                            \
        c += GD_QK, scale += 8, qa += GD_QK, qb += GD_QK, da++, db++;                                             \
    } while (0)

/* R x rows (a compile-time count) against one unpacked weight row: even and odd blocks in two accumulators
 * per row (two dependency chains), the mins 8 blocks per vector. Pointers walk the blocks (few registers). */
GD_INLINE void GD_FN(gd_dot_tile)(const struct gd_unpacked *u, int K, const struct gd_x *x, const int R,
                                  float *out) {
    const int nb = K / GD_QK;
    const int8_t *c = u->c, *qa = x->q[0], *qb = R > 2 ? x->q[2] : x->q[0];
    const float *scale = u->scale, *da = x->d[0], *db = R > 2 ? x->d[2] : x->d[0];
    const ptrdiff_t qs = R > 1 ? x->q[1] - x->q[0] : 0, ds = R > 1 ? x->d[1] - x->d[0] : 0;
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        GD_BLOCK(e0, e1, e2, e3);
        GD_BLOCK(o0, o1, o2, o3);
    }
    if (b < nb)
        GD_BLOCK(e0, e1, e2, e3);
    const __m256 sums[GD_MR] = {_mm256_add_ps(e0, o0), _mm256_add_ps(e1, o1), _mm256_add_ps(e2, o2),
                                _mm256_add_ps(e3, o3)};
    for (int r = 0; r < R; r++) {
        float total = GD_FN(gd_hsum)(sums[r]);
        if (u->has_min) {
            __m256 m = _mm256_setzero_ps();
            b = 0;
            for (; b + 8 <= nb; b += 8)
                m = _mm256_fmadd_ps(_mm256_loadu_ps(u->min + b), _mm256_loadu_ps(x->s[r] + b), m);
            if (b < nb) { /* the zero-padded mins; x's s past nb is never read */
                const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb - b), lanes);
                m = _mm256_fmadd_ps(_mm256_loadu_ps(u->min + b), _mm256_maskload_ps(x->s[r] + b, keep), m);
            }
            total += GD_FN(gd_hsum)(m);
        }
        out[r] = total;
    }
}

static void GD_FN(gd_dot)(const struct gd_unpacked *u, int K, const struct gd_x *x, int R, float *out) {
    switch (R) {
    case 1: GD_FN(gd_dot_tile)(u, K, x, 1, out); break;
    case 2: GD_FN(gd_dot_tile)(u, K, x, 2, out); break;
    case 3: GD_FN(gd_dot_tile)(u, K, x, 3, out); break;
    default: GD_FN(gd_dot_tile)(u, K, x, 4, out); break;
    }
}
#endif

/* An unpacked row (this path's gd_unpack) as its K weights, float32 (y32) or bfloat16 (y16, nearest-even): per 16
 * codes w = scale * code + min, the scale of the codes' half-block and (VNNI) the min of the 16 or (AVX2) of the
 * block of 32; one rounding each, as gd_dequantize_row's (the codes and scales hold its exact products). */
static void GD_FN(gd_values)(const struct gd_unpacked *u, int K, float *y32, uint16_t *y16) {
#if GD_VNNI
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int h = 0; h < K / 16; h++) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u->c + 16 * h)));
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(u->scale[(h / 2) * 8 + (h % 2) * 4]),
                                         _mm512_set1_ps(u->min16[h]));
        if (y32) {
            _mm512_storeu_ps(y32 + 16 * h, v);
        } else {
            const __m512i b = _mm512_castps_si512(v);
            const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(b, 16), one)));
            _mm256_storeu_si256((__m256i *)(y16 + 16 * h), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        }
    }
#else
    const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    for (int e = 0; e < K / 8; e++) {
        const int h = e / 2;
        const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(u->c + 8 * e)));
        const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(u->scale[(h / 2) * 8 + (h % 2) * 4]),
                                         _mm256_set1_ps(u->min[h / 2]));
        if (y32) {
            _mm256_storeu_ps(y32 + 8 * e, v);
        } else {
            const __m256i b = _mm256_castps_si256(v);
            const __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(b, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
            _mm_storeu_si128((__m128i *)(y16 + 8 * e),
                             _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
        }
    }
#endif
}

#if !GD_VNNI /* one 256-bit body serves both SIMD paths: compiled in the AVX2 pass only */
/* gd_quantize_row's rule in 256-bit vectors, the same bits: the product x * id rounded once (no FMA), converted
 * with the default rounding (nearest, ties to even, as nearbyintf). */
static void GD_FN(gd_quantize_row)(const float *x, int K, int8_t *q, float *d, float *s, float *s16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < K / GD_QK; b++) {
        __m256 v[4], m;
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_loadu_ps(x + b * GD_QK + 8 * i);
        m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float db = _mm_cvtss_f32(h) / 127.0f;
        const __m256 id = _mm256_set1_ps(db > 0.0f ? 1.0f / db : 0.0f);
        __m256i c[4];
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + b * GD_QK), _mm256_permutevar8x32_epi32(w, order));
        int sum[2];
        for (int half = 0; half < 2; half++) {
            const __m256i t = _mm256_add_epi32(c[2 * half], c[2 * half + 1]);
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
            sum[half] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 1)));
        }
        d[b] = db;
        s[b] = db * (float)(sum[0] + sum[1]);
        s16[2 * b] = db * (float)sum[0];
        s16[2 * b + 1] = db * (float)sum[1];
    }
}
#endif
#undef GD_BLOCK
#undef GD_ROW_BLOCK
#undef GD_INLINE
#endif
