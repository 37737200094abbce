/* Fused elementwise kernels of a decoder layer for CPUs (plain C11 + OpenMP), threaded over tokens:
 *   rms_norm_*      [residual += x or norm'(x);] out = norm(residual or x), per row (norm': Gemma's post-norms)
 *   act_and_mul_*   out = act(gate) * up over the fused (T, 2I) gate_up output
 *   rope_qk_*       optional per-head q/k RMSNorm, then neox rotary of q (to q_out) and k (in place)
 * Numerics: every kernel rounds where the torch code it replaces (pagedllm/models/layers) rounds: float32
 * compute, bfloat16 rounded to nearest even after each op that produced a bfloat16 tensor; rsqrt correctly
 * rounded; SiLU and GELU-tanh by torch's formulas; rotary as torch.addcmul (one float32 FMA), bit-exact.
 * No -ffast-math. The callers (pagedllm/ops/) validate arguments; strides and sizes are in elements.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "native_simd.h"
#include "native_team.h"

#define MAX_HEAD_DIM 1024 /* rope_qk's per-head scratch is MAX_HEAD_DIM floats on the stack */

int pagedllm_cpu_ops_abi_version(void) { return 3; }
int pagedllm_cpu_ops_max_head_dim(void) { return MAX_HEAD_DIM; }
/* 1 when bfloat16 rounding uses AVX512-BF16's vcvtneps2bf16 (with the exact fix-up). */
int pagedllm_cpu_ops_avx512bf16(void) { return native_simd_avx512bf16(); }

static inline float load1(const void *p, ptrdiff_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, ptrdiff_t i, float x, const int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

static inline v16f load16(const void *p, ptrdiff_t i, const int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

static inline void store16(void *p, ptrdiff_t i, v16f x, const int bf16) {
    if (bf16) store_bf16((uint16_t *)p + i, x);
    else store_f32((float *)p + i, x);
}

/* x rounded to the dtype, stored, and returned (the value a torch op would have written). */
static inline v16f round_store16(void *p, ptrdiff_t i, v16f x, const int bf16) {
    if (bf16) return round_store_bf16((uint16_t *)p + i, x);
    store_f32((float *)p + i, x);
    return x;
}

static inline v16f to_dtype(v16f x, const int bf16) { return bf16 ? round_bf16(x) : x; }
static inline float scalar_to_dtype(float x, const int bf16) { return bf16 ? round_bf16_1(x) : x; }


static inline v16f splat(float a) { return (v16f){0} + a; }

/* exp(x) over the whole float range: 2^n applied as 2^(n/2) 2^(n - n/2) so both ends are right. */
static inline v16f exp_v(v16f x) {
    x = select_f(x < -104.0f, splat(-104.0f), x);
    x = select_f(x > 88.8f, splat(88.8f), x);
    v16f n;
    const v16f y = exp_reduced_v16(x, &n);
    const v16i32 ni = __builtin_convertvector(n, v16i32);
    const v16i32 n1 = ni >> 1, n2 = ni - n1;
    return y * (v16f)((n1 + 127) << 23) * (v16f)((n2 + 127) << 23);
}

/* tanh(x), Cephes tanhf: an odd polynomial for |x| < 0.625, else 1 - 2 / (exp(2|x|) + 1), signed. */
static inline v16f tanh_v(v16f x) {
    const v16i32 sign = (v16i32)x & INT32_MIN;
    const v16f ax = (v16f)((v16i32)x & INT32_MAX);
    const v16f z = x * x;
    v16f p = splat(-5.70498872745e-3f);
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const v16f small = p * z * x + x;
    const v16f big = (v16f)((v16i32)(1.0f - 2.0f / (exp_v(ax + ax) + 1.0f)) | sign);
    return select_f(ax < 0.625f, small, big);
}


/* 1 / sqrt(mean(x^2) + eps) of one row, as torch.rsqrt (the sum in 16 lanes, another order). */
static inline __attribute__((always_inline)) float inv_rms(const void *x, int dim, float eps, const int bf16) {
    v16f acc = {0};
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
        const v16f h = load16(x, i, bf16);
        acc += h * h;
    }
    float sum = hsum(acc);
    for (; i < dim; i++) {
        const float h = load1(x, i, bf16);
        sum += h * h;
    }
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* n = x * inv_rms with weight w, cast to the dtype: RMSNorm casts n before the weight multiplies it,
 * GemmaRMSNorm casts n * (1 + w) at the end. */
static inline v16f normed_unrounded_v(v16f n, v16f w, int gemma, const int bf16) {
    return gemma ? n * (1.0f + w) : to_dtype(n, bf16) * w;
}

static inline v16f normed_v(v16f n, v16f w, int gemma, const int bf16) {
    return to_dtype(normed_unrounded_v(n, w, gemma, bf16), bf16);
}

static inline float normed_1(float n, float w, int gemma, const int bf16) {
    return scalar_to_dtype(gemma ? n * (1.0f + w) : scalar_to_dtype(n, bf16) * w, bf16);
}

/* One row: h = x, or norm_{x_w}(x); with residual, residual = cast(residual + h) and h = that; then
 * out = norm_w(h) when w is given. out may alias x. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const void *x, const void *x_w, void *residual, const void *w, void *out, int dim, float eps, int gemma,
    const int bf16) {
    const float x_rs = x_w ? inv_rms(x, dim, eps, bf16) : 0.0f;
    v16f acc = {0};
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
        v16f h = load16(x, i, bf16);
        if (x_w) h = normed_v(h * x_rs, load16(x_w, i, bf16), gemma, bf16);
        if (residual) {
            h = round_store16(residual, i, h + load16(residual, i, bf16), bf16);
        }
        acc += h * h;
    }
    float sum = hsum(acc);
    for (; i < dim; i++) {
        float h = load1(x, i, bf16);
        if (x_w) h = normed_1(h * x_rs, load1(x_w, i, bf16), gemma, bf16);
        if (residual) {
            h = scalar_to_dtype(h + load1(residual, i, bf16), bf16);
            store1(residual, i, h, bf16);
        }
        sum += h * h;
    }
    if (!w) return;
    const void *src = residual ? residual : x; /* x_w without a residual is not a caller's case */
    const float rs = 1.0f / sqrtf(sum / (float)dim + eps);
    for (i = 0; i + 16 <= dim; i += 16)
        store16(out, i, normed_unrounded_v(load16(src, i, bf16) * rs, load16(w, i, bf16), gemma, bf16), bf16);
    for (; i < dim; i++) store1(out, i, normed_1(load1(src, i, bf16) * rs, load1(w, i, bf16), gemma, bf16), bf16);
}

/* The row loop of every kernel: `BODY` for t in [0, num_rows), over OpenMP threads when num_threads > 1,
 * else a plain loop (an `if (false)` region still sets up a team per call). */
#define FOR_ROWS(num_rows, BODY)                                                                \
    do {                                                                                        \
        if (num_threads > 1) {                                                                  \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static)")               \
            for (int t = 0; t < (num_rows); t++) BODY;                                          \
        } else {                                                                                \
            for (int t = 0; t < (num_rows); t++) BODY;                                          \
        }                                                                                       \
    } while (0)

#define ROW(base, stride, elem) ((char *)(base) + (ptrdiff_t)t * (stride) * (elem))

/* x, out: (num_rows, dim) rows at x_stride / out_stride; residual: same or NULL; x_w, w: (dim,) or NULL. */
void rms_norm_f32(const void *x, const void *x_w, void *residual, const void *w, void *out, int num_rows, int dim,
                  ptrdiff_t x_stride, ptrdiff_t residual_stride, ptrdiff_t out_stride, float eps, int gemma,
                  int num_threads) {
    FOR_ROWS(num_rows, rms_norm_row(ROW(x, x_stride, 4), x_w, residual ? ROW(residual, residual_stride, 4) : NULL, w, ROW(out, out_stride, 4), dim, eps, gemma, 0));
}

void rms_norm_bf16(const void *x, const void *x_w, void *residual, const void *w, void *out, int num_rows, int dim,
                   ptrdiff_t x_stride, ptrdiff_t residual_stride, ptrdiff_t out_stride, float eps, int gemma,
                   int num_threads) {
    FOR_ROWS(num_rows, rms_norm_row(ROW(x, x_stride, 2), x_w, residual ? ROW(residual, residual_stride, 2) : NULL, w, ROW(out, out_stride, 2), dim, eps, gemma, 1));
}


enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

static inline __attribute__((always_inline)) v16f act_v(v16f x, const int act) {
    if (act == ACT_SILU) return x / (1.0f + exp_v(-x));
    const v16f inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + tanh_v(inner));
}

/* One row: dst[i] = cast(cast(act(gate[i])) * up[i]), up = gate + inter. */
static inline __attribute__((always_inline)) void act_and_mul_row(const char *gate, char *dst, int inter,
                                                                  const int act, const int bf16) {
    const char *up = gate + (size_t)inter * (bf16 ? 2 : 4);
    int i = 0;
    for (; i + 16 <= inter; i += 16)
        store16(dst, i, to_dtype(act_v(load16(gate, i, bf16), act), bf16) * load16(up, i, bf16), bf16);
    if (i < inter) { /* the tail through a zero-padded chunk */
        float g[16] = {0}, u[16] = {0}, o[16];
        for (int j = i; j < inter; j++) {
            g[j - i] = load1(gate, j, bf16);
            u[j - i] = load1(up, j, bf16);
        }
        store_f32(o, to_dtype(act_v(load_f32(g), act), bf16) * load_f32(u));
        for (int j = i; j < inter; j++) store1(dst, j, o[j - i], bf16);
    }
}

/* in: (num_rows, 2 * inter) rows at in_stride, gate then up; out: (num_rows, inter) rows at out_stride. */
#define ACT_AND_MUL_ROWS(elem_size, bf16)                                                                    \
    if (act == ACT_SILU) {                                                                                   \
        FOR_ROWS(num_rows, act_and_mul_row(ROW(in, in_stride, elem_size), ROW(out, out_stride, elem_size),   \
                                           inter, ACT_SILU, bf16));                                          \
    } else {                                                                                                 \
        FOR_ROWS(num_rows, act_and_mul_row(ROW(in, in_stride, elem_size), ROW(out, out_stride, elem_size),   \
                                           inter, ACT_GELU_TANH, bf16));                                     \
    }

void act_and_mul_f32(const void *in, void *out, int num_rows, int inter, ptrdiff_t in_stride,
                     ptrdiff_t out_stride, int act, int num_threads) {
    ACT_AND_MUL_ROWS(4, 0)
}

void act_and_mul_bf16(const void *in, void *out, int num_rows, int inter, ptrdiff_t in_stride,
                      ptrdiff_t out_stride, int act, int num_threads) {
    ACT_AND_MUL_ROWS(2, 1)
}


enum { QK_NORM_NONE = 0, QK_NORM_RMS = 1, QK_NORM_GEMMA = 2 };

/* buf (head_dim floats, values of the storage dtype) := its per-head norm. */
static inline __attribute__((always_inline)) void head_norm(float *buf, const void *w, int head_dim, float eps,
                                                            int kind, const int bf16) {
    const float rs = inv_rms(buf, head_dim, eps, 0);
    for (int i = 0; i < head_dim; i++) buf[i] = normed_1(buf[i] * rs, load1(w, i, bf16), kind == QK_NORM_GEMMA, bf16);
}

/* dst[i] = x[i] * cos[i] + x[(i + half) % rotary_dim] * sin[i] for i < rotary_dim (sin's first half
 * holds -sin), rounded as torch's mul + addcmul; dst[i] = x[i] after. */
static inline __attribute__((always_inline)) void rotate_head(const float *restrict x, void *dst,
                                                              const void *cos, const void *sin, int head_dim,
                                                              int rotary_dim, const int bf16) {
    const int half = rotary_dim / 2;
    float out[MAX_HEAD_DIM];
    for (int i = 0; i < half; i++) {
        const float c1 = load1(cos, i, bf16), s1 = load1(sin, i, bf16);
        const float c2 = load1(cos, i + half, bf16), s2 = load1(sin, i + half, bf16);
        out[i] = scalar_to_dtype(fmaf(x[i + half], s1, scalar_to_dtype(x[i] * c1, bf16)), bf16);
        out[i + half] = scalar_to_dtype(fmaf(x[i], s2, scalar_to_dtype(x[i + half] * c2, bf16)), bf16);
    }
    for (int i = rotary_dim; i < head_dim; i++) out[i] = x[i];
    int i = 0;
    for (; i + 16 <= head_dim; i += 16) store16(dst, i, load_f32(out + i), bf16);
    for (; i < head_dim; i++) store1(dst, i, out[i], bf16);
}

static inline __attribute__((always_inline)) void rope_qk_token(
    char *src, char *q_dst, const char *cos, int num_heads, int num_kv_heads, int head_dim, int rotary_dim,
    const void *q_weight, const void *k_weight, float eps, int norm_kind, const int bf16) {
    const size_t elem = bf16 ? 2 : 4;
    const char *sin = cos + (size_t)rotary_dim * elem;
    float buf[MAX_HEAD_DIM];
    for (int h = 0; h < num_heads + num_kv_heads; h++) {
        char *head = src + (size_t)h * head_dim * elem;
        char *dst = h < num_heads ? q_dst + (size_t)h * head_dim * elem : head;
        int i = 0;
        for (; i + 16 <= head_dim; i += 16) store_f32(buf + i, load16(head, i, bf16));
        for (; i < head_dim; i++) buf[i] = load1(head, i, bf16);
        if (norm_kind != QK_NORM_NONE)
            head_norm(buf, h < num_heads ? q_weight : k_weight, head_dim, eps, norm_kind, bf16);
        rotate_head(buf, dst, cos, sin, head_dim, rotary_dim, bf16);
    }
}

/* qkv: (num_tokens, >= (num_heads + num_kv_heads) * head_dim) rows, q heads then k heads; q_out:
 * (num_tokens, num_heads * head_dim) (may be qkv); cos_sin: (num_tokens, 2, rotary_dim); q_weight,
 * k_weight: (head_dim,). rotary_dim even, <= head_dim <= MAX_HEAD_DIM. */
void rope_qk_f32(void *qkv, ptrdiff_t qkv_stride, void *q_out, ptrdiff_t q_out_stride, const void *cos_sin,
                 ptrdiff_t cos_sin_stride, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                 int rotary_dim, const void *q_weight, const void *k_weight, float eps, int norm_kind,
                 int num_threads) {
    FOR_ROWS(num_tokens, rope_qk_token(ROW(qkv, qkv_stride, 4), ROW(q_out, q_out_stride, 4), ROW(cos_sin, cos_sin_stride, 4), num_heads, num_kv_heads, head_dim, rotary_dim, q_weight, k_weight, eps, norm_kind, 0));
}

void rope_qk_bf16(void *qkv, ptrdiff_t qkv_stride, void *q_out, ptrdiff_t q_out_stride, const void *cos_sin,
                  ptrdiff_t cos_sin_stride, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                  int rotary_dim, const void *q_weight, const void *k_weight, float eps, int norm_kind,
                  int num_threads) {
    FOR_ROWS(num_tokens, rope_qk_token(ROW(qkv, qkv_stride, 2), ROW(q_out, q_out_stride, 2), ROW(cos_sin, cos_sin_stride, 2), num_heads, num_kv_heads, head_dim, rotary_dim, q_weight, k_weight, eps, norm_kind, 1));
}

/* The same functions taking their arguments as one struct, field for field (pagedllm/ops/calls.py). */
struct rms_norm_call {
    const void *x, *x_w;
    void *residual;
    const void *w;
    void *out;
    int num_rows, dim;
    ptrdiff_t x_stride, residual_stride, out_stride;
    float eps;
    int gemma, num_threads;
};
struct act_and_mul_call {
    const void *in;
    void *out;
    int num_rows, inter;
    ptrdiff_t in_stride, out_stride;
    int act, num_threads;
};
struct rope_qk_call {
    void *qkv;
    ptrdiff_t qkv_stride;
    void *q_out;
    ptrdiff_t q_out_stride;
    const void *cos_sin;
    ptrdiff_t cos_sin_stride;
    int num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim;
    const void *q_weight, *k_weight;
    float eps;
    int norm_kind, num_threads;
};

#define RMS_NORM_CALL(NAME)                                                                                 \
    void NAME##_call(const struct rms_norm_call *c) {                                                      \
        NAME(c->x, c->x_w, c->residual, c->w, c->out, c->num_rows, c->dim, c->x_stride, c->residual_stride, \
             c->out_stride, c->eps, c->gemma, c->num_threads);                                             \
    }
#define ACT_AND_MUL_CALL(NAME)                                                                              \
    void NAME##_call(const struct act_and_mul_call *c) {                                                   \
        NAME(c->in, c->out, c->num_rows, c->inter, c->in_stride, c->out_stride, c->act, c->num_threads);   \
    }
#define ROPE_QK_CALL(NAME)                                                                                  \
    void NAME##_call(const struct rope_qk_call *c) {                                                       \
        NAME(c->qkv, c->qkv_stride, c->q_out, c->q_out_stride, c->cos_sin, c->cos_sin_stride, c->num_tokens, \
             c->num_heads, c->num_kv_heads, c->head_dim, c->rotary_dim, c->q_weight, c->k_weight, c->eps,  \
             c->norm_kind, c->num_threads);                                                                 \
    }
RMS_NORM_CALL(rms_norm_f32)
RMS_NORM_CALL(rms_norm_bf16)
ACT_AND_MUL_CALL(act_and_mul_f32)
ACT_AND_MUL_CALL(act_and_mul_bf16)
ROPE_QK_CALL(rope_qk_f32)
ROPE_QK_CALL(rope_qk_bf16)
#undef RMS_NORM_CALL
#undef ACT_AND_MUL_CALL
#undef ROPE_QK_CALL

/* The task forms (native_team.h): thread ith of nth runs the kernel on its share of the rows, on its own. */
#define AT_ROW(base, stride, row, elem) ((char *)(base) + (ptrdiff_t)(row) * (stride) * (elem))
#define RMS_NORM_TASK(NAME, ELEM)                                                                           \
    int NAME##_task(const void *args, int ith, int nth) {                                                  \
        const struct rms_norm_call *c = args;                                                              \
        long long b, e;                                                                                    \
        team_share(c->num_rows, ith, nth, &b, &e);                                                         \
        if (b < e)                                                                                         \
            NAME(AT_ROW(c->x, c->x_stride, b, ELEM), c->x_w,                                               \
                 c->residual ? AT_ROW(c->residual, c->residual_stride, b, ELEM) : NULL, c->w,              \
                 AT_ROW(c->out, c->out_stride, b, ELEM), (int)(e - b), c->dim, c->x_stride,                \
                 c->residual_stride, c->out_stride, c->eps, c->gemma, 1);                                  \
        return 0;                                                                                          \
    }
#define ACT_AND_MUL_TASK(NAME, ELEM)                                                                        \
    int NAME##_task(const void *args, int ith, int nth) {                                                  \
        const struct act_and_mul_call *c = args;                                                           \
        long long b, e;                                                                                    \
        team_share(c->num_rows, ith, nth, &b, &e);                                                         \
        if (b < e)                                                                                         \
            NAME(AT_ROW(c->in, c->in_stride, b, ELEM), AT_ROW(c->out, c->out_stride, b, ELEM), (int)(e - b), \
                 c->inter, c->in_stride, c->out_stride, c->act, 1);                                        \
        return 0;                                                                                          \
    }
#define ROPE_QK_TASK(NAME, ELEM)                                                                            \
    int NAME##_task(const void *args, int ith, int nth) {                                                  \
        const struct rope_qk_call *c = args;                                                               \
        long long b, e;                                                                                    \
        team_share(c->num_tokens, ith, nth, &b, &e);                                                       \
        if (b < e)                                                                                         \
            NAME(AT_ROW(c->qkv, c->qkv_stride, b, ELEM), c->qkv_stride,                                    \
                 AT_ROW(c->q_out, c->q_out_stride, b, ELEM), c->q_out_stride,                              \
                 AT_ROW(c->cos_sin, c->cos_sin_stride, b, ELEM), c->cos_sin_stride, (int)(e - b),          \
                 c->num_heads, c->num_kv_heads, c->head_dim, c->rotary_dim, c->q_weight, c->k_weight,      \
                 c->eps, c->norm_kind, 1);                                                                 \
        return 0;                                                                                          \
    }
RMS_NORM_TASK(rms_norm_f32, 4)
RMS_NORM_TASK(rms_norm_bf16, 2)
ACT_AND_MUL_TASK(act_and_mul_f32, 4)
ACT_AND_MUL_TASK(act_and_mul_bf16, 2)
ROPE_QK_TASK(rope_qk_f32, 4)
ROPE_QK_TASK(rope_qk_bf16, 2)
#undef RMS_NORM_TASK
#undef ACT_AND_MUL_TASK
#undef ROPE_QK_TASK
#undef AT_ROW
