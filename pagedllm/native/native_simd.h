/* Vector helpers shared by the engine's C kernels (pagedllm.native hashes this header into every
 * library's cache key). 16-lane GCC/Clang vector extensions, -march=native; AVX512-BF16 hosts get the
 * one-instruction bfloat16 conversion, others the exact integer one (forced by PAGEDLLM_NO_AVX512BF16).
 * bfloat16 rounding is c10::BFloat16's: nearest, ties to even, subnormals too, every NaN to 0x7fc0.
 */
#ifndef PAGEDLLM_NATIVE_SIMD_H
#define PAGEDLLM_NATIVE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(PAGEDLLM_NO_AVX512BF16)
#define PAGEDLLM_AVX512BF16 1
#else
#define PAGEDLLM_AVX512BF16 0
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* 1 when this build converts float32 to bfloat16 with vcvtneps2bf16 (plus the exact fix-up). */
static inline int native_simd_avx512bf16(void) { return PAGEDLLM_AVX512BF16; }

static inline v16f load_f32(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store_f32(float *p, v16f x) { memcpy(p, &x, sizeof x); }

/* 16 bfloat16 values (raw bits) widened to float32 (exact). */
static inline v16f load_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    /* One vpmovzxwd: GCC splits the vector-extension form into 256-bit halves under -march=native. */
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#endif
    v16u16 h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u32) << 16);
}

/* x in all 16 lanes: GCC lowers `(v16f){0} + x` lane by lane on AVX2. */
static inline v16f splat16(float x) {
#if defined(__AVX512F__)
    return (v16f)_mm512_set1_ps(x);
#elif defined(__AVX__)
    const __m256 h = _mm256_set1_ps(x);
    v16f r;
    memcpy(&r, &h, sizeof h);
    memcpy((char *)&r + sizeof h, &h, sizeof h);
    return r;
#else
    return (v16f){0} + x;
#endif
}

static inline v16f select_f(v16i32 keep, v16f a, v16f b) { return (v16f)(((v16i32)a & keep) | ((v16i32)b & ~keep)); }

/* Sum of the 16 lanes, in a fixed order: lanes i + (i + 8), then + 4, then (0 + 2) + (1 + 3). */
static inline float hsum(v16f x) {
#if defined(__clang__) || __GNUC__ >= 12
    /* Register shuffles: halves through memory stall on store forwarding. */
    const v8f s8 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
                   + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
#else
    v8f lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    const v8f s8 = lo + hi;
    v4f a, b;
    memcpy(&a, &s8, sizeof a);
    memcpy(&b, (const char *)&s8 + sizeof a, sizeof b);
    const v4f s4 = a + b;
#endif
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}


static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* float32 to bfloat16 bits, one value. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x rounded to bfloat16 and widened back (low 16 bits zero). */
static inline float round_bf16_1(float x) {
    const uint32_t u = (uint32_t)f32_to_bf16(x) << 16;
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* The exact rounding on 16 lanes with integer arithmetic: float32 bits, low 16 bits zero. */
static inline v16u32 bf16_bits_exact(v16f x) {
    const v16u32 u = (v16u32)x;
    const v16u32 rounded = u + 0x7fffu + ((u >> 16) & 1u);
    const v16u32 is_nan = (v16u32)((u & 0x7fffffffu) > 0x7f800000u);
    return ((rounded & ~is_nan) | (0x7fc00000u & is_nan)) & 0xffff0000u;
}

#if PAGEDLLM_AVX512BF16
/* vcvtneps2bf16 flushes subnormal inputs and keeps NaN payloads: vectors with such lanes (vfpclassps)
 * take the exact path. */
#define BF16_FIXUP_CLASSES 0xa1 /* QNaN 0x01 | subnormal 0x20 | SNaN 0x80 */

static inline __m256i bf16_pack_fast(v16f x) { return (__m256i)_mm512_cvtneps_pbh((__m512)x); }

static inline int bf16_needs_exact(v16f x) { return _mm512_fpclass_ps_mask((__m512)x, BF16_FIXUP_CLASSES) != 0; }
#endif

static inline v16f round_bf16(v16f x) {
#if PAGEDLLM_AVX512BF16
    if (__builtin_expect(!bf16_needs_exact(x), 1))
        return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack_fast(x)), 16);
#endif
    return (v16f)bf16_bits_exact(x);
}

static inline void store_bf16(uint16_t *p, v16f x) {
#if PAGEDLLM_AVX512BF16
    if (__builtin_expect(!bf16_needs_exact(x), 1)) {
        _mm256_storeu_si256((__m256i *)p, bf16_pack_fast(x));
        return;
    }
#endif
    const v16u16 h = __builtin_convertvector(bf16_bits_exact(x) >> 16, v16u16);
    memcpy(p, &h, sizeof h);
}

/* x rounded to bfloat16, stored at p (16 values) and returned as float32 lanes. */
static inline v16f round_store_bf16(uint16_t *p, v16f x) {
#if PAGEDLLM_AVX512BF16
    if (__builtin_expect(!bf16_needs_exact(x), 1)) {
        const __m256i h = bf16_pack_fast(x);
        _mm256_storeu_si256((__m256i *)p, h);
        return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    }
#endif
    const v16u32 b = bf16_bits_exact(x);
    const v16u16 h = __builtin_convertvector(b >> 16, v16u16);
    memcpy(p, &h, sizeof h);
    return (v16f)b;
}

/* Store x, already a bfloat16 value (low 16 bits zero), at p: only the high halves are kept. */
static inline void store_bf16_rounded(uint16_t *p, v16f x) {
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)x, 16)));
    return;
#endif
    const v16u16 h = __builtin_convertvector((v16u32)x >> 16, v16u16);
    memcpy(p, &h, sizeof h);
}

/* Cephes expf without range handling: x = n ln2 + r (ln2 in two parts so r is exact), exp(r) by a
 * degree-7 polynomial; sets *n, the caller clamps x and multiplies by 2^n. */
static inline __attribute__((always_inline)) v16f exp_reduced_v16(v16f x, v16f *n_out) {
    const v16f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16f y = (v16f){0} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    *n_out = n;
    return y * (r * r) + r + 1.0f;
}

#endif /* PAGEDLLM_NATIVE_SIMD_H */
