/* AVX2 helpers the 256-bit kernels share (quant_matmul_avx2.h, int8_matmul_avx2.h,
 * f32_matmul.c, bf16_matmul.c, fused_ops.c, paged_attention.c): 8 values at a time in float32,
 * loaded from float32 or bf16, bf16 rounding as bf16.h does it, a horizontal sum and exp.
 * Defined wherever the compiler targets AVX2 with FMA and F16C (AVX-512 CPUs too); a kernel
 * with an AVX-512 path (vec512.h) takes that one first. */
#ifndef FORNAX_VEC256_H
#define FORNAX_VEC256_H

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <stdint.h>

#define HAVE_VEC256 1

static inline __m256 vload8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 vload8_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* The float each lane would hold after a store to the type and a load back (f32_to_bf16). */
static inline __m256 vround8_f32(__m256 x) { return x; }
static inline __m256 vround8_bf16(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), top = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), top);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, top), _mm256_set1_epi32(0x00400000));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan);
}

/* Store 8 lanes; for bf16 they must be rounded already (vround8_bf16). */
static inline void vstore8_f32(float *p, __m256 x) { _mm256_storeu_ps(p, x); }
static inline void vstore8_bf16(uint16_t *p, __m256 x) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

/* The sum of 8 lanes, always in the same order. */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* exp(x) as exp512 in vec512.h: 2^n * 2^f, 2^f by a degree-6 polynomial; 2^n built in the
 * exponent bits (n within [-126, 127] after the clamp). */
static inline __m256 exp256(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(_mm256_min_ps(t, _mm256_set1_ps(128.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    /* 2^n: n + 127 in the exponent field; n = 128 (overflow) gives inf via two halves */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

#else
#define HAVE_VEC256 0
#endif

#endif
