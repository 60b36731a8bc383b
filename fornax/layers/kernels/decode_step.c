/* A whole small step of a Llama-family decoder in one call: every layer's norms, quantized
 * projections, rotary, K/V write, paged attention and SiLU MLP, then the final norm.
 *
 * Why this exists: at one token per step the arithmetic of this model is ~2 ms, but the
 * same step run op by op from Python is ~360 torch/ctypes calls plus the module glue
 * around them, about half of a 12-15 ms step (benchmarks/decode_profile.py). Here the
 * Python side makes one call per step.
 *
 * It calls the very kernels the op-by-op native path calls (fused_ops.c, quant_matmul.c,
 * bf16_matmul.c, int8_matmul.c, paged_attention.c), in the same order with the same roundings, so its
 * output is the same to the bit; tests/model/test_native_step.py checks that (with int8 K/V
 * caches too: kv_store_i8 writes the bits fornax/layers/kv_pool.py writes). It covers steps
 * where every sequence's new tokens go to the paged-attention kernel and every projection has
 * a native form for the step's rows (4-bit, 8-bit, bf16, or int8 x int8); anything else runs
 * op by op (fornax/models/native_step.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Built only with the integer matmuls it calls (quant_matmul.c, same condition); Python
 * loads it only where quant_matmul_available(). */
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || (defined(__aarch64__) && defined(__ARM_NEON))
#define HAVE_QUANT_MATMUL 1
#else
#define HAVE_QUANT_MATMUL 0
#endif

/* One projection's weights: kind Q8 / Q4 (formats in quant_matmul.c; d, m float16, m only for
 * Q4), BF16 (w the dense [n, k] weight, bf16 models only; bf16_matmul.c) or I8 (w the rotated
 * int8 panels, d the int32 column sums, m the float32 column scales; int8_matmul.c, bf16 only)
 * or AMX (w the tile-packed bf16 weight of amx_matmul.c, bf16 only). */
enum { QLINEAR_Q8 = 0, QLINEAR_Q4 = 1, QLINEAR_BF16 = 2, QLINEAR_I8 = 3, QLINEAR_AMX = 4 };
typedef struct {
    const void *w;
    const void *d, *m;
    const void *bias; /* NULL or [n] of the activation type */
    int n, k, kind;
    /* LoRA slots of the projection (lora.c layouts), or NULL: its adapted rows get their
     * low-rank products right after the base projection, as layers/linear.py adds them. */
    const float *lora_a, *lora_b;
    const int32_t *lora_bounds; /* [lora_parts + 1] */
    int lora_parts, lora_max_rank;
} qlinear;

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] */
    qlinear qkv, o, gate_up, down;      /* qkv rows: [q | k | v]; gate_up rows: [gate | up] */
    void *k_cache, *v_cache;            /* [num_slots, num_kv_heads, head_dim] */
    float *k_scale, *v_scale;           /* int8 caches: [num_slots, num_kv_heads]; else NULL */
} decoder_layer;

typedef struct {
    const decoder_layer *layers;
    const void *final_norm;
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int block_size, window; /* window 0: none */
    int kv_int8;            /* the caches are int8 rows with scales (paged_attention.c) */
    int part_keys;          /* paged_attention.c: > 0 splits rows by keys, fixed (deterministic mode) */
    float eps, scale;
} decoder_model;

/* One step's rows, each attending through the paged cache (as paged_attention.c). */
typedef struct {
    const int64_t *slots;        /* [rows] cache slot of each new token */
    const int32_t *block_tables; /* [num_seqs, max_blocks] */
    const int32_t *row_seq, *row_pos;
    int rows, max_blocks;
    const int32_t *lora_row_slot; /* [rows] each row's LoRA slot (< 0: none), or NULL: no adapted row */
    int lora_rank;                /* the largest rank among the step's adapters */
} step_rows;

#if HAVE_QUANT_MATMUL

#define DECLARE_KERNELS(SUFFIX, T)                                                               \
    int q4_matmul_##SUFFIX(const T *, long, int, int, const uint8_t *, const uint16_t *,         \
                           const uint16_t *, int, T *, int);                                     \
    int q8_matmul_##SUFFIX(const T *, long, int, int, const int8_t *, const uint16_t *,          \
                           const uint16_t *, int, T *, int);                                     \
    void rms_norm_##SUFFIX(const T *, long, const T *, long, T *, const T *, T *, int, int,      \
                           float, int);                                                          \
    void rotary_##SUFFIX(T *, long, int, int, int, const T *, const T *, int);                   \
    void silu_mul_##SUFFIX(const T *, long, T *, int, int, int);                                 \
    int paged_attention_##SUFFIX(const T *, long, const T *, const T *, const float *,          \
                                 const float *, T *, const int32_t *, int, const int32_t *,      \
                                 const int32_t *, int, int, int, int, int, float, int, int, int);\
    int paged_attention_##SUFFIX##_i8(const T *, long, const int8_t *, const int8_t *,           \
                                      const float *, const float *, T *, const int32_t *, int,   \
                                      const int32_t *, const int32_t *, int, int, int, int, int, \
                                      float, int, int, int);                                     \
    void kv_store_i8_##SUFFIX(const T *, long, int, const int64_t *, int, int, int8_t *, float *);

DECLARE_KERNELS(f32, float)
DECLARE_KERNELS(bf16, uint16_t)
int bf16_matmul_bf16(const uint16_t *, long, int, int, const uint16_t *, int, uint16_t *, int);
int int8_matmul_bf16(const uint16_t *, long, int, int, const int8_t *, const int32_t *, const float *, int,
                     uint16_t *, int);
int amx_bf16_matmul(const uint16_t *, long, int, int, const uint16_t *, int, uint16_t *, int);
int lora_add_f32(const float *, long, float *, long, int, int, const float *, const float *, const int32_t *, int,
                 const int32_t *, int, int, int);
int lora_add_bf16(const uint16_t *, long, uint16_t *, long, int, int, const float *, const float *,
                  const int32_t *, int, const int32_t *, int, int, int);

/* The BF16 and I8 kinds exist for bf16 activations only; a float32 step never gets one
 * (native_step.py), and refuses it if it did. */
static int bf16_only_matmul_f32(const float *x, long x_stride, int rows, int k, const qlinear *lin, float *y,
                                int nt) {
    (void)x, (void)x_stride, (void)rows, (void)k, (void)lin, (void)y, (void)nt;
    return 4;
}
static int bf16_only_matmul_bf16(const uint16_t *x, long x_stride, int rows, int k, const qlinear *lin,
                                 uint16_t *y, int nt) {
    if (lin->kind == QLINEAR_I8)
        return int8_matmul_bf16(x, x_stride, rows, k, lin->w, lin->d, lin->m, lin->n, y, nt);
    if (lin->kind == QLINEAR_AMX) return amx_bf16_matmul(x, x_stride, rows, k, lin->w, lin->n, y, nt);
    return bf16_matmul_bf16(x, x_stride, rows, k, lin->w, lin->n, y, nt);
}

/* The integer matmuls take at most this many rows a call (quant_matmul.c MAX_ROWS); longer
 * steps (a short prompt prefilled here) go in chunks, as layers/native.py QuantMatmul does. */
#define QUANT_MAX_ROWS 64

/* y = x W^T (+ b) (+ the adapted rows' LoRA products), x [rows, k] with row stride x_stride;
 * y [rows, n]. */
#define DEFINE_PROJECT(NAME, SUFFIX, T, LOAD, ROUND, STORE)                                       \
    static int NAME(const qlinear *lin, const T *x, long x_stride, int rows, T *y, int nt,       \
                    const step_rows *st) {                                                       \
        int bad = 0;                                                                             \
        if (lin->kind == QLINEAR_BF16 || lin->kind == QLINEAR_I8 || lin->kind == QLINEAR_AMX)    \
            bad = bf16_only_matmul_##SUFFIX(x, x_stride, rows, lin->k, lin, y, nt);              \
        const int quant = lin->kind == QLINEAR_Q4 || lin->kind == QLINEAR_Q8;                    \
        for (int r0 = 0; quant && r0 < rows && !bad; r0 += QUANT_MAX_ROWS) {                     \
            const int nr = rows - r0 < QUANT_MAX_ROWS ? rows - r0 : QUANT_MAX_ROWS;             \
            const T *xr = x + r0 * x_stride;                                                     \
            T *yr = y + (long)r0 * lin->n;                                                       \
            bad = lin->kind == QLINEAR_Q4                                                        \
                ? q4_matmul_##SUFFIX(xr, x_stride, nr, lin->k, lin->w, lin->d, lin->m, lin->n, yr, nt) \
                : q8_matmul_##SUFFIX(xr, x_stride, nr, lin->k, lin->w, lin->d, 0, lin->n, yr, nt); \
        }                                                                                        \
        if (bad) return bad;                                                                     \
        if (lin->bias) {                                                                         \
            const T *b = lin->bias;                                                              \
            for (int r = 0; r < rows; r++)                                                       \
                for (int i = 0; i < lin->n; i++)                                                 \
                    STORE(y + (long)r * lin->n, i, ROUND(LOAD(y + (long)r * lin->n, i) + LOAD(b, i))); \
        }                                                                                        \
        if (lin->lora_a && st->lora_row_slot)                                                    \
            bad = lora_add_##SUFFIX(x, x_stride, y, lin->n, rows, lin->k, lin->lora_a, lin->lora_b, \
                                    st->lora_row_slot, lin->lora_parts, lin->lora_bounds,        \
                                    lin->lora_max_rank, st->lora_rank, nt);                      \
        return bad;                                                                              \
    }

/* The layer order of fornax/models/llama.py (DecoderLayer.forward): each residual add is
 * fused into the norm after it. Scratch is one allocation per step. */
#define DEFINE_DECODE_STEP(NAME, SUFFIX, T, PROJECT)                                              \
    int NAME(const decoder_model *md, const T *x, const T *cos, const T *sin, const step_rows *st, \
             T *out, int nt) {                                                                   \
        const int rows = st->rows, hid = md->hidden, d = md->head_dim;                           \
        const int q_size = md->num_heads * d, kv_size = md->num_kv_heads * d;                    \
        const int qkv_w = q_size + 2 * kv_size, inter = md->intermediate;                        \
        const long per_row = 3L * hid + qkv_w + q_size + 3L * inter;                              \
        T *scratch = malloc(sizeof(T) * per_row * rows);                                         \
        if (!scratch) return 2;                                                                  \
        T *h = scratch, *residual = h + (long)rows * hid, *mlp = residual + (long)rows * hid;    \
        T *qkv = mlp + (long)rows * hid, *attn = qkv + (long)rows * qkv_w;                       \
        T *gate_up = attn + (long)rows * q_size, *act = gate_up + 2L * rows * inter;             \
        const T *layer_in = x; /* the previous layer's MLP output (layer 0: the embeddings) */  \
        int bad = 0;                                                                             \
        for (int l = 0; l < md->num_layers && !bad; l++) {                                       \
            const decoder_layer *ly = md->layers + l;                                            \
            if (l == 0) {                                                                        \
                rms_norm_##SUFFIX(x, hid, 0, 0, 0, ly->input_norm, h, rows, hid, md->eps, nt);   \
                memcpy(residual, x, sizeof(T) * rows * hid);                                     \
            } else {                                                                             \
                rms_norm_##SUFFIX(layer_in, hid, residual, hid, residual, ly->input_norm, h, rows, \
                                  hid, md->eps, nt);                                             \
            }                                                                                    \
            bad |= PROJECT(&ly->qkv, h, hid, rows, qkv, nt, st);                                     \
            rotary_##SUFFIX(qkv, qkv_w, rows, md->num_heads + md->num_kv_heads, d, cos, sin, nt); \
            if (md->kv_int8) {                                                                   \
                int8_t *kc = ly->k_cache, *vc = ly->v_cache;                                     \
                kv_store_i8_##SUFFIX(qkv + q_size, qkv_w, rows, st->slots, md->num_kv_heads, d,  \
                                     kc, ly->k_scale);                                           \
                kv_store_i8_##SUFFIX(qkv + q_size + kv_size, qkv_w, rows, st->slots,             \
                                     md->num_kv_heads, d, vc, ly->v_scale);                      \
                bad |= paged_attention_##SUFFIX##_i8(qkv, qkv_w, kc, vc, ly->k_scale, ly->v_scale, \
                                                     attn, st->block_tables, st->max_blocks,     \
                                                     st->row_seq, st->row_pos, rows,             \
                                                     md->num_heads, md->num_kv_heads, d,         \
                                                     md->block_size, md->scale, md->window, nt,      \
                                                     md->part_keys);                             \
            } else {                                                                             \
                T *kc = ly->k_cache, *vc = ly->v_cache;                                          \
                for (int r = 0; r < rows; r++) {                                                 \
                    memcpy(kc + st->slots[r] * kv_size, qkv + (long)r * qkv_w + q_size,          \
                           sizeof(T) * kv_size);                                                 \
                    memcpy(vc + st->slots[r] * kv_size, qkv + (long)r * qkv_w + q_size + kv_size, \
                           sizeof(T) * kv_size);                                                 \
                }                                                                                \
                bad |= paged_attention_##SUFFIX(qkv, qkv_w, kc, vc, 0, 0, attn, st->block_tables, \
                                                st->max_blocks, st->row_seq, st->row_pos, rows,  \
                                                md->num_heads, md->num_kv_heads, d,              \
                                                md->block_size, md->scale, md->window, nt,       \
                                                md->part_keys);                                  \
            }                                                                                    \
            bad |= PROJECT(&ly->o, attn, q_size, rows, mlp, nt, st);                                 \
            rms_norm_##SUFFIX(mlp, hid, residual, hid, residual, ly->post_norm, h, rows, hid,    \
                              md->eps, nt);                                                      \
            bad |= PROJECT(&ly->gate_up, h, hid, rows, gate_up, nt, st);                             \
            silu_mul_##SUFFIX(gate_up, 2L * inter, act, rows, inter, nt);                        \
            bad |= PROJECT(&ly->down, act, inter, rows, mlp, nt, st);                                \
            layer_in = mlp;                                                                      \
        }                                                                                        \
        if (!bad)                                                                                \
            rms_norm_##SUFFIX(layer_in, hid, residual, hid, residual, md->final_norm, out, rows, \
                              hid, md->eps, nt);                                                 \
        free(scratch);                                                                           \
        return bad;                                                                              \
    }

DEFINE_PROJECT(project_f32, f32, float, LOAD_F32, ROUND_F32, STORE_F32)
DEFINE_PROJECT(project_bf16, bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16)
DEFINE_DECODE_STEP(decode_step_f32, f32, float, project_f32)
DEFINE_DECODE_STEP(decode_step_bf16, bf16, uint16_t, project_bf16)

#endif
