/* Paged attention for short query runs (decode, speculative verification), read in place.
 *
 * Why this exists: with torch ops alone, attention over a paged cache first gathers every
 * sequence's K and V into a padded [B, L, Hkv, D] copy per layer per step, then transposes
 * it again for the matmuls. At 24 sequences x 400 tokens that is ~3.4 ms per layer, about
 * 60% of a decode step on this CPU (benchmarks/decode_attention.py). This kernel reads
 * each cached K/V row once, where it lies, and never writes a copy.
 *
 * Layout (fornax.models.llama.KVCache): k_cache/v_cache are [num_slots, num_kv_heads,
 * head_dim], slot = block_tables[seq][pos / block_size] * block_size + pos % block_size.
 * Queries are [num_rows, num_heads, head_dim] with row stride q_row_stride (elements);
 * row r belongs to sequence row_seq[r] and sits at position row_pos[r], so it attends to
 * keys 0..row_pos[r] (or the last `window` of them). Output rows are contiguous.
 *
 * Math is float32 throughout; bf16 is converted on load and rounded to nearest even on
 * store. Work items are (row, KV-head chunk) pairs (see DEFINE_PAGED_ATTENTION); the query
 * heads that share a KV head are handled together so each K/V row is loaded once for all of
 * them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One body for both element types: LOAD(ptr, i) -> float, STORE(ptr, i, float). */
#define LOAD_F32(p, i) ((p)[i])
#define STORE_F32(p, i, x) ((p)[i] = (x))
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define STORE_BF16(p, i, x) ((p)[i] = f32_to_bf16(x))

/* Attention of query row r for KV heads [kvh0, kvh1): all their query heads are scored
 * against each K row in one pass, so a token's K/V row (all heads, contiguous) is read once. */
#define DEFINE_ROW_ATTENTION(NAME, T, LOAD, STORE)                                               \
    static int NAME(const T *q, long q_row_stride, const T *k_cache, const T *v_cache, T *out,   \
                    const int32_t *table, int pos, int first, int r, int kvh0, int kvh1,         \
                    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale) { \
        const int group = num_heads / num_kv_heads, nh = (kvh1 - kvh0) * group;                  \
        const int n = pos - first + 1;                                                           \
        const long kv_row = (long)num_kv_heads * head_dim, h0 = (long)kvh0 * group;               \
        float *qf = malloc(sizeof(float) * ((size_t)nh * head_dim * 2 + (size_t)nh * n + head_dim)); \
        if (!qf) return 1;                                                                       \
        float *acc = qf + (long)nh * head_dim, *scores = acc + (long)nh * head_dim;              \
        float *kv = scores + (long)nh * n;                                                       \
        for (int h = 0; h < nh; h++) {                                                           \
            const T *qh = q + r * q_row_stride + (h0 + h) * head_dim;                            \
            for (int d = 0; d < head_dim; d++) qf[(long)h * head_dim + d] = LOAD(qh, d) * scale; \
        }                                                                                        \
        for (int j = 0; j < n; j++) {                                                            \
            const int p = first + j;                                                             \
            const long slot = (long)table[p / block_size] * block_size + p % block_size;         \
            for (int kh = kvh0; kh < kvh1; kh++) {                                               \
                const T *kr = k_cache + slot * kv_row + (long)kh * head_dim;                     \
                for (int d = 0; d < head_dim; d++) kv[d] = LOAD(kr, d);                         \
                for (int g = 0; g < group; g++) {                                                \
                    const int h = (kh - kvh0) * group + g;                                       \
                    const float *qh = qf + (long)h * head_dim;                                   \
                    float s = 0.f;                                                               \
                    _Pragma("omp simd reduction(+ : s)")                                         \
                    for (int d = 0; d < head_dim; d++) s += qh[d] * kv[d];                       \
                    scores[(long)h * n + j] = s;                                                 \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int h = 0; h < nh; h++) {                                                           \
            float *sh = scores + (long)h * n, mx = -INFINITY, total = 0.f;                       \
            for (int j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;                            \
            for (int j = 0; j < n; j++) { sh[j] = expf(sh[j] - mx); total += sh[j]; }            \
            const float inv = 1.f / total;                                                       \
            for (int j = 0; j < n; j++) sh[j] *= inv;                                            \
            memset(acc + (long)h * head_dim, 0, sizeof(float) * head_dim);                       \
        }                                                                                        \
        for (int j = 0; j < n; j++) {                                                            \
            const int p = first + j;                                                             \
            const long slot = (long)table[p / block_size] * block_size + p % block_size;         \
            for (int kh = kvh0; kh < kvh1; kh++) {                                               \
                const T *vr = v_cache + slot * kv_row + (long)kh * head_dim;                     \
                for (int d = 0; d < head_dim; d++) kv[d] = LOAD(vr, d);                         \
                for (int g = 0; g < group; g++) {                                                \
                    const int h = (kh - kvh0) * group + g;                                       \
                    const float w = scores[(long)h * n + j];                                     \
                    float *ah = acc + (long)h * head_dim;                                        \
                    for (int d = 0; d < head_dim; d++) ah[d] += w * kv[d];                       \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int h = 0; h < nh; h++) {                                                           \
            T *o = out + ((long)r * num_heads + h0 + h) * head_dim;                              \
            for (int d = 0; d < head_dim; d++) STORE(o, d, acc[(long)h * head_dim + d]);         \
        }                                                                                        \
        free(qf);                                                                                \
        return 0;                                                                                \
    }

/* Work is split into (row, KV-head chunk) items: whole rows when there are enough rows to
 * keep every thread busy (contiguous reads), single KV heads otherwise (a lone decode still
 * uses all threads). */
#define DEFINE_PAGED_ATTENTION(NAME, ROW, T)                                                     \
    int NAME(const T *q, long q_row_stride, const T *k_cache, const T *v_cache, T *out,          \
             const int32_t *block_tables, int max_blocks, const int32_t *row_seq,                \
             const int32_t *row_pos, int num_rows, int num_heads, int num_kv_heads,              \
             int head_dim, int block_size, float scale, int window, int num_threads) {           \
        if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 1;                             \
        const int chunk = num_rows >= 2 * num_threads ? num_kv_heads : 1;                        \
        const int per_row = num_kv_heads / chunk;                                                \
        const long num_items = (long)num_rows * per_row;                                         \
        int failed = 0;                                                                          \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                \
        for (long item = 0; item < num_items; item++) {                                          \
            const int r = (int)(item / per_row), kvh0 = (int)(item % per_row) * chunk;          \
            const int pos = row_pos[r];                                                          \
            const int first = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;       \
            const int32_t *table = block_tables + (long)row_seq[r] * max_blocks;                 \
            if (ROW(q, q_row_stride, k_cache, v_cache, out, table, pos, first, r, kvh0,          \
                    kvh0 + chunk, num_heads, num_kv_heads, head_dim, block_size, scale))         \
                failed = 1;                                                                      \
        }                                                                                        \
        return failed ? 2 : 0;                                                                   \
    }

DEFINE_ROW_ATTENTION(row_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROW_ATTENTION(row_attention_bf16, uint16_t, LOAD_BF16, STORE_BF16)
DEFINE_PAGED_ATTENTION(paged_attention_f32, row_attention_f32, float)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, row_attention_bf16, uint16_t)
