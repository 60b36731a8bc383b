/* AVX-512 helpers the kernels share: 16 values at a time in float32, loaded from and stored
 * to float32 or bf16, bf16 rounding as bf16.h does it (nearest even, quiet NaN), and exp.
 * Only defined where the compiler targets AVX-512F; callers keep their scalar loops for the
 * rest (and for tails shorter than 16). */
#ifndef FORNAX_VEC512_H
#define FORNAX_VEC512_H

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

#define HAVE_VEC512 1

static inline __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 vload_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* The float each lane would hold after a store to the type and a load back (f32_to_bf16). */
static inline __m512 vround_f32(__m512 x) { return x; }
static inline __m512 vround_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), top = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), top);
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, top), _mm512_set1_epi32(0x00400000));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* Store 16 lanes; for bf16 they must be rounded already (vround_bf16), so the top halves are the values. */
static inline void vstore_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void vstore_bf16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

/* exp(x) = 2^n * 2^f, n = round(x / ln 2), |f| <= 1/2; 2^f by a degree-6 polynomial (relative
 * error ~2e-7, float32's own rounding). Inputs below -87 give exp(-87); above ~88, inf. */
static inline __m512 exp512(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane t of the result = the sum of v[t]'s 16 lanes, for 16 vectors at once: ~3 shuffles and
 * adds per vector, where reducing each alone (_mm512_reduce_add_ps) takes ~8. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 pair[8], quad[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane L: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane L: the lane-L sums of v[4i .. 4i + 3] */
        const __m512d a = _mm512_castps_pd(pair[2 * i]), b = _mm512_castps_pd(pair[2 * i + 1]);
        quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* fold the four 128-bit lanes: lane 4m + i ends as the whole sum of v[4m + i] */
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88), _mm512_shuffle_f32x4(quad[0], quad[1], 0xdd));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88), _mm512_shuffle_f32x4(quad[2], quad[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xdd));
}

#else
#define HAVE_VEC512 0
#endif

#endif
