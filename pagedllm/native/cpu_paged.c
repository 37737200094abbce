/* Fused paged-attention decode and prefill kernels for CPUs (plain C11), reading K/V in place
 * through the block table. Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao 2022).
 *
 * Layout (pagedllm.attention.backend):
 *   q, out:       [num_reqs, num_heads, head_dim] float32 or bfloat16 (io_bf16), contiguous, not aliased;
 *                 bfloat16 output rounded to nearest even as torch does
 *   k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim], addressed as
 *                 block * kv_block_stride + offset * kv_token_stride + kv_head * head_dim
 *   k/v scales:   int8 only: [num_blocks, block_size, num_kv_heads] float32 (stored = round(x / scale))
 *   block_tables: [*, block_table_stride] int32; seq_lens: [*] int32 (sliding window W > 0: last W tokens)
 * Soft cap c > 0 (Gemma 2): s -> c * tanh(s / c). Query head h reads KV head h / (num_heads / num_kv_heads).
 * KV formats (pagedllm.quantization.kv_cache): float32, bfloat16 (uint16 bits), fp8 e4m3fn/e5m2 (x = code *
 * per-tensor scale), int8 (per token-and-head scale); scales fold into scores, p and the output.
 * head_dim is a multiple of 16. IEEE float32 (no -ffast-math); each request is computed by one thread
 * in a fixed order, so results do not depend on the thread count. The caller validates all arguments.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_simd.h"

#define TILE 32         /* tokens per online-softmax tile (K and V of a tile stay in L1/L2) */
#define MAX_HEADS 256   /* decode's scores are [MAX_HEADS][TILE] floats on the stack */
#define MAX_CHUNKS 16   /* head_dim <= 16 * MAX_CHUNKS */
/* 2 = prefetcht1 (L2): into L1 would evict the tile being computed. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
#ifndef PREFETCH_STRIDE
#define PREFETCH_STRIDE 64
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "native_team.h"

int pagedllm_cpu_paged_abi_version(void) { return 7; }

/* 1 when built with OpenMP, else 0 (the caller splits the work). */
int pagedllm_cpu_paged_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The team size a `num_threads(n)` region gets (1 without OpenMP). */
int pagedllm_cpu_paged_team_size(int n) {
    int size = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    {
#pragma omp single
        size = omp_get_num_threads();
    }
#endif
    (void)n;
    return size;
}
int pagedllm_cpu_paged_max_heads(void) { return MAX_HEADS; }
int pagedllm_cpu_paged_max_head_dim(void) { return 16 * MAX_CHUNKS; }

static inline void prefetch_row(const char *p, long long num_bytes) {
    for (long long b = 0; b < num_bytes; b += PREFETCH_STRIDE) __builtin_prefetch(p + b, 0, PREFETCH_LOCALITY);
}

/* A plain loop: GCC vectorizes it, while it scalarizes __builtin_convertvector from 8-bit lanes. */
static inline v16f load_i8(const int8_t *p) {
    int32_t t[16];
    for (int j = 0; j < 16; j++) t[j] = p[j];
    v16i32 x;
    memcpy(&x, t, sizeof x);
    return __builtin_convertvector(x, v16f);
}

static inline v16u32 load_u8(const uint8_t *p) {
    uint32_t t[16];
    for (int j = 0; j < 16; j++) t[j] = p[j];
    v16u32 x;
    memcpy(&x, t, sizeof x);
    return x;
}

/* 16 float8 codes (e4m3fn: MANT 3, BIAS 7; e5m2: 2, 15) to float32: normal codes by shifting the fields
 * and rebiasing the exponent, subnormals as mantissa * 2^(1 - BIAS - MANT) (exact). */
static inline v16f load_fp8(const uint8_t *p, const int mant, const int bias) {
    const v16u32 code = load_u8(p);
    const v16u32 mag = code & 0x7f;
    const v16u32 normal = (mag << (23 - mant)) + ((uint32_t)(127 - bias) << 23);
    const v16f sub = __builtin_convertvector(mag, v16f) * (1.0f / (float)(1u << (bias - 1 + mant)));
    v16u32 sub_bits;
    memcpy(&sub_bits, &sub, sizeof sub_bits);
    const v16u32 is_sub = (v16u32)(mag < (1u << mant)); /* all-ones lanes where the exponent field is 0 */
    const v16u32 bits = ((sub_bits & is_sub) | (normal & ~is_sub)) | ((code & 0x80) << 24);
    v16f x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3, KV_INT8 = 4 };

/* Elements [off, off + 16) of a cache in format fmt as float32 codes, still to be scaled (fp8, int8). */
static inline __attribute__((always_inline)) v16f load_kv(const void *cache, long long off, const int fmt) {
    switch (fmt) {
    case KV_BF16: return load_bf16((const uint16_t *)cache + off);
    case KV_FP8_E4M3: return load_fp8((const uint8_t *)cache + off, 3, 7);
    case KV_FP8_E5M2: return load_fp8((const uint8_t *)cache + off, 2, 15);
    case KV_INT8: return load_i8((const int8_t *)cache + off);
    default: return load_f32((const float *)cache + off);
    }
}

/* exp(x) for x <= 0, x clamped at -87.3 (result stays normal). */
static inline v16f exp_nonpos_v16(v16f x) {
    const v16f lim = (v16f){0} - 87.3f;
    const v16i32 low = x < lim;
    x = (v16f)(((v16i32)x & ~low) | ((v16i32)lim & low));
    v16f n;
    const v16f y = exp_reduced_v16(x, &n);
    const v16i32 bits = (__builtin_convertvector(n, v16i32) + 127) << 23;
    return y * (v16f)bits;
}

/* hsum of each of 16 vectors as the lanes of one: the same additions, so each lane equals hsum bitwise. */
static inline v16f hsum16(const v16f *x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 (GCC lowers 16-lane shuffles through the stack): the same additions on 8-lane halves. */
    __m256 s8[16];
    for (int j = 0; j < 16; j++) {
        __m256 lo, hi;
        memcpy(&lo, &x[j], sizeof lo);
        memcpy(&hi, (const char *)&x[j] + sizeof lo, sizeof hi);
        s8[j] = _mm256_add_ps(lo, hi);
    }
    v16f r;
    for (int half = 0; half < 2; half++) {
        const __m256 *v = s8 + 8 * half;
        __m256 t[4]; /* t[m] = [s4 of v[m] | s4 of v[m + 4]] */
        for (int m = 0; m < 4; m++)
            t[m] = _mm256_add_ps(_mm256_permute2f128_ps(v[m], v[m + 4], 0x20), _mm256_permute2f128_ps(v[m], v[m + 4], 0x31));
        /* w0 = [v0: s4[0] + s4[2], s4[1] + s4[3], v1: same | v4, v5], w1 likewise for v2, v3 | v6, v7 */
        const __m256 w0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xee));
        const __m256 w1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xee));
        const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(w0, w1, 0x88), _mm256_shuffle_ps(w0, w1, 0xdd));
        memcpy((char *)&r + half * sizeof z, &z, sizeof z);
    }
    return r;
#elif defined(__clang__) || __GNUC__ >= 12
    v16f y[8], z[4], w[2];
    for (int m = 0; m < 8; m++)
        y[m] = __builtin_shufflevector(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(x[2 * m], x[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                         30, 31);
    for (int m = 0; m < 4; m++)
        z[m] = __builtin_shufflevector(y[2 * m], y[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(y[2 * m], y[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                         30, 31);
    for (int m = 0; m < 2; m++)
        w[m] = __builtin_shufflevector(z[2 * m], z[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(z[2 * m], z[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                                         30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    v16f r;
    for (int j = 0; j < 16; j++) r[j] = hsum(x[j]);
    return r;
#endif
}

/* The P V loop's register block: QB query heads x CB chunks of head_dim (AVX-512: 24 of 32 registers). */
#if defined(__AVX512F__)
#define QB_PV(NUM_CHUNKS, GROUP) ((NUM_CHUNKS) >= 24 ? 1 : 24 / (NUM_CHUNKS))
#define CB_PV(NUM_CHUNKS, QB) (NUM_CHUNKS)
#else
#define PV_REGS 6
#define QB_PV(NUM_CHUNKS, GROUP) ((GROUP) < PV_REGS ? (GROUP) : PV_REGS)
#define CB_PV(NUM_CHUNKS, QB) ((NUM_CHUNKS) * (QB) <= PV_REGS ? (NUM_CHUNKS) : (PV_REGS / (QB) > 0 ? PV_REGS / (QB) : 1))
#endif
#define QB_MAX 24
#define DOTS_FLOATS(NUM_HEADS) ((size_t)(NUM_HEADS) * 256)

/* One request: out[h, :] = softmax(scale * q[h] . K^T) V over its first seq_len tokens. k_scales/v_scales:
 * int8's per token-and-head scales (NULL otherwise); k_scale/v_scale: per-tensor. Every sum is taken in the
 * order of a plain per-head loop with hsum. */
static inline __attribute__((always_inline)) void decode_one(
    const float *restrict q, const void *k_cache, const void *v_cache, const float *k_scales,
    const float *v_scales, const int32_t *restrict block_table, int seq_len, float *restrict out,
    v16f *restrict dots, int num_heads, int num_kv_heads, int head_dim, int block_size, long long kv_block_stride,
    long long kv_token_stride, float scale, float k_scale, float v_scale, int window, float soft_cap,
    const int32_t *next_table, int next_first, int next_len, const int fmt) {
    const int group = num_heads / num_kv_heads;
    const int num_chunks = head_dim / 16; /* a constant in the specialised copies (64, 128) */
    const int qb_pv = QB_PV(num_chunks, group), cb_pv = CB_PV(num_chunks, qb_pv);
/* scores[h][i]: head h, token t0 + i of the tile. */
    float scores[MAX_HEADS][TILE] __attribute__((aligned(64)));
    float row_max[MAX_HEADS], row_sum[MAX_HEADS];
    long long offsets[TILE];
    const long long elem_size = fmt == KV_F32 ? 4 : fmt == KV_BF16 ? 2 : 1;
    scale *= k_scale;
    const long long row_bytes = (long long)num_kv_heads * head_dim * elem_size;
    for (int h = 0; h < num_heads; h++) {
        row_max[h] = -INFINITY;
        row_sum[h] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)num_heads * head_dim);
    const v16i32 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

    const int first = window > 0 && seq_len > window ? seq_len - window : 0;
    for (int t0 = first; t0 < seq_len; t0 += TILE) {
        const int n = seq_len - t0 < TILE ? seq_len - t0 : TILE;
        for (int i = 0; i < n; i++) {
            const int t = t0 + i;
            offsets[i] = (long long)block_table[t / block_size] * kv_block_stride
                         + (long long)(t % block_size) * kv_token_stride;
        }
        for (int j0 = 0; j0 < n; j0 += 16) {
            const int nj = n - j0 < 16 ? n - j0 : 16;
            for (int j = 0; j < 16; j++) {
                if (j >= nj) { /* lanes past the tile: computed from zeros, never read */
                    for (int h = 0; h < num_heads; h++) dots[h * 16 + j] = (v16f){0};
                    continue;
                }
                const int i = j0 + j;
                prefetch_row((const char *)v_cache + offsets[i] * elem_size, row_bytes);
                const int t_next = t0 + TILE + i;
                if (t_next < seq_len)
                    prefetch_row((const char *)k_cache + ((long long)block_table[t_next / block_size] * kv_block_stride
                                                          + (long long)(t_next % block_size) * kv_token_stride)
                                                             * elem_size,
                                 row_bytes);
                else if (i < next_len) /* the last tile: the next request's first K rows instead */
                    prefetch_row((const char *)k_cache + ((long long)next_table[(next_first + i) / block_size] * kv_block_stride
                                                          + (long long)((next_first + i) % block_size) * kv_token_stride)
                                                             * elem_size,
                                 row_bytes);
                for (int kvh = 0; kvh < num_kv_heads; kvh++) {
                    const long long off = offsets[i] + (long long)kvh * head_dim;
                    v16f k[MAX_CHUNKS];
                    for (int c = 0; c < num_chunks; c++) k[c] = load_kv(k_cache, off + 16 * c, fmt);
                    for (int h = kvh * group; h < (kvh + 1) * group; h++) {
                        const float *qh = q + (size_t)h * head_dim;
                        v16f acc = load_f32(qh) * k[0];
                        for (int c = 1; c < num_chunks; c++) acc += load_f32(qh + 16 * c) * k[c];
                        dots[h * 16 + j] = acc;
                    }
                }
            }
            for (int kvh = 0; kvh < num_kv_heads; kvh++) {
                v16f token_scale = splat16(scale);
                if (fmt == KV_INT8)
                    for (int j = 0; j < nj; j++)
                        token_scale[j] = scale * k_scales[(offsets[j0 + j] + (long long)kvh * head_dim) / head_dim];
                for (int h = kvh * group; h < (kvh + 1) * group; h++) {
                    v16f s = token_scale * hsum16(dots + h * 16);
                    if (soft_cap > 0.0f)
                        for (int j = 0; j < nj; j++) s[j] = soft_cap * tanhf(s[j] / soft_cap);
                    store_f32(&scores[h][j0], s);
                }
            }
        }
/* Online softmax: alpha = exp(m_old - m), p = exp(s - m). */
        float alpha[MAX_HEADS];
        const v16f neg_inf = (v16f){0} - INFINITY;
        for (int h = 0; h < num_heads; h++) {
            const float m_old = row_max[h];
            v16f mx = splat16(m_old);
            for (int j0 = 0; j0 < n; j0 += 16) {
                const v16f x = select_f(lane < n - j0, load_f32(&scores[h][j0]), neg_inf);
                mx = select_f(x > mx, x, mx);
            }
            float m = mx[0];
            for (int j = 1; j < 16; j++) m = mx[j] > m ? mx[j] : m;
            alpha[h] = m_old == -INFINITY ? 0.0f : exp_nonpos_v16(splat16(m_old - m))[0];
            row_max[h] = m;
            for (int j0 = 0; j0 < n; j0 += 16) store_f32(&scores[h][j0], exp_nonpos_v16(load_f32(&scores[h][j0]) - splat16(m)));
            float sum = 0.0f;
            for (int i = 0; i < n; i++) sum += scores[h][i];
            row_sum[h] = row_sum[h] * alpha[h] + sum;
        }
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            const long long head_off = (long long)kvh * head_dim;
            for (int g0 = 0; g0 < group; g0 += qb_pv) {
                const int nb = group - g0 < qb_pv ? group - g0 : qb_pv, h0 = kvh * group + g0;
                for (int c0 = 0; c0 < num_chunks; c0 += cb_pv) {
                    const int nc = num_chunks - c0 < cb_pv ? num_chunks - c0 : cb_pv;
                    v16f acc[QB_MAX][MAX_CHUNKS];
                    for (int b = 0; b < nb; b++)
                        for (int c = 0; c < nc; c++)
                            acc[b][c] = load_f32(out + (size_t)(h0 + b) * head_dim + 16 * (c0 + c)) * splat16(alpha[h0 + b]);
                    for (int i = 0; i < n; i++) {
                        const long long off = offsets[i] + head_off + 16 * c0;
                        v16f v[MAX_CHUNKS];
                        for (int c = 0; c < nc; c++) v[c] = load_kv(v_cache, off + 16 * c, fmt);
                        const float vs = fmt == KV_INT8 ? v_scales[(offsets[i] + head_off) / head_dim] : 1.0f;
                        for (int b = 0; b < nb; b++) {
                            const float p = fmt == KV_INT8 ? scores[h0 + b][i] * vs : scores[h0 + b][i];
                            const v16f pv = splat16(p);
                            for (int c = 0; c < nc; c++) acc[b][c] += pv * v[c];
                        }
                    }
                    for (int b = 0; b < nb; b++)
                        for (int c = 0; c < nc; c++)
                            store_f32(out + (size_t)(h0 + b) * head_dim + 16 * (c0 + c), acc[b][c]);
                }
            }
        }
    }
    for (int h = 0; h < num_heads; h++) {
        const float inv = v_scale / row_sum[h];
        float *acc = out + (size_t)h * head_dim;
        for (int d = 0; d < head_dim; d++) acc[d] *= inv;
    }
}

struct decode_args {
    const void *q, *k_cache, *v_cache;
    const float *k_scales, *v_scales;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int num_heads, num_kv_heads, head_dim, block_size, window, io_bf16, req_end;
    long long block_table_stride, kv_block_stride, kv_token_stride;
    float scale, k_scale, v_scale, soft_cap;
};

/* Request r with its thread's scratch (DOTS_FLOATS(num_heads) floats, plus 2 rows of num_heads * head_dim
 * with io_bf16). */
static inline __attribute__((always_inline)) void decode_request(const struct decode_args *a, int r, float *scratch,
                                                                 const int fmt) {
    const size_t row_elems = (size_t)a->num_heads * a->head_dim, row = (size_t)r * row_elems;
    const float *q = (const float *)a->q + row;
    float *acc = (float *)a->out + row;
    if (a->io_bf16) {
        float *qf = scratch + DOTS_FLOATS(a->num_heads);
        acc = qf + row_elems;
        for (size_t e = 0; e < row_elems; e += 16) store_f32(qf + e, load_bf16((const uint16_t *)a->q + row + e));
        q = qf;
    }
    const int32_t *table = a->block_tables + (long long)r * a->block_table_stride;
    const int32_t *next_table = table + a->block_table_stride;
    int next_first = 0, next_len = 0;
    if (r + 1 < a->req_end) {
        const int len = a->seq_lens[r + 1];
        next_first = a->window > 0 && len > a->window ? len - a->window : 0;
        next_len = len - next_first < TILE ? len - next_first : TILE;
    }
#define DECODE_ONE(HEAD_DIM)                                                                                \
    decode_one(q, a->k_cache, a->v_cache, a->k_scales, a->v_scales, table, a->seq_lens[r], acc, (v16f *)scratch, \
               a->num_heads, a->num_kv_heads, (HEAD_DIM), a->block_size, a->kv_block_stride, a->kv_token_stride, \
               a->scale, a->k_scale, a->v_scale, a->window, a->soft_cap, next_table, next_first, next_len, fmt)
    if (a->head_dim == 64)
        DECODE_ONE(64);
    else if (a->head_dim == 128)
        DECODE_ONE(128);
    else
        DECODE_ONE(a->head_dim);
#undef DECODE_ONE
    if (a->io_bf16)
        for (size_t e = 0; e < row_elems; e += 16) store_bf16((uint16_t *)a->out + row + e, load_f32(acc + e));
}

/* One non-inlined function per KV format: GCC outlines an OpenMP region before it inlines. */
typedef void (*decode_request_fn)(const struct decode_args *, int, float *);
static void decode_request_f32(const struct decode_args *a, int r, float *s) { decode_request(a, r, s, KV_F32); }
static void decode_request_bf16(const struct decode_args *a, int r, float *s) { decode_request(a, r, s, KV_BF16); }
static void decode_request_e4m3(const struct decode_args *a, int r, float *s) { decode_request(a, r, s, KV_FP8_E4M3); }
static void decode_request_e5m2(const struct decode_args *a, int r, float *s) { decode_request(a, r, s, KV_FP8_E5M2); }
static void decode_request_int8(const struct decode_args *a, int r, float *s) { decode_request(a, r, s, KV_INT8); }

/* Requests [req_begin, req_end) on the calling thread alone (no OpenMP construct). Returns 0, or -1 when the
 * scratch allocation failed. */
static int decode_share(const struct decode_args *a, int req_begin, int req_end, decode_request_fn fn) {
    if (req_begin >= req_end) return 0;
    const size_t floats = DOTS_FLOATS(a->num_heads) + (a->io_bf16 ? 2 * (size_t)a->num_heads * a->head_dim : 0);
    float *scratch = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    if (scratch == NULL) return -1;
    for (int r = req_begin; r < req_end; r++) fn(a, r, scratch);
    free(scratch);
    return 0;
}

/* Requests [req_begin, req_end) over an OpenMP team. Returns 0, or -1 when a scratch allocation failed. */
static int decode_requests(const struct decode_args *a, int req_begin, int req_end, int num_threads,
                           decode_request_fn fn) {
    const size_t floats = DOTS_FLOATS(a->num_heads) + (a->io_bf16 ? 2 * (size_t)a->num_heads * a->head_dim : 0);
    int failed = 0;
    if (req_begin >= req_end) return 0;
    (void)num_threads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
        float *scratch = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int r = req_begin; r < req_end; r++)
            if (scratch != NULL) fn(a, r, scratch);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* The K/V cache write of a step: token t's row key[t * key_stride ..] (row_elems values, float32 or
 * bfloat16 with in_bf16) goes to k_cache at element slots[t] * row_elems in format fmt (KV_F32 or KV_BF16,
 * rounded to nearest even); likewise value. The caller checked every slot. */
static void write_kv(const void *key, const void *value, long long key_stride, long long value_stride, int in_bf16,
                     void *k_cache, void *v_cache, int fmt, const int64_t *slots, int num_tokens, long long row_elems) {
    for (int i = 0; i < 2; i++) {
        const void *src = i == 0 ? key : value;
        const long long stride = i == 0 ? key_stride : value_stride;
        void *cache = i == 0 ? k_cache : v_cache;
        for (int t = 0; t < num_tokens; t++) {
            const long long dst = slots[t] * row_elems, off = (long long)t * stride;
            if (fmt == KV_BF16 && in_bf16)
                memcpy((uint16_t *)cache + dst, (const uint16_t *)src + off, sizeof(uint16_t) * (size_t)row_elems);
            else if (fmt == KV_BF16)
                for (long long e = 0; e < row_elems; e++)
                    ((uint16_t *)cache)[dst + e] = f32_to_bf16(((const float *)src)[off + e]);
            else if (in_bf16)
                for (long long e = 0; e < row_elems; e++)
                    ((float *)cache)[dst + e] = bf16_to_f32(((const uint16_t *)src)[off + e]);
            else
                memcpy((float *)cache + dst, (const float *)src + off, sizeof(float) * (size_t)row_elems);
        }
    }
}

#define PAGED_DECODE_ARGS                                                                                   \
    const void *q, void *k_cache, void *v_cache, const float *k_scales, const float *v_scales,               \
        const int32_t *block_tables, const int32_t *seq_lens, void *out, int req_begin, int req_end,          \
        int num_heads, int num_kv_heads, int head_dim, int block_size, long long block_table_stride,          \
        long long kv_block_stride, long long kv_token_stride, float scale, float k_scale, float v_scale,      \
        int window, float soft_cap, int io_bf16, int num_threads, const void *key, const void *value,         \
        long long key_stride, long long value_stride, const int64_t *slots, int num_tokens

#define PAGED_DECODE_BODY(FN, FMT)                                                                          \
    if (key != NULL)                                                                                        \
        write_kv(key, value, key_stride, value_stride, io_bf16, k_cache, v_cache, FMT, slots, num_tokens,   \
                 (long long)num_kv_heads * head_dim);                                                       \
    const struct decode_args a = {q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, out,     \
                                  num_heads, num_kv_heads, head_dim, block_size, window, io_bf16, req_end,  \
                                  block_table_stride, kv_block_stride, kv_token_stride, scale, k_scale,     \
                                  v_scale, soft_cap};                                                       \
    return decode_requests(&a, req_begin, req_end, num_threads, FN);

/* Decode attention of requests [req_begin, req_end), one function per KV format. k_scale/v_scale: 1 when
 * unscaled. With key != NULL (float32/bfloat16 caches) the step's K/V rows are written first. */
int paged_decode_f32(PAGED_DECODE_ARGS) { PAGED_DECODE_BODY(decode_request_f32, KV_F32) }
int paged_decode_bf16(PAGED_DECODE_ARGS) { PAGED_DECODE_BODY(decode_request_bf16, KV_BF16) }
int paged_decode_fp8_e4m3(PAGED_DECODE_ARGS) { PAGED_DECODE_BODY(decode_request_e4m3, KV_FP8_E4M3) }
int paged_decode_fp8_e5m2(PAGED_DECODE_ARGS) { PAGED_DECODE_BODY(decode_request_e5m2, KV_FP8_E5M2) }
int paged_decode_int8(PAGED_DECODE_ARGS) { PAGED_DECODE_BODY(decode_request_int8, KV_INT8) }

/* The arguments of one paged_decode_<format> call, field for field in the order of PAGED_DECODE_ARGS
 * (filled once per step, pagedllm/attention/decode_plan.py). */
struct paged_decode_call {
    const void *q;
    void *k_cache, *v_cache;
    const float *k_scales, *v_scales;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int req_begin, req_end, num_heads, num_kv_heads, head_dim, block_size;
    long long block_table_stride, kv_block_stride, kv_token_stride;
    float scale, k_scale, v_scale;
    int window;
    float soft_cap;
    int io_bf16, num_threads;
    const void *key, *value;
    long long key_stride, value_stride;
    const int64_t *slots;
    int num_tokens;
};

#define PAGED_DECODE_CALL(NAME)                                                                             \
    int NAME##_call(const struct paged_decode_call *c) {                                                   \
        return NAME(c->q, c->k_cache, c->v_cache, c->k_scales, c->v_scales, c->block_tables, c->seq_lens,   \
                    c->out, c->req_begin, c->req_end, c->num_heads, c->num_kv_heads, c->head_dim,           \
                    c->block_size, c->block_table_stride, c->kv_block_stride, c->kv_token_stride, c->scale, \
                    c->k_scale, c->v_scale, c->window, c->soft_cap, c->io_bf16, c->num_threads, c->key,     \
                    c->value, c->key_stride, c->value_stride, c->slots, c->num_tokens);                     \
    }
PAGED_DECODE_CALL(paged_decode_f32)
PAGED_DECODE_CALL(paged_decode_bf16)
PAGED_DECODE_CALL(paged_decode_fp8_e4m3)
PAGED_DECODE_CALL(paged_decode_fp8_e5m2)
PAGED_DECODE_CALL(paged_decode_int8)
#undef PAGED_DECODE_CALL

/* The task forms (native_team.h) of a paged_decode_<format>_call: `_write_task` writes the step's K/V rows
 * (thread 0), `_task` decodes thread ith's share of the requests; a graph replay runs the write, then the decode. */
#define PAGED_DECODE_TASKS(NAME, FN, FMT)                                                                   \
    int NAME##_write_task(const void *args, int ith, int nth) {                                            \
        const struct paged_decode_call *c = args;                                                          \
        (void)nth;                                                                                          \
        if (ith == 0 && c->key != NULL)                                                                    \
            write_kv(c->key, c->value, c->key_stride, c->value_stride, c->io_bf16, c->k_cache, c->v_cache, \
                     FMT, c->slots, c->num_tokens, (long long)c->num_kv_heads * c->head_dim);              \
        return 0;                                                                                          \
    }                                                                                                      \
    int NAME##_task(const void *args, int ith, int nth) {                                                  \
        const struct paged_decode_call *c = args;                                                          \
        const struct decode_args a = {c->q, c->k_cache, c->v_cache, c->k_scales, c->v_scales,              \
                                      c->block_tables, c->seq_lens, c->out, c->num_heads, c->num_kv_heads, \
                                      c->head_dim, c->block_size, c->window, c->io_bf16, c->req_end,       \
                                      c->block_table_stride, c->kv_block_stride, c->kv_token_stride,       \
                                      c->scale, c->k_scale, c->v_scale, c->soft_cap};                      \
        long long b, e;                                                                                    \
        team_share(c->req_end - c->req_begin, ith, nth, &b, &e);                                           \
        return decode_share(&a, c->req_begin + (int)b, c->req_begin + (int)e, FN);                         \
    }
PAGED_DECODE_TASKS(paged_decode_f32, decode_request_f32, KV_F32)
PAGED_DECODE_TASKS(paged_decode_bf16, decode_request_bf16, KV_BF16)
PAGED_DECODE_TASKS(paged_decode_fp8_e4m3, decode_request_e4m3, KV_FP8_E4M3)
PAGED_DECODE_TASKS(paged_decode_fp8_e5m2, decode_request_e5m2, KV_FP8_E5M2)
PAGED_DECODE_TASKS(paged_decode_int8, decode_request_int8, KV_INT8)
#undef PAGED_DECODE_TASKS

/* Prefill attention: the Q new tokens of one request (positions num_context ..) attend causally to its
 * keys 0 .. num_context + Q - 1, read in place (the chunk's K/V written first). FlashAttention-2 loop order
 * (Dao 2023, Algorithm 1): a work item is a tile of queries x one KV head, the group's query heads folded
 * into the rows (row r = query r / group, head kvh * group + r % group); rows kept transposed (Q^T,
 * pre-scaled). Window W > 0: query at p sees keys p - W < k <= p.
 * q, out: [num_queries, num_heads, head_dim] float32 or bfloat16 contiguous; head_dim a multiple of 64.
 * Items are numbered tile * num_kv_heads + kvh. Returns 0, or -1 when a scratch allocation fails.
 */

#define PF_BK 64   /* keys per tile */
#define PF_ROWS 192 /* target rows (queries x group) per work item: 12 vectors; each K/V row read serves them all */
#if defined(__AVX512F__)
#define PF_NV 6    /* row vectors per micro-tile */
#define PF_RK 4    /* keys per S micro-tile: 4 x 6 accumulators (24 of the 32 AVX-512 registers) */
#define PF_RD 4    /* head_dim entries per O micro-tile: 4 x 6 accumulators */
#else /* AVX2: 16 registers, two per vector: 2 x 2 accumulators + 2 row vectors + a broadcast */
#define PF_NV 2
#define PF_RK 2
#define PF_RD 2
#endif

int pagedllm_cpu_paged_prefill_block_queries(int group) { return group >= PF_ROWS ? 1 : PF_ROWS / group; }


/* s[j][r0 ..] = sum_d k_j[d] qt[d][r0 ..] for NK keys x NV row vectors (qt: [head_dim][ld], s: [keys][ld]). */
static inline __attribute__((always_inline)) void pf_scores(const float *const *restrict k, const float *restrict qt,
                                                            float *restrict s, int ld, int head_dim, int nk, int nv) {
    v16f acc[PF_RK][PF_NV];
    for (int j = 0; j < nk; j++)
        for (int c = 0; c < nv; c++) acc[j][c] = (v16f){0};
    for (int d = 0; d < head_dim; d++) {
        v16f qv[PF_NV];
        for (int c = 0; c < nv; c++) qv[c] = load_f32(qt + (size_t)d * ld + 16 * c);
        for (int j = 0; j < nk; j++) {
            const v16f x = splat16(k[j][d]);
            for (int c = 0; c < nv; c++) acc[j][c] += x * qv[c];
        }
    }
    for (int j = 0; j < nk; j++)
        for (int c = 0; c < nv; c++) store_f32(s + (size_t)j * ld + 16 * c, acc[j][c]);
}

#define PF_BY_NV(CALL)                                                                                    \
    switch (nv) {                                                                                          \
    case 6: CALL(6); break;                                                                                \
    case 5: CALL(5); break;                                                                                \
    case 4: CALL(4); break;                                                                                \
    case 3: CALL(3); break;                                                                                \
    case 2: CALL(2); break;                                                                                \
    default: CALL(1); break;                                                                               \
    }

/* S^T over keys 0 .. n - 1: blocks of 6 row vectors outermost, so a block of Q^T stays in L1. */
static void pf_scores_tile(const float *const *k, const float *qt, float *s, int ld, int head_dim, int n, int nvec) {
    for (int c = 0; c < nvec; c += PF_NV) {
        const int nv = nvec - c < PF_NV ? nvec - c : PF_NV;
        int j = 0;
#define PF_S(NK, NV) pf_scores(k + j, qt + 16 * c, s + (size_t)j * ld + 16 * c, ld, head_dim, NK, NV)
#define PF_S4(NV) PF_S(PF_RK, NV)
#define PF_S3(NV) PF_S(3, NV)
#define PF_S2(NV) PF_S(2, NV)
#define PF_S1(NV) PF_S(1, NV)
        for (; j + PF_RK <= n; j += PF_RK) PF_BY_NV(PF_S4)
        switch (n - j) {
        case 3: PF_BY_NV(PF_S3) break;
        case 2: PF_BY_NV(PF_S2) break;
        case 1: PF_BY_NV(PF_S1) break;
        default: break;
        }
    }
}

/* O^T[d0 + i][c ..] = alpha[c ..] O^T[d0 + i][c ..] + sum_j v_j[d0 + i] P^T[j][c ..] (pt: [keys][ld], ot:
 * [head_dim][ld]). */
static inline __attribute__((always_inline)) void pf_accumulate(const float *restrict pt, const float *const *restrict v,
                                                                float *restrict ot, const float *restrict alpha, int ld,
                                                                int d0, int n, int nv) {
    v16f acc[PF_RD][PF_NV];
    for (int c = 0; c < nv; c++) {
        const v16f a = load_f32(alpha + 16 * c);
        for (int i = 0; i < PF_RD; i++) acc[i][c] = load_f32(ot + (size_t)(d0 + i) * ld + 16 * c) * a;
    }
    for (int j = 0; j < n; j++) {
        v16f p[PF_NV];
        for (int c = 0; c < nv; c++) p[c] = load_f32(pt + (size_t)j * ld + 16 * c);
        const float *vj = v[j] + d0;
        for (int i = 0; i < PF_RD; i++) {
            const v16f x = splat16(vj[i]);
            for (int c = 0; c < nv; c++) acc[i][c] += x * p[c];
        }
    }
    for (int i = 0; i < PF_RD; i++)
        for (int c = 0; c < nv; c++) store_f32(ot + (size_t)(d0 + i) * ld + 16 * c, acc[i][c]);
}

static void pf_accumulate_tile(const float *pt, const float *const *v, float *ot, const float *alpha, int ld,
                               int head_dim, int n, int nvec) {
    for (int c = 0; c < nvec; c += PF_NV) {
        const int nv = nvec - c < PF_NV ? nvec - c : PF_NV;
#define PF_PV(NV) pf_accumulate(pt + 16 * c, v, ot + 16 * c, alpha + 16 * c, ld, d0, n, NV)
        for (int d0 = 0; d0 < head_dim; d0 += PF_RD) PF_BY_NV(PF_PV)
    }
}

/* tanh(x) on 16 lanes (Cephes tanhf): x + x^3 P(x^2) for |x| < 0.625, else (1 - e) / (1 + e), e = exp(-2|x|). */
static inline v16f pf_tanh(v16f x) {
    const v16i32 sign = (v16i32)x & ((v16i32){0} + INT32_MIN);
    const v16f z = (v16f)((v16i32)x & ~sign); /* |x| */
    const v16f e = exp_nonpos_v16((v16f){0} - 2.0f * z);
    const v16f big = (1.0f - e) / (1.0f + e);
    const v16f z2 = x * x;
    v16f small = (v16f){0} - 5.70498872745e-3f;
    small = small * z2 + 2.06390887954e-2f;
    small = small * z2 - 5.37397155531e-2f;
    small = small * z2 + 1.33314422036e-1f;
    small = small * z2 - 3.33332819422e-1f;
    small = small * z2 * z + z;
    return (v16f)((v16i32)select_f(z < 0.625f, small, big) | sign);
}

/* Online-softmax update for keys k0 .. k0 + n - 1: row r sees key k iff row_lo[r] <= k <= row_pos[r].
 * s[j][r] becomes p = exp(s - m_new) (0 where masked); a row that has seen no key keeps m = -inf, l = 0. */
static void pf_softmax(float *restrict s, float *restrict m, float *restrict l, float *restrict alpha,
                       const int32_t *restrict row_pos, const int32_t *restrict row_lo, int ld, int nvec, int k0,
                       int n, int masked, float soft_cap) {
    const v16f neg_inf = (v16f){0} - INFINITY;
    for (int c = 0; c < nvec; c++) {
        v16i32 pos, lo;
        memcpy(&pos, row_pos + 16 * c, sizeof pos);
        memcpy(&lo, row_lo + 16 * c, sizeof lo);
        v16f mx = neg_inf;
        for (int j = 0; j < n; j++) {
            v16f x = load_f32(s + (size_t)j * ld + 16 * c);
            if (soft_cap > 0.0f) x = soft_cap * pf_tanh(x / soft_cap);
            if (masked) {
                const v16i32 key = (v16i32){0} + (k0 + j);
                x = select_f((key <= pos) & (key >= lo), x, neg_inf);
            }
            if (masked || soft_cap > 0.0f) store_f32(s + (size_t)j * ld + 16 * c, x);
            mx = select_f(x > mx, x, mx);
        }
        const v16f m_old = load_f32(m + 16 * c);
        const v16f m_new = select_f(mx > m_old, mx, m_old);
        /* m_old = -inf: nothing to rescale; m_new = -inf (only under a window): subtract 0, p masked to 0. */
        const v16f a = select_f(m_old > neg_inf, exp_nonpos_v16(m_old - m_new), (v16f){0});
        const v16f m_sub = select_f(m_new > neg_inf, m_new, (v16f){0});
        v16f sum = (v16f){0};
        for (int j = 0; j < n; j++) {
            const v16f x = load_f32(s + (size_t)j * ld + 16 * c);
            v16f p = exp_nonpos_v16(x - m_sub);
            if (masked) p = select_f(x > neg_inf, p, (v16f){0}); /* exactly 0 for hidden keys */
            store_f32(s + (size_t)j * ld + 16 * c, p);
            sum += p;
        }
        store_f32(m + 16 * c, m_new);
        store_f32(alpha + 16 * c, a);
        store_f32(l + 16 * c, load_f32(l + 16 * c) * a + sum);
    }
}

struct prefill_args {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_table;
    void *out;
    int num_queries, num_context, num_heads, num_kv_heads, head_dim, block_size, io_bf16;
    long long kv_block_stride, kv_token_stride;
    float scale;
    int window;     /* sliding window W (0: none) */
    float soft_cap; /* attention-logit soft cap c (0: none) */
};

/* One work item (a tile of queries x KV head kvh) of a prefill call, with its thread's scratch. */
static inline __attribute__((always_inline)) void prefill_item(const struct prefill_args *a, int item, float *scratch,
                                                               int32_t *row_pos, const int head_dim, const int is_bf16) {
    const void *q = a->q, *k_cache = a->k_cache, *v_cache = a->v_cache;
    const int32_t *block_table = a->block_table;
    void *out = a->out;
    const int num_queries = a->num_queries, num_context = a->num_context, num_heads = a->num_heads;
    const int num_kv_heads = a->num_kv_heads, block_size = a->block_size, io_bf16 = a->io_bf16;
    const long long kv_block_stride = a->kv_block_stride, kv_token_stride = a->kv_token_stride;
    const float scale = a->scale, soft_cap = a->soft_cap;
    const int window = a->window;
    const int group = num_heads / num_kv_heads;
    const int bq = pagedllm_cpu_paged_prefill_block_queries(group);
    const int ld = (bq * group + 15) / 16 * 16; /* rows rounded up to whole vectors */
    const size_t d = (size_t)head_dim;
    float *qt = scratch, *o = qt + d * ld, *s = o + d * ld, *m = s + (size_t)PF_BK * ld, *l = m + ld;
    float *alpha = l + ld, *wide = alpha + ld;
    int32_t *row_lo = row_pos + ld; /* each row's first visible key (row_pos: its last) */
    const float *k_rows[PF_BK], *v_rows[PF_BK];
    const long long elem_size = is_bf16 ? 2 : 4, row_bytes = (long long)head_dim * elem_size;
    const int tile = item / num_kv_heads, kvh = item % num_kv_heads;
    const int q0 = tile * bq, nq = num_queries - q0 < bq ? num_queries - q0 : bq;
    const int rows = nq * group, nvec = (rows + 15) / 16;
    for (int r = 0; r < nvec * 16; r++) {
        const size_t src = ((size_t)(q0 + r / group) * num_heads + kvh * group + r % group) * d;
        for (size_t c = 0; c < d; c++)
            qt[c * ld + r] = r < rows ? (io_bf16 ? bf16_to_f32(((const uint16_t *)q)[src + c])
                                                 : ((const float *)q)[src + c]) * scale
                                      : 0.0f;
        /* Padding rows see every key: their scores stay finite and are never written out. */
        row_pos[r] = r < rows ? num_context + q0 + r / group : INT32_MAX;
        row_lo[r] = r < rows && window > 0 ? row_pos[r] - window + 1 : INT32_MIN;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * d * ld);
    const int first_pos = num_context + q0, num_keys = first_pos + nq; /* keys this item sees */
    /* Under a window tiles starting before last_pos - W + 1 are masked. */
    const int first_key = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    const int last_lo = window > 0 ? num_keys - window : INT32_MIN;
    for (int k0 = first_key; k0 < num_keys; k0 += PF_BK) {
        const int n = num_keys - k0 < PF_BK ? num_keys - k0 : PF_BK;
        for (int j = 0; j < n; j++) {
            const int t = k0 + j;
            const long long off = (long long)block_table[t / block_size] * kv_block_stride
                                  + (long long)(t % block_size) * kv_token_stride + (long long)kvh * head_dim;
            if (is_bf16) {
                float *kw = wide + (size_t)j * d, *vw = wide + (PF_BK + (size_t)j) * d;
                for (int c = 0; c < head_dim; c += 16) {
                    store_f32(kw + c, load_bf16((const uint16_t *)k_cache + off + c));
                    store_f32(vw + c, load_bf16((const uint16_t *)v_cache + off + c));
                }
                k_rows[j] = kw;
                v_rows[j] = vw;
            } else {
                k_rows[j] = (const float *)k_cache + off;
                v_rows[j] = (const float *)v_cache + off;
            }
        }
        const int k1 = k0 + PF_BK, n1 = num_keys - k1 < PF_BK ? num_keys - k1 : PF_BK;
        for (int j = 0; j < n1; j++) {
            const int t = k1 + j;
            const long long off = (long long)block_table[t / block_size] * kv_block_stride
                                  + (long long)(t % block_size) * kv_token_stride + (long long)kvh * head_dim;
            prefetch_row((const char *)k_cache + off * elem_size, row_bytes);
            prefetch_row((const char *)v_cache + off * elem_size, row_bytes);
        }
        pf_scores_tile(k_rows, qt, s, ld, head_dim, n, nvec);
        pf_softmax(s, m, l, alpha, row_pos, row_lo, ld, nvec, k0, n, k0 + n - 1 > first_pos || k0 < last_lo,
                   soft_cap);
        pf_accumulate_tile(s, v_rows, o, alpha, ld, head_dim, n, nvec);
    }
    for (int r = 0; r < rows; r++) {
        const size_t dst = ((size_t)(q0 + r / group) * num_heads + kvh * group + r % group) * d;
        const float inv = 1.0f / l[r];
        if (io_bf16)
            for (size_t c = 0; c < d; c++) ((uint16_t *)out)[dst + c] = f32_to_bf16(o[c * ld + r] * inv);
        else
            for (size_t c = 0; c < d; c++) ((float *)out)[dst + c] = o[c * ld + r] * inv;
    }
}

/* Specialised copies (head_dim 64 unrolled), called through a pointer from the OpenMP region. */
typedef void (*prefill_item_fn)(const struct prefill_args *, int, float *, int32_t *);
static void prefill_item_f32_64(const struct prefill_args *a, int i, float *s, int32_t *p) { prefill_item(a, i, s, p, 64, 0); }
static void prefill_item_f32(const struct prefill_args *a, int i, float *s, int32_t *p) { prefill_item(a, i, s, p, a->head_dim, 0); }
static void prefill_item_bf16_64(const struct prefill_args *a, int i, float *s, int32_t *p) { prefill_item(a, i, s, p, 64, 1); }
static void prefill_item_bf16(const struct prefill_args *a, int i, float *s, int32_t *p) { prefill_item(a, i, s, p, a->head_dim, 1); }

/* Items [item_begin, item_end) over an OpenMP team, the costliest (last) first. Returns 0, or -1 when a
 * scratch allocation failed. */
static int prefill_items(const struct prefill_args *a, int item_begin, int item_end, int num_threads, int is_bf16,
                         prefill_item_fn fn) {
    const int group = a->num_heads / a->num_kv_heads;
    const int ld = (pagedllm_cpu_paged_prefill_block_queries(group) * group + 15) / 16 * 16;
    const size_t d = (size_t)a->head_dim;
    const size_t floats = 2 * d * ld + (size_t)PF_BK * ld + 3 * (size_t)ld + (is_bf16 ? 2 * (size_t)PF_BK * d : 0);
    int failed = 0;
    (void)num_threads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
        float *scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        int32_t *row_pos = malloc(sizeof(int32_t) * 2 * ld); /* row_pos, then row_lo */
        failed = scratch == NULL || row_pos == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int item = item_end - 1; item >= item_begin; item--)
            if (!failed) fn(a, item, scratch, row_pos);
        free(scratch);
        free(row_pos);
    }
    return failed ? -1 : 0;
}

#define PAGED_PREFILL_ARGS                                                                                  \
    const void *q, const void *k_cache, const void *v_cache, const int32_t *block_table, void *out,         \
        int num_queries, int num_context, int num_heads, int num_kv_heads, int head_dim, int block_size,    \
        long long kv_block_stride, long long kv_token_stride, float scale, int item_begin, int item_end,    \
        int io_bf16, int num_threads, int window, float soft_cap

#define PAGED_PREFILL_BODY(IS_BF16, FN64, FN)                                                               \
    const struct prefill_args a = {q, k_cache, v_cache, block_table, out, num_queries, num_context,         \
                                   num_heads, num_kv_heads, head_dim, block_size, io_bf16, kv_block_stride, \
                                   kv_token_stride, scale, window, soft_cap};                               \
    return prefill_items(&a, item_begin, item_end, num_threads, IS_BF16, head_dim == 64 ? FN64 : FN);

/* Prefill attention of items [item_begin, item_end) of one request, float32 K/V cache. */
int paged_prefill_f32(PAGED_PREFILL_ARGS) { PAGED_PREFILL_BODY(0, prefill_item_f32_64, prefill_item_f32) }

/* Same, bf16 K/V cache (raw uint16 bit patterns). */
int paged_prefill_bf16(PAGED_PREFILL_ARGS) { PAGED_PREFILL_BODY(1, prefill_item_bf16_64, prefill_item_bf16) }
