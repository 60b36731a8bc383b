/* A driver for the integer and dense matmul kernels, the fused elementwise ops and paged
 * attention with no Python and no torch, so that an AArch64 build of them (the NEON paths:
 * fornax/layers/kernels/quant_matmul_neon.h, int8_matmul_neon.h, dense_neon.h behind
 * bf16_matmul.c and f32_matmul.c, fused_ops.c and paged_attention.c on vec128.h) can run under
 * qemu-user and be checked against the same references as the x86 kernels
 * (tests/arm/test_neon_kernels.py writes the inputs and reads the outputs).
 *
 * Build: link with the kernels' own sources, e.g.
 *   aarch64-linux-gnu-gcc -O3 -march=armv8.2-a+dotprod -fopenmp -std=c11 -ffp-contract=fast -static \
 *       -Ifornax/layers/kernels tests/arm/harness.c fornax/layers/kernels/quant_matmul.c \
 *       fornax/layers/kernels/int8_matmul.c fornax/layers/kernels/fused_ops.c \
 *       fornax/layers/kernels/paged_attention.c fornax/layers/kernels/bf16_matmul.c \
 *       fornax/layers/kernels/f32_matmul.c -o harness -lm
 * Run:   qemu-aarch64-static ./harness CASE_DIR [CASE_DIR ...]
 * It prints one line per case ("ok DIR") and exits 0, or names what failed and exits 1.
 *
 * Each CASE_DIR holds raw little-endian binaries (no headers; sizes follow from `params`):
 *   params       int32[6]: op, rows, k, n, ldx, threads
 *                  op 1: Q4 (q4_matmul_f32), 2: Q8 (q8_matmul_f32),
 *                     3: int8 x int8 rotated (int8_matmul_bf16 or its _given_max form,
 *                        rotate_quantize_rows_bf16, rotated_row_max_bf16)
 *                  ldx: the activations' row stride in elements (>= k), threads: OpenMP threads
 *                  n_pad below: n rounded up to 4 (ops 1, 2) or to 64 (op 3)
 *   op 1 (Q4), inputs as fornax.layers.linear.BlockInt4 holds them:
 *     x.f32      float32 [rows, ldx]
 *     w.bin      uint8 [n_pad / 4, k / 64, 4, 32]     (packed)
 *     d.f16      float16 bits [n_pad / 4, k / 64, 4, 2] (d)
 *     m.f16      float16 bits [n_pad, k / 32]           (m)
 *     output y.f32  float32 [rows, n]
 *   op 2 (Q8), as BlockInt8 holds them: x.f32 as above, w.bin int8 [n_pad / 4, k / 64, 4, 64]
 *     (qweight), d.f16 as above; output y.f32
 *   op 3 (int8), as Int8Rotated holds them:
 *     x.bf16     bfloat16 bits [rows, ldx]
 *     w.bin      int8 [n_pad / 64, k / 4, 64, 4]      (packed)
 *     colsum.i32 int32 [n_pad]
 *     scale.f32  float32 [n_pad]
 *     given_max.f32  float32 [rows], optional: each row's rounding maximum
 *     outputs y.bf16 bfloat16 bits [rows, n] (the product), q.i8 int8 [rows, k] and
 *     qscale.f32 float32 [rows] (rotate_quantize_rows_bf16, given_max as the product's),
 *     rowmax.f32 float32 [rows] (rotated_row_max_bf16)
 * A kernel's nonzero status is reported as a failure.
 *
 * The fused elementwise ops (fused_ops.c, vectorized by vec.h: NEON's 4 lanes here) take ops
 * 4 .. 11, an even op on float32 (files *.f32), the odd one after it on bfloat16 bits (*.bf16);
 * T below is that type. Rows are read as [rows, ldx] (ldx: the row stride in elements), and
 * eps.f32 is float32[1]:
 *   op 4/5 (rms_norm_f32 / _bf16): k = n = dim; x.T [rows, ldx], w.T [dim], eps.f32,
 *     r.T [rows, ldx] optional (the residual, same stride); outputs y.T [rows, dim] and, with
 *     a residual, sum.T [rows, dim] (x + r as stored)
 *   op 6/7 (rms_norm_f32w_f32 / _bf16): k = n = dim; x.T [rows, ldx], w.f32 float32 [dim],
 *     eps.f32; output y.T [rows, dim]
 *   op 8/9 (rotary_f32 / _bf16): k = head_dim (even), n = num_heads (ldx >= n * k); x.T
 *     [rows, ldx], cos.T and sin.T [rows, head_dim]; output y.T [rows, ldx] (x after the
 *     rotation in place, the untouched columns too)
 *   op 10/11 (silu_mul_f32 / _bf16): k = n = inter (ldx >= 2 * inter); x.T [rows, ldx] (gate
 *     then up); output y.T [rows, inter]
 *
 * Paged attention (paged_attention.c, DEFINE_PAGED_ATTENTION) takes ops 12 .. 15: 12/13
 * paged_attention_f32 / _bf16 (pools in the queries' type), 14/15 paged_attention_f32_i8 /
 * _bf16_i8 (int8 pools with float32 row scales); T: float32 (even op) or bfloat16 (odd), C:
 * T or int8. k = head_dim, n = num_heads, ldx = the queries' row stride (>= n * k):
 *   attn.i32     int32[7]: num_kv_heads, block_size, num_slots, num_seqs, max_blocks, window
 *                  (0: none), part_keys (0: split as suits the call)
 *   scale.f32    float32[1]: the softmax scale
 *   q.T          [rows, ldx]: row r's heads [n, k] at its start
 *   k.C, v.C     [num_slots, num_kv_heads, k] (k.i8 / v.i8 for int8 pools)
 *   k_scale.f32, v_scale.f32  float32 [num_slots, num_kv_heads], int8 pools only
 *   block_tables.i32 int32 [num_seqs, max_blocks]; row_seq.i32, row_pos.i32 int32 [rows]
 *   output y.T   [rows, n, k]
 * Every index is checked against those sizes before the call (the kernel trusts them).
 *
 * The dense matmuls y = x W^T take ops 16 (f32_matmul_f32, T float32) and 17 (bf16_matmul_bf16,
 * T bfloat16); k = K, n = N, ldx = the activations' row stride (>= k):
 *   x.T          [rows, ldx]
 *   w.T          [n, k]
 *   outputs status.i32 int32[1] (the kernel's return value) and, where it is 0, y.T [rows, n]
 * Unlike the other ops a nonzero status is no failure here, and rows, k and n may be 0: shapes
 * the kernel must refuse (status 1) are cases too, checked by the test.
 *
 * `harness --lanes` prints "lanes L": vec.h's VF_LANES in this build (1: no vector path).
 * `harness --available` prints "bf16_matmul A" and "f32_matmul A": the dense kernels'
 * *_available() in this build.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h" /* only for --lanes: the fused ops' vector width under this build's flags */

/* quant_matmul.c (DEFINE_QUANT_MATMUL) */
int quant_matmul_available(void);
int q4_matmul_f32(const float *x, long x_stride, int t_rows, int k, const uint8_t *w, const uint16_t *d,
                  const uint16_t *m, int n, float *y, int num_threads);
int q8_matmul_f32(const float *x, long x_stride, int t_rows, int k, const int8_t *w, const uint16_t *d,
                  const uint16_t *m, int n, float *y, int num_threads);
/* int8_matmul.c */
int int8_matmul_available(void);
int int8_matmul_bf16_given_max(const uint16_t *x, long ldx, int rows, int k, const int8_t *wp,
                               const int32_t *colsum, const float *col_scale, int n, uint16_t *y,
                               int num_threads, const float *given_max);
int int8_matmul_bf16(const uint16_t *x, long ldx, int rows, int k, const int8_t *wp, const int32_t *colsum,
                     const float *col_scale, int n, uint16_t *y, int num_threads);
int rotate_quantize_rows_bf16(const uint16_t *x, long ldx, int rows, int k, int8_t *q, float *scale,
                              int num_threads, const float *given_max);
int rotated_row_max_bf16(const uint16_t *x, long ldx, int rows, int k, float *row_max, int num_threads);
/* fused_ops.c (DEFINE_RMS_NORM, DEFINE_RMS_NORM_F32W, DEFINE_ROTARY, DEFINE_SILU_MUL) */
void rms_norm_f32(const float *x, long x_stride, const float *residual, long r_stride, float *sum_out,
                  const float *weight, float *out, int rows, int dim, float eps, int num_threads);
void rms_norm_bf16(const uint16_t *x, long x_stride, const uint16_t *residual, long r_stride, uint16_t *sum_out,
                   const uint16_t *weight, uint16_t *out, int rows, int dim, float eps, int num_threads);
void rms_norm_f32w_f32(const float *x, long x_stride, const float *weight, float *out, int rows, int dim,
                       float eps, int num_threads);
void rms_norm_f32w_bf16(const uint16_t *x, long x_stride, const float *weight, uint16_t *out, int rows, int dim,
                        float eps, int num_threads);
void rotary_f32(float *x, long x_stride, int rows, int num_heads, int head_dim, const float *cos,
                const float *sin, int num_threads);
void rotary_bf16(uint16_t *x, long x_stride, int rows, int num_heads, int head_dim, const uint16_t *cos,
                 const uint16_t *sin, int num_threads);
void silu_mul_f32(const float *gate_up, long stride, float *out, int rows, int inter, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, long stride, uint16_t *out, int rows, int inter, int num_threads);
/* paged_attention.c (DEFINE_PAGED_ATTENTION): q, q row stride, K pool, V pool, K scales, V scales,
 * out, block_tables, max_blocks, row_seq, row_pos, rows, heads, kv_heads, head_dim, block_size,
 * scale, window, num_threads, part_keys */
#define DECLARE_PAGED_ATTENTION(NAME, T, C)                                                                 \
    int NAME(const T *q, long q_row_stride, const C *k_cache, const C *v_cache, const float *k_scale,       \
             const float *v_scale, T *out, const int32_t *block_tables, int max_blocks,                     \
             const int32_t *row_seq, const int32_t *row_pos, int num_rows, int num_heads, int num_kv_heads, \
             int head_dim, int block_size, float scale, int window, int num_threads, int part_keys);
DECLARE_PAGED_ATTENTION(paged_attention_f32, float, float)
DECLARE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, uint16_t)
DECLARE_PAGED_ATTENTION(paged_attention_f32_i8, float, int8_t)
DECLARE_PAGED_ATTENTION(paged_attention_bf16_i8, uint16_t, int8_t)
/* bf16_matmul.c, f32_matmul.c (dense_neon.h here) */
int bf16_matmul_available(void);
int bf16_matmul_bf16(const uint16_t *x, long x_stride, int t_rows, int k, const uint16_t *w, int n, uint16_t *y,
                     int num_threads);
int f32_matmul_available(void);
int f32_matmul_f32(const float *x, long x_stride, int t_rows, int k, const float *w, int n, float *y,
                   int num_threads);

enum {
    OP_RMS_NORM = 4,
    OP_RMS_NORM_F32W = 6,
    OP_ROTARY = 8,
    OP_SILU_MUL = 10,
    OP_FUSED_END = 12,
    OP_ATTENTION = 12,    /* 13: bf16 */
    OP_ATTENTION_I8 = 14, /* 15: bf16 queries */
    OP_ATTENTION_END = 16,
    OP_DENSE = 16, /* 17: bf16 */
    OP_DENSE_END = 18
};

static const char *case_dir;

static int fail(const char *what) {
    fprintf(stderr, "FAIL %s: %s\n", case_dir, what);
    return 1;
}

/* The whole file `name` in case_dir, which must be `bytes` long; NULL (and a message) if not.
 * optional: a missing file is no error (NULL, nothing printed). */
static void *read_input(const char *name, size_t bytes, int optional) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", case_dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (!optional) fprintf(stderr, "FAIL %s: cannot open %s\n", case_dir, name);
        return NULL;
    }
    void *buf = malloc(bytes ? bytes : 1);
    size_t got = buf ? fread(buf, 1, bytes, f) : 0;
    const int extra = fgetc(f) != EOF;
    fclose(f);
    if (!buf || got != bytes || extra) {
        fprintf(stderr, "FAIL %s: %s is not %zu bytes\n", case_dir, name, bytes);
        free(buf);
        return NULL;
    }
    return buf;
}

static int write_output(const char *name, const void *data, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", case_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return fail("cannot write an output");
    const size_t put = fwrite(data, 1, bytes, f);
    return (fclose(f) != 0 || put != bytes) ? fail("short write") : 0;
}

static int run_quant(int q4, int rows, int k, int n, int ldx, int threads) {
    const size_t n_pad = (size_t)(n + 3) / 4 * 4, groups = (size_t)k / 32;
    float *x = read_input("x.f32", sizeof(float) * (size_t)rows * ldx, 0);
    void *w = read_input("w.bin", n_pad * (q4 ? k / 2 : k), 0);
    uint16_t *d = read_input("d.f16", sizeof(uint16_t) * n_pad * groups, 0);
    uint16_t *m = q4 ? read_input("m.f16", sizeof(uint16_t) * n_pad * groups, 0) : NULL;
    float *y = calloc((size_t)rows * n, sizeof(float));
    int bad = !x || !w || !d || (q4 && !m) || !y;
    if (!bad) {
        const int status = q4 ? q4_matmul_f32(x, ldx, rows, k, w, d, m, n, y, threads)
                              : q8_matmul_f32(x, ldx, rows, k, w, d, NULL, n, y, threads);
        bad = status ? fail("the kernel returned a nonzero status")
                     : write_output("y.f32", y, sizeof(float) * (size_t)rows * n);
    }
    free(x), free(w), free(d), free(m), free(y);
    return bad;
}

static int run_int8(int rows, int k, int n, int ldx, int threads) {
    const size_t n_pad = (size_t)(n + 63) / 64 * 64;
    uint16_t *x = read_input("x.bf16", sizeof(uint16_t) * (size_t)rows * ldx, 0);
    int8_t *w = read_input("w.bin", n_pad * k, 0);
    int32_t *colsum = read_input("colsum.i32", sizeof(int32_t) * n_pad, 0);
    float *scale = read_input("scale.f32", sizeof(float) * n_pad, 0);
    float *given_max = read_input("given_max.f32", sizeof(float) * rows, 1);
    uint16_t *y = calloc((size_t)rows * n, sizeof(uint16_t));
    int8_t *q = calloc((size_t)rows * k, 1);
    float *qscale = calloc(rows, sizeof(float)), *rowmax = calloc(rows, sizeof(float));
    int bad = !x || !w || !colsum || !scale || !y || !q || !qscale || !rowmax;
    if (!bad) {
        const int status =
            given_max ? int8_matmul_bf16_given_max(x, ldx, rows, k, w, colsum, scale, n, y, threads, given_max)
                      : int8_matmul_bf16(x, ldx, rows, k, w, colsum, scale, n, y, threads);
        if (status) bad = fail("int8_matmul_bf16 returned a nonzero status");
        else if (rotate_quantize_rows_bf16(x, ldx, rows, k, q, qscale, threads, given_max))
            bad = fail("rotate_quantize_rows_bf16 returned a nonzero status");
        else if (rotated_row_max_bf16(x, ldx, rows, k, rowmax, threads))
            bad = fail("rotated_row_max_bf16 returned a nonzero status");
        else
            bad = write_output("y.bf16", y, sizeof(uint16_t) * (size_t)rows * n) ||
                  write_output("q.i8", q, (size_t)rows * k) ||
                  write_output("qscale.f32", qscale, sizeof(float) * rows) ||
                  write_output("rowmax.f32", rowmax, sizeof(float) * rows);
    }
    free(x), free(w), free(colsum), free(scale), free(given_max), free(y), free(q), free(qscale), free(rowmax);
    return bad;
}

/* `stem`.f32 or `stem`.bf16 (the case's element type), `count` elements. */
static void *read_typed(const char *stem, int bf16, size_t count, int optional) {
    char name[64];
    snprintf(name, sizeof name, "%s.%s", stem, bf16 ? "bf16" : "f32");
    return read_input(name, count * (bf16 ? sizeof(uint16_t) : sizeof(float)), optional);
}

static int write_typed(const char *stem, int bf16, const void *data, size_t count) {
    char name[64];
    snprintf(name, sizeof name, "%s.%s", stem, bf16 ? "bf16" : "f32");
    return write_output(name, data, count * (bf16 ? sizeof(uint16_t) : sizeof(float)));
}

static int run_fused(int op, int rows, int k, int n, int ldx, int threads) {
    const int bf16 = op & 1, kind = op & ~1;
    const size_t es = bf16 ? sizeof(uint16_t) : sizeof(float), in = (size_t)rows * ldx;
    if ((kind == OP_ROTARY && (k % 2 || (long)n * k > ldx)) || (kind == OP_SILU_MUL && (n != k || 2L * k > ldx)) ||
        ((kind == OP_RMS_NORM || kind == OP_RMS_NORM_F32W) && n != k))
        return fail("bad params for a fused op");
    void *x = read_typed("x", bf16, in, 0);
    int bad = !x;
    if (kind == OP_RMS_NORM || kind == OP_RMS_NORM_F32W) {
        float *eps = read_input("eps.f32", sizeof(float), 0);
        void *w = kind == OP_RMS_NORM ? read_typed("w", bf16, k, 0) : read_input("w.f32", sizeof(float) * k, 0);
        void *r = kind == OP_RMS_NORM ? read_typed("r", bf16, in, 1) : NULL;
        void *y = calloc((size_t)rows * k, es), *sum = r ? calloc((size_t)rows * k, es) : NULL;
        bad = bad || !eps || !w || !y || (r && !sum);
        if (!bad) {
            if (kind == OP_RMS_NORM && bf16) rms_norm_bf16(x, ldx, r, ldx, sum, w, y, rows, k, *eps, threads);
            else if (kind == OP_RMS_NORM) rms_norm_f32(x, ldx, r, ldx, sum, w, y, rows, k, *eps, threads);
            else if (bf16) rms_norm_f32w_bf16(x, ldx, w, y, rows, k, *eps, threads);
            else rms_norm_f32w_f32(x, ldx, w, y, rows, k, *eps, threads);
            bad = write_typed("y", bf16, y, (size_t)rows * k) || (sum && write_typed("sum", bf16, sum, (size_t)rows * k));
        }
        free(eps), free(w), free(r), free(y), free(sum);
    } else if (kind == OP_ROTARY) {
        void *c = read_typed("cos", bf16, (size_t)rows * k, 0), *s = read_typed("sin", bf16, (size_t)rows * k, 0);
        bad = bad || !c || !s;
        if (!bad) {
            if (bf16) rotary_bf16(x, ldx, rows, n, k, c, s, threads);
            else rotary_f32(x, ldx, rows, n, k, c, s, threads);
            bad = write_typed("y", bf16, x, in);
        }
        free(c), free(s);
    } else {
        void *y = calloc((size_t)rows * k, es);
        bad = bad || !y;
        if (!bad) {
            if (bf16) silu_mul_bf16(x, ldx, y, rows, k, threads);
            else silu_mul_f32(x, ldx, y, rows, k, threads);
            bad = write_typed("y", bf16, y, (size_t)rows * k);
        }
        free(y);
    }
    free(x);
    return bad;
}

/* Whether every one of `count` values lies in [0, limit). */
static int in_range(const int32_t *v, long count, long limit) {
    for (long i = 0; i < count; i++)
        if (v[i] < 0 || v[i] >= limit) return 0;
    return 1;
}

static int run_attention(int op, int rows, int head_dim, int heads, int ldx, int threads) {
    const int bf16 = op & 1, i8 = (op & ~1) == OP_ATTENTION_I8;
    int32_t *a = read_input("attn.i32", 7 * sizeof(int32_t), 0);
    float *scale = read_input("scale.f32", sizeof(float), 0);
    if (!a || !scale) {
        free(a), free(scale);
        return 1;
    }
    const int kv_heads = a[0], block_size = a[1], num_slots = a[2], num_seqs = a[3], max_blocks = a[4];
    const int window = a[5], part_keys = a[6];
    free(a);
    if (kv_heads < 1 || heads % kv_heads || block_size < 1 || num_slots < block_size || num_seqs < 1 ||
        max_blocks < 1 || window < 0 || part_keys < 0 || (long)heads * head_dim > ldx) {
        free(scale);
        return fail("bad attention params");
    }
    const size_t pool = (size_t)num_slots * kv_heads * head_dim, es = bf16 ? sizeof(uint16_t) : sizeof(float);
    void *q = read_typed("q", bf16, (size_t)rows * ldx, 0);
    void *k = i8 ? read_input("k.i8", pool, 0) : read_typed("k", bf16, pool, 0);
    void *v = i8 ? read_input("v.i8", pool, 0) : read_typed("v", bf16, pool, 0);
    float *ks = i8 ? read_input("k_scale.f32", sizeof(float) * num_slots * kv_heads, 0) : NULL;
    float *vs = i8 ? read_input("v_scale.f32", sizeof(float) * num_slots * kv_heads, 0) : NULL;
    int32_t *tables = read_input("block_tables.i32", sizeof(int32_t) * num_seqs * max_blocks, 0);
    int32_t *row_seq = read_input("row_seq.i32", sizeof(int32_t) * rows, 0);
    int32_t *row_pos = read_input("row_pos.i32", sizeof(int32_t) * rows, 0);
    void *y = calloc((size_t)rows * heads * head_dim, es);
    int bad = !q || !k || !v || (i8 && (!ks || !vs)) || !tables || !row_seq || !row_pos || !y;
    if (!bad && (!in_range(tables, (long)num_seqs * max_blocks, num_slots / block_size) ||
                 !in_range(row_seq, rows, num_seqs) || !in_range(row_pos, rows, (long)max_blocks * block_size)))
        bad = fail("an attention index is out of range");
    if (!bad) {
        const float sc = *scale;
        int status;
        if (i8 && bf16)
            status = paged_attention_bf16_i8(q, ldx, k, v, ks, vs, y, tables, max_blocks, row_seq, row_pos, rows,
                                             heads, kv_heads, head_dim, block_size, sc, window, threads, part_keys);
        else if (i8)
            status = paged_attention_f32_i8(q, ldx, k, v, ks, vs, y, tables, max_blocks, row_seq, row_pos, rows,
                                            heads, kv_heads, head_dim, block_size, sc, window, threads, part_keys);
        else if (bf16)
            status = paged_attention_bf16(q, ldx, k, v, NULL, NULL, y, tables, max_blocks, row_seq, row_pos, rows,
                                          heads, kv_heads, head_dim, block_size, sc, window, threads, part_keys);
        else
            status = paged_attention_f32(q, ldx, k, v, NULL, NULL, y, tables, max_blocks, row_seq, row_pos, rows,
                                         heads, kv_heads, head_dim, block_size, sc, window, threads, part_keys);
        bad = status ? fail("paged attention returned a nonzero status")
                     : write_typed("y", bf16, y, (size_t)rows * heads * head_dim);
    }
    free(scale), free(q), free(k), free(v), free(ks), free(vs), free(tables), free(row_seq), free(row_pos), free(y);
    return bad;
}

static int run_dense(int op, int rows, int k, int n, int ldx, int threads) {
    const int bf16 = op & 1;
    /* only what reading the files needs: the kernel itself must refuse the other bad shapes */
    if (rows < 0 || k < 0 || n < 0 || ldx < k || threads < 1) return fail("bad params for a dense matmul");
    void *x = read_typed("x", bf16, (size_t)rows * ldx, 0), *w = read_typed("w", bf16, (size_t)n * k, 0);
    void *y = calloc((size_t)rows * n + 1, bf16 ? sizeof(uint16_t) : sizeof(float));
    int bad = !x || !w || !y;
    if (!bad) {
        const int32_t status = bf16 ? bf16_matmul_bf16(x, ldx, rows, k, w, n, y, threads)
                                    : f32_matmul_f32(x, ldx, rows, k, w, n, y, threads);
        bad = write_output("status.i32", &status, sizeof status) ||
              (status == 0 && write_typed("y", bf16, y, (size_t)rows * n));
    }
    free(x), free(w), free(y);
    return bad;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--lanes") == 0) {
#if HAVE_VEC
        printf("lanes %d\n", VF_LANES);
#else
        printf("lanes 1\n");
#endif
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "--available") == 0) {
        printf("bf16_matmul %d\nf32_matmul %d\n", bf16_matmul_available(), f32_matmul_available());
        return 0;
    }
    if (!quant_matmul_available() || !int8_matmul_available()) {
        fprintf(stderr, "FAIL: the integer kernels are not compiled in for this target\n");
        return 1;
    }
    int failed = 0;
    for (int a = 1; a < argc; a++) {
        case_dir = argv[a];
        int32_t *p = read_input("params", 6 * sizeof(int32_t), 0);
        if (!p) {
            failed = 1;
            continue;
        }
        const int op = p[0], rows = p[1], k = p[2], n = p[3], ldx = p[4], threads = p[5];
        free(p);
        int bad;
        if (op >= OP_DENSE && op < OP_DENSE_END) bad = run_dense(op, rows, k, n, ldx, threads);
        else if (rows < 1 || k < 1 || n < 1 || ldx < k || threads < 1) bad = fail("bad params");
        else if (op == 1 || op == 2) bad = run_quant(op == 1, rows, k, n, ldx, threads);
        else if (op == 3) bad = run_int8(rows, k, n, ldx, threads);
        else if (op >= OP_RMS_NORM && op < OP_FUSED_END) bad = run_fused(op, rows, k, n, ldx, threads);
        else if (op >= OP_ATTENTION && op < OP_ATTENTION_END) bad = run_attention(op, rows, k, n, ldx, threads);
        else bad = fail("unknown op");
        if (!bad) printf("ok %s\n", case_dir);
        failed |= bad;
    }
    return failed;
}
