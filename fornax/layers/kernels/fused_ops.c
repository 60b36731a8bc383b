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
 *
 * With AVX-512 the loops run 16 values at a time, with AVX2 8, with NEON 4 (vec.h), with the
 * same roundings; only SiLU's exp is a polynomial instead of libm's (float32 rounding either
 * way) and the norm's sum of squares is summed in 16 (8, 4) lanes. Scalar, SiLU * up took ~10x torch's time at 512 rows
 * and the three ops ~160 ms of a 512-token prefill (30 layers).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec.h"

/* VEC_ONLY(code): the vector loop (vec.h: AVX-512 or AVX2) where there is one; the scalar loops
 * after it take the rest. */
#if HAVE_VEC
#define VEC_ONLY(...) __VA_ARGS__
#else
#define VEC_ONLY(...)
#endif

/* Rows below this are done on one thread: waking the pool costs more than the work. */
#define PARALLEL_MIN_ROWS 16

/* s = x + residual (stored when residual is given), y = w * cast(s * rsqrt(mean(s^2) + eps)). */
#define DEFINE_RMS_NORM(NAME, T, LOAD, ROUND, STORE, V)                                          \
    void NAME(const T *x, long x_stride, const T *residual, long r_stride, T *sum_out,           \
              const T *weight, T *out, int rows, int dim, float eps, int num_threads) {          \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)")      \
        for (int r = 0; r < rows; r++) {                                                         \
            const T *xr = x + r * x_stride;                                                      \
            T *sr = sum_out ? sum_out + (long)r * dim : 0;                                       \
            T *o = out + (long)r * dim;                                                          \
            float ss = 0.f;                                                                      \
            int i = 0;                                                                           \
            VEC_ONLY(vf ssv = vf_zero();)                                          \
            if (residual) {                                                                      \
                const T *rr = residual + r * r_stride;                                           \
                VEC_ONLY(for (; i + VF_LANES <= dim; i += VF_LANES) {                                        \
                    const vf s = vf_round_##V(vf_add(vf_load_##V(xr + i), vf_load_##V(rr + i))); \
                    vf_store_##V(sr + i, s);                                                       \
                    ssv = vf_fmadd(s, s, ssv);                                            \
                })                                                                               \
                for (; i < dim; i++) {                                                           \
                    const float s = ROUND(LOAD(xr, i) + LOAD(rr, i));                            \
                    STORE(sr, i, s);                                                             \
                    ss += s * s;                                                                 \
                }                                                                                \
                xr = sr;                                                                         \
            } else {                                                                             \
                VEC_ONLY(for (; i + VF_LANES <= dim; i += VF_LANES) {                                        \
                    const vf v = vf_load_##V(xr + i);                                          \
                    ssv = vf_fmadd(v, v, ssv);                                            \
                })                                                                               \
                for (; i < dim; i++) { const float v = LOAD(xr, i); ss += v * v; }               \
            }                                                                                    \
            VEC_ONLY(ss += vf_reduce_add(ssv);)                                           \
            const float inv = 1.f / sqrtf(ss / dim + eps);                                       \
            i = 0;                                                                               \
            VEC_ONLY(for (; i + VF_LANES <= dim; i += VF_LANES) {                                            \
                const vf v = vf_round_##V(vf_mul(vf_load_##V(xr + i), vf_set1(inv))); \
                vf_store_##V(o + i, vf_round_##V(vf_mul(vf_load_##V(weight + i), v)));         \
            })                                                                                   \
            for (; i < dim; i++)                                                                 \
                STORE(o, i, ROUND(LOAD(weight, i) * ROUND(LOAD(xr, i) * inv)));                  \
        }                                                                                        \
    }

/* y = cast(x * rsqrt(mean(x^2) + eps) * w), w float32, rounded once (Gemma's norm, w = 1 + weight:
 * HF multiplies in float32 before casting back). */
#define DEFINE_RMS_NORM_F32W(NAME, T, LOAD, ROUND, STORE, V)                                     \
    void NAME(const T *x, long x_stride, const float *weight, T *out, int rows, int dim, float eps, \
              int num_threads) {                                                                 \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)")      \
        for (int r = 0; r < rows; r++) {                                                         \
            const T *xr = x + r * x_stride;                                                      \
            T *o = out + (long)r * dim;                                                          \
            float ss = 0.f;                                                                      \
            int i = 0;                                                                           \
            VEC_ONLY(vf ssv = vf_zero();                                           \
                     for (; i + VF_LANES <= dim; i += VF_LANES) {                                            \
                         const vf v = vf_load_##V(xr + i);                                     \
                         ssv = vf_fmadd(v, v, ssv);                                       \
                     })                                                                          \
            for (; i < dim; i++) { const float v = LOAD(xr, i); ss += v * v; }                   \
            VEC_ONLY(ss += vf_reduce_add(ssv);)                                           \
            const float inv = 1.f / sqrtf(ss / dim + eps);                                       \
            i = 0;                                                                               \
            VEC_ONLY(for (; i + VF_LANES <= dim; i += VF_LANES) {                                            \
                const vf v = vf_mul(vf_load_##V(xr + i), vf_set1(inv));          \
                vf_store_##V(o + i, vf_round_##V(vf_mul(v, vf_load_f32(weight + i))));  \
            })                                                                                   \
            for (; i < dim; i++)                                                                 \
                STORE(o, i, ROUND(LOAD(xr, i) * inv * weight[i]));                               \
        }                                                                                        \
    }

/* In place, half-split layout (HF's rotate_half): for each of the first num_heads heads of
 * every row, x = x * cos + cat(-x2, x1) * sin, cos/sin [rows, head_dim] contiguous. */
#define DEFINE_ROTARY(NAME, T, LOAD, ROUND, STORE, V)                                             \
    void NAME(T *x, long x_stride, int rows, int num_heads, int head_dim, const T *cos,          \
              const T *sin, int num_threads) {                                                   \
        const int half = head_dim / 2;                                                           \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)")      \
        for (int r = 0; r < rows; r++) {                                                         \
            const T *c = cos + (long)r * head_dim, *s = sin + (long)r * head_dim;                \
            for (int h = 0; h < num_heads; h++) {                                                \
                T *v = x + r * x_stride + (long)h * head_dim;                                    \
                int i = 0;                                                                       \
                VEC_ONLY(for (; i + VF_LANES <= half; i += VF_LANES) {                                       \
                    const vf a = vf_load_##V(v + i), b = vf_load_##V(v + i + half);              \
                    const vf ac = vf_round_##V(vf_mul(a, vf_load_##V(c + i)));            \
                    const vf bs = vf_round_##V(vf_mul(b, vf_load_##V(s + i)));            \
                    const vf bc = vf_round_##V(vf_mul(b, vf_load_##V(c + i + half)));     \
                    const vf as = vf_round_##V(vf_mul(a, vf_load_##V(s + i + half)));     \
                    vf_store_##V(v + i, vf_round_##V(vf_sub(ac, bs)));                        \
                    vf_store_##V(v + i + half, vf_round_##V(vf_add(bc, as)));                 \
                })                                                                               \
                for (; i < half; i++) {                                                          \
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
#define DEFINE_SILU_MUL(NAME, T, LOAD, ROUND, STORE, V)                                           \
    void NAME(const T *gate_up, long stride, T *out, int rows, int inter, int num_threads) {     \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)")      \
        for (int r = 0; r < rows; r++) {                                                         \
            const T *g = gate_up + r * stride, *u = g + inter;                                   \
            T *o = out + (long)r * inter;                                                        \
            int i = 0;                                                                           \
            VEC_ONLY(for (; i + VF_LANES <= inter; i += VF_LANES) {                                          \
                const vf v = vf_load_##V(g + i);                                               \
                const vf e = vf_exp(vf_sub(vf_zero(), v));                  \
                const vf act = vf_round_##V(vf_div(v, vf_add(vf_set1(1.f), e))); \
                vf_store_##V(o + i, vf_round_##V(vf_mul(act, vf_load_##V(u + i))));            \
            })                                                                                   \
            for (; i < inter; i++) {                                                             \
                const float v = LOAD(g, i);                                                      \
                STORE(o, i, ROUND(ROUND(v / (1.f + expf(-v))) * LOAD(u, i)));                   \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, LOAD_F32, ROUND_F32, STORE_F32, f32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16, bf16)
DEFINE_RMS_NORM_F32W(rms_norm_f32w_f32, float, LOAD_F32, ROUND_F32, STORE_F32, f32)
DEFINE_RMS_NORM_F32W(rms_norm_f32w_bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16, bf16)
DEFINE_ROTARY(rotary_f32, float, LOAD_F32, ROUND_F32, STORE_F32, f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16, bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, LOAD_F32, ROUND_F32, STORE_F32, f32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, LOAD_BF16, ROUND_BF16, STORE_BF16, bf16)
