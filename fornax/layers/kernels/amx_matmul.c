/* Dense bf16 matmul on AMX tiles, y[T, N] = x[T, K] W^T (bf16 in and out, float32 sums), for
 * deterministic mode's dense bf16 layers (layers/linear.py AmxBf16, docs/deterministic.md).
 *
 * Why this exists: deterministic mode needs one kernel for every step size whose result for a
 * row does not depend on the other rows of the call. bf16_matmul.c is such a kernel and fast
 * for decode, but it is AVX-512 and compute-bound past a few rows: a 512-row prefill took ~7x
 * oneDNN's time, which uses AMX there (benchmarks/bf16_matmul.py). AMX tiles give that speed
 * back with an order of additions fixed per output: each output starts at zero and takes one
 * TDPBF16PS per 32 values of K, in K order, whatever the row count, the blocking or the thread
 * that computes it. So a decode row (its block padded with zero rows) and the same row inside
 * a prefill give the same bits.
 *
 * Layout: W packed by layers/linear.py AmxBf16 as [N_pad / 16, K / 32, 16, 16, 2]: for each
 * block of 16 output channels and 32 input values, the 1 KiB B tile TDPBF16PS reads (row p:
 * the 16 channels' values 2p and 2p + 1). N_pad is N rounded up to 32 (zero channels): work
 * goes in panels of two such blocks. K must be a multiple of 32.
 *
 * Tiles: C0-C3 the 2 x 2 blocks of 16 rows x 16 channels, A (tmm4, tmm5) two row blocks of x,
 * B (tmm6, tmm7) two channel blocks of W: 4 tile products per 4 tile loads.
 */
/* syscall() is declared by unistd.h only outside strict C11 (-std=c11): without this it was an
 * implicit declaration returning int. */
#define _DEFAULT_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#if HAVE_AMX
#include "vec512.h"

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a state component (arch_prctl) */
#define XFEATURE_XTILEDATA 18      /* the AMX tile data */
#define BLOCK 16                   /* rows (and channels) per tile */
#define KSTEP 32                   /* bf16 values of K per tile row */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = BLOCK, cfg.colsb[t] = 64; /* every tile 16 x 64 bytes */
    _tile_loadconfig(&cfg);
}

/* The C tile `c` (float32 [16][16], row stride 64 bytes) rounded to bf16 into y: `rows` rows
 * from y, `cols` channels from column c0 (those past N left out). */
static void store_block(const float *c, int rows, int cols, uint16_t *y, long n, int c0) {
    const __mmask16 live = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++) {
        const __m512 v = vround_bf16(_mm512_loadu_ps(c + r * BLOCK));
        const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        _mm256_mask_storeu_epi16(y + (long)r * n + c0, live, h);
    }
}
#endif

/* 1 where compiled in and the OS lets this process use the tile registers (asked here, once
 * for the whole process; Linux 5.16 and later). */
int amx_bf16_available(void) {
#if HAVE_AMX
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
#else
    return 0;
#endif
}

/* x: [t_rows, k] bf16 with row stride x_stride (elements); w packed as above; y: [t_rows, n].
 * Returns 0; 1 bad shape; 2 no memory; 3 not available. */
int amx_bf16_matmul(const uint16_t *x, long x_stride, int t_rows, int k, const uint16_t *w, int n, uint16_t *y,
                    int num_threads) {
#if HAVE_AMX
    if (k % KSTEP || t_rows < 1 || n < 1) return 1;
    if (!amx_bf16_available()) return 3;
    const int row_blocks = (t_rows + BLOCK - 1) / BLOCK, panels = (n + 2 * BLOCK - 1) / (2 * BLOCK);
    const int ksteps = k / KSTEP, tail = t_rows % BLOCK;
    /* the last row block, when partial, as a zero-padded copy (tiles always load 16 rows; the
     * padding rows only ever meet their own outputs, which are not stored) */
    uint16_t *padded = NULL;
    if (tail) {
        padded = calloc((size_t)BLOCK * k, sizeof(uint16_t));
        if (!padded) return 2;
        for (int r = 0; r < tail; r++)
            memcpy(padded + (long)r * k, x + (long)(t_rows - tail + r) * x_stride, sizeof(uint16_t) * k);
    }
    const long b_tile = (long)BLOCK * KSTEP; /* bf16 values per B tile */
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
        float c[4][BLOCK * BLOCK];
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; p++) {
            const uint16_t *w0 = w + (long)(2 * p) * ksteps * b_tile, *w1 = w0 + (long)ksteps * b_tile;
            for (int rb = 0; rb < row_blocks; rb += 2) {
                const int pair = rb + 1 < row_blocks; /* two row blocks in this pass */
                const uint16_t *a[2];
                long a_stride[2];
                for (int i = 0; i < 2; i++) {
                    const int blk = rb + (i && pair ? 1 : 0);
                    const int is_tail = tail && blk == row_blocks - 1;
                    a[i] = is_tail ? padded : x + (long)blk * BLOCK * x_stride;
                    a_stride[i] = (is_tail ? k : x_stride) * (long)sizeof(uint16_t);
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int s = 0; s < ksteps; s++) {
                    _tile_loadd(6, w0 + s * b_tile, 64);
                    _tile_loadd(7, w1 + s * b_tile, 64);
                    _tile_loadd(4, a[0] + s * KSTEP, a_stride[0]);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (pair) {
                        _tile_loadd(5, a[1] + s * KSTEP, a_stride[1]);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                if (pair) {
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                }
                for (int i = 0; i < 1 + pair; i++) {
                    const int r0 = (rb + i) * BLOCK, rows = t_rows - r0 < BLOCK ? t_rows - r0 : BLOCK;
                    for (int j = 0; j < 2; j++) {
                        const int c0 = (2 * p + j) * BLOCK;
                        if (c0 < n) store_block(c[2 * i + j], rows, n - c0, y + (long)r0 * n, n, c0);
                    }
                }
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
#else
    (void)x, (void)x_stride, (void)t_rows, (void)k, (void)w, (void)n, (void)y, (void)num_threads;
    return 3;
#endif
}
