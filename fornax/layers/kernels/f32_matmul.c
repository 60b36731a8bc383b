/* Dense float32 matmul, y[T, N] = x[T, K] W^T, for float32 models' steps of any size
 * (layers/linear.py DenseF32, docs/kernels.md, docs/deterministic.md).
 *
 * Why this exists: torch's float32 linear (MKL / oneDNN) picks its blocking, and so the order
 * of each output's additions, by the shape of the call and the thread count, so a row's result
 * depends on how many rows came with it. Here every output is one chain of fused multiply-adds
 * over 16 lanes in K order, reduced by the same transposing reduction whatever tile it is in:
 * the tiles of bf16_matmul.c with float32 arithmetic. It reads the weights 2x faster than
 * torch's at one row and falls to ~0.83x of it at 512 (docs/kernels.md). K must be a multiple
 * of 16.
 */
#include <stdint.h>
#include <string.h>

#include "vec512.h"

#define ROWS 4 /* weight rows per tile */
#define COLS 4 /* activation rows per pass over a tile */
#if HAVE_VEC512
#define F32_AVAILABLE 1
static inline __attribute__((always_inline)) void tile_f32(const float *w, int k, const float *x, long x_stride,
                                                            const int NT, int live, float *y, long n) {
    __m512 acc[ROWS][COLS];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        __m512 wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = _mm512_loadu_ps(w + (long)(r < live ? r : live - 1) * k + i);
        for (int j = 0; j < NT; j++) {
            const __m512 xv = _mm512_loadu_ps(x + j * x_stride + i);
            for (int r = 0; r < ROWS; r++) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]);
        }
    }
    __m512 v[ROWS * COLS];
    for (int j = 0; j < COLS; j++)
        for (int r = 0; r < ROWS; r++) v[j * ROWS + r] = j < NT ? acc[r][j] : _mm512_setzero_ps();
    float out[ROWS * COLS];
    _mm512_storeu_ps(out, reduce16(v)); /* lane j * 4 + r */
    for (int j = 0; j < NT; j++) memcpy(y + j * n, out + j * ROWS, sizeof(float) * live);
}
#else
/* Without AVX-512: AVX2's 8-lane tile, or NEON's two halves of it, the same sums (dense_vec.h). */
#include "dense_vec.h"
#define F32_AVAILABLE DENSE_VEC_AVAILABLE
#if DENSE_VEC_AVAILABLE
#define STORE_F32_ONE(p, i, f) ((p)[i] = (f))
DEFINE_DENSE_TILE(tile_vec, float, DENSE_LOAD8_F32, STORE_F32_ONE)
DEFINE_DENSE_MATMUL(matmul_vec, float, tile_vec, 0, 16)
#endif
#endif

int f32_matmul_available(void) { return F32_AVAILABLE; }

/* x: [t_rows, k] float32 with row stride x_stride (elements); w: [n, k] float32; y: [t_rows, n]. */
int f32_matmul_f32(const float *x, long x_stride, int t_rows, int k, const float *w, int n, float *y,
                   int num_threads) {
#if F32_AVAILABLE && !HAVE_VEC512
    return matmul_vec(x, x_stride, t_rows, k, w, n, y, num_threads);
#elif F32_AVAILABLE
    if (k % 16 || t_rows < 1 || n < 1) return 1;
    const int tiles = (n + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int b = 0; b < tiles; b++) {
        const int o0 = b * ROWS, live = n - o0 < ROWS ? n - o0 : ROWS;
        for (int t0 = 0; t0 < t_rows; t0 += COLS) {
            const int nt = t_rows - t0 < COLS ? t_rows - t0 : COLS;
            const float *wt = w + (long)o0 * k, *xt = x + t0 * x_stride;
            float *yt = y + (long)t0 * n + o0;
            switch (nt) {
            case 4: tile_f32(wt, k, xt, x_stride, 4, live, yt, n); break;
            case 3: tile_f32(wt, k, xt, x_stride, 3, live, yt, n); break;
            case 2: tile_f32(wt, k, xt, x_stride, 2, live, yt, n); break;
            default: tile_f32(wt, k, xt, x_stride, 1, live, yt, n); break;
            }
        }
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)t_rows, (void)k, (void)w, (void)n, (void)y, (void)num_threads;
    return 3;
#endif
}
