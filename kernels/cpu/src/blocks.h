/* Each GGUF type's 32 weights at a time, as integer-valued floats and the scales that make
   them weights: integers_<type>(block, s, q, d, &m) gives sub-block s of the block, with
   w = d[e / 16] q[e] + m for element e (d per 16 weights for Q6_K, per 32 for the others; m
   zero for the types without a min). Read as ggml lays the blocks out, every scale and min
   as the file stores it. Included by quants.c, once per instruction set. */
#ifndef PAGECHAT_BLOCKS_H
#define PAGECHAT_BLOCKS_H

#include "pagechat_cpu.h"
#include "simd.h"

/* ---- the integers through a q32 (every version; x86 reads the simplest types directly) -- */
/* unpack_<type>(block, s, q, d, m): sub-block s of the block; w = d[e / 16] q[e] + m.
   Each version defines the same q32 operations for them: nibbles_16, nibbles_32, bits_16,
   shifted_bits, q_or, q_sub, q_shl4, q_load. */

/* the K types' six-bit scale and min of sub-block j (ggml's get_scale_min_k4) */
static inline void k_scale_min(const uint8_t *s, int j, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

#if defined(PC_X86)
/* 16 bytes -> 32 values: their low nibbles, then their high ones */
static inline __m256i nibbles_16(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}
/* 32 bytes -> their low (high = 0) or high nibbles */
static inline __m256i nibbles_32(const uint8_t *p, int high) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(high ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(15));
}
/* byte e = 16 where bit e of `bits` is set, else 0 */
static inline __m256i bits_16(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
/* byte e = (p[e] >> shift) & mask */
static inline __m256i shifted_bits(const uint8_t *p, int shift, int mask) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(shift)),
                            _mm256_set1_epi8((char)mask));
}
static inline q32 q_or(q32 a, q32 b) {
    return _mm256_or_si256(a, b);
}
static inline q32 q_sub(q32 a, int n) {
    return _mm256_sub_epi8(a, _mm256_set1_epi8((char)n));
}
static inline q32 q_shl4(q32 a) {
    return _mm256_slli_epi16(a, 4); /* bytes below 16 stay within their byte */
}
static inline q32 q_load(const uint8_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}

#elif defined(PC_ISA_NEON)
static inline q32 nibbles_16(const uint8_t *p) {
    const uint8x16_t b = vld1q_u8(p);
    q32 q = {
        {vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15))), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))}};
    return q;
}
static inline q32 nibbles_32(const uint8_t *p, int high) {
    q32 q;
    for (int h = 0; h < 2; h++) {
        const uint8x16_t b = vld1q_u8(p + 16 * h);
        q.val[h] = vreinterpretq_s8_u8(high ? vshrq_n_u8(b, 4) : vandq_u8(b, vdupq_n_u8(15)));
    }
    return q;
}
static inline q32 bits_16(uint32_t bits) {
    static const uint8_t select_bytes[16] = {1, 2, 4, 8, 16, 32, 64, 128,
                                             1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t select = vld1q_u8(select_bytes);
    q32 q;
    for (int h = 0; h < 2; h++) {
        const uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t)(bits >> (16 * h))),
                                              vdup_n_u8((uint8_t)(bits >> (16 * h + 8))));
        q.val[h] = vreinterpretq_s8_u8(vandq_u8(vtstq_u8(spread, select), vdupq_n_u8(16)));
    }
    return q;
}
static inline q32 shifted_bits(const uint8_t *p, int shift, int mask) {
    q32 q;
    for (int h = 0; h < 2; h++) {
        const uint8x16_t b = vshlq_u8(vld1q_u8(p + 16 * h), vdupq_n_s8((int8_t)-shift));
        q.val[h] = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8((uint8_t)mask)));
    }
    return q;
}
static inline q32 q_or(q32 a, q32 b) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vorrq_s8(a.val[h], b.val[h]);
    return a;
}
static inline q32 q_sub(q32 a, int n) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vsubq_s8(a.val[h], vdupq_n_s8((int8_t)n));
    return a;
}
static inline q32 q_shl4(q32 a) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vshlq_n_s8(a.val[h], 4);
    return a;
}
static inline q32 q_load(const uint8_t *p) {
    q32 q = {{vld1q_s8((const int8_t *)p), vld1q_s8((const int8_t *)p + 16)}};
    return q;
}

#else /* generic */
static inline q32 nibbles_16(const uint8_t *p) {
    q32 q;
    for (int i = 0; i < 16; i++)
        q.v[i] = (int8_t)(p[i] & 15), q.v[i + 16] = (int8_t)(p[i] >> 4);
    return q;
}
static inline q32 nibbles_32(const uint8_t *p, int high) {
    q32 q;
    for (int i = 0; i < 32; i++)
        q.v[i] = (int8_t)(high ? p[i] >> 4 : p[i] & 15);
    return q;
}
static inline q32 bits_16(uint32_t bits) {
    q32 q;
    for (int i = 0; i < 32; i++)
        q.v[i] = (int8_t)(((bits >> i) & 1u) << 4);
    return q;
}
static inline q32 shifted_bits(const uint8_t *p, int shift, int mask) {
    q32 q;
    for (int i = 0; i < 32; i++)
        q.v[i] = (int8_t)((p[i] >> shift) & mask);
    return q;
}
static inline q32 q_or(q32 a, q32 b) {
    for (int i = 0; i < 32; i++)
        a.v[i] = (int8_t)(a.v[i] | b.v[i]);
    return a;
}
static inline q32 q_sub(q32 a, int n) {
    for (int i = 0; i < 32; i++)
        a.v[i] = (int8_t)(a.v[i] - n);
    return a;
}
static inline q32 q_shl4(q32 a) {
    for (int i = 0; i < 32; i++)
        a.v[i] = (int8_t)(a.v[i] << 4);
    return a;
}
static inline q32 q_load(const uint8_t *p) {
    q32 q;
    memcpy(q.v, p, 32);
    return q;
}
#endif

/* Q4_0: fp16 d, 16 bytes of nibbles; w = d (q - 8) */
static inline q32 unpack_q4_0(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    return q_sub(nibbles_16(b + 2), 8);
}

/* Q4_1: fp16 d and m, 16 bytes of nibbles; w = d q + m */
static inline q32 unpack_q4_1(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = fp16_scale(b + 2);
    return nibbles_16(b + 4);
}

/* Q5_0: fp16 d, 32 high bits (bit e for element e), 16 bytes of nibbles; w = d (q - 16) */
static inline q32 unpack_q5_0(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    uint32_t high;
    memcpy(&high, b + 2, sizeof high);
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    return q_sub(q_or(nibbles_16(b + 6), bits_16(high)), 16);
}

/* Q8_0: fp16 d, 32 int8; w = d q */
static inline q32 unpack_q8_0(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    return q_load(b + 2);
}

/* Q4_K: fp16 d and dmin, 12 bytes of six-bit (scale, min) pairs, 128 bytes of nibbles (32
   bytes per two sub-blocks: the even one in the low nibbles); w = d sc q - dmin mn */
static inline q32 unpack_q4_k(const uint8_t *b, int s, float d[2], float *m) {
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    d[0] = d[1] = fp16_scale(b) * sc;
    *m = -fp16_scale(b + 2) * mn;
    return nibbles_32(b + 16 + 32 * (s / 2), s & 1);
}

/* Q5_K: Q4_K's fields and 32 bytes of high bits (bit s of byte e for sub-block s) before
   the nibbles */
static inline q32 unpack_q5_k(const uint8_t *b, int s, float d[2], float *m) {
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    d[0] = d[1] = fp16_scale(b) * sc;
    *m = -fp16_scale(b + 2) * mn;
    return q_or(nibbles_32(b + 48 + 32 * (s / 2), s & 1), q_shl4(shifted_bits(b + 16, s, 1)));
}

/* Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16
   weights), fp16 d last; w = d sc (q - 32). Each half of 128 weights is four runs of 32:
   run r takes the low (r < 2) or high nibbles of 32 bytes (r odd: the second 32) and bits
   2r, 2r + 1 of the half's 32 high bytes. */
static inline q32 unpack_q6_k(const uint8_t *b, int s, float d[2], float *m) {
    const int half = s / 4, run = s % 4;
    const int8_t *scales = (const int8_t *)(b + 192) + 8 * half + 2 * run;
    const float scale = fp16_scale(b + 208);
    d[0] = scale * (float)scales[0];
    d[1] = scale * (float)scales[1];
    *m = 0.0f;
    const q32 low = nibbles_32(b + 64 * half + 32 * (run & 1), run >= 2);
    const q32 high = q_shl4(shifted_bits(b + 128 + 32 * half, 2 * run, 3));
    return q_sub(q_or(low, high), 32);
}

/* ---- the integers as floats ------------------------------------------------------------ */
#define DEFINE_INTEGERS(T)                                                                         \
    static inline void integers_##T(const uint8_t *block, int s, vf q[Q32_VECTORS], float d[2],    \
                                    float *m) {                                                    \
        q32_to_vf(unpack_##T(block, s, d, m), q);                                                  \
    }

#if defined(PC_X86)
/* x86: the types whose integers are plain nibbles or bytes go straight from memory to int32
   lanes (vpmovzxbd / vpmovsxbd), then to floats: fewer instructions than through a q32 of
   bytes, where a batch-1 step is bound by them (the others keep the q32 path). */
#if defined(PC_ISA_AVX512)
typedef __m512i vi;
static inline vi vi_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vi vi_s8(const uint8_t *p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vf vi_float(vi z, int bias) {
    return _mm512_cvtepi32_ps(_mm512_add_epi32(z, _mm512_set1_epi32(bias)));
}
static inline vi vi_low(vi z) {
    return _mm512_and_si512(z, _mm512_set1_epi32(15));
}
static inline vi vi_high(vi z) {
    return _mm512_srli_epi32(z, 4);
}
#else
typedef __m256i vi;
static inline vi vi_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vi vi_s8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vf vi_float(vi z, int bias) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(z, _mm256_set1_epi32(bias)));
}
static inline vi vi_low(vi z) {
    return _mm256_and_si256(z, _mm256_set1_epi32(15));
}
static inline vi vi_high(vi z) {
    return _mm256_srli_epi32(z, 4);
}
#endif

/* 16 bytes of nibbles, plus `bias`: their low nibbles are weights 0-15, their high ones 16-31 */
static inline void nibble_pairs(const uint8_t *p, int bias, vf q[Q32_VECTORS]) {
    for (int h = 0; h < Q32_VECTORS / 2; h++) {
        const vi z = vi_u8(p + h * VF_W);
        q[h] = vi_float(vi_low(z), bias);
        q[h + Q32_VECTORS / 2] = vi_float(vi_high(z), bias);
    }
}

static inline void integers_q4_0(const uint8_t *b, int s, vf q[Q32_VECTORS], float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    nibble_pairs(b + 2, -8, q);
}

static inline void integers_q4_1(const uint8_t *b, int s, vf q[Q32_VECTORS], float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = fp16_scale(b + 2);
    nibble_pairs(b + 4, 0, q);
}

static inline void integers_q8_0(const uint8_t *b, int s, vf q[Q32_VECTORS], float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    for (int h = 0; h < Q32_VECTORS; h++)
        q[h] = vi_float(vi_s8(b + 2 + h * VF_W), 0);
}

static inline void integers_q4_k(const uint8_t *b, int s, vf q[Q32_VECTORS], float d[2], float *m) {
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    d[0] = d[1] = fp16_scale(b) * sc;
    *m = -fp16_scale(b + 2) * mn;
    const uint8_t *bytes = b + 16 + 32 * (s / 2);
    for (int h = 0; h < Q32_VECTORS; h++) {
        const vi z = vi_u8(bytes + h * VF_W);
        q[h] = vi_float(s & 1 ? vi_high(z) : vi_low(z), 0);
    }
}
#else
DEFINE_INTEGERS(q4_0)
DEFINE_INTEGERS(q4_1)
DEFINE_INTEGERS(q8_0)
DEFINE_INTEGERS(q4_k)
#endif
DEFINE_INTEGERS(q5_0)
DEFINE_INTEGERS(q5_k)
DEFINE_INTEGERS(q6_k)

#endif
