/* bfloat16 <-> float32 and the per-type load/round/store macros the kernels share.
 * bf16 is the top half of an IEEE float32; stores round to nearest even, as torch does. */
#ifndef FORNAX_BF16_H
#define FORNAX_BF16_H

#include <stdint.h>
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

/* LOAD(ptr, i) -> float; STORE(ptr, i, float); ROUND(float) -> the float the type would hold. */
#define LOAD_F32(p, i) ((p)[i])
#define STORE_F32(p, i, x) ((p)[i] = (x))
#define ROUND_F32(x) (x)
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define STORE_BF16(p, i, x) ((p)[i] = f32_to_bf16(x))
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x))

#endif
