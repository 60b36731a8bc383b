/* Weight-only 4-bit and 8-bit matmuls for small steps (decode, speculative verification):
 * y[T, N] = x[T, K] W^T with W in blocks of 32 input values, as llama.cpp's Q4_1 / Q8_0.
 *
 * Why this exists: torch's int4/int8 CPU kernels convert each weight to float and multiply
 * in float. Here the activations of a step are quantized once to int8 (one scale per 4
 * values, see quantize_row), and each weight block meets them in one integer dot product
 * (AVX-512 VNNI: 64 multiply-adds per instruction); the float work is one fused multiply-add
 * per pair of blocks. The step reads 5 (Q4) or 8.5 (Q8) bits per weight and little else.
 *
 * Formats (built by fornax/layers/linear.py):
 * - Q4: w = d * q + m, q in [0, 15], per row and block of 32. The 4-bit values of two
 *   neighbouring blocks share bytes: byte b of a pair holds block 2p's value b in its low
 *   nibble and block 2p+1's value b in its high nibble, so one 32-byte load splits into the
 *   64 values in order. d and m are float16 (as in the GGUF blocks).
 * - Q8: w = d * q, q in [-127, 127] int8, d float16.
 * Rows come in tiles of ROW_BLOCK (N padded up to a multiple): a tile's pair p of all its rows
 * lies together, then its pair p + 1, so a tile reads its weights and scales as one forward
 * stream ([N / 4, K / 64, 4, pair bytes]; d [N / 4, K / 64, 4, 2]); read row after row, four
 * interleaved short streams defeated the prefetcher and the LM head ran 3x slower. m stays
 * [N, K / 32].
 * Scales are half precision because a decode step is bound by memory bandwidth: float32
 * scales made Q4 6 bits per weight instead of 5, and the step that much slower.
 * K must be a multiple of 64 (every supported model's hidden and MLP widths are).
 *
 * The dot products are exact integers; the error against the float matmul comes from the
 * activations' 8-bit rounding (at most 1/254 of the largest of each 4 values). Block sums of x
 * for the Q4 offsets m are taken from the unrounded activations.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QMM_VNNI 1
#else
#define QMM_VNNI 0
#endif
/* The same kernel in 256-bit vectors (quant_matmul_avx2.h) and in NEON (quant_matmul_neon.h):
 * each defines quantize_row, offset_dot and tile with the AVX-512 versions' contracts below. */
#if !QMM_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMM_AVX2 1
#else
#define QMM_AVX2 0
#endif
#if !QMM_VNNI && !QMM_AVX2 && defined(__aarch64__) && defined(__ARM_NEON)
#define QMM_NEON 1
#else
#define QMM_NEON 0
#endif
#define QMM_ANY (QMM_VNNI || QMM_AVX2 || QMM_NEON)

#define QBLOCK 32
#define MAX_ROWS 64 /* activation rows per call; small steps have at most a few dozen */
#define ROW_BLOCK 4 /* output rows per tile */
/* Software prefetch distance in the weight stream. A decode step streams ~96 MB of weights
 * from memory; 2 KB ahead measured ~8% faster than the hardware prefetcher alone over a
 * model's worth of matrices (medians of 15 rounds: 4.51 vs 4.92 ms; 1 KB 4.60, 4 KB 4.57). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

/* 1 where the integer kernels were compiled in; the Python side keeps torch's kernels otherwise. */
int quant_matmul_available(void) { return QMM_ANY; }

#if QMM_ANY

/* One step's activations, quantized: xq [T, K] int8 with one scale per 4 consecutive values,
 * dxv [T, K / 4] those scales (16 per pair of blocks: the dot product's 16 lanes each sum 4
 * products, so a lane can carry its own activation scale at no cost in the inner loop; the
 * float multiply-add there scales each lane anyway), xsum [T, K / 32] exact block sums.
 *
 * Why groups of 4, not llama.cpp's blocks of 32: rounded against the largest of 32 values,
 * small activations lost most of their bits, and the default model's perplexity rose 1.3%
 * over bf16 with its own Q4_1 weights, against 0.1% for torch's kernel on bf16 activations.
 * Against the largest of 4, each value keeps about bf16's precision. */
typedef struct {
    int8_t *xq;
    float *dxv, *xsum;
} quantized_x;

#if QMM_VNNI
static void quantize_row(const float *x, int k, int8_t *xq, float *dxv, float *xsum) {
    const __m512i every_fourth = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    for (int i = 0; i < k; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        __m512 amax = _mm512_abs_ps(v);
        amax = _mm512_max_ps(amax, _mm512_permute_ps(amax, 0xb1)); /* neighbours: [1 0 3 2] */
        amax = _mm512_max_ps(amax, _mm512_permute_ps(amax, 0x4e)); /* pairs: [2 3 0 1] */
        const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(127.f), amax);
        const __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv)); /* round to nearest even */
        _mm_storeu_si128((__m128i *)(xq + i), _mm512_cvtsepi32_epi8(qv));
        const __m512 scale = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
        _mm_storeu_ps(dxv + i / 4, _mm512_castps512_ps128(_mm512_permutexvar_ps(every_fourth, scale)));
    }
    for (int g = 0; g < k / QBLOCK; g++)
        xsum[g] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_loadu_ps(x + g * QBLOCK), _mm512_loadu_ps(x + g * QBLOCK + 16)));
}

#elif QMM_AVX2
#include "quant_matmul_avx2.h"
#elif QMM_NEON
#include "quant_matmul_neon.h"
#endif

/* Per-call scratch, sized for the step; freed by the caller. NULL when out of memory. */
static int quantize_x(const float *x32, int t_rows, int k, quantized_x *q) {
    q->xq = aligned_alloc(64, (size_t)t_rows * k + 64);
    q->dxv = aligned_alloc(64, sizeof(float) * ((size_t)t_rows * (k / 64) * 16 + 16));
    q->xsum = malloc(sizeof(float) * (size_t)t_rows * (k / QBLOCK));
    if (!q->xq || !q->dxv || !q->xsum) return -1;
    for (int t = 0; t < t_rows; t++)
        quantize_row(x32 + (long)t * k, k, q->xq + (long)t * k, q->dxv + (long)t * (k / 64) * 16,
                     q->xsum + (long)t * (k / QBLOCK));
    return 0;
}

static void free_x(quantized_x *q) {
    free(q->xq);
    free(q->dxv);
    free(q->xsum);
}

#if QMM_VNNI
/* sum over g of m[g] * xs[g] (the Q4 offsets against exact block sums of x). */
static inline float offset_dot(const uint16_t *m, const float *xs, int groups) {
    __m512 acc = _mm512_setzero_ps();
    for (int g = 0; g < groups; g += 16) {
        const __mmask16 live = groups - g >= 16 ? 0xffff : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, m + g));
        acc = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(live, xs + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* A tile of R weight rows x NT activation rows: each pair of weight blocks is unpacked once
 * and meets NT activation rows; each activation pair is loaded once and meets R weight rows.
 * Several output rows per pass give the core independent accumulator chains to overlap
 * (one row alone waits on its own multiply-add chain) and share the activation loads.
 * y[r * y_stride + j] = row (o0 + r) . activation row (t0 + j). */
static inline __attribute__((always_inline)) void tile(
    const int Q4, const uint8_t *w, const uint16_t *d, const uint16_t *m, int k,
    const quantized_x *q, int t0, const int NT, float *y, int y_stride) {
    enum { R = ROW_BLOCK };
    const int pairs = k / 64, groups = k / QBLOCK;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512i row_pattern[R]; /* lanes [d(2p) x 8 | d(2p+1) x 8] of row r from the tile's 8 scales */
    for (int r = 0; r < R; r++)
        row_pattern[r] = _mm512_set_epi32(2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1,
                                          2 * r + 1, 2 * r + 1, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r,
                                          2 * r, 2 * r);
    __m512 acc[R][2];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
#if PREFETCH_BYTES > 0
        /* ahead in the tile stream (past its end runs into the next tile, which comes next) */
        for (int line = 0; line < (Q4 ? 2 : 4); line++)
            _mm_prefetch((const char *)w + (long)p * (Q4 ? 32 : 64) * R + PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
#endif
        __m512i xv[2];
        __m512 sx[2];
        for (int j = 0; j < NT; j++) {
            xv[j] = _mm512_loadu_si512(q->xq + (long)(t0 + j) * k + 64 * p);
            sx[j] = _mm512_load_ps(q->dxv + ((long)(t0 + j) * pairs + p) * 16);
        }
        /* the tile's 4 rows x 2 block scales of this pair: 16 contiguous bytes */
        const __m512 scales = _mm512_castps256_ps512(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + (long)p * 2 * R))));
        __m512i wv[R];
        if (Q4) {
            /* two rows per 64-byte load: split the nibbles of both, then regroup 128-bit lanes
             * into [row's low nibbles | row's high nibbles] = its 64 values in order */
            for (int r = 0; r < R; r += 2) {
                const __m512i v = _mm512_loadu_si512(w + (long)p * 32 * R + 32 * r);
                const __m512i lo = _mm512_and_si512(v, nibble);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                wv[r] = _mm512_shuffle_i64x2(lo, hi, 0x44);
                wv[r + 1] = _mm512_shuffle_i64x2(lo, hi, 0xee);
            }
        } else {
            for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_si512(w + ((long)p * R + r) * 64);
        }
        for (int r = 0; r < R; r++) {
            const __m512 sw = _mm512_permutexvar_ps(row_pattern[r], scales);
            if (Q4) {
                for (int j = 0; j < NT; j++) {
                    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv[j]);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sw, sx[j]), acc[r][j]);
                }
            } else {
                /* VNNI multiplies unsigned by signed bytes: |w| against x with w's sign moved onto it. */
                const __m512i uw = _mm512_abs_epi8(wv[r]);
                const __mmask64 neg = _mm512_movepi8_mask(wv[r]);
                for (int j = 0; j < NT; j++) {
                    const __m512i xs = _mm512_mask_sub_epi8(xv[j], neg, _mm512_setzero_si512(), xv[j]);
                    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uw, xs);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sw, sx[j]), acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NT; j++)
            y[r * y_stride + j] = _mm512_reduce_add_ps(acc[r][j]) +
                (Q4 ? offset_dot(m + (long)r * groups, q->xsum + (long)(t0 + j) * groups, groups) : 0.f);
}

#endif

/* A tile's rows for every activation row, two activation rows at a time. */
static inline __attribute__((always_inline)) void row_block(
    const int Q4, const uint8_t *w, const uint16_t *d, const uint16_t *m, int k, const quantized_x *q,
    int t_rows, float *y /* [ROW_BLOCK][MAX_ROWS] */) {
    int t0 = 0;
    for (; t0 + 2 <= t_rows; t0 += 2) tile(Q4, w, d, m, k, q, t0, 2, y + t0, MAX_ROWS);
    if (t0 < t_rows) tile(Q4, w, d, m, k, q, t0, 1, y + t0, MAX_ROWS);
}


/* x: [t_rows, k] with row stride x_stride (elements) of type T; y: [t_rows, n] contiguous. */
#define DEFINE_QUANT_MATMUL(NAME, T, LOAD, STORE, W_T, Q4)                                        \
    int NAME(const T *x, long x_stride, int t_rows, int k, const W_T *w, const uint16_t *d,      \
             const uint16_t *m, int n, T *y, int num_threads) {                                  \
        if (k % 64 || t_rows < 1 || t_rows > MAX_ROWS) return 1;                                  \
        float *x32 = malloc(sizeof(float) * (size_t)t_rows * k);                                 \
        if (!x32) return 2;                                                                      \
        for (int t = 0; t < t_rows; t++)                                                         \
            for (int i = 0; i < k; i++) x32[(long)t * k + i] = LOAD(x + t * x_stride, i);        \
        quantized_x q;                                                                           \
        const int bad = quantize_x(x32, t_rows, k, &q);                                          \
        free(x32);                                                                               \
        if (bad) { free_x(&q); return 2; }                                                       \
        const long tile_bytes = (long)ROW_BLOCK * (Q4 ? k / 2 : k);                              \
        const int groups = k / QBLOCK, blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;                 \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                   \
        for (int b = 0; b < blocks; b++) {                                                       \
            float out[ROW_BLOCK * MAX_ROWS];                                                     \
            const int o0 = b * ROW_BLOCK, live = n - o0 < ROW_BLOCK ? n - o0 : ROW_BLOCK;        \
            row_block(Q4, (const uint8_t *)w + b * tile_bytes, d + (long)o0 * groups,            \
                      Q4 ? m + (long)o0 * groups : 0, k, &q, t_rows, out);                       \
            for (int r = 0; r < live; r++)                                                       \
                for (int t = 0; t < t_rows; t++) STORE(y + (long)t * n, o0 + r, out[r * MAX_ROWS + t]); \
        }                                                                                        \
        free_x(&q);                                                                              \
        return 0;                                                                                \
    }

DEFINE_QUANT_MATMUL(q4_matmul_f32, float, LOAD_F32, STORE_F32, uint8_t, 1)
DEFINE_QUANT_MATMUL(q4_matmul_bf16, uint16_t, LOAD_BF16, STORE_BF16, uint8_t, 1)
DEFINE_QUANT_MATMUL(q8_matmul_f32, float, LOAD_F32, STORE_F32, int8_t, 0)
DEFINE_QUANT_MATMUL(q8_matmul_bf16, uint16_t, LOAD_BF16, STORE_BF16, int8_t, 0)

#endif
