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
 * store, except the bf16 scores: AVX-512 BF16 dot products of the bf16 query and key (exact
 * products, float32 sums), scaled after the sum (key_scores_bf16). With that and the value
 * pass done per KV head for its whole query group (pv_group), one layer of a lone
 * 2,000-key decode took ~25% less time (30 layers, K/V from memory: 3.3-3.8 vs 4.2-5.1 ms;
 * ad hoc A/B of builds side by side). Work items are (row, KV-head chunk, key part)
 * triples (see DEFINE_PAGED_ATTENTION); the query heads that share a KV head are handled
 * together so each K/V row is loaded once for all of them.
 *
 * int8 caches (--kv-cache-dtype int8): each (slot, KV head) row of head_dim values is int8
 * with one float32 scale, k_scale/v_scale [num_slots, num_kv_heads]; row = int8 * scale.
 * Long-context decode attention reads every cached K/V row, and this halves the bytes: a
 * 2,000-token decode step ran 1.15-1.19x faster, once the int8 scores were made cheap (see
 * I8_KEYS below). kv_store_i8_* below writes rows in that form; fornax/layers/kv_pool.py is
 * the torch twin (same arithmetic, same bits).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec128.h"
#include "vec256.h"
#include "vec512.h"

/* Ask for `bytes` from p on into the cache ahead of use. A sequence's K/V rows are scattered
 * by block, so the hardware prefetcher loses the stream at every block boundary; with the
 * weights streaming through the caches in between, a lone 2,000-key decode read its K/V
 * from memory. Prefetching K and V 8 keys ahead made it ~8% faster end to end (two A/B
 * rounds, 2026-12-03). */
#define PREFETCH_KEYS_AHEAD 8
static inline void prefetch_bytes(const void *p, long bytes) {
    for (long b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* The three inner loops, over one head's head_dim values. With AVX-512 (and head_dim a
 * multiple of 16, true of every supported model) they are written out with intrinsics:
 * left to the auto-vectorizer inside the macro bodies below they ran ~5x slower. AVX2 and
 * Arm NEON (AArch64, vec128.h) have the same loops at 8 and 4 lanes. */
#if defined(__AVX512F__)
#define DEFINE_ROW_TO_F32(NAME, T, LOAD16, LOAD)                                                 \
    static inline void NAME(float *dst, const T *src, int n) {                                   \
        if (n % 16 == 0) {                                                                       \
            for (int d = 0; d < n; d += 16) _mm512_storeu_ps(dst + d, LOAD16(src + d));          \
            return;                                                                              \
        }                                                                                        \
        for (int d = 0; d < n; d++) dst[d] = LOAD(src, d);                                       \
    }
#elif HAVE_VEC256 /* the same loops 8 values at a time (vec256.h): LOAD16 names the 8-lane load */
#define DEFINE_ROW_TO_F32(NAME, T, LOAD16, LOAD)                                                 \
    static inline void NAME(float *dst, const T *src, int n) {                                   \
        if (n % 8 == 0) {                                                                        \
            for (int d = 0; d < n; d += 8) _mm256_storeu_ps(dst + d, LOAD16(src + d));           \
            return;                                                                              \
        }                                                                                        \
        for (int d = 0; d < n; d++) dst[d] = LOAD(src, d);                                       \
    }
#elif HAVE_VEC128 /* 4 values at a time (vec128.h) */
#define DEFINE_ROW_TO_F32(NAME, T, LOAD16, LOAD)                                                 \
    static inline void NAME(float *dst, const T *src, int n) {                                   \
        if (n % 4 == 0) {                                                                        \
            for (int d = 0; d < n; d += 4) vst1q_f32(dst + d, LOAD16(src + d));                  \
            return;                                                                              \
        }                                                                                        \
        for (int d = 0; d < n; d++) dst[d] = LOAD(src, d);                                       \
    }
#else
#define DEFINE_ROW_TO_F32(NAME, T, LOAD16, LOAD)                                                 \
    static inline void NAME(float *dst, const T *src, int n) {                                   \
        for (int d = 0; d < n; d++) dst[d] = LOAD(src, d);                                       \
    }
#endif
#if HAVE_VEC512
#define VLOAD_BF16 vload_bf16
#define VLOAD_F32 vload_f32
#elif HAVE_VEC256
#define VLOAD_BF16 vload8_bf16
#define VLOAD_F32 vload8_f32
#elif HAVE_VEC128
#define VLOAD_BF16 vload4_bf16
#define VLOAD_F32 vload4_f32
#endif
DEFINE_ROW_TO_F32(row_to_f32_bf16, uint16_t, VLOAD_BF16, LOAD_BF16)

static inline void row_to_f32_f32(float *dst, const float *src, int n) { memcpy(dst, src, sizeof(float) * n); }

static inline float dot_f32(const float *a, const float *b, int n) {
#if defined(__AVX512F__)
    if (n % 32 == 0) {
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int d = 0; d < n; d += 32) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), s1);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    }
#elif HAVE_VEC256
    if (n % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int d = 0; d < n; d += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
        }
        return hsum256(_mm256_add_ps(s0, s1));
    }
#elif HAVE_VEC128
    /* AVX2's 16 values a step, in four accumulators: with 4-cycle FMAs two chains would leave
     * the FMA pipes of an Arm core idle half the time */
    if (n % 16 == 0) {
        float32x4_t s0 = vdupq_n_f32(0.f), s1 = s0, s2 = s0, s3 = s0;
        for (int d = 0; d < n; d += 16) {
            s0 = vfmaq_f32(s0, vld1q_f32(a + d), vld1q_f32(b + d));
            s1 = vfmaq_f32(s1, vld1q_f32(a + d + 4), vld1q_f32(b + d + 4));
            s2 = vfmaq_f32(s2, vld1q_f32(a + d + 8), vld1q_f32(b + d + 8));
            s3 = vfmaq_f32(s3, vld1q_f32(a + d + 12), vld1q_f32(b + d + 12));
        }
        return hsum128(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    }
#endif
    float s = 0.f;
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* s[j] = exp(s[j] - max(s)) in place; returns the sum and stores the max in *mx_out. Scalar
 * expf was most of a long row's time: 9 heads x 2,048 keys of libm calls per layer. */

static inline float exp_shifted_sum(float *s, int n, float *mx_out) {
    float mx = -INFINITY, total = 0.f;
    int j = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    mx = _mm512_reduce_max_ps(mv);
    for (int i = j; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    const __m512 mxv = _mm512_set1_ps(mx);
    __m512 tv = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mxv));
        _mm512_storeu_ps(s + j, e);
        tv = _mm512_add_ps(tv, e);
    }
    total = _mm512_reduce_add_ps(tv);
#elif HAVE_VEC256
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    mx = hmax256(mv);
    for (int i = j; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 tv = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
        _mm256_storeu_ps(s + j, e);
        tv = _mm256_add_ps(tv, e);
    }
    total = hsum256(tv);
#elif HAVE_VEC128
    float32x4_t mv = vdupq_n_f32(-INFINITY);
    for (; j + 4 <= n; j += 4) mv = vmaxq_f32(mv, vld1q_f32(s + j));
    mx = vmaxvq_f32(mv);
    for (int i = j; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    const float32x4_t mxv = vdupq_n_f32(mx);
    float32x4_t tv = vdupq_n_f32(0.f);
    for (j = 0; j + 4 <= n; j += 4) {
        const float32x4_t e = exp128(vsubq_f32(vld1q_f32(s + j), mxv));
        vst1q_f32(s + j, e);
        tv = vaddq_f32(tv, e);
    }
    total = hsum128(tv);
#else
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    j = 0;
#endif
    for (; j < n; j++) { s[j] = expf(s[j] - mx); total += s[j]; }
    *mx_out = mx;
    return total;
}

/* acc[0:head_dim] += sum over t < count of w[t] * v[t * stride : + head_dim]: the keys of one
 * block run at once, so the accumulator stays in registers across them (an axpy per key
 * stored and reloaded it every key: a store-to-load chain that dominated the V pass). */
#if defined(__AVX512F__)
#define DEFINE_PV_TILE(NAME, T, LOAD16, LOAD)                                                    \
    static inline void NAME(float *acc, const float *w, const T *v, long stride, int count,      \
                            int head_dim) {                                                      \
        if (head_dim % 32 == 0) {                                                                \
            for (int c = 0; c < head_dim; c += 32) {                                             \
                __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);        \
                for (int t = 0; t < count; t++) {                                                \
                    const __m512 wt = _mm512_set1_ps(w[t]);                                      \
                    a0 = _mm512_fmadd_ps(wt, LOAD16(v + t * stride + c), a0);                    \
                    a1 = _mm512_fmadd_ps(wt, LOAD16(v + t * stride + c + 16), a1);               \
                }                                                                                \
                _mm512_storeu_ps(acc + c, a0);                                                   \
                _mm512_storeu_ps(acc + c + 16, a1);                                              \
            }                                                                                    \
            return;                                                                              \
        }                                                                                        \
        for (int t = 0; t < count; t++)                                                          \
            for (int d = 0; d < head_dim; d++) acc[d] += w[t] * LOAD(v + t * stride, d);         \
    }
#elif HAVE_VEC256
#define DEFINE_PV_TILE(NAME, T, LOAD16, LOAD)                                                    \
    static inline void NAME(float *acc, const float *w, const T *v, long stride, int count,      \
                            int head_dim) {                                                      \
        if (head_dim % 16 == 0) {                                                                \
            for (int c = 0; c < head_dim; c += 16) {                                             \
                __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);         \
                for (int t = 0; t < count; t++) {                                                \
                    const __m256 wt = _mm256_set1_ps(w[t]);                                      \
                    a0 = _mm256_fmadd_ps(wt, LOAD16(v + t * stride + c), a0);                    \
                    a1 = _mm256_fmadd_ps(wt, LOAD16(v + t * stride + c + 8), a1);                \
                }                                                                                \
                _mm256_storeu_ps(acc + c, a0);                                                   \
                _mm256_storeu_ps(acc + c + 8, a1);                                               \
            }                                                                                    \
            return;                                                                              \
        }                                                                                        \
        for (int t = 0; t < count; t++)                                                          \
            for (int d = 0; d < head_dim; d++) acc[d] += w[t] * LOAD(v + t * stride, d);         \
    }
#elif HAVE_VEC128 /* AVX2's 16 values per pass over the keys, as 4 accumulators (dot_f32's reason) */
#define DEFINE_PV_TILE(NAME, T, LOAD16, LOAD)                                                    \
    static inline void NAME(float *acc, const float *w, const T *v, long stride, int count,      \
                            int head_dim) {                                                      \
        if (head_dim % 16 == 0) {                                                                \
            for (int c = 0; c < head_dim; c += 16) {                                             \
                float32x4_t a0 = vld1q_f32(acc + c), a1 = vld1q_f32(acc + c + 4);                \
                float32x4_t a2 = vld1q_f32(acc + c + 8), a3 = vld1q_f32(acc + c + 12);           \
                for (int t = 0; t < count; t++) {                                                \
                    const float32x4_t wt = vdupq_n_f32(w[t]);                                    \
                    const T *vt = v + t * stride + c;                                            \
                    a0 = vfmaq_f32(a0, wt, LOAD16(vt));                                          \
                    a1 = vfmaq_f32(a1, wt, LOAD16(vt + 4));                                      \
                    a2 = vfmaq_f32(a2, wt, LOAD16(vt + 8));                                      \
                    a3 = vfmaq_f32(a3, wt, LOAD16(vt + 12));                                     \
                }                                                                                \
                vst1q_f32(acc + c, a0);                                                          \
                vst1q_f32(acc + c + 4, a1);                                                      \
                vst1q_f32(acc + c + 8, a2);                                                      \
                vst1q_f32(acc + c + 12, a3);                                                     \
            }                                                                                    \
            return;                                                                              \
        }                                                                                        \
        for (int t = 0; t < count; t++)                                                          \
            for (int d = 0; d < head_dim; d++) acc[d] += w[t] * LOAD(v + t * stride, d);         \
    }
#else
#define DEFINE_PV_TILE(NAME, T, LOAD16, LOAD)                                                    \
    static inline void NAME(float *acc, const float *w, const T *v, long stride, int count,      \
                            int head_dim) {                                                      \
        for (int t = 0; t < count; t++)                                                          \
            for (int d = 0; d < head_dim; d++) acc[d] += w[t] * LOAD(v + t * stride, d);         \
    }
#endif
#if defined(__AVX512F__)
static inline __m512 vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#define VLOAD_I8 vload_i8
#elif HAVE_VEC256
static inline __m256 vload8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define VLOAD_I8 vload8_i8
#elif HAVE_VEC128
/* 4 int8 values: one 32-bit load (no read past them), widened to int16, int32, float32 */
static inline float32x4_t vload4_i8(const int8_t *p) {
    int32_t bits;
    memcpy(&bits, p, sizeof bits);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(bits))))));
}
#define VLOAD_I8 vload4_i8
#endif
#define LOAD_I8(p, i) ((float)(p)[i])
DEFINE_PV_TILE(pv_tile_bf16, uint16_t, VLOAD_BF16, LOAD_BF16)
DEFINE_PV_TILE(pv_tile_f32, float, VLOAD_F32, LOAD_F32)
DEFINE_PV_TILE(pv_tile_i8, int8_t, VLOAD_I8, LOAD_I8)

/* The value pass for all `group` query heads of one KV head at once: each V row is loaded
 * (and converted) once for the group instead of once per head, with the same per-head
 * multiply-adds in the same order as pv_tile. G is a constant at each call (pv_group's
 * switch), so the accumulators stay in registers. w: the group's first head's weights,
 * w_stride apart per head; acc: the group's [G][head_dim] accumulators. */
#if defined(__AVX512F__)
#define MAX_PV_GROUP 8
#define DEFINE_PV_GROUP(NAME, T, LOAD16)                                                         \
    static inline __attribute__((always_inline)) void NAME##_g(                                 \
        const int G, float *acc, const float *w, long w_stride, const T *v, long stride,         \
        int count, int head_dim) {                                                               \
        for (int c = 0; c < head_dim; c += 32) {                                                 \
            __m512 a0[MAX_PV_GROUP], a1[MAX_PV_GROUP];                                           \
            for (int g = 0; g < G; g++) {                                                        \
                a0[g] = _mm512_loadu_ps(acc + (long)g * head_dim + c);                           \
                a1[g] = _mm512_loadu_ps(acc + (long)g * head_dim + c + 16);                      \
            }                                                                                    \
            for (int t = 0; t < count; t++) {                                                    \
                const __m512 v0 = LOAD16(v + t * stride + c), v1 = LOAD16(v + t * stride + c + 16); \
                for (int g = 0; g < G; g++) {                                                    \
                    const __m512 wt = _mm512_set1_ps(w[g * w_stride + t]);                       \
                    a0[g] = _mm512_fmadd_ps(wt, v0, a0[g]);                                      \
                    a1[g] = _mm512_fmadd_ps(wt, v1, a1[g]);                                      \
                }                                                                                \
            }                                                                                    \
            for (int g = 0; g < G; g++) {                                                        \
                _mm512_storeu_ps(acc + (long)g * head_dim + c, a0[g]);                           \
                _mm512_storeu_ps(acc + (long)g * head_dim + c + 16, a1[g]);                      \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    /* 1 when done; 0: the caller runs pv_tile per head (head_dim not a multiple of 32, or a   \
     * group larger than MAX_PV_GROUP) */                                                       \
    static inline int NAME(int group, float *acc, const float *w, long w_stride, const T *v,     \
                           long stride, int count, int head_dim) {                              \
        if (head_dim % 32) return 0;                                                             \
        switch (group) {                                                                         \
        case 1: NAME##_g(1, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 2: NAME##_g(2, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 3: NAME##_g(3, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 4: NAME##_g(4, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 5: NAME##_g(5, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 6: NAME##_g(6, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 7: NAME##_g(7, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 8: NAME##_g(8, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        default: return 0;                                                                       \
        }                                                                                        \
    }
#elif HAVE_VEC256
#define MAX_PV_GROUP 6 /* 12 accumulators + 2 values + 1 weight of AVX2's 16 registers */
#define DEFINE_PV_GROUP(NAME, T, LOAD16)                                                         \
    static inline __attribute__((always_inline)) void NAME##_g(                                 \
        const int G, float *acc, const float *w, long w_stride, const T *v, long stride,         \
        int count, int head_dim) {                                                               \
        for (int c = 0; c < head_dim; c += 16) {                                                 \
            __m256 a0[MAX_PV_GROUP], a1[MAX_PV_GROUP];                                           \
            for (int g = 0; g < G; g++) {                                                        \
                a0[g] = _mm256_loadu_ps(acc + (long)g * head_dim + c);                           \
                a1[g] = _mm256_loadu_ps(acc + (long)g * head_dim + c + 8);                       \
            }                                                                                    \
            for (int t = 0; t < count; t++) {                                                    \
                const __m256 v0 = LOAD16(v + t * stride + c), v1 = LOAD16(v + t * stride + c + 8); \
                for (int g = 0; g < G; g++) {                                                    \
                    const __m256 wt = _mm256_set1_ps(w[g * w_stride + t]);                       \
                    a0[g] = _mm256_fmadd_ps(wt, v0, a0[g]);                                      \
                    a1[g] = _mm256_fmadd_ps(wt, v1, a1[g]);                                      \
                }                                                                                \
            }                                                                                    \
            for (int g = 0; g < G; g++) {                                                        \
                _mm256_storeu_ps(acc + (long)g * head_dim + c, a0[g]);                           \
                _mm256_storeu_ps(acc + (long)g * head_dim + c + 8, a1[g]);                       \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    static inline int NAME(int group, float *acc, const float *w, long w_stride, const T *v,     \
                           long stride, int count, int head_dim) {                              \
        if (head_dim % 16) return 0;                                                             \
        switch (group) {                                                                         \
        case 1: NAME##_g(1, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 2: NAME##_g(2, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 3: NAME##_g(3, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 4: NAME##_g(4, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 5: NAME##_g(5, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 6: NAME##_g(6, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        default: return 0;                                                                       \
        }                                                                                        \
    }
#elif HAVE_VEC128
/* 8 values of each head at a time: 16 accumulators + 2 values + 1 weight of NEON's 32
 * registers, so groups of 7 and 8 (common GQA ratios) stay on this path too */
#define MAX_PV_GROUP 8
#define DEFINE_PV_GROUP(NAME, T, LOAD16)                                                         \
    static inline __attribute__((always_inline)) void NAME##_g(                                 \
        const int G, float *acc, const float *w, long w_stride, const T *v, long stride,         \
        int count, int head_dim) {                                                               \
        for (int c = 0; c < head_dim; c += 8) {                                                  \
            float32x4_t a0[MAX_PV_GROUP], a1[MAX_PV_GROUP];                                      \
            for (int g = 0; g < G; g++) {                                                        \
                a0[g] = vld1q_f32(acc + (long)g * head_dim + c);                                 \
                a1[g] = vld1q_f32(acc + (long)g * head_dim + c + 4);                             \
            }                                                                                    \
            for (int t = 0; t < count; t++) {                                                    \
                const float32x4_t v0 = LOAD16(v + t * stride + c), v1 = LOAD16(v + t * stride + c + 4); \
                for (int g = 0; g < G; g++) {                                                    \
                    const float32x4_t wt = vdupq_n_f32(w[g * w_stride + t]);                     \
                    a0[g] = vfmaq_f32(a0[g], wt, v0);                                            \
                    a1[g] = vfmaq_f32(a1[g], wt, v1);                                            \
                }                                                                                \
            }                                                                                    \
            for (int g = 0; g < G; g++) {                                                        \
                vst1q_f32(acc + (long)g * head_dim + c, a0[g]);                                  \
                vst1q_f32(acc + (long)g * head_dim + c + 4, a1[g]);                              \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    static inline int NAME(int group, float *acc, const float *w, long w_stride, const T *v,     \
                           long stride, int count, int head_dim) {                              \
        if (head_dim % 8) return 0;                                                              \
        switch (group) {                                                                         \
        case 1: NAME##_g(1, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 2: NAME##_g(2, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 3: NAME##_g(3, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 4: NAME##_g(4, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 5: NAME##_g(5, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 6: NAME##_g(6, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 7: NAME##_g(7, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        case 8: NAME##_g(8, acc, w, w_stride, v, stride, count, head_dim); return 1;             \
        default: return 0;                                                                       \
        }                                                                                        \
    }
#else
#define DEFINE_PV_GROUP(NAME, T, LOAD16)                                                         \
    static inline int NAME(int group, float *acc, const float *w, long w_stride, const T *v,     \
                           long stride, int count, int head_dim) {                              \
        (void)group, (void)acc, (void)w, (void)w_stride, (void)v, (void)stride, (void)count,     \
            (void)head_dim;                                                                      \
        return 0;                                                                                \
    }
#endif
DEFINE_PV_GROUP(pv_group_bf16, uint16_t, VLOAD_BF16)
DEFINE_PV_GROUP(pv_group_f32, float, VLOAD_F32)
DEFINE_PV_GROUP(pv_group_i8, int8_t, VLOAD_I8)

/* Scores against int8 K rows, 16 keys at a time. Per key and KV head the row is converted to
 * float32 once, into registers (D a constant: 64 or 128), and multiplied with each of its
 * group's pre-scaled float32 queries; the 16-lane products are kept (part[h][t]) and summed
 * for 16 keys at once by reduce16, then scaled by the rows' scales. A horizontal sum per key
 * and head (_mm512_reduce_add_ps) was most of the kernel's time; converting the row into a
 * buffer and reloading it, another quarter (perf, 2026-12-03). */
#if defined(__AVX512F__)
#define I8_KEYS 16
static inline __attribute__((always_inline)) void i8_row_partials_d(const int D, const int8_t *kr, const float *qf,
                                                                    int group, __m512 *part) {
    __m512 kf[8];
    for (int c = 0; c < D / 16; c++) kf[c] = vload_i8(kr + 16 * c);
    for (int g = 0; g < group; g++) {
        const float *qh = qf + (long)g * D;
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qh), kf[0]), a1 = _mm512_mul_ps(_mm512_loadu_ps(qh + 16), kf[1]);
        for (int c = 2; c < D / 16; c += 2) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kf[c], a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c + 16), kf[c + 1], a1);
        }
        part[g * I8_KEYS] = _mm512_add_ps(a0, a1);
    }
}
/* part: [group][I8_KEYS] products of this key (slot t of the batch) */
static inline __attribute__((always_inline)) void i8_row_partials(const int8_t *kr, const float *qf, int group,
                                                                  int head_dim, __m512 *part) {
    if (head_dim == 64) i8_row_partials_d(64, kr, qf, group, part);
    else i8_row_partials_d(128, kr, qf, group, part);
}
/* The batch's `count` keys (from key j0 on): scores[h * n + j0 + t] for every head, times the
 * keys' row scales ks [nkv][I8_KEYS]. */
static inline void flush_partials(__m512 *part, const float *ks, int nh, int group, int count, float *scores,
                                  long n, int j0) {
    const __mmask16 keep = (__mmask16)((1u << count) - 1);
    for (int h = 0; h < nh; h++) {
        __m512 *ph = part + (long)h * I8_KEYS;
        for (int t = count; t < I8_KEYS; t++) ph[t] = _mm512_setzero_ps();
        const __m512 sums = _mm512_mul_ps(reduce16(ph), _mm512_loadu_ps(ks + (h / group) * I8_KEYS));
        _mm512_mask_storeu_ps(scores + (long)h * n + j0, keep, sums);
    }
}
#define I8_BATCHED(head_dim) ((head_dim) == 64 || (head_dim) == 128)
#define I8_PARTIALS(kr, qf, group, head_dim, part, hk, t) \
    i8_row_partials(kr, qf, group, head_dim, (__m512 *)(part) + (hk) * I8_KEYS + (t))
#define I8_FLUSH(part, ks, nh, group, count, scores, n, j0) \
    flush_partials((__m512 *)(part), ks, nh, group, count, scores, n, j0)
#else
#define I8_KEYS 16
#define I8_BATCHED(head_dim) 0
#define I8_PARTIALS(kr, qf, group, head_dim, part, hk, t) ((void)(hk))
#define I8_FLUSH(part, ks, nh, group, count, scores, n, j0) ((void)0)
#endif

DEFINE_ROW_TO_F32(row_to_f32_i8, int8_t, VLOAD_I8, LOAD_I8)

/* Scores of one key for the query heads of KV heads [kvh0, kvh0 + nkv), bf16 K against the
 * bf16 queries as they are, with AVX-512 BF16 dot products (each product exact in float32,
 * float32 sums) and the softmax scale applied to the sum: no conversion of K to float32,
 * which with the dot products was most of the score pass. k: the key's row at kvh0; q: the
 * query row at the first head. Returns 0 where it cannot run (the caller then converts). */
static inline int key_scores_bf16(const uint16_t *k, const uint16_t *q, int nkv, int group, int head_dim,
                                  float scale, float *scores, long n, int j) {
#if defined(__AVX512BF16__)
    if (head_dim % 32) return 0;
    for (int kh = 0; kh < nkv; kh++) {
        const uint16_t *kr = k + (long)kh * head_dim;
        for (int g = 0; g < group; g++) {
            const int h = kh * group + g;
            const uint16_t *qh = q + (long)h * head_dim;
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < head_dim; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(kr + d));
            scores[(long)h * n + j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    return 1;
#else
    (void)k, (void)q, (void)nkv, (void)group, (void)head_dim, (void)scale, (void)scores, (void)n, (void)j;
    return 0;
#endif
}
static inline int key_scores_f32(const float *k, const float *q, int nkv, int group, int head_dim, float scale,
                                 float *scores, long n, int j) {
    (void)k, (void)q, (void)nkv, (void)group, (void)head_dim, (void)scale, (void)scores, (void)n, (void)j;
    return 0; /* float32 caches take the converting path: it is a plain float dot product there */
}

/* The pieces both row parts below share. A part starts empty: per head a running max of
 * -inf, a sum of 0 and a zero accumulator (an empty part then merges as nothing). */
static inline void row_part_clear(float *m, float *l, float *acc, int nh, int head_dim) {
    for (int h = 0; h < nh; h++) { m[h] = -INFINITY; l[h] = 0.f; }
    memset(acc, 0, sizeof(float) * (size_t)nh * head_dim);
}

/* qf[h][d] = q[h][d] * scale for the part's nh query heads (q: its first head), in float32 */
#define LOAD_SCALED_QUERIES(qf, q, nh, head_dim, LOAD, scale)                                    \
    for (int h = 0; h < (nh); h++)                                                               \
        for (int d = 0; d < (head_dim); d++) (qf)[(long)h * (head_dim) + d] = LOAD((q) + (long)h * (head_dim), d) * (scale)

/* The value pass: acc[h] += sum over the part's keys of w[h][j] * V row, one run of keys that
 * sit in consecutive slots of one block at a time, each V row loaded once for its KV head's
 * whole query group (PV_GROUP), or per head where that cannot run (PV_TILE). w: [nh][n]. */
#define DEFINE_VALUE_PASS(NAME, C, PV_GROUP, PV_TILE)                                            \
    static void NAME(float *acc, const float *w, int n, const C *v_cache, const int32_t *table,  \
                     int k0, int kvh0, int kvh1, int group, long kv_row, int head_dim,           \
                     int block_size) {                                                           \
        for (int j = 0, off = k0 % block_size, blk = k0 / block_size; j < n; blk++, off = 0) {  \
            const int run = block_size - off < n - j ? block_size - off : n - j;                 \
            const long slot = (long)table[blk] * block_size + off;                               \
            for (int kh = kvh0; kh < kvh1; kh++) {                                               \
                const C *vr = v_cache + slot * kv_row + (long)kh * head_dim;                     \
                const int h0k = (kh - kvh0) * group;                                             \
                if (PV_GROUP(group, acc + (long)h0k * head_dim, w + (long)h0k * n + j, n, vr, kv_row, run, head_dim)) \
                    continue;                                                                    \
                for (int g = 0; g < group; g++) {                                                \
                    const int h = h0k + g;                                                       \
                    PV_TILE(acc + (long)h * head_dim, w + (long)h * n + j, vr, kv_row, run, head_dim); \
                }                                                                                \
            }                                                                                    \
            j += run;                                                                            \
        }                                                                                        \
    }
DEFINE_VALUE_PASS(value_pass_f32, float, pv_group_f32, pv_tile_f32)
DEFINE_VALUE_PASS(value_pass_bf16, uint16_t, pv_group_bf16, pv_tile_bf16)
DEFINE_VALUE_PASS(value_pass_i8, int8_t, pv_group_i8, pv_tile_i8)

/* Attention of query row r for KV heads [kvh0, kvh1) over keys [k0, k1): all their query
 * heads are scored against each K row in one pass, so a token's K/V row is read once. The
 * result is left unnormalised: per head the running max m, the sum of exp(score - m), and
 * acc = sum of exp(score - m) * V, so parts of one row's keys can be merged afterwards.
 * Returns nonzero when out of memory. */
#define DEFINE_ROW_PART(NAME, T, LOAD, TO_F32, KEY_SCORES, VALUE_PASS)                           \
    static int NAME(const T *q, long q_row_stride, const T *k_cache, const T *v_cache,           \
                    const float *k_scale, const float *v_scale, const int32_t *table, int k0,    \
                    int k1, int r, int kvh0, int kvh1, int num_heads, int num_kv_heads,          \
                    int head_dim, int block_size, float scale, float *m, float *l, float *acc) { \
        (void)k_scale, (void)v_scale; /* float caches carry no scales */                        \
        const int group = num_heads / num_kv_heads, nh = (kvh1 - kvh0) * group;                  \
        const int n = k1 - k0;                                                                   \
        const long kv_row = (long)num_kv_heads * head_dim, h0 = (long)kvh0 * group;               \
        row_part_clear(m, l, acc, nh, head_dim);                                                 \
        if (n <= 0) return 0;                                                                    \
        float *qf = malloc(sizeof(float) * ((size_t)nh * head_dim + (size_t)nh * n + head_dim)); \
        if (!qf) return 1;                                                                       \
        float *scores = qf + (long)nh * head_dim, *kv = scores + (long)nh * n;                   \
        LOAD_SCALED_QUERIES(qf, q + r * q_row_stride + h0 * head_dim, nh, head_dim, LOAD, scale); \
        const long row_bytes = (long)(kvh1 - kvh0) * head_dim * sizeof(T);                       \
        int pf_off = (k0 + PREFETCH_KEYS_AHEAD) % block_size;                                    \
        int pf_blk = (k0 + PREFETCH_KEYS_AHEAD) / block_size;                                    \
        for (int j = 0, off = k0 % block_size, blk = k0 / block_size; j < n; j++) {              \
            /* slot of key k0 + j, stepped along the block table (no division per key) */      \
            const long slot = (long)table[blk] * block_size + off;                               \
            if (++off == block_size) { off = 0; blk++; }                                         \
            if (j + PREFETCH_KEYS_AHEAD < n) { /* K (for now) and V (for the value pass) */     \
                const long pf = ((long)table[pf_blk] * block_size + pf_off) * kv_row + (long)kvh0 * head_dim; \
                prefetch_bytes(k_cache + pf, row_bytes);                                         \
                prefetch_bytes(v_cache + pf, row_bytes);                                         \
                if (++pf_off == block_size) { pf_off = 0; pf_blk++; }                           \
            }                                                                                    \
            if (KEY_SCORES(k_cache + slot * kv_row + (long)kvh0 * head_dim, q + r * q_row_stride + h0 * head_dim, \
                           kvh1 - kvh0, group, head_dim, scale, scores, n, j))                    \
                continue;                                                                        \
            for (int kh = kvh0; kh < kvh1; kh++) {                                               \
                const T *kr = k_cache + slot * kv_row + (long)kh * head_dim;                     \
                TO_F32(kv, kr, head_dim);                                                        \
                for (int g = 0; g < group; g++) {                                                \
                    const int h = (kh - kvh0) * group + g;                                       \
                    scores[(long)h * n + j] = dot_f32(qf + (long)h * head_dim, kv, head_dim);    \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int h = 0; h < nh; h++) l[h] = exp_shifted_sum(scores + (long)h * n, n, m + h);     \
        VALUE_PASS(acc, scores, n, v_cache, table, k0, kvh0, kvh1, group, kv_row, head_dim, block_size); \
        free(qf);                                                                                \
        return 0;                                                                                \
    }

/* The same for int8 caches: the K row of each KV head is converted to float32 once and
 * scored against the group's (pre-scaled) float32 queries, times the row's scale; after the
 * softmax sums, each key's weight is multiplied by its V row's scale, so the value pass
 * reads int8 V rows unscaled. T is the query (and output) type. */
#define DEFINE_ROW_PART_I8(NAME, T, LOAD)                                                        \
    static int NAME(const T *q, long q_row_stride, const int8_t *k_cache, const int8_t *v_cache, \
                    const float *k_scale, const float *v_scale, const int32_t *table, int k0,    \
                    int k1, int r, int kvh0, int kvh1, int num_heads, int num_kv_heads,          \
                    int head_dim, int block_size, float scale, float *m, float *l, float *acc) { \
        const int group = num_heads / num_kv_heads, nh = (kvh1 - kvh0) * group;                  \
        const int n = k1 - k0;                                                                   \
        const long kv_row = (long)num_kv_heads * head_dim, h0 = (long)kvh0 * group;               \
        row_part_clear(m, l, acc, nh, head_dim);                                                 \
        if (n <= 0) return 0;                                                                    \
        const int nkv = kvh1 - kvh0, batched = I8_BATCHED(head_dim);                             \
        /* part: [nh][I8_KEYS] vectors of 16 floats (reduce16's input); ks: [nkv][I8_KEYS] */  \
        const size_t part_floats = batched ? (size_t)nh * I8_KEYS * 16 : 0;                      \
        float *qf = malloc(sizeof(float) * ((size_t)nh * head_dim + (size_t)(nh + nkv) * n + head_dim \
                                            + part_floats + 16 + (size_t)nkv * I8_KEYS));         \
        if (!qf) return 1;                                                                       \
        /* vs: each key's V scale per KV head, [nkv][n], read here so the weights can be scaled \
         * in contiguous runs later (a gather of them per key was ~a quarter of the kernel) */  \
        float *scores = qf + (long)nh * head_dim, *vs = scores + (long)nh * n, *kv = vs + (long)nkv * n; \
        /* part is read and written as whole vectors: 64-byte aligned */                       \
        float *part = (float *)(((uintptr_t)(kv + head_dim) + 63) & ~(uintptr_t)63);             \
        float *ks_batch = part + part_floats;                                                    \
        LOAD_SCALED_QUERIES(qf, q + r * q_row_stride + h0 * head_dim, nh, head_dim, LOAD, scale); \
        const long row_bytes = (long)(kvh1 - kvh0) * head_dim;                                   \
        int pf_off = (k0 + PREFETCH_KEYS_AHEAD) % block_size;                                    \
        int pf_blk = (k0 + PREFETCH_KEYS_AHEAD) / block_size;                                    \
        for (int j = 0, off = k0 % block_size, blk = k0 / block_size; j < n; j++) {              \
            const long slot = (long)table[blk] * block_size + off;                               \
            if (++off == block_size) { off = 0; blk++; }                                         \
            if (j + PREFETCH_KEYS_AHEAD < n) {                                                   \
                const long pf_slot = (long)table[pf_blk] * block_size + pf_off;                  \
                const long pf = pf_slot * kv_row + (long)kvh0 * head_dim;                        \
                prefetch_bytes(k_cache + pf, row_bytes);                                         \
                prefetch_bytes(v_cache + pf, row_bytes);                                         \
                if (pf_off == 0) { /* a block's scales are one short run */                      \
                    __builtin_prefetch(k_scale + pf_slot * num_kv_heads, 0, 3);                  \
                    __builtin_prefetch(v_scale + pf_slot * num_kv_heads, 0, 3);                  \
                }                                                                                \
                if (++pf_off == block_size) { pf_off = 0; pf_blk++; }                           \
            }                                                                                    \
            const int t = j % I8_KEYS;                                                           \
            for (int kh = kvh0; kh < kvh1; kh++) {                                               \
                vs[(long)(kh - kvh0) * n + j] = v_scale[slot * num_kv_heads + kh];               \
                const int8_t *kr = k_cache + slot * kv_row + (long)kh * head_dim;                \
                const float ks = k_scale[slot * num_kv_heads + kh];                              \
                const long hk = (long)(kh - kvh0) * group;                                       \
                if (batched) {                                                                   \
                    ks_batch[(kh - kvh0) * I8_KEYS + t] = ks;                                    \
                    I8_PARTIALS(kr, qf + hk * head_dim, group, head_dim, part, hk, t);           \
                    continue;                                                                    \
                }                                                                                \
                row_to_f32_i8(kv, kr, head_dim);                                                 \
                for (int g = 0; g < group; g++) {                                                \
                    const int h = (kh - kvh0) * group + g;                                       \
                    scores[(long)h * n + j] = dot_f32(qf + (long)h * head_dim, kv, head_dim) * ks; \
                }                                                                                \
            }                                                                                    \
            if (batched && (t == I8_KEYS - 1 || j == n - 1))                                     \
                I8_FLUSH(part, ks_batch, nh, group, t + 1, scores, n, j - t);                    \
        }                                                                                        \
        for (int h = 0; h < nh; h++) l[h] = exp_shifted_sum(scores + (long)h * n, n, m + h);     \
        for (int kh = kvh0; kh < kvh1; kh++)                                                     \
            for (int g = 0; g < group; g++) {                                                    \
                float *w = scores + (long)((kh - kvh0) * group + g) * n;                         \
                const float *vsk = vs + (long)(kh - kvh0) * n;                                   \
                for (int j = 0; j < n; j++) w[j] *= vsk[j];                                      \
            }                                                                                    \
        value_pass_i8(acc, scores, n, v_cache, table, k0, kvh0, kvh1, group, kv_row, head_dim, block_size); \
        free(qf);                                                                                \
        return 0;                                                                                \
    }

/* Work items are (row, KV-head chunk, key part) triples. Whole rows when there are enough
 * rows to keep every thread busy. With few rows, a long one is split into parts of at least
 * MIN_PART_KEYS keys (all heads: whole K/V rows, read sequentially), merged in a second pass
 * (split-K, as in flash-decoding), so one long request still uses every core evenly; a
 * very short one is split by KV head. Parts read whole K/V rows, so a block's 16 slots are
 * one sequential run for the prefetcher: at 256 keys per part, a lone decode of a few hundred
 * keys went per KV head instead, reading 128 of every 384 bytes, and its attention took ~57%
 * of the time of its layer's matmuls; at 32, ~31% (perf, one run each, 2026-12-03).
 *
 * part_keys > 0 (deterministic mode, docs/deterministic.md): that split depends on how many
 * rows share the call and on the thread count, and so do a row's sums. Instead every row is
 * cut into parts of part_keys keys counted from its first key, all KV heads together, and
 * merged in part order: the order of a row's additions then follows from its own length. */
#define MIN_PART_KEYS 32
#define DEFINE_PAGED_ATTENTION(NAME, PART, T, C, STORE)                                          \
    int NAME(const T *q, long q_row_stride, const C *k_cache, const C *v_cache,                  \
             const float *k_scale, const float *v_scale, T *out, const int32_t *block_tables,    \
             int max_blocks, const int32_t *row_seq, const int32_t *row_pos, int num_rows,       \
             int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,         \
             int window, int num_threads, int part_keys) {                                       \
        if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_rows <= 0) return num_rows < 0; \
        int longest = 0;                                                                         \
        for (int r = 0; r < num_rows; r++) longest = row_pos[r] + 1 > longest ? row_pos[r] + 1 : longest; \
        if (window > 0 && longest > window) longest = window;                                    \
        /* Few rows: split long ones by keys (whole K/V rows, read sequentially), short ones by \
         * KV head; enough rows: one item per row. */                                           \
        const int fixed = part_keys > 0;                                                         \
        const int few = !fixed && num_rows < 2 * num_threads;                                    \
        const int split_keys = few && longest >= 2 * MIN_PART_KEYS;                              \
        const int chunk = few && !split_keys ? 1 : num_kv_heads;                                 \
        const int per_row = num_kv_heads / chunk, group = num_heads / num_kv_heads;              \
        const int nh = chunk * group, stride = nh * (head_dim + 2);                              \
        const long base = (long)num_rows * per_row;                                              \
        int parts = 1;                                                                           \
        if (split_keys) {                                                                        \
            parts = (4 * num_threads + num_rows - 1) / num_rows;                                 \
            if (parts > longest / MIN_PART_KEYS) parts = longest / MIN_PART_KEYS;                \
        }                                                                                        \
        /* unit_first[u]: the first item of unit u (a row's chunk of KV heads); its parts are   \
         * the items up to unit_first[u + 1] */                                                  \
        long *unit_first = malloc(sizeof(long) * (size_t)(base + 1));                            \
        if (!unit_first) return 2;                                                               \
        unit_first[0] = 0;                                                                       \
        for (long unit = 0; unit < base; unit++) {                                               \
            const int pos = row_pos[unit / per_row];                                             \
            const int n = window > 0 && pos + 1 > window ? window : pos + 1;                     \
            unit_first[unit + 1] = unit_first[unit] + (fixed ? (n + part_keys - 1) / part_keys : parts); \
        }                                                                                        \
        const long num_items = unit_first[base];                                                 \
        float *scratch = malloc(sizeof(float) * (size_t)num_items * stride);                     \
        long *item_unit = malloc(sizeof(long) * (size_t)num_items);                              \
        if (!scratch || !item_unit) {                                                            \
            free(scratch), free(item_unit), free(unit_first);                                    \
            return 2;                                                                            \
        }                                                                                        \
        for (long unit = 0; unit < base; unit++)                                                 \
            for (long item = unit_first[unit]; item < unit_first[unit + 1]; item++) item_unit[item] = unit; \
        int failed = 0;                                                                          \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)") \
        for (long item = 0; item < num_items; item++) {                                          \
            const long unit = item_unit[item];                                                   \
            const int unit_parts = (int)(unit_first[unit + 1] - unit_first[unit]);               \
            const int part = (int)(item - unit_first[unit]);                                     \
            const int r = (int)(unit / per_row), kvh0 = (int)(unit % per_row) * chunk;           \
            const int pos = row_pos[r];                                                          \
            const int first = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;       \
            const int n = pos - first + 1;                                                       \
            int k0, k1;                                                                          \
            if (fixed) {                                                                         \
                k0 = first + part * part_keys;                                                   \
                k1 = k0 + part_keys < pos + 1 ? k0 + part_keys : pos + 1;                        \
            } else {                                                                             \
                k0 = first + (int)((long)n * part / unit_parts);                                 \
                k1 = first + (int)((long)n * (part + 1) / unit_parts);                           \
            }                                                                                    \
            float *m = scratch + item * stride, *l = m + nh, *acc = l + nh;                      \
            if (PART(q, q_row_stride, k_cache, v_cache, k_scale, v_scale,                       \
                     block_tables + (long)row_seq[r] * max_blocks,                               \
                     k0, k1, r, kvh0, kvh0 + chunk, num_heads, num_kv_heads, head_dim,           \
                     block_size, scale, m, l, acc))                                              \
                failed = 1;                                                                      \
        }                                                                                        \
        if (!failed) {                                                                           \
            _Pragma("omp parallel for num_threads(num_threads) if (base * nh >= 64)")            \
            for (long unit = 0; unit < base; unit++) {                                           \
                const int r = (int)(unit / per_row), kvh0 = (int)(unit % per_row) * chunk;      \
                const float *first_part = scratch + unit_first[unit] * stride;                   \
                const int unit_parts = (int)(unit_first[unit + 1] - unit_first[unit]);           \
                for (int h = 0; h < nh; h++) {                                                   \
                    float mx = -INFINITY, total = 0.f;                                           \
                    for (int p = 0; p < unit_parts; p++) {                                       \
                        const float mp = first_part[p * stride + h];                             \
                        mx = mp > mx ? mp : mx;                                                  \
                    }                                                                            \
                    float w[unit_parts];                                                         \
                    for (int p = 0; p < unit_parts; p++) {                                       \
                        const float *mp = first_part + p * stride;                               \
                        w[p] = mp[h] == -INFINITY ? 0.f : expf(mp[h] - mx);                      \
                        total += w[p] * mp[nh + h];                                              \
                    }                                                                            \
                    const float inv = 1.f / total;                                               \
                    T *o = out + ((long)r * num_heads + (long)kvh0 * group + h) * head_dim;      \
                    for (int d = 0; d < head_dim; d++) {                                         \
                        float v = 0.f;                                                           \
                        for (int p = 0; p < unit_parts; p++)                                     \
                            v += w[p] * first_part[p * stride + 2 * nh + (long)h * head_dim + d]; \
                        STORE(o, d, v * inv);                                                    \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        free(scratch);                                                                           \
        free(item_unit);                                                                         \
        free(unit_first);                                                                        \
        return failed ? 2 : 0;                                                                   \
    }

DEFINE_ROW_PART(row_part_f32, float, LOAD_F32, row_to_f32_f32, key_scores_f32, value_pass_f32)
DEFINE_ROW_PART(row_part_bf16, uint16_t, LOAD_BF16, row_to_f32_bf16, key_scores_bf16, value_pass_bf16)
DEFINE_ROW_PART_I8(row_part_f32_i8, float, LOAD_F32)
DEFINE_ROW_PART_I8(row_part_bf16_i8, uint16_t, LOAD_BF16)
DEFINE_PAGED_ATTENTION(paged_attention_f32, row_part_f32, float, float, STORE_F32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, row_part_bf16, uint16_t, uint16_t, STORE_BF16)
DEFINE_PAGED_ATTENTION(paged_attention_f32_i8, row_part_f32_i8, float, int8_t, STORE_F32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16_i8, row_part_bf16_i8, uint16_t, int8_t, STORE_BF16)

/* Quantize `rows` rows of new K or V ([rows, num_kv_heads, head_dim], row stride src_stride)
 * into an int8 cache at slots[r]: per (row, KV head), scale = max|x| / 127 and
 * q = round-to-nearest-even(x / scale), scale 0 for an all-zero row (divided by 1). The
 * operations are those of fornax/layers/kv_pool.py quantize_rows, in the same order (IEEE
 * division, default rounding), so both write the same bits. */
/* GCC 12 for aarch64 dies (internal compiler error in vect_transform_reduction) vectorizing
 * the max|x| reduction over bf16 loads below at -O3; the loop is a few dozen values per head. */
#if defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__)
#define KV_STORE_ATTRS __attribute__((optimize("no-tree-vectorize")))
#else
#define KV_STORE_ATTRS
#endif
#define DEFINE_KV_STORE_I8(NAME, T, LOAD)                                                        \
    KV_STORE_ATTRS void NAME(const T *src, long src_stride, int rows, const int64_t *slots, int num_kv_heads,   \
              int head_dim, int8_t *cache, float *scales) {                                      \
        for (int r = 0; r < rows; r++)                                                           \
            for (int kh = 0; kh < num_kv_heads; kh++) {                                          \
                const T *x = src + r * src_stride + (long)kh * head_dim;                         \
                float amax = 0.f;                                                                \
                for (int d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(LOAD(x, d)));        \
                const float s = amax / 127.f, div = s > 0.f ? s : 1.f;                           \
                int8_t *dst = cache + (slots[r] * num_kv_heads + kh) * (long)head_dim;           \
                for (int d = 0; d < head_dim; d++)                                               \
                    dst[d] = (int8_t)fminf(fmaxf(nearbyintf(LOAD(x, d) / div), -127.f), 127.f);  \
                scales[slots[r] * num_kv_heads + kh] = s;                                        \
            }                                                                                    \
    }
DEFINE_KV_STORE_I8(kv_store_i8_f32, float, LOAD_F32)
DEFINE_KV_STORE_I8(kv_store_i8_bf16, uint16_t, LOAD_BF16)
