/* GGUF weights repacked for an AVX512-VNNI GEMM: out[m, n] = bias[n] + sum_k x[m, k] * W[n, k], x quantized per
 * row to int8 blocks of 32 as native/gguf_dot.c's gguf_quantize_rows writes them (q, d, s = d * sum(q), s16 = d *
 * each 16's sum), W as unsigned codes with a float scale and min per group of k (w = scale * code + min: the form
 * gguf_unpack_rows gives every block type, and int4's groups and int8's channels take).
 *
 * Layout (gguf_repack): outputs in tiles of 16 (one int32 lane each), k in sub-blocks of `sub` (32; 16 where the
 * scale changes every 16 codes, Q6_K), scales in groups of `group` k (a multiple of sub dividing K: sub for GGUF
 * blocks, the group of int4, K for one scale per channel). Per tile, in k order:
 *   codes, per sub-block: sub / 4 groups of 64 bytes, group j holding k = 4j..4j+3 of the tile's 16 outputs (lane
 *          l = bytes 4l..4l+3), so that one 512-bit vpdpbusd dots 4 k of 16 outputs with one x row's 4 codes
 *          broadcast; with 4-bit codes (sub 32), 4 groups of 64 bytes: low nibbles = group i, high = group i + 4;
 *   scale, min, per group: 16 floats each (gguf_repack writes float32; gguf_repack_dot also reads IEEE halves,
 *          which hold the scales of Q8_0, Q4_0/1 and Q5_0/1 exactly: the file stores them so).
 * Padding outputs (N not a multiple of 16) have code 0, scale 0 and min 0.
 *
 * The product (ggml's "repacked" GEMM idea, written here): a register block of up to 4 x rows and 2 tiles (32
 * outputs) loads each 4-k group of codes once for its rows, and each broadcast of 4 x codes feeds both tiles; per
 * sub-block, x row and tile, sub / 4 vpdpbusd sum the integer dot of 16 outputs exactly, one convert, one multiply
 * by x's block scale and one FMA by the weights' scales add it to the float sums, one FMA adds the min against x's
 * sum (s or s16). Float32 would spend sub FMAs per row on the same products.
 * Numerics: each output sums its sub-blocks in k order into one accumulator and the min terms into another, added
 * at the end: an output depends only on its weight row and its x row, never on M, the other rows or the thread
 * count (batch-invariant).
 * The dot needs AVX512-VNNI (gguf_repack_available), compiled under its own target pragma and chosen at run time;
 * packing and unpacking are portable C.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "native_team.h"

#define GR_ABI_VERSION 4
#define GR_NR 16 /* outputs per tile */
#define GR_MR 4  /* x rows per register block */
#define GR_PAIR_ROWS 8 /* rows from which a register block takes two tiles */
#define GR_QK 32 /* x block */

int pagedllm_gguf_repack_abi_version(void) { return GR_ABI_VERSION; }

static int gr_valid(int bits, int sub, int group, int K) {
    return (sub == 32 || (sub == 16 && bits == 8)) && (bits == 4 || bits == 8) && K > 0 && K % GR_QK == 0 &&
           group > 0 && group % sub == 0 && K % group == 0;
}

/* Bytes of one tile's codes per sub-block. */
static ptrdiff_t gr_sub_bytes(int bits, int sub) { return bits == 4 ? GR_NR * sub / 2 : GR_NR * sub; }

static ptrdiff_t gr_tiles(int N) { return (N + GR_NR - 1) / GR_NR; }

/* gguf_repack_dot's arguments in order (its task form takes them as one struct). */
struct gr_dot_args {
    const uint8_t *codes;
    const void *scale, *min;
    int half, bits, sub, group, N, K;
    const int8_t *xq;
    const float *xd, *xs, *xs16;
    int M;
    const float *bias;
    float *out;
    ptrdiff_t out_stride;
    int num_threads;
};

/* Bytes of the repacked codes of an (N, K) weight; floats of its scales (and of its mins). */
ptrdiff_t gguf_repack_code_bytes(int bits, int sub, int N, int K) {
    return gr_valid(bits, sub, sub, K) ? gr_tiles(N) * (K / sub) * gr_sub_bytes(bits, sub) : -1;
}

ptrdiff_t gguf_repack_scale_count(int group, int N, int K) { return gr_tiles(N) * (K / group) * GR_NR; }

/* codes (N, K) uint8 (below 16 when bits is 4), scale_in and min_in (N, K / in_step) float32 (a scale and min per
 * in_step k: 16 from gguf_unpack_rows, the group itself from int4 / int8) to the layout above: each group takes
 * the scale and min of its first k (the caller checks that they agree across the group). Returns -1 for bits, sub,
 * group or K outside the layout, or an in_step that does not divide the group. */
int gguf_repack(const uint8_t *codes, const float *scale_in, const float *min_in, int in_step, int N, int K, int bits,
                int sub, int group, uint8_t *out_codes, float *out_scale, float *out_min, int num_threads) {
    if (!gr_valid(bits, sub, group, K) || in_step <= 0 || group % in_step)
        return -1;
    const int nsub = K / sub, ngroups = K / group;
    const ptrdiff_t gb = gr_sub_bytes(bits, sub);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (ptrdiff_t t = 0; t < gr_tiles(N); t++) {
        for (int g = 0; g < ngroups; g++) {
            float *sc = out_scale + (t * ngroups + g) * GR_NR, *mn = out_min + (t * ngroups + g) * GR_NR;
            for (int l = 0; l < GR_NR; l++) {
                const ptrdiff_t n = t * GR_NR + l, at = n * (K / in_step) + (ptrdiff_t)g * group / in_step;
                sc[l] = n < N ? scale_in[at] : 0.0f;
                mn[l] = n < N ? min_in[at] : 0.0f;
            }
        }
        for (int b = 0; b < nsub; b++) {
            uint8_t *c = out_codes + (t * nsub + b) * gb;
            memset(c, 0, (size_t)gb);
            for (int l = 0; l < GR_NR; l++) {
                const ptrdiff_t n = t * GR_NR + l;
                if (n >= N)
                    continue;
                const uint8_t *cn = codes + n * K + (ptrdiff_t)b * sub;
                for (int k = 0; k < sub; k++) {
                    const int j = k / 4, byte = 4 * l + k % 4;
                    if (bits == 8)
                        c[64 * j + byte] = cn[k];
                    else
                        c[64 * (j % 4) + byte] |= (uint8_t)((cn[k] & 0xF) << (4 * (j / 4)));
                }
            }
        }
    }
    return 0;
}

/* IEEE half to float, exact (scales and mins are finite). */
static inline float gr_half(uint16_t h) {
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const float v = e ? ldexpf((float)(m | 0x400), e - 25) : ldexpf((float)m, -24);
    return e == 0x1f ? (m ? NAN : INFINITY) * (h & 0x8000 ? -1.0f : 1.0f) : (h & 0x8000 ? -v : v);
}

static inline float gr_scale_at(const void *p, int half, ptrdiff_t i) {
    return half ? gr_half(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Rows rows[0..nrows) (all N rows in order when rows is NULL) of a repacked (N, K) weight as the values
 * scale * code + min: float32 (out rows out_stride apart), or bfloat16 bits (round to nearest even) with out_bf16;
 * scale and min float32, or IEEE halves with half. Returns -1 for bits, sub or K outside the layout, -2 for a row
 * outside [0, N). */
int gguf_repack_values(const uint8_t *codes, const void *scale, const void *min, int half, int N, int K, int bits,
                       int sub, int group, const int64_t *rows, int nrows, void *out, ptrdiff_t out_stride,
                       int out_bf16, int num_threads) {
    if (!gr_valid(bits, sub, group, K))
        return -1;
    if (rows)
        for (int i = 0; i < nrows; i++)
            if (rows[i] < 0 || rows[i] >= N)
                return -2;
    const int nsub = K / sub, per = group / sub, ngroups = K / group, count = rows ? nrows : N;
    const ptrdiff_t gb = gr_sub_bytes(bits, sub);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int i = 0; i < count; i++) {
        const ptrdiff_t n = rows ? rows[i] : i, t = n / GR_NR;
        const int l = (int)(n % GR_NR);
        for (int b = 0; b < nsub; b++) {
            const uint8_t *c = codes + (t * nsub + b) * gb;
            const ptrdiff_t at_scale = (t * ngroups + b / per) * GR_NR + l;
            const float s = gr_scale_at(scale, half, at_scale), m = gr_scale_at(min, half, at_scale);
            for (int k = 0; k < sub; k++) {
                const int j = k / 4, byte = 4 * l + k % 4;
                const int code = bits == 8 ? c[64 * j + byte] : (c[64 * (j % 4) + byte] >> (4 * (j / 4))) & 0xF;
                const float v = s * (float)code + m;
                const ptrdiff_t at = (ptrdiff_t)i * out_stride + (ptrdiff_t)b * sub + k;
                if (out_bf16) {
                    uint32_t u;
                    memcpy(&u, &v, 4);
                    ((uint16_t *)out)[at] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                } else {
                    ((float *)out)[at] = v;
                }
            }
        }
    }
    return 0;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GR_SIMD 1
#else
#define GR_SIMD 0
#endif

/* Whether this CPU runs gguf_repack_dot. */
int gguf_repack_available(void) {
#if GR_SIMD
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

#if GR_SIMD
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#define GR_INLINE static inline __attribute__((always_inline))

struct gr_x { /* the x rows of a register block */
    const int8_t *q[GR_MR];
    const float *d[GR_MR], *s[GR_MR];
};

GR_INLINE __m512 gr_load16(const int half, const void *p, ptrdiff_t i) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* One register block: T tiles (T * 16 outputs, tile_codes bytes and tile_scales scales apart) against R x rows,
 * res[r * GR_NR * T + 16 * t + l]. bits, sub, half, R and T are constants at each call site (the loops unroll, the
 * accumulators stay in registers: 3 R T of them, the integer dots and the two float sums). */
GR_INLINE void gr_block(const int bits, const int sub, const int half, const int R, const int T,
                        const uint8_t *codes, ptrdiff_t tile_codes, const void *scale, const void *min,
                        ptrdiff_t tile_scales, int nsub, int per, const struct gr_x *x, float *res) {
    const int quads = sub / 4;
    const ptrdiff_t gb = gr_sub_bytes(bits, sub);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[GR_MR][2], accm[GR_MR][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = accm[r][t] = _mm512_setzero_ps();
    for (int b = 0; b < nsub; b++) {
        __m512i dot[GR_MR][2];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                dot[r][t] = _mm512_setzero_si512();
        for (int j = 0; j < quads; j++) { /* k = b * sub + 4 j .. + 3 */
            __m512i w[2];
            for (int t = 0; t < T; t++) {
                const uint8_t *c = codes + t * tile_codes + b * gb;
                if (bits == 4) { /* group j % 4 holds quad j in its low (j < 4) or high nibbles */
                    const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * (j % 4)));
                    w[t] = _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), m4);
                } else {
                    w[t] = _mm512_loadu_si512((const void *)(c + 64 * j));
                }
            }
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, x->q[r] + b * sub + 4 * j, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                for (int t = 0; t < T; t++)
                    dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], w[t], xb);
            }
        }
        __m512 sc[2], mn[2];
        for (int t = 0; t < T; t++) {
            sc[t] = gr_load16(half, scale, t * tile_scales + GR_NR * (b / per));
            mn[t] = gr_load16(half, min, t * tile_scales + GR_NR * (b / per));
        }
        const int xb = b * sub / GR_QK; /* x's block */
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_set1_ps(x->d[r][xb]), s = _mm512_set1_ps(x->s[r][b]);
            for (int t = 0; t < T; t++) {
                const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][t]), d);
                acc[r][t] = _mm512_fmadd_ps(v, sc[t], acc[r][t]);
                accm[r][t] = _mm512_fmadd_ps(mn[t], s, accm[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            _mm512_storeu_ps(res + GR_NR * (T * r + t), _mm512_add_ps(acc[r][t], accm[r][t]));
}

#define GR_BLOCK(bits, sub, half, R)                                                                                \
    if (T == 2)                                                                                                     \
        gr_block(bits, sub, half, R, 2, codes, tile_codes, scale, min, tile_scales, nsub, per, x, res);            \
    else                                                                                                            \
        gr_block(bits, sub, half, R, 1, codes, tile_codes, scale, min, tile_scales, nsub, per, x, res);

#define GR_ROWS(bits, sub, half)                                                                                    \
    switch (R) {                                                                                                    \
    case 1: GR_BLOCK(bits, sub, half, 1) break;                                                                     \
    case 2: GR_BLOCK(bits, sub, half, 2) break;                                                                     \
    case 3: GR_BLOCK(bits, sub, half, 3) break;                                                                     \
    default: GR_BLOCK(bits, sub, half, GR_MR) break;                                                                \
    }

static void gr_block_rows(int bits, int sub, int half, int R, int T, const uint8_t *codes, ptrdiff_t tile_codes,
                          const void *scale, const void *min, ptrdiff_t tile_scales, int nsub, int per,
                          const struct gr_x *x, float *res) {
    if (half && bits == 4)
        GR_ROWS(4, 32, 1)
    else if (half)
        GR_ROWS(8, 32, 1)
    else if (bits == 4)
        GR_ROWS(4, 32, 0)
    else if (sub == 32)
        GR_ROWS(8, 32, 0)
    else
        GR_ROWS(8, 16, 0)
}
#undef GR_ROWS
#undef GR_BLOCK

struct gr_product { /* one product's arguments */
    const uint8_t *codes;
    const void *scale, *min;
    int half, bits, sub, N, K, M, nsub, per;
    ptrdiff_t tile_codes, tile_scales, out_stride;
    const int8_t *xq;
    const float *xd, *xsum, *bias;
    float *out;
};

/* Tiles t0 .. t0 + T - 1 against every x row, written to out (plus bias). */
static void gr_tiles_rows(const struct gr_product *p, ptrdiff_t t0, int T) {
    const int width = p->N - t0 * GR_NR < T * GR_NR ? (int)(p->N - t0 * GR_NR) : T * GR_NR;
    for (int m0 = 0; m0 < p->M; m0 += GR_MR) {
        const int R = p->M - m0 < GR_MR ? p->M - m0 : GR_MR;
        struct gr_x x;
        for (int r = 0; r < R; r++) {
            x.q[r] = p->xq + (ptrdiff_t)(m0 + r) * p->K;
            x.d[r] = p->xd + (ptrdiff_t)(m0 + r) * (p->K / GR_QK);
            x.s[r] = p->xsum + (ptrdiff_t)(m0 + r) * p->nsub;
        }
        float res[GR_MR * 2 * GR_NR];
        const ptrdiff_t at = (p->half ? 2 : 4) * t0 * p->tile_scales; /* bytes */
        gr_block_rows(p->bits, p->sub, p->half, R, T, p->codes + t0 * p->tile_codes, p->tile_codes,
                      (const char *)p->scale + at, (const char *)p->min + at, p->tile_scales, p->nsub, p->per, &x,
                      res);
        for (int r = 0; r < R; r++) {
            float *o = p->out + (ptrdiff_t)(m0 + r) * p->out_stride + t0 * GR_NR;
            const float *v = res + GR_NR * T * r;
            for (int l = 0; l < width; l++)
                o[l] = p->bias ? v[l] + p->bias[t0 * GR_NR + l] : v[l];
        }
    }
}

/* Pairs of tiles [pair_begin, pair_end) against every x row. Two tiles per register block where the product is
 * compute-bound (GR_PAIR_ROWS rows and up); below, a read of the weights, one tile at a time streams them faster. */
static void gr_pairs(const struct gr_product *p, ptrdiff_t pair_begin, ptrdiff_t pair_end) {
    const ptrdiff_t tiles = gr_tiles(p->N);
    const int T = p->M >= GR_PAIR_ROWS ? 2 : 1;
    for (ptrdiff_t pair = pair_begin; pair < pair_end; pair++) {
        const ptrdiff_t t0 = 2 * pair;
        if (tiles - t0 < 2 || T == 1)
            for (ptrdiff_t t = t0; t < t0 + 2 && t < tiles; t++)
                gr_tiles_rows(p, t, 1);
        else
            gr_tiles_rows(p, t0, 2);
    }
}

static struct gr_product gr_product_of(const struct gr_dot_args *a) {
    const struct gr_product p = {a->codes, a->scale, a->min, a->half, a->bits, a->sub, a->N, a->K, a->M,
                                 a->K / a->sub, a->group / a->sub, (a->K / a->sub) * gr_sub_bytes(a->bits, a->sub),
                                 (a->K / a->group) * GR_NR, a->out_stride, a->xq, a->xd,
                                 a->sub == 32 ? a->xs : a->xs16, a->bias, a->out};
    return p;
}

/* out[m, n] = bias[n] + sum_k x[m, k] W[n, k] for m < M, n < N; W repacked (gguf_repack; scale and min float32,
 * or IEEE halves with half), x as gguf_quantize_rows wrote it (q (M, K), d and s (M, K / 32), s16 (M, K / 16)), out
 * rows out_stride floats apart. Threads take pairs of tiles. Returns -1 for bits, sub, group or K outside the
 * layout (halves: sub 32 only) or a CPU without AVX512-VNNI. */
int gguf_repack_dot(const uint8_t *codes, const void *scale, const void *min, int half, int bits, int sub, int group,
                    int N, int K,
                    const int8_t *xq, const float *xd, const float *xs, const float *xs16, int M, const float *bias,
                    float *out, ptrdiff_t out_stride, int num_threads) {
    if (!gr_valid(bits, sub, group, K) || (half && sub != 32) || !gguf_repack_available())
        return -1;
    const struct gr_dot_args a = {codes, scale, min, half, bits, sub, group, N, K, xq, xd, xs, xs16, M, bias, out,
                                  out_stride, num_threads};
    const struct gr_product p = gr_product_of(&a);
    const ptrdiff_t pairs = (gr_tiles(N) + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (ptrdiff_t pair = 0; pair < pairs; pair++)
        gr_pairs(&p, pair, pair + 1);
    return 0;
}

/* gguf_repack_dot's task form (native_team.h): thread ith's share of the pairs of tiles. */
int gguf_repack_dot_task(const void *args, int ith, int nth) {
    const struct gr_dot_args *a = args;
    if (!gr_valid(a->bits, a->sub, a->group, a->K) || (a->half && a->sub != 32) || !gguf_repack_available())
        return -1;
    const struct gr_product p = gr_product_of(a);
    long long b, e;
    team_share((gr_tiles(a->N) + 1) / 2, ith, nth, &b, &e);
    gr_pairs(&p, b, e);
    return 0;
}
#pragma GCC pop_options
#else
int gguf_repack_dot(const uint8_t *codes, const void *scale, const void *min, int half, int bits, int sub, int group,
                    int N, int K,
                    const int8_t *xq, const float *xd, const float *xs, const float *xs16, int M, const float *bias,
                    float *out, ptrdiff_t out_stride, int num_threads) {
    return -1;
}
int gguf_repack_dot_task(const void *args, int ith, int nth) { return -1; }
#endif
