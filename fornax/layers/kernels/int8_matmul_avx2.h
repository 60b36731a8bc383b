/* int8_matmul.c in 256-bit vectors, for CPUs with AVX2 and FMA but no AVX-512 VNNI.
 * Included by int8_matmul.c only; the weight panels, the rotation and the rounding are the
 * ones described there, so the same packed weights serve every instruction set.
 *
 * The product differs in one way. AVX2's byte dot product (vpmaddubsw) sums pairs of
 * unsigned x signed bytes into int16 with saturation, so the offset-128 activations of the
 * VNNI kernel (up to 255) times weights up to 127 could saturate. Here the activations stay
 * signed: |a| is the unsigned side and the weight takes a's sign (vpsignb), so each pair sums
 * to at most 2 x 127 x 127 = 32,258 and every int32 sum is exact, the same integers as VNNI's.
 * vpmaddwd by ones then adds the int16 pairs into the int32 lane of each 4 bytes. */
#include <omp.h>

#include "vec256.h"

/* One butterfly stage inside a vector: lanes under `upper` take partner - x, the rest x + partner. */
#define BUTTERFLY(x, partner, upper) _mm256_blend_ps(_mm256_add_ps(x, partner), _mm256_sub_ps(partner, x), upper)

/* H_32 on a block held as four vectors (values 0-7, 8-15, 16-23, 24-31). The stages run in
 * the AVX-512 version's order (distance 16, then 8, 4, 2, 1), so each value is the same sum. */
static inline void hadamard32_avx2(__m256 v[4]) {
    const __m256 a0 = _mm256_add_ps(v[0], v[2]), a1 = _mm256_add_ps(v[1], v[3]);
    const __m256 b0 = _mm256_sub_ps(v[0], v[2]), b1 = _mm256_sub_ps(v[1], v[3]);
    v[0] = _mm256_add_ps(a0, a1), v[1] = _mm256_sub_ps(a0, a1); /* distance 8 */
    v[2] = _mm256_add_ps(b0, b1), v[3] = _mm256_sub_ps(b0, b1);
    for (int j = 0; j < 4; j++) {
        __m256 x = v[j];
        x = BUTTERFLY(x, _mm256_permute2f128_ps(x, x, 0x01), 0xF0); /* distance 4 */
        x = BUTTERFLY(x, _mm256_permute_ps(x, 0x4E), 0xCC);         /* distance 2 */
        x = BUTTERFLY(x, _mm256_permute_ps(x, 0xB1), 0xAA);         /* distance 1 */
        v[j] = x;
    }
}

static inline void rotated_block(const uint16_t *xr, __m256 v[4]) {
    for (int j = 0; j < 4; j++) v[j] = vload8_bf16(xr + 8 * j);
    hadamard32_avx2(v);
}

static inline float rotated_max_avx2(const uint16_t *xr, int k) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < k; i += HBLOCK) {
        __m256 v[4];
        rotated_block(xr + i, v);
        for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    return hmax256(amax);
}

/* round(v * inv) clamped to [-127, 127], 32 values (four vectors) to 32 int8 in order. */
static inline __m256i round_int8(const __m256 v[4], __m256 inv) {
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
        const __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
        q[j] = _mm256_min_epi32(_mm256_max_epi32(i, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    }
    const __m256i ab = _mm256_packs_epi32(q[0], q[1]), cd = _mm256_packs_epi32(q[2], q[3]);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* As the AVX-512 quantize_row; offset must be 0 here (the product takes signed activations).
 * abs_out, where given, also receives |q| (the unsigned side of the product). */
static float quantize_row_abs(const uint16_t *xr, int k, int8_t *qr, uint8_t *abs_out, float given_max) {
    const float m = given_max >= 0.f ? given_max : rotated_max_avx2(xr, k);
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
    for (int i = 0; i < k; i += HBLOCK) {
        __m256 v[4];
        rotated_block(xr + i, v);
        const __m256i q = round_int8(v, inv);
        _mm256_storeu_si256((__m256i *)(qr + i), q);
        if (abs_out) _mm256_storeu_si256((__m256i *)(abs_out + i), _mm256_abs_epi8(q));
    }
    return m / 127.f;
}

#if !HAVE_VEC512 /* else int8_matmul.c has AVX-512 versions of these two */
static inline float rotated_max(const uint16_t *xr, int k) { return rotated_max_avx2(xr, k); }

static inline float quantize_row(const uint16_t *xr, int k, int8_t *qr, int offset, float given_max) {
    (void)offset; /* 0 from every caller on this path (see above) */
    return quantize_row_abs(xr, k, qr, NULL, given_max);
}
#endif

#define PANEL 64
#define HALF 32 /* channels per register block: 4 vectors of 8 int32 sums */
#define MR2 2   /* activation rows per register block: 8 accumulators of the 16 registers */
/* Values of K per pass over the rows: a pass reads 64 channels x KC bytes of the panel (16 KB),
 * which stays in L1 while every pair of rows meets it. Without it a pair of rows streamed the
 * whole half panel (48 KB at K = 1536) from L2 and the MLP's down projection ran at a sixth of
 * the speed of the others. Integer sums carried between passes are exact, so the blocking
 * changes no bit of the result. */
#define KC 256

/* R rows x the 32 channels [h * 32, h * 32 + 32) of one panel over K values [k0, k0 + kc):
 * sums added into part ([R][64] int32 for the panel's channels, zero before the first pass). */
static inline __attribute__((always_inline)) void half_panel_pass(
    const int R, const int8_t *q, const uint8_t *qa, int k, int k0, int kc, const int8_t *wp, int h,
    int32_t *part) {
    __m256i acc[4 * MR2];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[4 * r + j] = _mm256_loadu_si256((const __m256i *)(part + r * PANEL + HALF * h + 8 * j));
    for (int kq = k0 / 4; kq < (k0 + kc) / 4; kq++) {
        const int8_t *w = wp + (long)kq * 4 * PANEL + 4 * HALF * h;
        __m256i as[MR2], au[MR2];
        for (int r = 0; r < R; r++) {
            int32_t quad, aquad;
            memcpy(&quad, q + (long)r * k + 4 * kq, 4);
            memcpy(&aquad, qa + (long)r * k + 4 * kq, 4);
            as[r] = _mm256_set1_epi32(quad), au[r] = _mm256_set1_epi32(aquad);
        }
        for (int j = 0; j < 4; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * j));
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_maddubs_epi16(au[r], _mm256_sign_epi8(wv, as[r]));
                acc[4 * r + j] = _mm256_add_epi32(acc[4 * r + j], _mm256_madd_epi16(p, ones));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(part + r * PANEL + HALF * h + 8 * j), acc[4 * r + j]);
}

/* Every row x one panel of 64 channels (c0 .. c0 + 63, those below n), to bf16. part: [rows][64]
 * int32 scratch. */
static void rows_times_panel_avx2(const int8_t *q, const uint8_t *qa, const float *row_scale, int rows, int k,
                                  const int8_t *wp, const float *col_scale, int c0, int n, uint16_t *y,
                                  int32_t *part) {
    memset(part, 0, sizeof(int32_t) * (size_t)rows * PANEL);
    const int halves = c0 + HALF < n ? 2 : 1;
    for (int k0 = 0; k0 < k; k0 += KC) {
        const int kc = k - k0 < KC ? k - k0 : KC;
        for (int h = 0; h < halves; h++)
            for (int r0 = 0; r0 < rows; r0 += MR2) {
                const long at = (long)r0 * k;
                int32_t *pr = part + (long)r0 * PANEL;
                if (rows - r0 >= 2) half_panel_pass(2, q + at, qa + at, k, k0, kc, wp, h, pr);
                else half_panel_pass(1, q + at, qa + at, k, k0, kc, wp, h, pr);
            }
    }
    const int live_cols = n - c0 < PANEL ? n - c0 : PANEL;
    for (int r = 0; r < rows; r++) {
        const __m256 rs = _mm256_set1_ps(row_scale[r]);
        for (int c = 0; c < live_cols; c += 8) {
            float out[8];
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(part + (long)r * PANEL + c)));
            _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_mul_ps(rs, _mm256_loadu_ps(col_scale + c0 + c))));
            const int live = live_cols - c < 8 ? live_cols - c : 8;
            for (int i = 0; i < live; i++) y[(long)r * n + c0 + c + i] = f32_to_bf16(out[i]);
        }
    }
}

/* int8_matmul_bf16_given_max's body on this path (its checks done by the caller). */
static int int8_product(const uint16_t *x, long ldx, int rows, int k, const int8_t *wp,
                             const float *col_scale, int n, uint16_t *y, int num_threads, const float *given_max) {
    int8_t *q = malloc((size_t)rows * k * 2 + sizeof(float) * (size_t)rows);
    if (!q) return 2;
    uint8_t *qa = (uint8_t *)q + (size_t)rows * k;
    float *row_scale = (float *)(qa + (size_t)rows * k); /* k is a multiple of 32: aligned */
    const int panels = (n + PANEL - 1) / PANEL;
    int32_t *parts = malloc(sizeof(int32_t) * (size_t)(num_threads > 0 ? num_threads : 1) * rows * PANEL);
    if (!parts) {
        free(q);
        return 2;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            row_scale[r] = quantize_row_abs(x + (long)r * ldx, k, q + (long)r * k, qa + (long)r * k,
                                            given_max ? given_max[r] : -1.f);
        int32_t *part = parts + (size_t)omp_get_thread_num() * rows * PANEL; /* this thread's sums */
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; p++)
            rows_times_panel_avx2(q, qa, row_scale, rows, k, wp + (long)p * PANEL * k, col_scale, p * PANEL, n, y,
                                  part);
    }
    free(parts);
    free(q);
    return 0;
}
