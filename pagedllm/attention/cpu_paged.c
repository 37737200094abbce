/* Fused paged-attention decode kernel for CPUs (plain C11, no dependencies).
 *
 * Decode attention (one query token per request) read straight through the block table:
 * every K and V row of a request's context is loaded exactly once, for all query heads
 * together, with no gather copy. The softmax is computed online (Milakov & Gimelshein 2018,
 * "Online normalizer calculation for softmax"; the tiled form of FlashAttention, Dao et al.
 * 2022): the context is processed in tiles of up to TILE tokens; per tile and query head the
 * running maximum m, the running denominator l and the unnormalised output acc are rescaled
 * once by exp(m_old - m_new), so a single pass over K/V suffices.
 *
 * Layout (the one of pagedllm.attention.backend):
 *   q, out:        [num_reqs, num_heads, head_dim] float32, contiguous (out doubles as the
 *                  accumulator, so it must not alias q)
 *   k/v cache:     [num_blocks, block_size, num_kv_heads, head_dim] (float32 or bf16 as uint16),
 *                  addressed as block * kv_block_stride + offset * kv_token_stride + kv_head * head_dim
 *   block_tables:  [*, block_table_stride] int32; row r holds request r's physical block ids
 *   seq_lens:      [*] int32; request r attends to its tokens 0 .. seq_lens[r] - 1, or with a
 *                  sliding window W > 0 to its last W tokens only (earlier blocks are not read)
 * Attention-logit soft-capping (Gemma 2): with soft_cap c > 0 each score s becomes c * tanh(s / c).
 * Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 *
 * Vectorization: GCC/Clang vector extensions over 16-float chunks of head_dim (one AVX-512
 * register, two AVX2 ones), so head_dim must be a multiple of 16; head_dim 64 and 128 get
 * copies with the chunk loops unrolled so the accumulators live in registers. The next
 * tile's K rows and the current tile's V rows are prefetched while the scores are computed
 * (blocks are scattered, so the hardware prefetcher alone keeps only ~1/3 of the bandwidth).
 *
 * Numerics: IEEE float32 (built without -ffast-math; -ffp-contract=fast allows FMA). Dot
 * products sum 16 lanes then halve in a fixed order; exp is a Cephes-style polynomial (max
 * rel. error ~2 ulp for arguments <= 0) so the tile loop vectorizes. Results are
 * deterministic and independent of how requests are split between threads (each request
 * is computed by one call, in one order).
 *
 * The caller (pagedllm/attention/cpu_paged.py) validates shapes, block ids and limits;
 * the kernel trusts its arguments.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32         /* tokens per online-softmax tile (K and V of a tile stay in L1/L2) */
#define MAX_HEADS 256   /* scores scratch is [MAX_HEADS][TILE] floats on the stack */
#define MAX_CHUNKS 16   /* head_dim <= 16 * MAX_CHUNKS */
/* Prefetch hint for the rows of the next tile: 2 = prefetcht1 (into L2). Into L1 (3) evicts the
 * tile being computed; measured at batch 64, context 300, block 16: 2 beats 3 by ~1.5x. */
#define PREFETCH_LOCALITY 2

int pagedllm_cpu_paged_abi_version(void) { return 2; }
int pagedllm_cpu_paged_max_heads(void) { return MAX_HEADS; }
int pagedllm_cpu_paged_max_head_dim(void) { return 16 * MAX_CHUNKS; }

/* exp(x) for x <= 0 (x >= -87.3 gives a normal result; below, exp(-87.3) ~ 1e-38 is returned,
 * harmless next to a softmax denominator >= 1). Cephes expf: x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by a degree-7 polynomial, 2^n by building the exponent bits. */
static inline float exp_nonpos(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float pow2n;
    memcpy(&pow2n, &bits, sizeof pow2n);
    return y * pow2n;
}

/* Ask for the cache lines of one token's K or V row (all KV heads). */
static inline void prefetch_row(const char *p, long long num_bytes) {
    for (long long b = 0; b < num_bytes; b += 64) __builtin_prefetch(p + b, 0, PREFETCH_LOCALITY);
}

/* 16-float vectors (GCC/Clang vector extensions): one AVX-512 register, two AVX2 ones. */
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

static inline v16f load_f32(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline v16f load_bf16(const uint16_t *p) {
    v16u16 h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u32) << 16);
}

static inline void store_f32(float *p, v16f x) { memcpy(p, &x, sizeof x); }

/* Sum of the 16 lanes, in a fixed order (halving). */
static inline float hsum(v16f x) {
    v8f lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    const v8f s8 = lo + hi;
    v4f a, b;
    memcpy(&a, &s8, sizeof a);
    memcpy(&b, (const char *)&s8 + sizeof a, sizeof b);
    const v4f s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* One request: out[h, :] = softmax(scale * q[h] . K^T) V over its first seq_len tokens.
 * head_dim is a multiple of 16. is_bf16 is a compile-time constant at both call sites, so
 * each gets its own specialised copy. */
static inline __attribute__((always_inline)) void decode_one(
    const float *restrict q, const void *k_cache, const void *v_cache, const int32_t *restrict block_table,
    int seq_len, float *restrict out, int num_heads, int num_kv_heads, int head_dim, int block_size,
    long long kv_block_stride, long long kv_token_stride, float scale, int window, float soft_cap, int is_bf16) {
    const int group = num_heads / num_kv_heads;
    const int num_chunks = head_dim / 16; /* a constant in the specialised copies (64, 128) */
    float scores[MAX_HEADS][TILE];
    float row_max[MAX_HEADS], row_sum[MAX_HEADS];
    long long offsets[TILE];
    const long long elem_size = is_bf16 ? 2 : 4;
    const long long row_bytes = (long long)num_kv_heads * head_dim * elem_size;
    for (int h = 0; h < num_heads; h++) {
        row_max[h] = -INFINITY;
        row_sum[h] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)num_heads * head_dim);

    const int first = window > 0 && seq_len > window ? seq_len - window : 0;
    for (int t0 = first; t0 < seq_len; t0 += TILE) {
        const int n = seq_len - t0 < TILE ? seq_len - t0 : TILE;
        /* Element offset of each token's row (KV head 0) in the cache, through the block table. */
        for (int i = 0; i < n; i++) {
            const int t = t0 + i;
            offsets[i] = (long long)block_table[t / block_size] * kv_block_stride
                         + (long long)(t % block_size) * kv_token_stride;
        }
        /* Scores: each K row is loaded once, for the `group` query heads that share it. */
        for (int i = 0; i < n; i++) {
            /* Prefetch this token's V row (read after the scores) and the next tile's K row. */
            prefetch_row((const char *)v_cache + offsets[i] * elem_size, row_bytes);
            const int t_next = t0 + TILE + i;
            if (t_next < seq_len)
                prefetch_row((const char *)k_cache + ((long long)block_table[t_next / block_size] * kv_block_stride
                                                      + (long long)(t_next % block_size) * kv_token_stride) * elem_size,
                             row_bytes);
            for (int kvh = 0; kvh < num_kv_heads; kvh++) {
                const long long off = offsets[i] + (long long)kvh * head_dim;
                v16f k[MAX_CHUNKS];
                for (int c = 0; c < num_chunks; c++)
                    k[c] = is_bf16 ? load_bf16((const uint16_t *)k_cache + off + 16 * c)
                                   : load_f32((const float *)k_cache + off + 16 * c);
                for (int g = 0; g < group; g++) {
                    const int h = kvh * group + g;
                    const float *qh = q + (size_t)h * head_dim;
                    v16f acc = load_f32(qh) * k[0];
                    for (int c = 1; c < num_chunks; c++) acc += load_f32(qh + 16 * c) * k[c];
                    const float s = scale * hsum(acc);
                    scores[h][i] = soft_cap > 0.0f ? soft_cap * tanhf(s / soft_cap) : s;
                }
            }
        }
        /* Online softmax: rescale the running state once per tile, then exponentiate the tile. */
        for (int h = 0; h < num_heads; h++) {
            float m = row_max[h];
            for (int i = 0; i < n; i++) m = scores[h][i] > m ? scores[h][i] : m;
            const float alpha = row_max[h] == -INFINITY ? 0.0f : exp_nonpos(row_max[h] - m);
            row_max[h] = m;
            float sum = 0.0f;
            for (int i = 0; i < n; i++) {
                scores[h][i] = exp_nonpos(scores[h][i] - m);
                sum += scores[h][i];
            }
            row_sum[h] = row_sum[h] * alpha + sum;
            /* acc = alpha * acc + sum_i p_i V_i, the accumulator chunk held in a register; the
             * tile's V rows are read from memory by the group's first head, from cache after. */
            const long long head_off = (long long)(h / group) * head_dim;
            float *dst = out + (size_t)h * head_dim;
            v16f acc[MAX_CHUNKS];
            for (int c = 0; c < num_chunks; c++) acc[c] = load_f32(dst + 16 * c) * alpha;
            for (int i = 0; i < n; i++) {
                const long long off = offsets[i] + head_off;
                const float p = scores[h][i];
                for (int c = 0; c < num_chunks; c++)
                    acc[c] += p * (is_bf16 ? load_bf16((const uint16_t *)v_cache + off + 16 * c)
                                           : load_f32((const float *)v_cache + off + 16 * c));
            }
            for (int c = 0; c < num_chunks; c++) store_f32(dst + 16 * c, acc[c]);
        }
    }
    for (int h = 0; h < num_heads; h++) {
        const float inv = 1.0f / row_sum[h];
        float *acc = out + (size_t)h * head_dim;
        for (int d = 0; d < head_dim; d++) acc[d] *= inv;
    }
}

#define PAGED_DECODE_ARGS                                                                                   \
    const float *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,                  \
        const int32_t *seq_lens, float *out, int req_begin, int req_end, int num_heads, int num_kv_heads,   \
        int head_dim, int block_size, long long block_table_stride, long long kv_block_stride,              \
        long long kv_token_stride, float scale, int window, float soft_cap

/* head_dim 64 and 128 get copies with the chunk loops fully unrolled (accumulators in registers). */
#define DECODE_REQUESTS(HEAD_DIM, IS_BF16)                                                                  \
    for (int r = req_begin; r < req_end; r++) {                                                             \
        const size_t row = (size_t)r * num_heads * (HEAD_DIM);                                              \
        decode_one(q + row, k_cache, v_cache, block_tables + (long long)r * block_table_stride, seq_lens[r], \
                   out + row, num_heads, num_kv_heads, (HEAD_DIM), block_size, kv_block_stride,             \
                   kv_token_stride, scale, window, soft_cap, IS_BF16);                                                        \
    }

#define PAGED_DECODE_BODY(IS_BF16)                                                                          \
    if (head_dim == 64) {                                                                                   \
        DECODE_REQUESTS(64, IS_BF16)                                                                        \
    } else if (head_dim == 128) {                                                                           \
        DECODE_REQUESTS(128, IS_BF16)                                                                       \
    } else {                                                                                                \
        DECODE_REQUESTS(head_dim, IS_BF16)                                                                  \
    }

/* Decode attention of requests [req_begin, req_end), float32 K/V cache. */
void paged_decode_f32(PAGED_DECODE_ARGS) { PAGED_DECODE_BODY(0) }

/* Same, bf16 K/V cache (raw uint16 bit patterns); q and out stay float32. */
void paged_decode_bf16(PAGED_DECODE_ARGS) { PAGED_DECODE_BODY(1) }
