/* The tile of the dense small-step kernels (bf16_matmul.c, f32_matmul.c) in 256-bit vectors,
 * for CPUs without AVX-512: 4 weight rows against up to 2 activation rows, every product a
 * float32 fused multiply-add (a product of two bf16 values is exact in float32, as in
 * VDPBF16PS), 8 lanes per output summed in K order, then each output's lanes added by
 * hsum256 in one fixed order. Neither the tile's live rows nor the call's activation rows
 * change how an output is summed, so a row's result does not depend on the batch it came in
 * (deterministic mode, docs/deterministic.md). K must be a multiple of 8 (16 for the
 * prefetch walk). Two activation rows, not four: 8 accumulators leave registers for the
 * weights (AVX2 has 16). */
#ifndef FORNAX_DENSE_AVX2_H
#define FORNAX_DENSE_AVX2_H

#include "vec256.h"

#define DENSE_AVX2_ROWS 4
#define DENSE_AVX2_COLS 2

/* NAME(w, k, x, x_stride, NT, live, prefetch_bytes, y, n): y[j * n + r] = weight row r . x row j
 * for r < live, j < NT; WT/XT the element types, LOAD8 their 8-lane loads, STORE_ONE(y, i, f)
 * stores one output. */
#define DEFINE_DENSE_TILE_AVX2(NAME, T, LOAD8, STORE_ONE)                                          \
    static inline __attribute__((always_inline)) void NAME(                                        \
        const T *w, int k, const T *x, long x_stride, const int NT, int live, int prefetch_bytes, \
        T *y, long n) {                                                                            \
        __m256 acc[DENSE_AVX2_ROWS][DENSE_AVX2_COLS];                                              \
        for (int r = 0; r < DENSE_AVX2_ROWS; r++)                                                  \
            for (int j = 0; j < NT; j++) acc[r][j] = _mm256_setzero_ps();                          \
        for (int i = 0; i < k; i += 8) {                                                           \
            __m256 wv[DENSE_AVX2_ROWS];                                                            \
            for (int r = 0; r < DENSE_AVX2_ROWS; r++) {                                            \
                /* rows past the matrix's end repeat its last row; never stored */                 \
                wv[r] = LOAD8(w + (long)(r < live ? r : live - 1) * k + i);                        \
                if (prefetch_bytes && (i * (int)sizeof(T)) % 64 == 0)                              \
                    _mm_prefetch((const char *)(w + (long)i * DENSE_AVX2_ROWS) + 64 * r + prefetch_bytes, \
                                 _MM_HINT_T0);                                                     \
            }                                                                                      \
            for (int j = 0; j < NT; j++) {                                                         \
                const __m256 xv = LOAD8(x + j * x_stride + i);                                     \
                for (int r = 0; r < DENSE_AVX2_ROWS; r++) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]); \
            }                                                                                      \
        }                                                                                          \
        for (int j = 0; j < NT; j++)                                                               \
            for (int r = 0; r < live; r++) STORE_ONE(y + j * n, r, hsum256(acc[r][j]));            \
    }

#endif
