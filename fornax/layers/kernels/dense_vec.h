/* The dense small-step kernels' tile where there is no AVX-512 path (bf16_matmul.c,
 * f32_matmul.c): dense_avx2.h's on x86 with AVX2 + FMA + F16C, dense_neon.h's (the same sums)
 * on AArch64, under one set of names, and the call over all tiles that both share: the loop
 * over weight tiles and activation passes does not depend on the vector width, only the tile
 * does. DENSE_VEC_AVAILABLE is 0 where neither compiles (the entry points then return 3). */
#ifndef FORNAX_DENSE_VEC_H
#define FORNAX_DENSE_VEC_H

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "dense_avx2.h"
#define DENSE_VEC_AVAILABLE 1
#define DENSE_ROWS DENSE_AVX2_ROWS
#define DENSE_COLS DENSE_AVX2_COLS
#define DEFINE_DENSE_TILE DEFINE_DENSE_TILE_AVX2
#define DENSE_LOAD8_BF16 vload8_bf16
#define DENSE_LOAD8_F32 vload8_f32
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "dense_neon.h"
#define DENSE_VEC_AVAILABLE 1
#define DENSE_ROWS DENSE_NEON_ROWS
#define DENSE_COLS DENSE_NEON_COLS
#define DEFINE_DENSE_TILE DEFINE_DENSE_TILE_NEON
#define DENSE_LOAD8_BF16 dense_neon_load8_bf16
#define DENSE_LOAD8_F32 dense_neon_load8_f32
#else
#define DENSE_VEC_AVAILABLE 0
#endif

#if DENSE_VEC_AVAILABLE
/* The call over all tiles: NAME(x, x_stride, t_rows, k, w, n, y, num_threads) -> 0, or 1 for a bad
 * shape (K not a multiple of K_MULTIPLE, the AVX-512 kernel's contract for the same dtype, so a
 * shape one CPU takes every CPU takes). TILE takes 2 activation rows at a time (DENSE_COLS). */
#define DEFINE_DENSE_MATMUL(NAME, T, TILE, PREFETCH, K_MULTIPLE)                                               \
    static int NAME(const T *x, long x_stride, int t_rows, int k, const T *w, int n, T *y, int num_threads) { \
        if (k % (K_MULTIPLE) || t_rows < 1 || n < 1) return 1;                                                 \
        const int tiles = (n + DENSE_ROWS - 1) / DENSE_ROWS;                                                  \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                                \
        for (int b = 0; b < tiles; b++) {                                                                     \
            const int o0 = b * DENSE_ROWS, live = n - o0 < DENSE_ROWS ? n - o0 : DENSE_ROWS;                  \
            for (int t0 = 0; t0 < t_rows; t0 += DENSE_COLS) {                                                 \
                const T *wt = w + (long)o0 * k, *xt = x + t0 * x_stride;                                      \
                T *yt = y + (long)t0 * n + o0;                                                                \
                const int pf = t0 == 0 ? (PREFETCH) : 0; /* later passes find the tile in cache */            \
                if (t_rows - t0 >= 2) TILE(wt, k, xt, x_stride, 2, live, pf, yt, n);                          \
                else TILE(wt, k, xt, x_stride, 1, live, pf, yt, n);                                           \
            }                                                                                                 \
        }                                                                                                     \
        return 0;                                                                                             \
    }
#endif

#endif
