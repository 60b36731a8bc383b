/* quant_matmul.c's helpers in 256-bit vectors, for CPUs with AVX2, FMA and F16C but no
 * AVX-512 (AMD Zen 2 and 3, Intel client cores since Haswell). Included by quant_matmul.c
 * only; the formats and the contracts of quantize_row, offset_dot and tile are the AVX-512
 * versions' there.
 *
 * The integer dot product: AVX2 has no VNNI, so 4 bytes x 4 bytes into an int32 lane is
 * vpmaddubsw (unsigned x signed bytes, pairs summed into int16) then vpmaddwd by ones (pairs
 * of int16 into int32): the same lanes VNNI's dpbusd fills, so the activation scales per 4
 * values line up with the lanes as they do there. Both products stay exact: a Q4 weight is
 * at most 15 and an activation at most 127 in magnitude (2 x 15 x 127 fits int16), and a Q8
 * weight is taken as |w| against the activation with w's sign (2 x 127 x 127 = 32,258).
 *
 * A pair of blocks (64 values) is two vectors: values 0-31 (the pair's first block: Q4 low
 * nibbles) and 32-63 (the second block). Each has its own accumulator per output, so each
 * block's weight scale multiplies only its own lanes. */
#include "vec256.h"

/* 32 int32 lanes (4 vectors of 8, in order) -> 32 int8 in order (values within [-127, 127]). */
static inline __m256i pack_int8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d); /* per 128-bit lane */
    const __m256i abcd = _mm256_packs_epi16(ab, cd);
    /* packs work within 128-bit lanes: 4-byte groups now run a0 b0 c0 d0 a1 b1 c1 d1 */
    return _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quantize_row(const float *x, int k, int8_t *xq, float *dxv, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < k; i += 32) {
        __m256i qi[4];
        for (int j = 0; j < 4; j++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
            __m256 amax = _mm256_andnot_ps(sign, v);
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0xb1)); /* neighbours */
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0x4e)); /* pairs: each group of 4 */
            const __m256 live = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
            const __m256 inv = _mm256_and_ps(live, _mm256_div_ps(_mm256_set1_ps(127.f), amax));
            qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv)); /* round to nearest even */
            const __m256 scale = _mm256_div_ps(amax, _mm256_set1_ps(127.f));
            dxv[(i + 8 * j) / 4] = _mm256_cvtss_f32(scale);
            dxv[(i + 8 * j) / 4 + 1] = _mm_cvtss_f32(_mm256_extractf128_ps(scale, 1));
        }
        _mm256_storeu_si256((__m256i *)(xq + i), pack_int8(qi[0], qi[1], qi[2], qi[3]));
    }
    for (int g = 0; g < k / QBLOCK; g++) {
        const float *xg = x + g * QBLOCK;
        const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                       _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
        xsum[g] = hsum256(s);
    }
}

static inline float offset_dot(const uint16_t *m, const float *xs, int groups) {
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g))), _mm256_loadu_ps(xs + g), acc);
    float s = hsum256(acc);
    for (; g < groups; g++) s += _cvtsh_ss(m[g]) * xs[g];
    return s;
}

/* 8 int32 lanes, lane i = sum over bytes 4i..4i+3 of u[b] * s[b] (u unsigned, s signed). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void tile(
    const int Q4, const uint8_t *w, const uint16_t *d, const uint16_t *m, int k,
    const quantized_x *q, int t0, const int NT, float *y, int y_stride) {
    enum { R = ROW_BLOCK };
    const int pairs = k / 64, groups = k / QBLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256 acc[R][2];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++) {
#if PREFETCH_BYTES > 0
        for (int line = 0; line < (Q4 ? 2 : 4); line++)
            _mm_prefetch((const char *)w + (long)p * (Q4 ? 32 : 64) * R + PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
#endif
        __m256i xv[2][2];
        __m256 sx[2][2];
        for (int j = 0; j < NT; j++) {
            const int8_t *xr = q->xq + (long)(t0 + j) * k + 64 * p;
            const float *sr = q->dxv + ((long)(t0 + j) * pairs + p) * 16;
            xv[j][0] = _mm256_loadu_si256((const __m256i *)xr);
            xv[j][1] = _mm256_loadu_si256((const __m256i *)(xr + 32));
            sx[j][0] = _mm256_load_ps(sr);
            sx[j][1] = _mm256_load_ps(sr + 8);
        }
        /* the tile's 4 rows x 2 block scales of this pair */
        const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + (long)p * 2 * R)));
        for (int r = 0; r < R; r++) {
            const __m256 sw0 = _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(2 * r));
            const __m256 sw1 = _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(2 * r + 1));
            __m256i s0[2], s1[2];
            if (Q4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (long)p * 32 * R + 32 * r));
                const __m256i lo = _mm256_and_si256(v, nibble);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                for (int j = 0; j < NT; j++) {
                    s0[j] = dot_u8s8(lo, xv[j][0]);
                    s1[j] = dot_u8s8(hi, xv[j][1]);
                }
            } else {
                const int8_t *wr = (const int8_t *)w + ((long)p * R + r) * 64;
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)wr);
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wr + 32));
                const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
                for (int j = 0; j < NT; j++) {
                    s0[j] = dot_u8s8(u0, _mm256_sign_epi8(xv[j][0], w0));
                    s1[j] = dot_u8s8(u1, _mm256_sign_epi8(xv[j][1], w1));
                }
            }
            for (int j = 0; j < NT; j++) {
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[j]), _mm256_mul_ps(sw0, sx[j][0]), acc[r][j]);
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[j]), _mm256_mul_ps(sw1, sx[j][1]), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NT; j++)
            y[r * y_stride + j] = hsum256(acc[r][j]) +
                (Q4 ? offset_dot(m + (long)r * groups, q->xsum + (long)(t0 + j) * groups, groups) : 0.f);
}
