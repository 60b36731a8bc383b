/* Arm NEON helpers (AArch64): 4 float32 lanes at a time, loaded from and stored to float32
 * or bf16, bf16 rounding as bf16.h does it (nearest even, quiet NaN), a horizontal sum in a
 * fixed order and exp by the algorithm of exp256 (vec256.h): the same constants, clamp and
 * polynomial, so one lane gives the bits an AVX2 lane gives. vec.h maps its width-neutral
 * names onto these where neither AVX-512 nor AVX2 is there; callers keep their scalar loops
 * for the rest (and for tails shorter than 4). Tested under qemu: tests/arm. */
#ifndef FORNAX_VEC128_H
#define FORNAX_VEC128_H

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#include <stdint.h>

#define HAVE_VEC128 1

static inline float32x4_t vload4_f32(const float *p) { return vld1q_f32(p); }
/* bf16 is the top half of a float32: widen each u16 to u32 and shift it up by 16 (one SHLL). */
static inline float32x4_t vload4_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* The float each lane would hold after a store to the type and a load back (f32_to_bf16). */
static inline float32x4_t vround4_f32(float32x4_t x) { return x; }
static inline float32x4_t vround4_bf16(float32x4_t x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x), top = vdupq_n_u32(0xffff0000u);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vandq_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), lsb)), top);
    const uint32x4_t quiet = vorrq_u32(vandq_u32(u, top), vdupq_n_u32(0x00400000));
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(x, x)); /* all ones where x is NaN */
    return vreinterpretq_f32_u32(vbslq_u32(nan, quiet, rounded));
}

/* Store 4 lanes; for bf16 they must be rounded already (vround4_bf16), so the top halves are the values. */
static inline void vstore4_f32(float *p, float32x4_t x) { vst1q_f32(p, x); }
static inline void vstore4_bf16(uint16_t *p, float32x4_t x) {
    vst1_u16(p, vshrn_n_u32(vreinterpretq_u32_f32(x), 16));
}

/* The sum of 4 lanes, always in the same order: (v0 + v2) + (v1 + v3), as hsum256 folds its
 * upper half onto the lower first. */
static inline float hsum128(float32x4_t v) {
    const float32x2_t s = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
}

/* exp(x) as exp256 in vec256.h: 2^n * 2^f, n = round(x / ln 2) (to nearest even), 2^f by a
 * degree-6 polynomial; 2^n built in the exponent bits in two halves (n = 128 overflows to inf).
 * The clamp uses vmaxnm so that a quiet NaN input gives exp(-87) as _mm256_max_ps does
 * (it returns its second operand when either is NaN); vmax would pass the NaN through. */
static inline float32x4_t exp128(float32x4_t x) {
    const float32x4_t t = vmulq_f32(vmaxnmq_f32(x, vdupq_n_f32(-87.0f)), vdupq_n_f32(1.44269504088896341f));
    const float32x4_t n = vrndnq_f32(vminnmq_f32(t, vdupq_n_f32(128.0f)));
    const float32x4_t f = vmulq_f32(vsubq_f32(t, n), vdupq_n_f32(0.693147180559945309f));
    float32x4_t p = vdupq_n_f32(1.0f / 720);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, f);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, f);
    /* 2^n: n + 127 in the exponent field, as two factors so that n = 128 gives inf */
    const int32x4_t ni = vcvtnq_s32_f32(n);
    const int32x4_t half = vshrq_n_s32(ni, 1);
    const float32x4_t a = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
    const float32x4_t b = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, a), b);
}

#else
#define HAVE_VEC128 0
#endif

#endif
