/* Dense bf16 matmul for small steps: y[T, N] = x[T, K] W^T, with x, W and y bfloat16 and
 * float32 sums, for T up to a few dozen rows (decode, speculative verification).
 *
 * Why this exists: at one row a step reads every weight once and does two flops per
 * weight, so it is bound by memory bandwidth. torch's bf16 linear (oneDNN) reaches ~13 GB/s
 * there on this machine (benchmarks/decode_profile.py: the dense model's matmuls took 21 ms
 * for 270 MB), and a dense decode step ran op by op from Python besides. Here each thread
 * streams its own contiguous run of weight rows with a software prefetch 8 KB ahead, and
 * the one-call step (decode_step.c) can use it, as it does the 4- and 8-bit kernels.
 *
 * Arithmetic: AVX-512 BF16 dot products (VDPBF16PS): each product of two bf16 values is exact
 * in float32 and sums are float32, as in oneDNN; only the order of the additions differs, so
 * results agree with torch's to float32 rounding before the final rounding to bf16.
 *
 * Layout: W is the Linear's own weight, [N, K] row-major, not a copy. Rows are taken in
 * tiles of ROWS (4 consecutive rows, one contiguous stretch of memory) against up to COLS
 * activation rows at once: 16 independent accumulator chains, each weight line loaded once
 * per COLS activation rows and each activation line once per tile. K must be a multiple of
 * 32 (one 64-byte line of bf16).
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BMM_AVAILABLE 1
#define BMM_VEC 0
#else
/* Without AVX-512 BF16: the bf16 values widened to float32 and multiplied by FMA, in AVX2's 8
 * lanes or NEON's two halves of them (dense_vec.h); BMM_VEC is 0 where neither compiles. */
#include "dense_vec.h"
#define BMM_AVAILABLE 0
#define BMM_VEC DENSE_VEC_AVAILABLE
#endif

#define ROWS 4 /* weight rows per tile */
#define COLS 4 /* activation rows per pass over a tile */
/* Software prefetch distance. A tile's rows are read side by side (4 streams 2K bytes apart),
 * and prefetching each row's own stream ahead ran at ~18 GB/s; walking the tile's memory as
 * one linear stream 8 KB ahead ran at ~29 GB/s, the machine's read bandwidth (torch sum
 * over 256 MB: 28-31 GB/s). A model's worth of matrices at one row: 9.2-9.6 ms against
 * 14-15 ms (1 KB ahead: 10.5-11.2 ms); ad hoc A/B of builds side by side. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif

/* 1 where the kernel was compiled in; the Python side keeps torch's linear otherwise. */
int bf16_matmul_available(void) { return BMM_AVAILABLE || BMM_VEC; }

#if BMM_AVAILABLE

#include <string.h>

#include "bf16.h"
#include "vec512.h"

/* One tile of `live` weight rows against NT activation rows: y[j * n + r] = row r . x row j.
 * NT is a constant at each call site (dispatch below), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *w, int k, const uint16_t *x, long x_stride, const int NT, int live, int prefetch,
    uint16_t *y, long n) {
    __m512 acc[ROWS][COLS];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 32) {
        __m512bh wv[ROWS];
        for (int r = 0; r < ROWS; r++) {
            /* rows past the matrix's end (live < ROWS) repeat its last row; never stored */
            const uint16_t *wr = w + (long)(r < live ? r : live - 1) * k + i;
            /* the tile is one stretch of memory: walk it PREFETCH_BYTES ahead, a line per load */
            if (prefetch) _mm_prefetch((const char *)(w + (long)i * ROWS + 32 * r) + PREFETCH_BYTES, _MM_HINT_T0);
            wv[r] = (__m512bh)_mm512_loadu_si512(wr);
        }
        for (int j = 0; j < NT; j++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j * x_stride + i);
            for (int r = 0; r < ROWS; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[r], xv);
        }
    }
    /* The 16 sums in one transposing reduction, rounded together (reducing each sum alone was
     * ~40% of a tile's work at K = 576). Partial tiles (fewer activation or weight rows) take
     * the same reduction with zeros in the empty slots, never a horizontal sum of their own:
     * each output is then summed in the same order whichever rows share its call, so a row's
     * result does not depend on the batch it came in (deterministic mode,
     * docs/deterministic.md). */
    _Static_assert(ROWS * COLS == 16, "reduce16 takes 16 sums");
    __m512 v[ROWS * COLS];
    for (int j = 0; j < COLS; j++)
        for (int r = 0; r < ROWS; r++) v[j * ROWS + r] = j < NT ? acc[r][j] : _mm512_setzero_ps();
    const __m512 sums = vround_bf16(reduce16(v)); /* lane j * 4 + r */
    uint16_t out[ROWS * COLS];
    vstore_bf16(out, sums);
    for (int j = 0; j < NT; j++) memcpy(y + j * n, out + j * ROWS, sizeof(uint16_t) * live);
}

/* x: [t_rows, k] bf16 with row stride x_stride (elements); w: [n, k] bf16; y: [t_rows, n]. */
int bf16_matmul_bf16(const uint16_t *x, long x_stride, int t_rows, int k, const uint16_t *w, int n,
                     uint16_t *y, int num_threads) {
    if (k % 32 || t_rows < 1 || n < 1) return 1;
    const int tiles = (n + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int b = 0; b < tiles; b++) {
        const int o0 = b * ROWS, live = n - o0 < ROWS ? n - o0 : ROWS;
        /* the first pass streams the tile from memory and prefetches ahead; later passes
         * (more than COLS activation rows) find it in cache */
        for (int t0 = 0; t0 < t_rows; t0 += COLS) {
            const int nt = t_rows - t0 < COLS ? t_rows - t0 : COLS;
            const uint16_t *wt = w + (long)o0 * k, *xt = x + t0 * x_stride;
            const int pf = t0 == 0;
            uint16_t *yt = y + (long)t0 * n + o0;
            switch (nt) {
            case 4: tile(wt, k, xt, x_stride, 4, live, pf, yt, n); break;
            case 3: tile(wt, k, xt, x_stride, 3, live, pf, yt, n); break;
            case 2: tile(wt, k, xt, x_stride, 2, live, pf, yt, n); break;
            default: tile(wt, k, xt, x_stride, 1, live, pf, yt, n); break;
            }
        }
    }
    return 0;
}

#elif BMM_VEC

#include "bf16.h"

#define STORE_BF16_ONE(p, i, f) ((p)[i] = f32_to_bf16(f))
DEFINE_DENSE_TILE(tile_vec, uint16_t, DENSE_LOAD8_BF16, STORE_BF16_ONE)
DEFINE_DENSE_MATMUL(matmul_vec, uint16_t, tile_vec, PREFETCH_BYTES, 32)

int bf16_matmul_bf16(const uint16_t *x, long x_stride, int t_rows, int k, const uint16_t *w, int n,
                     uint16_t *y, int num_threads) {
    return matmul_vec(x, x_stride, t_rows, k, w, n, y, num_threads);
}

#else

int bf16_matmul_bf16(const uint16_t *x, long x_stride, int t_rows, int k, const uint16_t *w, int n,
                     uint16_t *y, int num_threads) {
    (void)x, (void)x_stride, (void)t_rows, (void)k, (void)w, (void)n, (void)y, (void)num_threads;
    return 3; /* not compiled for this CPU */
}

#endif
