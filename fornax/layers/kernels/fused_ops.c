/* Fused elementwise ops of a decoder layer: (residual add +) RMSNorm, rotary embedding in
 * place, SiLU(gate) * up.
 *
 * Why this exists: a decode step of a small model is made of tiny tensors, so its time goes
 * to per-op dispatch rather than arithmetic. In torch ops, one RMSNorm is eight calls
 * (cast, pow, mean, add, rsqrt, mul, cast, mul) and rotary seven per tensor; at 30 layers
 * that is ~1,300 calls per step, a few microseconds each. Here each is one call.
 *
 * Every function reproduces the torch expression it replaces, including where torch rounds
 * to the tensor's dtype between operations (bf16: round to nearest even after each op, as
 * torch does when it computes a bf16 op in float32 and stores it). So the bf16 path stays
 * within rounding of the torch path, and the f32 path within float reassociation.
 *
 * Rows may be strided (views into a fused projection's output); elements within a row are
 * contiguous. Outputs are contiguous [rows, dim] unless noted.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Rows below this are done on one thread: waking the pool costs more than the work. */
#define PARALLEL_MIN_ROWS 16

/* s = x + residual (stored when residual is given), y = w * cast(s * rsqrt(mean(s^2) + eps)). */
#define DEFINE_RMS_NORM(NAME, T, LOAD, ROUND, STORE)                                             \
    void NAME(const T *x, long x_stride, const T *residual, long r_stride, T *sum_out,           \
              const T *weight, T *out, int rows, int dim, float eps, int num_threads) {          \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)")      \
        for (int r = 0; r < rows; r++) {                                                         \
            const T *xr = x + r * x_stride;                                                      \
            T *sr = sum_out ? sum_out + (long)r * dim : 0;                                       \
            T *o = out + (long)r * dim;                                                          \
            float ss = 0.f;                                                                      \
            if (residual) {                                                                      \
                const T *rr = residual + r * r_stride;                                           \
                for (int i = 0; i < dim; i++) {                                                  \
                    const float s = ROUND(LOAD(xr, i) + LOAD(rr, i));                            \
                    STORE(sr, i, s);                                                             \
                    ss += s * s;                                                                 \
                }                                                                                \
                xr = sr;                                                                         \
            } else {                                                                             \
                for (int i = 0; i < dim; i++) { const float v = LOAD(xr, i); ss += v * v; }      \
            }                                                                                    \
            const float inv = 1.f / sqrtf(ss / dim + eps);                                       \
            for (int i = 0; i < dim; i++)                                                        \
                STORE(o, i, ROUND(LOAD(weight, i) * ROUND(LOAD(xr, i) * inv)));                  \
        }                                                                                        \
    }

/* In place, half-split layout (HF's rotate_half): for each of the first num_heads heads of
 * every row, x = x * cos + cat(-x2, x1) * sin, cos/sin [rows, head_dim] contiguous. */
#define DEFINE_ROTARY(NAME, T, LOAD, ROUND, STORE)                                               \
    void NAME(T *x, long x_stride, int rows, int num_heads, int head_dim, const T *cos,          \
              const T *sin, int num_threads) {                                                   \
        const int half = head_dim / 2;                                                           \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)")      \
        for (int r = 0; r < rows; r++) {                                                         \
            const T *c = cos + (long)r * head_dim, *s = sin + (long)r * head_dim;                \
            for (int h = 0; h < num_heads; h++) {                                                \
                T *v = x + r * x_stride + (long)h * head_dim;                                    \
                for (int i = 0; i < half; i++) {                                                 \
                    const float a = LOAD(v, i), b = LOAD(v, i + half);                           \
                    const float lo = ROUND(ROUND(a * LOAD(c, i)) + ROUND(-b * LOAD(s, i)));      \
                    const float hi = ROUND(ROUND(b * LOAD(c, i + half)) + ROUND(a * LOAD(s, i + half))); \
                    STORE(v, i, lo);                                                             \
                    STORE(v, i + half, hi);                                                      \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

/* out = silu(gate) * up, gate = row[0:inter], up = row[inter:2*inter]. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, ROUND, STORE)                                             \
    void NAME(const T *gate_up, long stride, T *out, int rows, int inter, int num_threads) {     \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)")      \
        for (int r = 0; r < rows; r++) {                                                         \
            const T *g = gate_up + r * stride, *u = g + inter;                                   \
            T *o = out + (long)r * inter;                                                        \
            for (int i = 0; i < inter; i++) {                                                    \
                const float v = LOAD(g, i);                                                      \
                STORE(o, i, ROUND(ROUND(v / (1.f + expf(-v))) * LOAD(u, i)));                   \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, LOAD_F32, ROUND_F32, STORE_F32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16)
DEFINE_ROTARY(rotary_f32, float, LOAD_F32, ROUND_F32, STORE_F32)
DEFINE_ROTARY(rotary_bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16)
DEFINE_SILU_MUL(silu_mul_f32, float, LOAD_F32, ROUND_F32, STORE_F32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16)
