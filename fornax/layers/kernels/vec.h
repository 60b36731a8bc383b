/* One vector of float32 lanes at the widest width the build has: AVX-512's 16 lanes
 * (vec512.h), AVX2's 8 (vec256.h) or Arm NEON's 4 on AArch64 (vec128.h). Kernels whose loops
 * are the same at every width (fused_ops.c) are written once against these names; each maps
 * to one intrinsic or helper. */
#ifndef FORNAX_VEC_H
#define FORNAX_VEC_H

#include "vec128.h"
#include "vec256.h"
#include "vec512.h"

#if HAVE_VEC512
#define HAVE_VEC 1
#define VF_LANES 16
typedef __m512 vf;
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_reduce_add _mm512_reduce_add_ps
#define vf_exp exp512
#define vf_load_f32 vload_f32
#define vf_load_bf16 vload_bf16
#define vf_round_f32 vround_f32
#define vf_round_bf16 vround_bf16
#define vf_store_f32 vstore_f32
#define vf_store_bf16 vstore_bf16
#elif HAVE_VEC256
#define HAVE_VEC 1
#define VF_LANES 8
typedef __m256 vf;
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_reduce_add hsum256
#define vf_exp exp256
#define vf_load_f32 vload8_f32
#define vf_load_bf16 vload8_bf16
#define vf_round_f32 vround8_f32
#define vf_round_bf16 vround8_bf16
#define vf_store_f32 vstore8_f32
#define vf_store_bf16 vstore8_bf16
#elif HAVE_VEC128
#define HAVE_VEC 1
#define VF_LANES 4
typedef float32x4_t vf;
#define vf_zero() vdupq_n_f32(0.0f)
#define vf_set1 vdupq_n_f32
#define vf_add vaddq_f32
#define vf_sub vsubq_f32
#define vf_mul vmulq_f32
#define vf_div vdivq_f32
#define vf_fmadd(a, b, c) vfmaq_f32((c), (a), (b)) /* a * b + c, one rounding */
#define vf_reduce_add hsum128
#define vf_exp exp128
#define vf_load_f32 vload4_f32
#define vf_load_bf16 vload4_bf16
#define vf_round_f32 vround4_f32
#define vf_round_bf16 vround4_bf16
#define vf_store_f32 vstore4_f32
#define vf_store_bf16 vstore4_bf16
#else
#define HAVE_VEC 0
#endif

#endif
