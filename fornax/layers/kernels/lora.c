/* LoRA products of one step (layers/lora.py; docs/lora.md): for every row t that uses an adapter,
 *     y[t, lo_p:hi_p] += B_p (A_p x_t)     for each fused part p (q/k/v, gate/up, or one part),
 * with the adapter of slot row_slot[t] (< 0: the base model, the row is left as it is).
 *
 * Exactly the arithmetic each row needs, read straight from the slots: no gather of the step's
 * adapters, no mask, no block-diagonal zeros (the torch path pays those to stay two matmuls).
 * A and B of the few adapters in a step are reused by all their rows from cache.
 *
 * Plain C: the compiler vectorizes the two loops (dot products over `in`, axpys over a part's
 * outputs) for the level the library is built for (AVX2+FMA, AVX-512, NEON: layers/isa.py).
 * Sums are in float32. (Not batch-invariant: a step of fewer rows than threads takes the
 * split path below; deterministic mode refuses adapters, config/engine.py.)
 *
 * Layouts (float32, contiguous): a [slots, parts, max_rank, in]; b [slots, max_rank, out] with the
 * parts side by side in the columns (part p's B^T in columns bounds[p] .. bounds[p+1]).
 * The adapter's scaling is folded into b. x and y rows have strides in elements. */
#include <stdint.h>

#include "bf16.h"

int lora_available(void) { return 1; }

static void lora_row(const float *xf, float *yf, int in, int parts, const int32_t *bounds, int max_rank,
                     int rank, const float *a_slot, const float *b_slot) {
    float u[parts * rank];
    for (int p = 0; p < parts; p++) {
        for (int r = 0; r < rank; r++) {
            const float *ar = a_slot + ((long)p * max_rank + r) * in;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < in; i++) acc += ar[i] * xf[i];
            u[p * rank + r] = acc;
        }
    }
    for (int p = 0; p < parts; p++) {
        int lo = bounds[p], hi = bounds[p + 1];
        for (int r = 0; r < rank; r++) {
            const float *br = b_slot + (long)r * bounds[parts];
            float s = u[p * rank + r];
#pragma omp simd
            for (int o = lo; o < hi; o++) yf[o] += s * br[o];
        }
    }
}

/* Output columns a thread takes at a time when one row's products are split across threads. */
#define LORA_COLS 64

/* Returns 0, or 1 for arguments it cannot take. Steps of at least as many rows as threads
 * split rows over threads; fewer rows (a decode of one or two sequences) split each row's
 * dot products, then its output columns, so every thread works either way. */
#define LORA_ADD(NAME, T, LOAD, STORE)                                                                 \
    int NAME(const T *x, long x_stride, T *y, long y_stride, int rows, int in, const float *a,        \
             const float *b, const int32_t *row_slot, int parts, const int32_t *bounds, int max_rank, \
             int rank, int num_threads) {                                                              \
        if (rows < 0 || in <= 0 || parts <= 0 || rank <= 0 || rank > max_rank) return 1;              \
        int out = bounds[parts];                                                                       \
        long a_slot = (long)parts * max_rank * in, b_slot = (long)max_rank * out;                      \
        if (rows >= num_threads) {                                                                     \
            _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)")        \
            for (int t = 0; t < rows; t++) {                                                           \
                int s = row_slot[t];                                                                   \
                if (s < 0) continue;                                                                   \
                float xf[in], yf[out];                                                                 \
                for (int i = 0; i < in; i++) xf[i] = LOAD(x + t * x_stride, i);                        \
                for (int o = 0; o < out; o++) yf[o] = LOAD(y + t * y_stride, o);                       \
                lora_row(xf, yf, in, parts, bounds, max_rank, rank, a + s * a_slot, b + s * b_slot);  \
                for (int o = 0; o < out; o++) STORE(y + t * y_stride, o, yf[o]);                       \
            }                                                                                          \
            return 0;                                                                                  \
        }                                                                                              \
        int chunks = 0;                                                                                \
        for (int p = 0; p < parts; p++) chunks += (bounds[p + 1] - bounds[p] + LORA_COLS - 1) / LORA_COLS; \
        float xf[in], u[parts * rank];                                                                 \
        _Pragma("omp parallel num_threads(num_threads)")                                               \
        for (int t = 0; t < rows; t++) {                                                               \
            int s = row_slot[t];                                                                       \
            if (s < 0) continue;                                                                       \
            const float *as = a + s * a_slot, *bs = b + s * b_slot;                                    \
            _Pragma("omp for schedule(static)")                                                        \
            for (int i = 0; i < in; i++) xf[i] = LOAD(x + t * x_stride, i);                            \
            _Pragma("omp for schedule(static)")                                                        \
            for (int j = 0; j < parts * rank; j++) {                                                   \
                const float *ar = as + ((long)(j / rank) * max_rank + j % rank) * in;                  \
                float acc = 0.0f;                                                                      \
                _Pragma("omp simd reduction(+ : acc)")                                                 \
                for (int i = 0; i < in; i++) acc += ar[i] * xf[i];                                     \
                u[j] = acc;                                                                            \
            }                                                                                          \
            _Pragma("omp for schedule(static)")                                                        \
            for (int c = 0; c < chunks; c++) {                                                         \
                int p = 0, k = c, n;                                                                   \
                while (k >= (n = (bounds[p + 1] - bounds[p] + LORA_COLS - 1) / LORA_COLS)) k -= n, p++; \
                int lo = bounds[p] + k * LORA_COLS, hi = lo + LORA_COLS < bounds[p + 1] ? lo + LORA_COLS : bounds[p + 1]; \
                float acc[LORA_COLS];                                                                  \
                for (int o = lo; o < hi; o++) acc[o - lo] = LOAD(y + t * y_stride, o);                 \
                for (int r = 0; r < rank; r++) {                                                       \
                    const float *br = bs + (long)r * out;                                              \
                    float w = u[p * rank + r];                                                         \
                    _Pragma("omp simd")                                                                \
                    for (int o = lo; o < hi; o++) acc[o - lo] += w * br[o];                            \
                }                                                                                      \
                for (int o = lo; o < hi; o++) STORE(y + t * y_stride, o, acc[o - lo]);                 \
            }                                                                                          \
        }                                                                                              \
        return 0;                                                                                      \
    }

LORA_ADD(lora_add_f32, float, LOAD_F32, STORE_F32)
LORA_ADD(lora_add_bf16, uint16_t, LOAD_BF16, STORE_BF16)
