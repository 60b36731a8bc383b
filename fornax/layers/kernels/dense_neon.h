/* The tile of the dense small-step kernels (bf16_matmul.c, f32_matmul.c) in Arm NEON (AArch64),
 * for Arm servers and Apple silicon: dense_avx2.h's tile, sum for sum. 4 weight rows against up
 * to 2 activation rows, every product a float32 fused multiply-add (a product of two bf16 values
 * is exact in float32), and each output kept as AVX2's 8 lanes in two 4-lane halves: lane l of
 * the low half takes K positions l, l + 8, l + 16 ..., of the high half l + 4, l + 12 ..., in K
 * order, as lanes l and l + 4 of the AVX2 accumulator do. The halves are then added and the 4
 * sums folded as hsum256 folds them ((0 + 2) + (1 + 3), vec128.h's hsum128), so each output is
 * the same float32 as the AVX2 path's, and its bf16 rounding (f32_to_bf16) the same bits:
 * deterministic mode gives one answer on an AVX2 x86 and an Arm machine (tests/arm checks it).
 *
 * Neither the tile's live rows nor the call's activation rows change how an output is summed,
 * so a row's result does not depend on the batch it came in (deterministic mode,
 * docs/deterministic.md). K must be a multiple of 8 (the entry points keep their own, larger
 * multiples: K_MULTIPLE below). Registers: 16 accumulators (4 rows x 2 activation rows x 2
 * halves), 8 weight halves and 2 activation halves of NEON's 32. Four activation rows in 4-lane
 * chains would fit too, but would sum in another order than AVX2 and leave a one-row step
 * (decode) only 4 independent chains against the FMA latency; here it has 8. */
#ifndef FORNAX_DENSE_NEON_H
#define FORNAX_DENSE_NEON_H

#include <stdint.h>

#include "vec128.h"

#define DENSE_NEON_ROWS 4
#define DENSE_NEON_COLS 2

/* 8 consecutive values as float32, the low 4 then the high 4. */
static inline float32x4x2_t dense_neon_load8_f32(const float *p) {
    float32x4x2_t v;
    v.val[0] = vld1q_f32(p);
    v.val[1] = vld1q_f32(p + 4);
    return v;
}

/* bf16 is the top half of a float32: each u16 widened to u32 and shifted up by 16 (SHLL). */
static inline float32x4x2_t dense_neon_load8_bf16(const uint16_t *p) {
    const uint16x8_t h = vld1q_u16(p);
    float32x4x2_t v;
    v.val[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
    v.val[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
    return v;
}

/* NAME(w, k, x, x_stride, NT, live, prefetch_bytes, y, n): y[j * n + r] = weight row r . x row j
 * for r < live, j < NT; T the element type, LOAD8 its 8-value load (dense_neon_load8_*),
 * STORE_ONE(y, i, f) stores one output. NT is a constant at each call site (the dispatch in
 * dense_vec.h's DEFINE_DENSE_MATMUL), so the accumulators stay in registers. */
#define DEFINE_DENSE_TILE_NEON(NAME, T, LOAD8, STORE_ONE)                                                   \
    static inline __attribute__((always_inline)) void NAME(                                                 \
        const T *w, int k, const T *x, long x_stride, const int NT, int live, int prefetch_bytes,           \
        T *y, long n) {                                                                                     \
        float32x4_t lo[DENSE_NEON_ROWS][DENSE_NEON_COLS], hi[DENSE_NEON_ROWS][DENSE_NEON_COLS];             \
        for (int r = 0; r < DENSE_NEON_ROWS; r++)                                                           \
            for (int j = 0; j < NT; j++) lo[r][j] = hi[r][j] = vdupq_n_f32(0.0f);                           \
        for (int i = 0; i < k; i += 8) {                                                                    \
            float32x4x2_t wv[DENSE_NEON_ROWS];                                                              \
            for (int r = 0; r < DENSE_NEON_ROWS; r++) {                                                     \
                /* rows past the matrix's end repeat its last row; never stored */                          \
                wv[r] = LOAD8(w + (long)(r < live ? r : live - 1) * k + i);                                 \
                /* the tile is one stretch of memory: walk it as one stream prefetch_bytes ahead, */        \
                /* one 64-byte line per 64 bytes read (bf16_matmul.c says why) */                           \
                if (prefetch_bytes && (i * (int)sizeof(T)) % 64 == 0)                                       \
                    __builtin_prefetch((const char *)(w + (long)i * DENSE_NEON_ROWS) + 64 * r + prefetch_bytes); \
            }                                                                                               \
            for (int j = 0; j < NT; j++) {                                                                  \
                const float32x4x2_t xv = LOAD8(x + j * x_stride + i);                                       \
                for (int r = 0; r < DENSE_NEON_ROWS; r++) {                                                 \
                    lo[r][j] = vfmaq_f32(lo[r][j], wv[r].val[0], xv.val[0]);                                \
                    hi[r][j] = vfmaq_f32(hi[r][j], wv[r].val[1], xv.val[1]);                                \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        /* r runs to the constant ROWS, not to live: with every index known at compile time the */          \
        /* accumulators stay in registers (a loop to live kept them in memory, stored every step) */        \
        for (int j = 0; j < NT; j++)                                                                        \
            for (int r = 0; r < DENSE_NEON_ROWS; r++)                                                       \
                if (r < live) STORE_ONE(y + j * n, r, hsum128(vaddq_f32(lo[r][j], hi[r][j])));              \
    }

#endif
