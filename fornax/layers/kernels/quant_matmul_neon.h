/* quant_matmul.c's helpers in Arm NEON (AArch64), for CPUs without AVX-512 or AVX2: Arm
 * servers (Graviton, Ampere, Grace) and Apple silicon. Included by quant_matmul.c only; the
 * formats and the contracts of quantize_row, offset_dot and tile are the AVX-512 versions'
 * there, and the same packed weights serve every instruction set.
 *
 * The integer dot product: with the Armv8.2 dot product extension (__ARM_FEATURE_DOTPROD,
 * every Arm server core since Neoverse N1), sdot sums 4 signed x signed byte products into
 * each int32 lane: the same lanes VNNI's dpbusd fills, so the activation scales per 4 values
 * line up with the lanes as they do there. Signed on both sides: a Q4 weight (0..15) is a
 * valid int8 as it is, and a Q8 weight needs no sign moved onto the activation. Without the
 * extension (Cortex-A72 and older), smull makes the 16 products exactly in int16 (at most
 * 127 x 127 in magnitude) and two pairwise widening adds sum each 4 into an int32 lane.
 *
 * A pair of blocks (64 values) is four vectors of 16: values 0-15 and 16-31 (the pair's first
 * block: Q4 low nibbles), 32-47 and 48-63 (the second block: high nibbles). Each block's two
 * vectors are scaled by their activation scales and summed, then take the block's weight
 * scale in one multiply-add into the output's accumulator. */
#include <arm_neon.h>

static inline float32x4_t qmm_load_f16x4(const uint16_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

static inline float qmm_f16_to_f32(uint16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

/* 4 int32 lanes, lane i = sum over bytes 4i..4i+3 of a[b] * b[b] (both signed). Exact. */
static inline int32x4_t qmm_dot(int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), a, b);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_high_s8(a, b);
    return vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
#endif
}

static void quantize_row(const float *x, int k, int8_t *xq, float *dxv, float *xsum) {
    const float32x4_t c127 = vdupq_n_f32(127.f);
    for (int i = 0; i < k; i += 16) {
        float32x4_t v[4];
        for (int j = 0; j < 4; j++) v[j] = vld1q_f32(x + i + 4 * j);
        /* pairwise maxima twice: lane g = max |x| of the g-th group of 4 */
        const float32x4_t amax = vpmaxq_f32(vpmaxq_f32(vabsq_f32(v[0]), vabsq_f32(v[1])),
                                            vpmaxq_f32(vabsq_f32(v[2]), vabsq_f32(v[3])));
        const uint32x4_t live = vcgtq_f32(amax, vdupq_n_f32(0.f));
        const float32x4_t inv = vreinterpretq_f32_u32(vandq_u32(live, vreinterpretq_u32_f32(vdivq_f32(c127, amax))));
        vst1q_f32(dxv + i / 4, vdivq_f32(amax, c127));
        /* round to nearest even; |x| * 127 / max stays within 127, the narrowing saturates anyway */
        const int32x4_t q0 = vcvtnq_s32_f32(vmulq_laneq_f32(v[0], inv, 0));
        const int32x4_t q1 = vcvtnq_s32_f32(vmulq_laneq_f32(v[1], inv, 1));
        const int32x4_t q2 = vcvtnq_s32_f32(vmulq_laneq_f32(v[2], inv, 2));
        const int32x4_t q3 = vcvtnq_s32_f32(vmulq_laneq_f32(v[3], inv, 3));
        const int16x8_t h0 = vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1));
        const int16x8_t h1 = vcombine_s16(vqmovn_s32(q2), vqmovn_s32(q3));
        vst1q_s8(xq + i, vcombine_s8(vqmovn_s16(h0), vqmovn_s16(h1)));
    }
    for (int g = 0; g < k / QBLOCK; g++) {
        const float *xg = x + g * QBLOCK;
        float32x4_t s[4];
        for (int j = 0; j < 4; j++) s[j] = vaddq_f32(vld1q_f32(xg + 4 * j), vld1q_f32(xg + 16 + 4 * j));
        xsum[g] = vaddvq_f32(vaddq_f32(vaddq_f32(s[0], s[1]), vaddq_f32(s[2], s[3])));
    }
}

static inline float offset_dot(const uint16_t *m, const float *xs, int groups) {
    float32x4_t acc = vdupq_n_f32(0.f);
    int g = 0;
    for (; g + 4 <= groups; g += 4) acc = vfmaq_f32(acc, qmm_load_f16x4(m + g), vld1q_f32(xs + g));
    float s = vaddvq_f32(acc);
    for (; g < groups; g++) s += qmm_f16_to_f32(m[g]) * xs[g];
    return s;
}

static inline __attribute__((always_inline)) void tile(
    const int Q4, const uint8_t *w, const uint16_t *d, const uint16_t *m, int k,
    const quantized_x *q, int t0, const int NT, float *y, int y_stride) {
    enum { R = ROW_BLOCK };
    const int pairs = k / 64, groups = k / QBLOCK;
    const uint8x16_t nibble = vdupq_n_u8(0x0f);
    float32x4_t acc[R][2];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = vdupq_n_f32(0.f);
    for (int p = 0; p < pairs; p++) {
#if PREFETCH_BYTES > 0
        /* ahead in the tile stream (past its end runs into the next tile, which comes next) */
        for (int line = 0; line < (Q4 ? 2 : 4); line++)
            __builtin_prefetch((const char *)w + (long)p * (Q4 ? 32 : 64) * R + PREFETCH_BYTES + 64 * line, 0, 3);
#endif
        int8x16_t xv[2][4];
        float32x4_t sx[2][4];
        for (int j = 0; j < NT; j++) {
            const int8_t *xr = q->xq + (long)(t0 + j) * k + 64 * p;
            const float *sr = q->dxv + ((long)(t0 + j) * pairs + p) * 16;
            for (int i = 0; i < 4; i++) {
                xv[j][i] = vld1q_s8(xr + 16 * i);
                sx[j][i] = vld1q_f32(sr + 4 * i);
            }
        }
        /* the tile's 4 rows x 2 block scales of this pair: 8 contiguous float16 */
        float dw[2 * R];
        vst1q_f32(dw, qmm_load_f16x4(d + (long)p * 2 * R));
        vst1q_f32(dw + 4, qmm_load_f16x4(d + (long)p * 2 * R + 4));
        for (int r = 0; r < R; r++) {
            int8x16_t wv[4]; /* the pair's 64 values in order */
            if (Q4) {
                const uint8_t *wr = w + (long)p * 32 * R + 32 * r;
                const uint8x16_t v0 = vld1q_u8(wr), v1 = vld1q_u8(wr + 16);
                wv[0] = vreinterpretq_s8_u8(vandq_u8(v0, nibble));
                wv[1] = vreinterpretq_s8_u8(vandq_u8(v1, nibble));
                wv[2] = vreinterpretq_s8_u8(vshrq_n_u8(v0, 4));
                wv[3] = vreinterpretq_s8_u8(vshrq_n_u8(v1, 4));
            } else {
                const int8_t *wr = (const int8_t *)w + ((long)p * R + r) * 64;
                for (int i = 0; i < 4; i++) wv[i] = vld1q_s8(wr + 16 * i);
            }
            for (int j = 0; j < NT; j++) {
                float32x4_t b0 = vmulq_f32(vcvtq_f32_s32(qmm_dot(wv[0], xv[j][0])), sx[j][0]);
                b0 = vfmaq_f32(b0, vcvtq_f32_s32(qmm_dot(wv[1], xv[j][1])), sx[j][1]);
                float32x4_t b1 = vmulq_f32(vcvtq_f32_s32(qmm_dot(wv[2], xv[j][2])), sx[j][2]);
                b1 = vfmaq_f32(b1, vcvtq_f32_s32(qmm_dot(wv[3], xv[j][3])), sx[j][3]);
                acc[r][j] = vfmaq_n_f32(acc[r][j], b0, dw[2 * r]);
                acc[r][j] = vfmaq_n_f32(acc[r][j], b1, dw[2 * r + 1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NT; j++)
            y[r * y_stride + j] = vaddvq_f32(acc[r][j]) +
                (Q4 ? offset_dot(m + (long)r * groups, q->xsum + (long)(t0 + j) * groups, groups) : 0.f);
}
