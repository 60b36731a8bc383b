/* int8_matmul.c in Arm NEON (AArch64), for CPUs without AVX-512 or AVX2. Included by
 * int8_matmul.c only; the weight panels, the rotation and the rounding are the ones described
 * there, so the same packed weights serve every instruction set.
 *
 * The activations stay signed, as on the AVX2 path (offset 0, no column sums): the Armv8.2
 * dot product (__ARM_FEATURE_DOTPROD) multiplies signed by signed bytes, 4 per int32 lane.
 * A weight vector of 16 bytes is 4 channels x 4 consecutive values (the panels' k-quads), so
 * one sdot by an activation quad (its lane form: one of the 4 quads of a 16-byte activation
 * load) adds 4 products into each of the 4 channels' sums. Without the extension, smull
 * makes 8 products exactly in int16 and sadalp adds them in pairs into int32 lanes; the pairs
 * of each channel are added once at the end. Either way each sum is the exact int32 of the
 * other paths, and the float ops after it (float(sum) * (row_scale * col_scale), one bf16
 * rounding) are the AVX2 path's, as are the transform's adds and the rounding: the same bits.
 *
 * With the Armv8.6 int8 matrix multiply (__ARM_FEATURE_MATMUL_INT8: Neoverse V1 / V2 / N2,
 * Graviton 3 and 4, Grace), smmla does twice sdot's multiply-adds per instruction: see
 * quarter_block. The sums are again the exact int32s.
 *
 * A register block is R rows (up to MR_NEON) x 16 channels, a quarter of a panel: 4 int32
 * vectors per row (8 without the dot product), its weights reused by the R rows. */
#include <arm_neon.h>

static inline void bf16x32_load(const uint16_t *p, float32x4_t v[8]) {
    for (int j = 0; j < 4; j++) {
        const uint16x8_t h = vld1q_u16(p + 8 * j);
        v[2 * j] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        v[2 * j + 1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
    }
}

/* One butterfly stage between two vectors: a takes a + b, b takes a - b (lower - upper). */
#define BUTTERFLY_NEON(a, b)                                  \
    do {                                                      \
        const float32x4_t sum_ = vaddq_f32(a, b), dif_ = vsubq_f32(a, b); \
        (a) = sum_, (b) = dif_;                               \
    } while (0)

/* H_32 on a block held as eight vectors (values 4i..4i+3 in v[i]). The stages run in the
 * AVX-512 version's order (distance 16, then 8, 4, 2, 1), lower + upper and lower - upper at
 * each, so each value is the same sum as there. */
static inline void hadamard32_neon(float32x4_t v[8]) {
    for (int i = 0; i < 4; i++) BUTTERFLY_NEON(v[i], v[i + 4]); /* distance 16 */
    for (int h = 0; h < 8; h += 4)
        for (int i = 0; i < 2; i++) BUTTERFLY_NEON(v[h + i], v[h + i + 2]); /* distance 8 */
    for (int i = 0; i < 8; i += 2) BUTTERFLY_NEON(v[i], v[i + 1]); /* distance 4 */
    for (int i = 0; i < 8; i += 2) {
        /* distance 2, two vectors a, b at once: [a0 a1 b0 b1] against [a2 a3 b2 b3] */
        const float64x2_t a = vreinterpretq_f64_f32(v[i]), b = vreinterpretq_f64_f32(v[i + 1]);
        const float32x4_t lo = vreinterpretq_f32_f64(vzip1q_f64(a, b)), hi = vreinterpretq_f32_f64(vzip2q_f64(a, b));
        const float64x2_t s = vreinterpretq_f64_f32(vaddq_f32(lo, hi)), d = vreinterpretq_f64_f32(vsubq_f32(lo, hi));
        const float32x4_t a2 = vreinterpretq_f32_f64(vzip1q_f64(s, d)), b2 = vreinterpretq_f32_f64(vzip2q_f64(s, d));
        /* distance 1: even lanes against odd lanes */
        const float32x4_t even = vuzp1q_f32(a2, b2), odd = vuzp2q_f32(a2, b2);
        const float32x4_t s1 = vaddq_f32(even, odd), d1 = vsubq_f32(even, odd);
        v[i] = vzip1q_f32(s1, d1);
        v[i + 1] = vzip2q_f32(s1, d1);
    }
}

static inline void rotated_block_neon(const uint16_t *xr, float32x4_t v[8]) {
    bf16x32_load(xr, v);
    hadamard32_neon(v);
}

/* max|v| over one row's blockwise transform v. */
static inline float rotated_max(const uint16_t *xr, int k) {
    float32x4_t amax = vdupq_n_f32(0.f);
    for (int i = 0; i < k; i += HBLOCK) {
        float32x4_t v[8];
        rotated_block_neon(xr + i, v);
        for (int j = 0; j < 8; j++) amax = vmaxq_f32(amax, vabsq_f32(v[j]));
    }
    return vmaxvq_f32(amax);
}

/* round(v * inv) clamped to [-127, 127], 16 values (four vectors) to 16 int8 in order. */
static inline int8x16_t round_int8_neon(const float32x4_t v[4], float32x4_t inv) {
    int16x4_t h[4];
    for (int j = 0; j < 4; j++) {
        const int32x4_t i = vcvtnq_s32_f32(vmulq_f32(v[j], inv)); /* nearest even */
        h[j] = vmovn_s32(vminq_s32(vmaxq_s32(i, vdupq_n_s32(-127)), vdupq_n_s32(127)));
    }
    return vcombine_s8(vmovn_s16(vcombine_s16(h[0], h[1])), vmovn_s16(vcombine_s16(h[2], h[3])));
}

/* As the AVX-512 quantize_row; offset must be 0 here (the product takes signed activations). */
static inline float quantize_row(const uint16_t *xr, int k, int8_t *qr, int offset, float given_max) {
    (void)offset; /* 0 from every caller on this path (see above) */
    const float m = given_max >= 0.f ? given_max : rotated_max(xr, k);
    const float32x4_t inv = vdupq_n_f32(m > 0.f ? 127.f / m : 0.f);
    for (int i = 0; i < k; i += HBLOCK) {
        float32x4_t v[8];
        rotated_block_neon(xr + i, v);
        vst1q_s8(qr + i, round_int8_neon(v, inv));
        vst1q_s8(qr + i + 16, round_int8_neon(v + 4, inv));
    }
    return m / 127.f;
}

#define PANEL 64
#define QUARTER 16 /* channels per register block */
#if defined(__ARM_FEATURE_MATMUL_INT8) || defined(__ARM_FEATURE_DOTPROD)
#define MR_NEON 4 /* rows per register block: 16 accumulators of the 32 registers */
#else
#define MR_NEON 2 /* 16 accumulators too: each channel's sum is two pair lanes until the end */
#endif

/* R rows x the 16 channels c .. c + 15 of one panel (wq: the panel's weights at those
 * channels' first quad), sums to bf16 (channels below n). */
static inline __attribute__((always_inline)) void quarter_block(
    const int R, const int8_t *q, int k, const int8_t *wq, const float *row_scale, const float *col_scale,
    int c, int n, uint16_t *y) {
    int32x4_t sum[MR_NEON][4];
#if defined(__ARM_FEATURE_MATMUL_INT8)
    /* smmla: a 2 x 8 block of activations (rows 2h, 2h + 1; 8 consecutive values) times a
     * 2 x 8 block of weights (two channels' same 8 values) into a 2 x 2 block of sums
     * [row 2h: c, c + 1 | row 2h + 1: c, c + 1]. Two k-quads of the panel interleaved by
     * 32-bit lanes give each channel its 8 values in a row. An odd last row meets zeros. */
    int32x4_t mm[MR_NEON / 2][8]; /* [row pair][channel pair (2i, 2i + 1)] */
    for (int h = 0; h < (R + 1) / 2; h++)
        for (int i = 0; i < 8; i++) mm[h][i] = vdupq_n_s32(0);
    for (int kk = 0; kk < k; kk += 8) {
        const int8_t *w = wq + (long)(kk / 4) * 4 * PANEL;
        int8x16_t b[8];
        for (int j = 0; j < 4; j++) {
            const int32x4_t w0 = vreinterpretq_s32_s8(vld1q_s8(w + 16 * j));
            const int32x4_t w1 = vreinterpretq_s32_s8(vld1q_s8(w + 4 * PANEL + 16 * j));
            b[2 * j] = vreinterpretq_s8_s32(vzip1q_s32(w0, w1));
            b[2 * j + 1] = vreinterpretq_s8_s32(vzip2q_s32(w0, w1));
        }
        for (int h = 0; h < (R + 1) / 2; h++) {
            const int8x8_t lo = vld1_s8(q + (long)(2 * h) * k + kk);
            const int8x8_t hi = 2 * h + 1 < R ? vld1_s8(q + (long)(2 * h + 1) * k + kk) : vdup_n_s8(0);
            const int8x16_t a = vcombine_s8(lo, hi);
            for (int i = 0; i < 8; i++) mm[h][i] = vmmlaq_s32(mm[h][i], a, b[i]);
        }
    }
    for (int h = 0; h < (R + 1) / 2; h++)
        for (int j = 0; j < 4; j++) {
            const int64x2_t c01 = vreinterpretq_s64_s32(mm[h][2 * j]), c23 = vreinterpretq_s64_s32(mm[h][2 * j + 1]);
            sum[2 * h][j] = vreinterpretq_s32_s64(vzip1q_s64(c01, c23));
            if (2 * h + 1 < R) sum[2 * h + 1][j] = vreinterpretq_s32_s64(vzip2q_s64(c01, c23));
        }
#elif defined(__ARM_FEATURE_DOTPROD)
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) sum[r][j] = vdupq_n_s32(0);
    for (int kk = 0; kk < k; kk += 16) { /* four k-quads a step: one 16-byte load per row */
        const int8_t *w = wq + (long)(kk / 4) * 4 * PANEL;
        int8x16_t a[MR_NEON];
        for (int r = 0; r < R; r++) a[r] = vld1q_s8(q + (long)r * k + kk);
#define QUAD_STEP(L)                                                                           \
    do {                                                                                       \
        int8x16_t wv[4];                                                                       \
        for (int j = 0; j < 4; j++) wv[j] = vld1q_s8(w + (L) * 4 * PANEL + 16 * j);            \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) sum[r][j] = vdotq_laneq_s32(sum[r][j], wv[j], a[r], L); \
    } while (0)
        QUAD_STEP(0);
        QUAD_STEP(1);
        QUAD_STEP(2);
        QUAD_STEP(3);
#undef QUAD_STEP
    }
#else
    int32x4_t pair[MR_NEON][8]; /* [r][2j]: channels 4j, 4j + 1; [r][2j + 1]: 4j + 2, 4j + 3; two lanes each */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 8; j++) pair[r][j] = vdupq_n_s32(0);
    for (int kq = 0; kq < k / 4; kq++) {
        const int8_t *w = wq + (long)kq * 4 * PANEL;
        int8x8_t a[MR_NEON];
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, q + (long)r * k + 4 * kq, 4);
            a[r] = vreinterpret_s8_s32(vdup_n_s32(quad));
        }
        for (int j = 0; j < 4; j++) {
            const int8x16_t wv = vld1q_s8(w + 16 * j);
            for (int r = 0; r < R; r++) {
                pair[r][2 * j] = vpadalq_s16(pair[r][2 * j], vmull_s8(vget_low_s8(wv), a[r]));
                pair[r][2 * j + 1] = vpadalq_s16(pair[r][2 * j + 1], vmull_s8(vget_high_s8(wv), a[r]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) sum[r][j] = vpaddq_s32(pair[r][2 * j], pair[r][2 * j + 1]);
#endif
    for (int j = 0; j < 4; j++) {
        const int cj = c + 4 * j;
        if (cj >= n) break;
        const float32x4_t cs = vld1q_f32(col_scale + cj); /* col_scale has n_pad entries */
        const int live = n - cj < 4 ? n - cj : 4;
        for (int r = 0; r < R; r++) {
            float out[4];
            vst1q_f32(out, vmulq_f32(vcvtq_f32_s32(sum[r][j]), vmulq_f32(vdupq_n_f32(row_scale[r]), cs)));
            for (int i = 0; i < live; i++) y[(long)r * n + cj + i] = f32_to_bf16(out[i]);
        }
    }
}

static void rows_times_panel_neon(const int8_t *q, const float *row_scale, int rows, int k, const int8_t *wp,
                                  const float *col_scale, int c0, int n, uint16_t *y) {
    for (int j = 0; j < PANEL / QUARTER && c0 + QUARTER * j < n; j++) {
        const int8_t *wq = wp + 4 * QUARTER * j; /* the quarter's bytes within each 256-byte k-quad */
        for (int r0 = 0; r0 < rows; r0 += MR_NEON) {
            const int8_t *qr = q + (long)r0 * k;
            const float *rs = row_scale + r0;
            uint16_t *yr = y + (long)r0 * n;
            const int c = c0 + QUARTER * j;
            switch (rows - r0 < MR_NEON ? rows - r0 : MR_NEON) {
#if MR_NEON > 2
            case 4: quarter_block(4, qr, k, wq, rs, col_scale, c, n, yr); break;
            case 3: quarter_block(3, qr, k, wq, rs, col_scale, c, n, yr); break;
#endif
            case 2: quarter_block(2, qr, k, wq, rs, col_scale, c, n, yr); break;
            default: quarter_block(1, qr, k, wq, rs, col_scale, c, n, yr); break;
            }
        }
    }
}

/* int8_matmul_bf16_given_max's body on this path (its checks done by the caller). */
static int int8_product(const uint16_t *x, long ldx, int rows, int k, const int8_t *wp, const float *col_scale,
                        int n, uint16_t *y, int num_threads, const float *given_max) {
    int8_t *q = malloc((size_t)rows * k + sizeof(float) * (size_t)rows);
    if (!q) return 2;
    float *row_scale = (float *)(q + (size_t)rows * k); /* k is a multiple of 32: aligned */
    const int panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            row_scale[r] = quantize_row(x + (long)r * ldx, k, q + (long)r * k, 0, given_max ? given_max[r] : -1.f);
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; p++)
            rows_times_panel_neon(q, row_scale, rows, k, wp + (long)p * PANEL * k, col_scale, p * PANEL, n, y);
    }
    free(q);
    return 0;
}
