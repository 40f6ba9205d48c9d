/* GGUF weight blocks, read as stored: matrix-vector products with fp32 inputs (decode) and
   dequantization to dense rows (the dense path of large steps, embedding lookups).

   Every type is read 32 weights at a time (a block of Q4_0/Q4_1/Q5_0/Q8_0, a sub-block of
   the K types' super-blocks of 256): its integers into a q32, then w = d q + m in fp32 with
   the block's scales as the file stores them (d per 16 weights for Q6_K, per 32 for the
   others). That is gguf's dequantization value for value: d q is exact in fp32 for every
   type here (at most 11 + 8 + 6 bits), so d q + m rounds once, fused or not. The product
   with the input is then an fp32 dot product: what the dequantized fp32 model computes, in
   another order of additions, never through int8 inputs.

   A row's output does not depend on how many rows the call has: each lane of the
   accumulator takes the row's elements in the same order at every batch size. */
#include <stdlib.h>

#include "pagechat_cpu.h"
#include "simd.h"

/* ---- each type's 32 integers and scales ------------------------------------------------ */
/* unpack_<type>(block, s, q, d, m): sub-block s of the block; w = d[e / 16] q[e] + m. */

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
    return _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}
#define Q_NIBBLES_16(p) nibbles_16(p)
#define Q_NIBBLES_32(p, high) nibbles_32(p, high)
#define Q_OR(a, b) _mm256_or_si256(a, b)
#define Q_SUB(a, n) _mm256_sub_epi8(a, _mm256_set1_epi8(n))
#define Q_SHL4(a) _mm256_slli_epi16(a, 4) /* bytes below 16 stay within their byte */
#define Q_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define Q_BITS_16(bits) bits_16(bits)
#define Q_SHIFTED(p, shift, mask) shifted_bits(p, shift, mask)

#elif defined(PC_ISA_NEON)
static inline q32 nibbles_16(const uint8_t *p) {
    const uint8x16_t b = vld1q_u8(p);
    q32 q = {{vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15))), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))}};
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
    static const uint8_t select_bytes[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
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
    for (int h = 0; h < 2; h++) a.val[h] = vorrq_s8(a.val[h], b.val[h]);
    return a;
}
static inline q32 q_sub(q32 a, int n) {
    for (int h = 0; h < 2; h++) a.val[h] = vsubq_s8(a.val[h], vdupq_n_s8((int8_t)n));
    return a;
}
static inline q32 q_shl4(q32 a) {
    for (int h = 0; h < 2; h++) a.val[h] = vshlq_n_s8(a.val[h], 4);
    return a;
}
static inline q32 q_load(const uint8_t *p) {
    q32 q = {{vld1q_s8((const int8_t *)p), vld1q_s8((const int8_t *)p + 16)}};
    return q;
}
#define Q_NIBBLES_16(p) nibbles_16(p)
#define Q_NIBBLES_32(p, high) nibbles_32(p, high)
#define Q_OR(a, b) q_or(a, b)
#define Q_SUB(a, n) q_sub(a, n)
#define Q_SHL4(a) q_shl4(a)
#define Q_LOAD(p) q_load(p)
#define Q_BITS_16(bits) bits_16(bits)
#define Q_SHIFTED(p, shift, mask) shifted_bits(p, shift, mask)

#else /* generic */
static inline q32 nibbles_16(const uint8_t *p) {
    q32 q;
    for (int i = 0; i < 16; i++) q.v[i] = (int8_t)(p[i] & 15), q.v[i + 16] = (int8_t)(p[i] >> 4);
    return q;
}
static inline q32 nibbles_32(const uint8_t *p, int high) {
    q32 q;
    for (int i = 0; i < 32; i++) q.v[i] = (int8_t)(high ? p[i] >> 4 : p[i] & 15);
    return q;
}
static inline q32 bits_16(uint32_t bits) {
    q32 q;
    for (int i = 0; i < 32; i++) q.v[i] = (int8_t)(((bits >> i) & 1u) << 4);
    return q;
}
static inline q32 shifted_bits(const uint8_t *p, int shift, int mask) {
    q32 q;
    for (int i = 0; i < 32; i++) q.v[i] = (int8_t)((p[i] >> shift) & mask);
    return q;
}
static inline q32 q_or(q32 a, q32 b) {
    for (int i = 0; i < 32; i++) a.v[i] = (int8_t)(a.v[i] | b.v[i]);
    return a;
}
static inline q32 q_sub(q32 a, int n) {
    for (int i = 0; i < 32; i++) a.v[i] = (int8_t)(a.v[i] - n);
    return a;
}
static inline q32 q_shl4(q32 a) {
    for (int i = 0; i < 32; i++) a.v[i] = (int8_t)(a.v[i] << 4);
    return a;
}
static inline q32 q_load(const uint8_t *p) {
    q32 q;
    memcpy(q.v, p, 32);
    return q;
}
#define Q_NIBBLES_16(p) nibbles_16(p)
#define Q_NIBBLES_32(p, high) nibbles_32(p, high)
#define Q_OR(a, b) q_or(a, b)
#define Q_SUB(a, n) q_sub(a, n)
#define Q_SHL4(a) q_shl4(a)
#define Q_LOAD(p) q_load(p)
#define Q_BITS_16(bits) bits_16(bits)
#define Q_SHIFTED(p, shift, mask) shifted_bits(p, shift, mask)
#endif

/* Q4_0: fp16 d, 16 bytes of nibbles; w = d (q - 8) */
static inline q32 unpack_q4_0(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    return Q_SUB(Q_NIBBLES_16(b + 2), 8);
}

/* Q4_1: fp16 d and m, 16 bytes of nibbles; w = d q + m */
static inline q32 unpack_q4_1(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = fp16_scale(b + 2);
    return Q_NIBBLES_16(b + 4);
}

/* Q5_0: fp16 d, 32 high bits (bit e for element e), 16 bytes of nibbles; w = d (q - 16) */
static inline q32 unpack_q5_0(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    uint32_t high;
    memcpy(&high, b + 2, sizeof high);
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    return Q_SUB(Q_OR(Q_NIBBLES_16(b + 6), Q_BITS_16(high)), 16);
}

/* Q8_0: fp16 d, 32 int8; w = d q */
static inline q32 unpack_q8_0(const uint8_t *b, int s, float d[2], float *m) {
    (void)s;
    d[0] = d[1] = fp16_scale(b);
    *m = 0.0f;
    return Q_LOAD(b + 2);
}

/* Q4_K: fp16 d and dmin, 12 bytes of six-bit (scale, min) pairs, 128 bytes of nibbles (32
   bytes per two sub-blocks: the even one in the low nibbles); w = d sc q - dmin mn */
static inline q32 unpack_q4_k(const uint8_t *b, int s, float d[2], float *m) {
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    d[0] = d[1] = fp16_scale(b) * sc;
    *m = -fp16_scale(b + 2) * mn;
    return Q_NIBBLES_32(b + 16 + 32 * (s / 2), s & 1);
}

/* Q5_K: Q4_K's fields and 32 bytes of high bits (bit s of byte e for sub-block s) before
   the nibbles */
static inline q32 unpack_q5_k(const uint8_t *b, int s, float d[2], float *m) {
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    d[0] = d[1] = fp16_scale(b) * sc;
    *m = -fp16_scale(b + 2) * mn;
    return Q_OR(Q_NIBBLES_32(b + 48 + 32 * (s / 2), s & 1), Q_SHL4(Q_SHIFTED(b + 16, s, 1)));
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
    const q32 low = Q_NIBBLES_32(b + 64 * half + 32 * (run & 1), run >= 2);
    const q32 high = Q_SHL4(Q_SHIFTED(b + 128 + 32 * half, 2 * run, 3));
    return Q_SUB(Q_OR(low, high), 32);
}

/* ---- kernels per type ------------------------------------------------------------------ */
#define GEMV_ROWS 4 /* input rows whose dot products share one pass over a block's weights */
#if defined(PC_ISA_GENERIC)
#define DOT_J 1 /* weight rows one input row's products take together (more spill on SSE2) */
#else
#define DOT_J 4
#endif

/* Steps of more rows dequantize TILE_J weight rows into L1, then take TILE_R input rows at a
   time against them: TILE_J x TILE_R accumulators in registers, each weight vector loaded
   once per TILE_R rows and each input vector once per TILE_J weight rows. */
#if defined(PC_ISA_AVX512)
#define TILE_J 6 /* 24 of the 32 zmm registers accumulate (6 x 4 ran ahead of 4 x 6, 3 x 8) */
#define TILE_R 4
#elif defined(PC_ISA_NEON)
#define TILE_J 4 /* 16 of the 32 q registers */
#define TILE_R 4
#elif defined(PC_ISA_AVX2)
#define TILE_J 3 /* 12 of the 16 ymm registers: 3 x 4 ran 1.3x 2 x 4's and 2 x 6's */
#define TILE_R 4
#else
#define TILE_J 2 /* 8 vf, in 16 of SSE2's xmm registers */
#define TILE_R 4
#endif

/* y[r * ldy + j] for TILE-sized (or smaller: J, R) blocks of dequantized rows w (row j at
   w + j * k) and input rows x. Each output's lanes take its elements in the order dots_<type>
   takes them: a row's result does not depend on the path. */
static inline __attribute__((always_inline)) void dense_tile(const float *w, const float *x,
                                                             int64_t k, float *y, int64_t ldy,
                                                             const int J, const int R) {
    vf acc[TILE_J][TILE_R];
    for (int j = 0; j < J; j++)
        for (int r = 0; r < R; r++) acc[j][r] = vf_zero();
    for (int64_t c = 0; c < k; c += VF_W) {
        vf wv[TILE_J];
        for (int j = 0; j < J; j++) wv[j] = vf_load(w + j * k + c);
        for (int r = 0; r < R; r++) {
            const vf xv = vf_load(x + r * k + c);
            for (int j = 0; j < J; j++) acc[j][r] = vf_fma(wv[j], xv, acc[j][r]);
        }
    }
    for (int j = 0; j < J; j++)
        for (int r = 0; r < R; r++) y[r * ldy + j] = vf_sum(acc[j][r]);
}

/* Input rows [0, m) against J dequantized weight rows (J constant): TILE_R rows at a time,
   then the rest in one smaller tile. */
static inline __attribute__((always_inline)) void dense_rows(const float *w, const float *x,
                                                             int64_t m, int64_t k, float *y,
                                                             int64_t ldy, const int J) {
    int64_t r = 0;
    for (; r + TILE_R <= m; r += TILE_R) dense_tile(w, x + r * k, k, y + r * ldy, ldy, J, TILE_R);
    const float *xr = x + r * k;
    float *yr = y + r * ldy;
    switch (m - r) {
    case 1: dense_tile(w, xr, k, yr, ldy, J, 1); break;
    case 2: dense_tile(w, xr, k, yr, ldy, J, 2); break;
    case 3: dense_tile(w, xr, k, yr, ldy, J, 3); break;
#if TILE_R > 4
    case 4: dense_tile(w, xr, k, yr, ldy, J, 4); break;
    case 5: dense_tile(w, xr, k, yr, ldy, J, 5); break;
#endif
    default: break;
    }
}

/* Every input row against `rows` (up to TILE_J) dequantized weight rows. */
static void dense_block(const float *w, int rows, const float *x, int64_t m, int64_t k, float *y,
                        int64_t ldy) {
    if (rows == TILE_J) {
        dense_rows(w, x, m, k, y, ldy, TILE_J);
        return;
    }
    for (int j = 0; j < rows; j++) dense_rows(w + j * k, x, m, k, y + j, ldy, 1);
}

/* For each type: weights_<type> (32 weights as vf), a row's dequantization, the dot products
   of a weight row with up to GEMV_ROWS input rows, and the product over rows [n_begin, n_end)
   (through dense_block above GEMV_ROWS input rows; `buf` holds TILE_J rows then). */
#define DEFINE_TYPE(T, SUBS, BYTES)                                                            \
    static void row_##T(const uint8_t *row, int64_t k, float *out) {                           \
        for (const uint8_t *block = row; block < row + k / (32 * SUBS) * BYTES; block += BYTES) \
            for (int s = 0; s < SUBS; s++, out += 32) {                                        \
                vf w[Q32_VECTORS];                                                             \
                weights_##T(block, s, w);                                                      \
                for (int v = 0; v < Q32_VECTORS; v++) vf_store(out + v * VF_W, w[v]);          \
            }                                                                                  \
    }                                                                                          \
    static inline __attribute__((always_inline)) void dots_##T(                                \
        const uint8_t *row, int64_t row_bytes, const float *x, int64_t k, float *y, int64_t ldy, \
        const int J, const int rows) {                                                         \
        vf acc[DOT_J > 2 ? DOT_J : 2][GEMV_ROWS]; /* two input rows take two weight rows */  \
        for (int j = 0; j < J; j++)                                                            \
            for (int r = 0; r < rows; r++) acc[j][r] = vf_zero();                              \
        const float *xc = x;                                                                   \
        for (int64_t at = 0; at < k / (32 * SUBS) * BYTES; at += BYTES)                        \
            for (int s = 0; s < SUBS; s++, xc += 32)                                           \
                for (int j = 0; j < J; j++) {                                                  \
                    vf w[Q32_VECTORS];                                                         \
                    weights_##T(row + j * row_bytes + at, s, w);                               \
                    for (int r = 0; r < rows; r++)                                             \
                        for (int v = 0; v < Q32_VECTORS; v++)                                  \
                            acc[j][r] = vf_fma(w[v], vf_load(xc + r * k + v * VF_W), acc[j][r]); \
                }                                                                              \
        for (int j = 0; j < J; j++)                                                            \
            for (int r = 0; r < rows; r++) y[r * ldy + j] = vf_sum(acc[j][r]);                 \
    }                                                                                          \
    static void gemv_##T(const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,       \
                         int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end,     \
                         float *buf) {                                                         \
        if (m > GEMV_ROWS) {                                                                   \
            for (int64_t j = n_begin; j < n_end; j += TILE_J) {                                \
                const int rows = n_end - j < TILE_J ? (int)(n_end - j) : TILE_J;               \
                for (int i = 0; i < rows; i++) row_##T(w + (j + i) * row_bytes, k, buf + i * k); \
                dense_block(buf, rows, x, m, k, y + j, ldy);                                   \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        /* few input rows: DOT_J weight rows together, so that that many chains of dependent \
           FMAs run at once (one row's chain alone waited on the FMA latency) */               \
        int64_t j = n_begin;                                                                   \
        if (m == 1)                                                                            \
            for (; j + DOT_J <= n_end; j += DOT_J)                                             \
                dots_##T(w + j * row_bytes, row_bytes, x, k, y + j, ldy, DOT_J, 1);            \
        if (m == 2)                                                                            \
            for (; j + 2 <= n_end; j += 2)                                                     \
                dots_##T(w + j * row_bytes, row_bytes, x, k, y + j, ldy, 2, 2);                \
        for (; j < n_end; j++) {                                                               \
            const uint8_t *row = w + j * row_bytes;                                            \
            switch (m) {                                                                       \
            case 1: dots_##T(row, row_bytes, x, k, y + j, ldy, 1, 1); break;                   \
            case 2: dots_##T(row, row_bytes, x, k, y + j, ldy, 1, 2); break;                   \
            case 3: dots_##T(row, row_bytes, x, k, y + j, ldy, 1, 3); break;                   \
            default: dots_##T(row, row_bytes, x, k, y + j, ldy, 1, 4); break;                  \
            }                                                                                  \
        }                                                                                      \
    }

/* weights_<type>(block, s, w): sub-block s's 32 weights as vf, d q + m each. */
#define DEFINE_WEIGHTS(T)                                                                      \
    static inline void weights_##T(const uint8_t *block, int s, vf w[Q32_VECTORS]) {           \
        float d[2], m;                                                                         \
        q32_to_vf(unpack_##T(block, s, d, &m), w);                                             \
        for (int v = 0; v < Q32_VECTORS; v++)                                                  \
            w[v] = vf_fma(w[v], vf_set1(d[v * VF_W / 16]), vf_set1(m));                        \
    }

#if defined(PC_X86)
/* x86: the types whose integers are plain nibbles or bytes go straight from memory to int32
   lanes (vpmovzxbd / vpmovsxbd), then to floats: fewer instructions than through a q32 of
   bytes, where a batch-1 step is bound by them (the others keep the q32 path). */
#if defined(PC_ISA_AVX512)
typedef __m512i vi;
static inline vi vi_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_s8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vi_low_nibbles(vi z) { return _mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(15))); }
static inline vf vi_high_nibbles(vi z) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4)); }
static inline vf vi_float(vi z) { return _mm512_cvtepi32_ps(z); }
#else
typedef __m256i vi;
static inline vi vi_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vi_s8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vf vi_low_nibbles(vi z) { return _mm256_cvtepi32_ps(_mm256_and_si256(z, _mm256_set1_epi32(15))); }
static inline vf vi_high_nibbles(vi z) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(z, 4)); }
static inline vf vi_float(vi z) { return _mm256_cvtepi32_ps(z); }
#endif

/* an fp16 scale broadcast to every lane: vpbroadcastw and one vector conversion, where the
   scalar conversion and a broadcast took twice the instructions */
static inline vf fp16_lanes(const uint8_t *p) {
    int16_t h;
    memcpy(&h, p, sizeof h);
#if defined(PC_ISA_AVX512)
    return _mm512_cvtph_ps(_mm256_set1_epi16(h));
#else
    return _mm256_cvtph_ps(_mm_set1_epi16(h));
#endif
}

/* 16 bytes of nibbles: their low nibbles are weights 0-15, their high ones 16-31 */
static inline void nibble_pairs(const uint8_t *p, vf d, vf m, vf w[Q32_VECTORS]) {
    for (int h = 0; h < Q32_VECTORS / 2; h++) {
        const vi z = vi_u8(p + h * VF_W);
        w[h] = vf_fma(vi_low_nibbles(z), d, m);
        w[h + Q32_VECTORS / 2] = vf_fma(vi_high_nibbles(z), d, m);
    }
}

static inline void weights_q4_0(const uint8_t *b, int s, vf w[Q32_VECTORS]) {
    (void)s;
    const vf d = fp16_lanes(b);
    nibble_pairs(b + 2, d, vf_mul(d, vf_set1(-8.0f)), w); /* d q - 8 d: both exact */
}

static inline void weights_q4_1(const uint8_t *b, int s, vf w[Q32_VECTORS]) {
    (void)s;
    nibble_pairs(b + 4, fp16_lanes(b), fp16_lanes(b + 2), w);
}

static inline void weights_q8_0(const uint8_t *b, int s, vf w[Q32_VECTORS]) {
    (void)s;
    const vf d = fp16_lanes(b);
    for (int h = 0; h < Q32_VECTORS; h++) w[h] = vf_mul(vi_float(vi_s8(b + 2 + h * VF_W)), d);
}

static inline void weights_q4_k(const uint8_t *b, int s, vf w[Q32_VECTORS]) {
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    const vf d = vf_set1(fp16_scale(b) * sc), m = vf_set1(-fp16_scale(b + 2) * mn);
    const uint8_t *q = b + 16 + 32 * (s / 2);
    for (int h = 0; h < Q32_VECTORS; h++) {
        const vi z = vi_u8(q + h * VF_W);
        w[h] = vf_fma(s & 1 ? vi_high_nibbles(z) : vi_low_nibbles(z), d, m);
    }
}
#else
DEFINE_WEIGHTS(q4_0)
DEFINE_WEIGHTS(q4_1)
DEFINE_WEIGHTS(q8_0)
DEFINE_WEIGHTS(q4_k)
#endif
DEFINE_WEIGHTS(q5_0)
DEFINE_WEIGHTS(q5_k)
DEFINE_WEIGHTS(q6_k)

DEFINE_TYPE(q4_0, 1, 18)
DEFINE_TYPE(q4_1, 1, 20)
DEFINE_TYPE(q5_0, 1, 22)
DEFINE_TYPE(q8_0, 1, 34)
DEFINE_TYPE(q4_k, 8, 144)
DEFINE_TYPE(q5_k, 8, 176)
DEFINE_TYPE(q6_k, 8, 210)

typedef void (*row_fn)(const uint8_t *row, int64_t k, float *out);

static row_fn row_kernel(int64_t type) {
    switch (type) {
    case PC_Q4_0: return row_q4_0;
    case PC_Q4_1: return row_q4_1;
    case PC_Q5_0: return row_q5_0;
    case PC_Q8_0: return row_q8_0;
    case PC_Q4_K: return row_q4_k;
    case PC_Q5_K: return row_q5_k;
    case PC_Q6_K: return row_q6_k;
    default: return NULL;
    }
}

/* ---- entry points ---------------------------------------------------------------------- */

/* y[r * ldy + j] = sum_c x[r * k + c] w[j, c] for input rows r < m and weight rows j in
   [n_begin, n_end): w is n rows of row_bytes (k / block_elements(type) blocks each), x is
   [m, k] fp32 (k a multiple of the type's block), y fp32. The caller checked the shapes. */
void PC_FN(gemv)(int64_t type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,
                 int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end) {
    float *row_buf = NULL;
    if (m > GEMV_ROWS && (row_buf = malloc(sizeof(float) * (size_t)(TILE_J * k))) == NULL) {
        /* no room for a dequantized row: the same sums, the weights read once per 4 rows */
        for (int64_t r = 0; r < m; r += GEMV_ROWS) {
            const int64_t rows = m - r < GEMV_ROWS ? m - r : GEMV_ROWS;
            PC_FN(gemv)(type, w, row_bytes, x + r * k, rows, k, y + r * ldy, ldy, n_begin, n_end);
        }
        return;
    }
    switch (type) {
    case PC_Q4_0: gemv_q4_0(w, row_bytes, x, m, k, y, ldy, n_begin, n_end, row_buf); break;
    case PC_Q4_1: gemv_q4_1(w, row_bytes, x, m, k, y, ldy, n_begin, n_end, row_buf); break;
    case PC_Q5_0: gemv_q5_0(w, row_bytes, x, m, k, y, ldy, n_begin, n_end, row_buf); break;
    case PC_Q8_0: gemv_q8_0(w, row_bytes, x, m, k, y, ldy, n_begin, n_end, row_buf); break;
    case PC_Q4_K: gemv_q4_k(w, row_bytes, x, m, k, y, ldy, n_begin, n_end, row_buf); break;
    case PC_Q5_K: gemv_q5_k(w, row_bytes, x, m, k, y, ldy, n_begin, n_end, row_buf); break;
    case PC_Q6_K: gemv_q6_k(w, row_bytes, x, m, k, y, ldy, n_begin, n_end, row_buf); break;
    default: break;
    }
    free(row_buf);
}

/* Weight rows [r_begin, r_end) dense: row r to out + (r - r_begin) * ld, as fp32 or bf16
   (out_type PC_F32 / PC_BF16), each weight the value gguf's dequantization gives. */
int64_t PC_FN(dequant)(int64_t type, const uint8_t *w, int64_t row_bytes, int64_t k,
                       int64_t r_begin, int64_t r_end, void *out, int64_t ld, int64_t out_type) {
    const row_fn row = row_kernel(type);
    if (row == NULL || (out_type != PC_F32 && out_type != PC_BF16)) return PC_BAD_SHAPE;
    if (out_type == PC_F32) {
        for (int64_t r = r_begin; r < r_end; r++)
            row(w + r * row_bytes, k, (float *)out + (r - r_begin) * ld);
        return PC_OK;
    }
    float *buf = malloc(sizeof(float) * (size_t)k);
    if (buf == NULL) return PC_NO_MEMORY;
    for (int64_t r = r_begin; r < r_end; r++) {
        row(w + r * row_bytes, k, buf);
        uint16_t *dst = (uint16_t *)out + (r - r_begin) * ld;
        for (int64_t c = 0; c < k; c++) dst[c] = f32_to_bf16(buf[c]);
    }
    free(buf);
    return PC_OK;
}

/* Rows ids[0..count) of a weight, dense fp32, to out [count, k]: an embedding lookup. */
int64_t PC_FN(dequant_rows)(int64_t type, const uint8_t *w, int64_t row_bytes, int64_t k,
                            const int64_t *ids, int64_t count, float *out) {
    const row_fn row = row_kernel(type);
    if (row == NULL) return PC_BAD_SHAPE;
    for (int64_t i = 0; i < count; i++) row(w + ids[i] * row_bytes, k, out + i * k);
    return PC_OK;
}
