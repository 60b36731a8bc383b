/* int8 x int8 matmuls with per-token activation scales (layers/linear.py Int8Rotated):
 * y = x W^T, with x rounded to int8 per row and W to int8 per output channel, both after a
 * blockwise Hadamard rotation.
 *
 * Why: int8 dot products (AVX-512 VNNI) do twice the multiply-adds per instruction of bf16
 * ones, and read half the weight bytes. Over the default model's weights, from memory, this
 * kernel (activation rounding included) was 2.2-2.8x the native bf16 kernel at 4-64 rows and
 * 1.8-2.1x oneDNN's bf16 linear at 128-512; torch._int_mm's product alone (activations
 * already int8, sums left in int32) was 1.2-2.3x slower up to 64 rows and level past 128
 * (benchmarks/int8_matmul.py, 2026-12-03).
 *
 * Quantizing a whole row of activations with one scale loses precision where a few channels
 * are much larger than the rest (LLM activations have such outlier channels): +5% perplexity
 * on the default model. So each row is first rotated by a 32-point Hadamard transform per
 * block of 32 (the weights by the same transform, once, at load): x W^T = (x H)(W H)^T for
 * an orthogonal H, and the rotation spreads an outlier over its block before the row's
 * maximum is taken (QuaRot, Ashkboos et al. 2024, with small blocks). That brought the loss
 * to under 1%.
 *
 * H here is the unnormalized Sylvester matrix (entries +-1, H H^T = 32 I); the weight side
 * carries the 1/32. Rounding is to nearest even (the CPU's default), clamped to [-127, 127].
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec512.h"

#define HBLOCK 32


#if HAVE_VEC512
/* One butterfly stage inside a vector: lane i pairs with lane i ^ h; the lower lane of each
 * pair takes the sum, the upper one the difference (lower - upper). */
static inline __m512 butterfly(__m512 x, __m512 partner, __mmask16 upper) {
    return _mm512_mask_sub_ps(_mm512_add_ps(x, partner), upper, partner, x);
}

/* H_32 on a block held as two vectors (values 0-15, 16-31): [H16(a + b), H16(a - b)]. */
static inline void hadamard32(__m512 *a, __m512 *b) {
    __m512 v[2] = {_mm512_add_ps(*a, *b), _mm512_sub_ps(*a, *b)};
    for (int j = 0; j < 2; j++) {
        __m512 x = v[j];
        x = butterfly(x, _mm512_shuffle_f32x4(x, x, 0x4E), 0xFF00); /* distance 8 */
        x = butterfly(x, _mm512_shuffle_f32x4(x, x, 0xB1), 0xF0F0); /* distance 4 */
        x = butterfly(x, _mm512_permute_ps(x, 0x4E), 0xCCCC);       /* distance 2 */
        x = butterfly(x, _mm512_permute_ps(x, 0xB1), 0xAAAA);       /* distance 1 */
        v[j] = x;
    }
    *a = v[0];
    *b = v[1];
}

/* Round 16 values times inv to int8 (nearest even, clamped to [-127, 127]), plus `offset`
 * (0, or 128 for the unsigned form VNNI's dpbusd takes on its left). */
static inline void store_int8(int8_t *q, __m512 x, __m512 inv, int offset) {
    __m512i i = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv)), _mm512_set1_epi32(-127));
    i = _mm512_add_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(offset));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i));
}

/* max|v| over one row's blockwise transform v. */
static inline float rotated_max(const uint16_t *xr, int k) {
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < k; i += HBLOCK) {
        __m512 a = vload_bf16(xr + i), b = vload_bf16(xr + i + 16);
        hadamard32(&a, &b);
        amax = _mm512_max_ps(amax, _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    }
    return _mm512_reduce_max_ps(amax);
}

/* One row: the blockwise transform, then q = round(v / scale) + offset with scale = m / 127,
 * m the row's max|v| (0 for a zero row), or `given_max` where that is >= 0: a tensor-parallel
 * rank's row is a slice of the whole row, and the whole row's maximum (a max all-reduce of the
 * ranks' rotated_max) gives the slice the rounding the whole row gets. The transform is done
 * twice (once for the maximum, once to round) rather than kept: a few adds per value on a row
 * in L1, and no buffer. */
static float quantize_row(const uint16_t *xr, int k, int8_t *qr, int offset, float given_max) {
    const float m = given_max >= 0.f ? given_max : rotated_max(xr, k);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    for (int i = 0; i < k; i += HBLOCK) {
        __m512 a = vload_bf16(xr + i), b = vload_bf16(xr + i + 16);
        hadamard32(&a, &b);
        store_int8(qr + i, a, inv, offset);
        store_int8(qr + i + 16, b, inv, offset);
    }
    return m / 127.f;
}
#endif

/* The product without VNNI: AVX2 (also on AVX-512 CPUs without VNNI) or NEON. Each header
 * brings its own rotation for the product, and rotated_max / quantize_row where no AVX-512
 * ones exist. */
#if !(HAVE_VEC512 && defined(__AVX512VNNI__)) && defined(__AVX2__) && defined(__FMA__)
#include "int8_matmul_avx2.h"
#define HAVE_AVX2_PRODUCT 1
#else
#define HAVE_AVX2_PRODUCT 0
#endif
#if !HAVE_VEC512 && !HAVE_AVX2_PRODUCT && defined(__aarch64__) && defined(__ARM_NEON)
#include "int8_matmul_neon.h"
#define HAVE_NEON_PRODUCT 1
#else
#define HAVE_NEON_PRODUCT 0
#endif
#define HAVE_ROTATE (HAVE_VEC512 || HAVE_AVX2_PRODUCT || HAVE_NEON_PRODUCT)

/* q [rows, k] int8 and scale [rows] from x [rows, k] bf16 (row stride ldx), as quantize_row
 * with no offset (given_max as there, or NULL): the rounding int8_matmul_bf16 does, exposed so
 * tests can check it. k must be a multiple of 32. Returns 0, 1 for a bad k, 3 where not
 * compiled in. */
int rotate_quantize_rows_bf16(const uint16_t *x, long ldx, int rows, int k, int8_t *q, float *scale,
                              int num_threads, const float *given_max) {
#if HAVE_ROTATE
    if (k % HBLOCK) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 4)
    for (int r = 0; r < rows; r++)
        scale[r] = quantize_row(x + (long)r * ldx, k, q + (long)r * k, 0, given_max ? given_max[r] : -1.f);
    return 0;
#else
    (void)x, (void)ldx, (void)rows, (void)k, (void)q, (void)scale, (void)num_threads, (void)given_max;
    return 3;
#endif
}

/* ---- the product for up to a few dozen rows: y [rows, n] bf16 = x W^T ----
 *
 * Weights (packed by layers/linear.py Int8Rotated): the rotated int8 weight in panels of 64
 * output channels, [n_pad / 64, k / 4, 64, 4] (n_pad = n rounded up to 64, zero rows), so a
 * panel's 4 values of 64 channels are 256 consecutive bytes and a panel is one forward
 * stream; colsum [n_pad] int32 (each channel's sum of int8 weights); scale [n_pad] float.
 * Activations are rounded per row (quantize_row) with offset 128: dpbusd multiplies unsigned
 * by signed bytes, and sum((q + 128) w) - 128 colsum = sum(q w) exactly.
 * A register block is MR rows x 64 channels: 4 * MR int32 accumulators, each k-quad one
 * broadcast of 4 activation bytes per row and 4 weight loads shared by the rows. */
#if HAVE_VEC512 && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#define PANEL 64
#define MR 6

/* R rows x one panel, sums to bf16 (columns c0 .. c0 + 63, those below n). One function with
 * its accumulators local, every loop over them unrolled: so they live in registers (passed
 * between functions, GCC kept them on the stack, at a third of the speed). */
static inline __attribute__((always_inline)) void panel_block(const int R, const uint8_t *a, int k,
                                                              const int8_t *wp, const float *row_scale,
                                                              const int32_t *colsum, const float *col_scale,
                                                              int c0, int n, uint16_t *y) {
    __m512i acc[4 * MR];
#pragma GCC unroll 24
    for (int i = 0; i < 4 * R; i++) acc[i] = _mm512_setzero_si512();
    for (int kq = 0; kq < k / 4; kq++) {
        const int8_t *w = wp + (long)kq * 4 * PANEL;
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, a + (long)r * k + 4 * kq, 4);
            const __m512i av = _mm512_set1_epi32(quad);
            acc[4 * r + 0] = _mm512_dpbusd_epi32(acc[4 * r + 0], av, w0);
            acc[4 * r + 1] = _mm512_dpbusd_epi32(acc[4 * r + 1], av, w1);
            acc[4 * r + 2] = _mm512_dpbusd_epi32(acc[4 * r + 2], av, w2);
            acc[4 * r + 3] = _mm512_dpbusd_epi32(acc[4 * r + 3], av, w3);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const int c = c0 + 16 * j;
        if (c >= n) break;
        const __mmask16 live = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(colsum + c), 7); /* 128 colsum */
        const __m512 cs = _mm512_loadu_ps(col_scale + c);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[4 * r + j], offset));
            const __m512 v = vround_bf16(_mm512_mul_ps(sums, _mm512_mul_ps(_mm512_set1_ps(row_scale[r]), cs)));
            const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
            _mm256_mask_storeu_epi16(y + (long)r * n + c, live, h);
        }
    }
}

static void rows_times_panel(const uint8_t *a, const float *row_scale, int rows, int k, const int8_t *wp,
                             const int32_t *colsum, const float *col_scale, int c0, int n, uint16_t *y) {
    for (int r0 = 0; r0 < rows; r0 += MR) {
        const uint8_t *ar = a + (long)r0 * k;
        uint16_t *yr = y + (long)r0 * n;
        const float *rs = row_scale + r0;
        switch (rows - r0 < MR ? rows - r0 : MR) {
#define ROWS_CASE(R) case R: panel_block(R, ar, k, wp, rs, colsum, col_scale, c0, n, yr); break;
        ROWS_CASE(6) ROWS_CASE(5) ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) ROWS_CASE(1)
#undef ROWS_CASE
        }
    }
}
#else
#define HAVE_VNNI 0
#endif

/* row_max [rows]: each row's max|v| (rotated_max), for a max all-reduce across tensor-parallel
 * ranks before int8_matmul_bf16_given_max. Returns 0, 1 for a bad k, 3 where not compiled in. */
int rotated_row_max_bf16(const uint16_t *x, long ldx, int rows, int k, float *row_max, int num_threads) {
#if HAVE_ROTATE
    if (k % HBLOCK) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 4)
    for (int r = 0; r < rows; r++) row_max[r] = rotated_max(x + (long)r * ldx, k);
    return 0;
#else
    (void)x, (void)ldx, (void)rows, (void)k, (void)row_max, (void)num_threads;
    return 3;
#endif
}

/* 1 where compiled in (AVX-512 VNNI, AVX2, NEON); the Python side keeps bf16 otherwise. */
int int8_matmul_available(void) { return HAVE_VNNI || HAVE_AVX2_PRODUCT || HAVE_NEON_PRODUCT; }

/* x [rows, k] bf16 (row stride ldx), weights as above; y [rows, n] bf16; given_max [rows] or
 * NULL: each row's rounding maximum, where not the row's own (quantize_row). Returns 0; 1 bad
 * shape; 2 no memory; 3 not compiled in. */
int int8_matmul_bf16_given_max(const uint16_t *x, long ldx, int rows, int k, const int8_t *wp,
                               const int32_t *colsum, const float *col_scale, int n, uint16_t *y,
                               int num_threads, const float *given_max) {
#if HAVE_VNNI
    if (k % HBLOCK || rows < 1 || n < 1) return 1;
    uint8_t *a = malloc((size_t)rows * k + sizeof(float) * (size_t)rows);
    if (!a) return 2;
    float *row_scale = (float *)(a + (size_t)rows * k); /* k is a multiple of 32: aligned */
    const int panels = (n + PANEL - 1) / PANEL;
    /* One parallel region for both phases (a step makes ~4 calls per layer: each region is a
     * wake-up and a barrier). Panels are handed out one at a time: when another process takes
     * a core mid-call (a load generator on the same machine, the HTTP loop), the thread left
     * running does the rest instead of waiting for its partner's static share. */
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            row_scale[r] = quantize_row(x + (long)r * ldx, k, (int8_t *)a + (long)r * k, 128,
                                        given_max ? given_max[r] : -1.f);
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; p++)
            rows_times_panel(a, row_scale, rows, k, wp + (long)p * PANEL * k, colsum, col_scale, p * PANEL, n, y);
    }
    free(a);
    return 0;
#elif HAVE_AVX2_PRODUCT || HAVE_NEON_PRODUCT
    (void)colsum; /* the offset-free product needs no column sums */
    if (k % HBLOCK || rows < 1 || n < 1) return 1;
    return int8_product(x, ldx, rows, k, wp, col_scale, n, y, num_threads, given_max);
#else
    (void)x, (void)ldx, (void)rows, (void)k, (void)wp, (void)colsum, (void)col_scale, (void)n, (void)y,
        (void)num_threads, (void)given_max;
    return 3;
#endif
}

int int8_matmul_bf16(const uint16_t *x, long ldx, int rows, int k, const int8_t *wp, const int32_t *colsum,
                     const float *col_scale, int n, uint16_t *y, int num_threads) {
    return int8_matmul_bf16_given_max(x, ldx, rows, k, wp, colsum, col_scale, n, y, num_threads, NULL);
}
