/* pagechat's CPU kernels, compiled once per machine by kernels/native.py:
   - packed weights back to dense, for steps with too many rows for the packed kernels;
   - an int8 matrix-vector product with fp32 logits, for the LM head at decode;
   - decode attention read straight through the paged KV cache.

   Packed weights back to dense bf16, for steps with too many rows for the packed kernels.

   torch's weight-only CPU kernels are fast while a step reads few rows (decode) and slow once
   it has many (prefill: ~2.5x a dense bf16 GEMM at 512 rows), because they dequantize the
   weights again for every few rows. Dequantizing a layer's weight once into a scratch buffer
   and running the dense GEMM costs ~1 ms per decoder layer of the default model instead.
   Plain C, written for the compiler to vectorize (built with -O3 -march=native by native.py).

   The dense matmul runs in bf16 where the CPU has fast bf16 dot products and in fp32 where
   it has not (an AVX2-only CPU ran bf16 matmuls ~7x slower), so each function writes either:
   `out_fp32` selects float outputs, else bf16 ones. bf16 values travel as uint16_t and are
   rounded to nearest even, as torch rounds.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (no NaNs reach here) */
    return (uint16_t)(u >> 16);
}

/* int4 in torch's CPU layout (`_convert_weight_to_int4pack_for_cpu`, checked by
   tests/engine/test_native.py and once at start-up): packed is [N, K/2] bytes holding tiles
   of 64 output rows; tile t is K runs of 32 bytes, byte j of run k holding w[64t + j, k] in
   its low nibble and w[64t + 32 + j, k] in its high one. The last N % 64 rows (a multiple of
   16) form one narrower tile of width R, byte j of run k holding rows 2j and 2j + 1.
   scales_zeros is [K/32, N, 2] bf16: w = scale * (q - 8) + zero, one pair per group of 32
   along k. Rows [n_begin, n_end) (on tile boundaries) are written transposed: w[n, c] to
   out[c * out_stride + n - n_begin], so a run of 64 outputs is contiguous and vectorizes. */
static inline float int4_value(uint8_t nibble, const uint16_t *pair) {
    return ((float)nibble - 8.0f) * bf16_to_float(pair[0]) + bf16_to_float(pair[1]);
}

/* Writes one output as bf16 or fp32 (see the top). */
#define STORE(out, out_fp32, index, value)                     \
    do {                                                       \
        if (out_fp32)                                          \
            ((float *)(out))[index] = (value);                 \
        else                                                   \
            ((uint16_t *)(out))[index] = float_to_bf16(value); \
    } while (0)

static inline void dequant_int4(const uint8_t *packed, const uint16_t *scales_zeros, void *out,
                                int64_t n, int64_t k, int64_t n_begin, int64_t n_end,
                                int64_t out_stride, const int out_fp32) {
    const int64_t full_rows = n - n % 64;
    for (int64_t c = 0; c < k; c++) {
        const uint16_t *pairs = scales_zeros + (c / 32) * n * 2;
        const int64_t row0 = c * out_stride - n_begin; /* output index of row 0, column c */
        for (int64_t base = n_begin; base < n_end && base < full_rows; base += 64) {
            const uint8_t *bytes = packed + base * k / 2 + c * 32;
            for (int j = 0; j < 32; j++) {
                const int64_t lo = base + j, hi = base + 32 + j;
                STORE(out, out_fp32, row0 + lo, int4_value(bytes[j] & 15, pairs + 2 * lo));
                STORE(out, out_fp32, row0 + hi, int4_value(bytes[j] >> 4, pairs + 2 * hi));
            }
        }
        if (n_end > full_rows) {
            const int64_t half = (n - full_rows) / 2;
            const uint8_t *bytes = packed + full_rows * k / 2 + c * half;
            for (int64_t j = 0; j < half; j++) {
                const int64_t lo = full_rows + 2 * j, hi = lo + 1;
                STORE(out, out_fp32, row0 + lo, int4_value(bytes[j] & 15, pairs + 2 * lo));
                STORE(out, out_fp32, row0 + hi, int4_value(bytes[j] >> 4, pairs + 2 * hi));
            }
        }
    }
}

/* Two copies, so that each inner loop is compiled for one output type. */
void pagechat_dequant_int4(const uint8_t *packed, const uint16_t *scales_zeros, void *out,
                           int64_t n, int64_t k, int64_t n_begin, int64_t n_end,
                           int64_t out_stride, int64_t out_fp32) {
    if (out_fp32)
        dequant_int4(packed, scales_zeros, out, n, k, n_begin, n_end, out_stride, 1);
    else
        dequant_int4(packed, scales_zeros, out, n, k, n_begin, n_end, out_stride, 0);
}

/* int8 as `_weight_int8pack_mm` reads it: q [N, K] int8, one bf16 scale per row.
   Rows [n_begin, n_end) are written as they are: w[n, c] to out[(n - n_begin) * out_stride
   + c] (out_stride is K for a dense block). */
static inline void dequant_int8(const int8_t *q, const uint16_t *scales, void *out, int64_t k,
                                int64_t n_begin, int64_t n_end, int64_t out_stride,
                                const int out_fp32) {
    for (int64_t r = n_begin; r < n_end; r++) {
        const float scale = bf16_to_float(scales[r]);
        const int8_t *src = q + r * k;
        const int64_t row = (r - n_begin) * out_stride;
        for (int64_t c = 0; c < k; c++) {
            STORE(out, out_fp32, row + c, (float)src[c] * scale);
        }
    }
}

void pagechat_dequant_int8(const int8_t *q, const uint16_t *scales, void *out, int64_t n,
                           int64_t k, int64_t n_begin, int64_t n_end, int64_t out_stride,
                           int64_t out_fp32) {
    (void)n;
    if (out_fp32)
        dequant_int8(q, scales, out, k, n_begin, n_end, out_stride, 1);
    else
        dequant_int8(q, scales, out, k, n_begin, n_end, out_stride, 0);
}

/* y[r, j] = scale[j] * sum_c q[j, c] * x[r, c] for r < m and weight rows j in [n_begin,
   n_end): an int8 matrix-vector product with fp32 input, accumulation and output, for the
   LM head at decode. torch's `_weight_int8pack_mm` runs in bf16 and rounds the logits to
   8 significant bits (steps of 0.125 at 25: top tokens tie); this keeps them fp32. Each
   weight row is read from memory once: the m dot products over it find it in L1. y is
   [m, n] (row stride n). */
#if defined(__AVX512F__)
#include <immintrin.h>
/* gcc 12 lowers generic vector conversions from int8 to scalar code: intrinsics instead. */
static inline float dot_int8(const int8_t *w, const float *x, int64_t k) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) {
        const __m512i w0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + c)));
        const __m512i w1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + c + 16)));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(w0), _mm512_loadu_ps(x + c), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(w1), _mm512_loadu_ps(x + c + 16), acc1);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    for (; c < k; c++) sum += (float)w[c] * x[c];
    return sum;
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float dot_int8(const int8_t *w, const float *x, int64_t k) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
        const __m256i w0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + c)));
        const __m256i w1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + c + 8)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w0), _mm256_loadu_ps(x + c), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w1), _mm256_loadu_ps(x + c + 8), acc1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(acc0, acc1));
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    for (; c < k; c++) sum += (float)w[c] * x[c];
    return sum;
}
#else
static inline float dot_int8(const int8_t *w, const float *x, int64_t k) {
    float sum = 0.0f;
    for (int64_t c = 0; c < k; c++) sum += (float)w[c] * x[c];
    return sum;
}
#endif

void pagechat_int8_gemv(const float *x, int64_t m, const int8_t *q, const uint16_t *scales,
                        float *y, int64_t n, int64_t k, int64_t n_begin, int64_t n_end) {
    for (int64_t j = n_begin; j < n_end; j++) {
        const float scale = bf16_to_float(scales[j]);
        for (int64_t r = 0; r < m; r++) {
            y[r * n + j] = scale * dot_int8(q + j * k, x + r * k, k);
        }
    }
}

/* Decode attention straight through the paged cache: for each sequence b and query head h,
   out[b, h] = softmax(scale * q[b, h] . k[slot]) . v[slot] over the sequence's context
   slots. No gathered copy of K/V and no padded SDPA: torch's path gathers every context
   position into a fresh tensor twice a layer and runs SDPA over the padded batch, ~90 us a
   layer for one sequence of 300 tokens where this loop reads the cache in place.

   q and out are [B, Hq, D]; the caches are flat [slots, Hkv, D] (the pool's layer view);
   slots is [B, C] int64 (row b's first seq_lens[b] entries are its context, in order); query
   head h reads KV head h / (Hq / Hkv). Rows [b_begin, b_end) of the batch. */
#if defined(__AVX512F__)
static inline float dot_f32(const float *a, const float *b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float sum = _mm512_reduce_add_ps(acc);
    for (; i < d; i++) sum += a[i] * b[i];
    return sum;
}
#else
static inline float dot_f32(const float *a, const float *b, int64_t d) {
    float sum = 0.0f;
    for (int64_t i = 0; i < d; i++) sum += a[i] * b[i];
    return sum;
}
#endif


/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for rows r of d floats: a decoder layer's
   RMSNorm in fp32. torch's fp32 rms_norm on the CPU is six ops (pow, mean, add, rsqrt, two
   muls), ~20 us for one row of 576 here, called twice a layer: a tenth of a batch-1 step. */
void pagechat_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t d,
                       float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * d;
        float *dst = out + r * d;
        const float inv = 1.0f / sqrtf(dot_f32(row, row, d) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) dst[i] = row[i] * inv * w[i];
    }
}


/* exp(x) for x <= 0 (scores minus their peak), in plain arithmetic the compiler vectorizes
   (expf is a call per element): 2^(x log2 e) split into an integer power, set in the
   exponent bits, and a fraction's power by a degree-6 polynomial; relative error ~2e-7.
   Below -87 the result is 0 (as expf's rounds to). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f; /* x log2 e, in [-125.5, 0] */
    const float whole = __builtin_floorf(t);
    const float f = t - whole; /* in [0, 1) */
    float p = 1.535336188e-4f;
    p = p * f + 1.339887440e-3f;
    p = p * f + 9.618437357e-3f;
    p = p * f + 5.550332471e-2f;
    p = p * f + 2.402264791e-1f;
    p = p * f + 6.931472028e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)whole + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
/* The horizontal sums of 16 vectors, as one vector: lane j holds the sum of v[j]. */
static inline __m512 sum_each(const __m512 v[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}
#endif

/* One sequence's decode attention for query heads [h_begin, h_end): o [Hq, D] from qb [Hq, D]
   over the len context slots ctx (cache rows of num_kv_heads * head_dim floats); scores
   holds Hq * len floats. Where peaks is set, each head's largest score and its softmax's
   sum go to peaks[hq] and totals[hq] (a part of the context, merged by merge_ranges). */
static void attend_row(const float *qb, const float *k_cache, const float *v_cache,
                       const int64_t *ctx, int64_t len, float *scores, float *o,
                       int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                       int64_t h_begin, int64_t h_end, float *peaks, float *totals) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per cache slot */
    /* scores[hq * len + c]; a slot's K (and later V) rows for every head are read together,
       front to back: the context streams through once, not once per head. */
    int64_t c = 0;
#if defined(__AVX512F__)
    /* 16 positions at a time, their 16 dot products reduced together (one transpose-add
       where one each took a horizontal sum): the block's K rows stay in L1 for every head */
    if (head_dim % 16 == 0)
        for (; c + 16 <= len; c += 16)
            for (int64_t hq = h_begin; hq < h_end; hq++) {
                const float *qh = qb + hq * head_dim;
                const int64_t head = (hq / group) * head_dim;
                __m512 dots[16];
                for (int j = 0; j < 16; j++) {
                    const float *k = k_cache + ctx[c + j] * row + head;
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t i = 0; i < head_dim; i += 16)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + i), _mm512_loadu_ps(k + i), acc);
                    dots[j] = acc;
                }
                _mm512_storeu_ps(scores + hq * len + c,
                                 _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale)));
            }
#endif
    for (; c < len; c++) {
        const float *k = k_cache + ctx[c] * row;
        for (int64_t hq = h_begin; hq < h_end; hq++)
            scores[hq * len + c] =
                scale * dot_f32(qb + hq * head_dim, k + (hq / group) * head_dim, head_dim);
    }
    for (int64_t hq = h_begin; hq < h_end; hq++) {
        float *s = scores + hq * len;
        float peak = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < len; c++) peak = s[c] > peak ? s[c] : peak;
        for (int64_t c = 0; c < len; c++) s[c] = exp_nonpositive(s[c] - peak);
        for (int64_t c = 0; c < len; c++) total += s[c];
        if (peaks) peaks[hq] = peak, totals[hq] = total; /* to merge with another range's */
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < len; c++) s[c] *= inv;
    }
#if defined(__AVX512F__)
    /* head_dim 64: each KV head's V row loaded once into registers for the query heads that
       read it (up to four), their outputs accumulated in registers over the context */
    if (head_dim == 64 && group <= 4 && h_begin == 0 && h_end == num_q_heads) {
        for (int64_t kv = 0; kv < num_kv_heads; kv++) {
            __m512 acc[4][4];
            for (int a = 0; a < 4; a++)
                for (int i = 0; i < 4; i++) acc[a][i] = _mm512_setzero_ps();
            const float *p = scores + kv * group * len;
            for (int64_t c = 0; c < len; c++) {
                const float *v = v_cache + ctx[c] * row + kv * 64;
                const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
                const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
                for (int64_t a = 0; a < group; a++) {
                    const __m512 w = _mm512_set1_ps(p[a * len + c]);
                    acc[a][0] = _mm512_fmadd_ps(w, v0, acc[a][0]);
                    acc[a][1] = _mm512_fmadd_ps(w, v1, acc[a][1]);
                    acc[a][2] = _mm512_fmadd_ps(w, v2, acc[a][2]);
                    acc[a][3] = _mm512_fmadd_ps(w, v3, acc[a][3]);
                }
            }
            for (int64_t a = 0; a < group; a++)
                for (int i = 0; i < 4; i++)
                    _mm512_storeu_ps(o + (kv * group + a) * 64 + 16 * i, acc[a][i]);
        }
        return;
    }
#endif
    for (int64_t i = h_begin * head_dim; i < h_end * head_dim; i++) o[i] = 0.0f;
    for (int64_t c = 0; c < len; c++) {
        const float *v = v_cache + ctx[c] * row;
        for (int64_t hq = h_begin; hq < h_end; hq++) {
            const float p = scores[hq * len + c];
            const float *vh = v + (hq / group) * head_dim;
            float *oh = o + hq * head_dim;
            for (int64_t i = 0; i < head_dim; i++) oh[i] += p * vh[i];
        }
    }
}

int pagechat_paged_decode(const float *q, const float *k_cache, const float *v_cache,
                          const int64_t *slots, const int64_t *seq_lens, float *out,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t max_context, float scale, int64_t b_begin, int64_t b_end) {
    float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * max_context));
    if (scores == NULL) return 1;
    for (int64_t b = b_begin; b < b_end; b++) {
        const int64_t offset = b * num_q_heads * head_dim;
        attend_row(q + offset, k_cache, v_cache, slots + b * max_context, seq_lens[b], scores,
                   out + offset, num_q_heads, num_kv_heads, head_dim, scale, 0, num_q_heads,
                   NULL, NULL);
    }
    free(scores);
    return 0;
}

/* y[r, n] = sum_c x[r, c] * w[n, c] for r < m and the weight rows [n_begin, n_end) (tiles of
   64), w an int4 weight in torch's CPU layout (see pagechat_dequant_int4): fp32 input,
   accumulation and output, reading the packed nibbles once for up to 4 input rows at a time.
   torch's `_weight_int4pack_mm_for_cpu` runs in bf16 and, at one row, read the default
   model's layers at ~4 GB/s here. Per group g of 32 columns, w = s (q - 8) + z, so
   sum_c x_c w_c = s (sum_c x_c q_c - 8 X) + z X with X = sum_c x_c: the loop accumulates
   x q over the group and applies the pair once. AVX512 only: returns 1 (nothing done)
   where it was compiled without, and the caller keeps torch's kernel. y is [m, n]. */
#define INT4_GEMV_ROWS 4

int pagechat_int4_gemv(const float *x, int64_t m, const uint8_t *packed,
                       const uint16_t *scales_zeros, float *y, int64_t n, int64_t k,
                       int64_t n_begin, int64_t n_end) {
#if defined(__AVX512F__)
    if (n % 64 || k % 32) return 1;
    const __m512i low_nibbles = _mm512_set1_epi32(15);
    for (int64_t base = n_begin; base < n_end; base += 64) {
        const uint8_t *tile = packed + base * k / 2;
        for (int64_t r0 = 0; r0 < m; r0 += INT4_GEMV_ROWS) {
            const int64_t rows = m - r0 < INT4_GEMV_ROWS ? m - r0 : INT4_GEMV_ROWS;
            __m512 out[INT4_GEMV_ROWS][4];
            for (int64_t r = 0; r < INT4_GEMV_ROWS; r++)
                for (int v = 0; v < 4; v++) out[r][v] = _mm512_setzero_ps();
            for (int64_t g = 0; g < k / 32; g++) {
                __m512 acc[INT4_GEMV_ROWS][4];
                float xsum[INT4_GEMV_ROWS] = {0};
                for (int64_t r = 0; r < INT4_GEMV_ROWS; r++)
                    for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
                for (int64_t c = g * 32; c < g * 32 + 32; c++) {
                    const uint8_t *bytes = tile + c * 32;
                    /* rows base + [0, 16), [16, 32) from the low nibbles of bytes 0-15 and
                       16-31; rows base + [32, 48), [48, 64) from their high nibbles */
                    const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
                    const __m512i b1 =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16)));
                    const __m512 w[4] = {
                        _mm512_cvtepi32_ps(_mm512_and_si512(b0, low_nibbles)),
                        _mm512_cvtepi32_ps(_mm512_and_si512(b1, low_nibbles)),
                        _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)),
                        _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)),
                    };
                    for (int64_t r = 0; r < rows; r++) {
                        const float xc = x[(r0 + r) * k + c];
                        const __m512 xv = _mm512_set1_ps(xc);
                        xsum[r] += xc;
                        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(xv, w[v], acc[r][v]);
                    }
                }
                /* (scale, zero) bf16 pairs of the tile's 64 rows: each 32-bit lane holds one
                   row's pair, scale in the low half; as floats, scale = lane << 16 and
                   zero = the lane's high half. */
                const uint16_t *pairs = scales_zeros + (g * n + base) * 2;
                for (int v = 0; v < 4; v++) {
                    const __m512i lane = _mm512_loadu_si512((const void *)(pairs + 32 * v));
                    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(lane, 16));
                    const __m512 zero = _mm512_castsi512_ps(
                        _mm512_and_si512(lane, _mm512_set1_epi32((int)0xFFFF0000u)));
                    for (int64_t r = 0; r < rows; r++) {
                        const __m512 xs = _mm512_set1_ps(xsum[r]);
                        const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), xs, acc[r][v]);
                        out[r][v] = _mm512_fmadd_ps(scale, centred, out[r][v]);
                        out[r][v] = _mm512_fmadd_ps(zero, xs, out[r][v]);
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++)
                for (int v = 0; v < 4; v++)
                    _mm512_storeu_ps(y + (r0 + r) * n + base + 16 * v, out[r][v]);
        }
    }
    return 0;
#else
    (void)x, (void)m, (void)packed, (void)scales_zeros, (void)y, (void)n, (void)k;
    (void)n_begin, (void)n_end;
    return 1;
#endif
}

/* int4 in pagechat's VNNI layout, for CPUs with AVX512-VNNI: the same values as torch's layout
   (w = scale * (q - 8) + zero, the same [K/32, N, 2] bf16 pairs), packed so that one
   vpdpbusd multiplies four consecutive weights of each of 16 rows by four int8 inputs.
   Rows come in tiles of 16; a tile is K/32 groups, a group four runs of 8 columns, a run 64
   bytes: byte 4j + i holds w[16t + j, 32g + 8s + i] in its low nibble and column + 4 in its
   high one (native.pack_int4_vnni builds it).

   The input goes in as two int8 digits per group of 32: x ~ dx (hi + lo / 254) with
   dx = max|x| / 127, hi = round(x / dx) and lo the rounded remainder in steps of dx / 254,
   so each input is off by at most dx / 508 = max|x| / 64516 (one int8 digit alone, as
   llama.cpp's Q8 activations, is off by up to max|x| / 254: on the bundled model that moved
   the logits 5.4% of the largest against the dequantized weights, where bf16 moved them
   3.0%). Per group, sum_c x_c w_c = dx (scale (X q - 8 X) + zero X) with X q =
   sum hi q + sum lo q / 254 and X = sum hi + sum lo / 254: two vpdpbusd a run. */
typedef struct {
    int8_t *hi, *lo; /* [m, K] each */
    float *dx;       /* [m, K/32]: each group's step */
    float *sx;       /* [m, K/32]: each group's sum hi + sum lo / 254 */
} quantized_rows;

static inline size_t quantized_bytes(int64_t m, int64_t k) {
    return (size_t)(2 * m * k) + (size_t)(m * (k / 32)) * 2 * sizeof(float);
}

static inline quantized_rows quantized_view(void *buffer, int64_t m, int64_t k) {
    quantized_rows q;
    q.dx = buffer;
    q.sx = q.dx + m * (k / 32);
    q.hi = (int8_t *)(q.sx + m * (k / 32));
    q.lo = q.hi + m * k;
    return q;
}

#define LOW_DIGIT 254.0f /* steps of the second digit per step of the first */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGECHAT_VNNI 1
static void quantize_rows(const float *x, int64_t m, int64_t k, quantized_rows q) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < k / 32; g++) {
            const float *src = x + r * k + 32 * g;
            const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
            const float peak = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
            const float step = peak / 127.0f;
            const __m512 inv = _mm512_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
            const __m512 dx = _mm512_set1_ps(step);
            const __m512 low_inv = _mm512_mul_ps(inv, _mm512_set1_ps(LOW_DIGIT));
            /* round to nearest even, as torch.round; the remainder exactly (fnmadd) */
            const __m512i ha = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
            const __m512i hb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
            const __m512 ra = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ha), dx, a);
            const __m512 rb = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(hb), dx, b);
            const __m512i la = _mm512_cvtps_epi32(_mm512_mul_ps(ra, low_inv));
            const __m512i lb = _mm512_cvtps_epi32(_mm512_mul_ps(rb, low_inv));
            int8_t *hi = q.hi + r * k + 32 * g, *lo = q.lo + r * k + 32 * g;
            _mm_storeu_si128((__m128i *)hi, _mm512_cvtsepi32_epi8(ha));
            _mm_storeu_si128((__m128i *)(hi + 16), _mm512_cvtsepi32_epi8(hb));
            _mm_storeu_si128((__m128i *)lo, _mm512_cvtsepi32_epi8(la));
            _mm_storeu_si128((__m128i *)(lo + 16), _mm512_cvtsepi32_epi8(lb));
            const float high_sum = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(ha, hb));
            const float low_sum = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(la, lb));
            q.dx[r * (k / 32) + g] = step;
            q.sx[r * (k / 32) + g] = high_sum + low_sum / LOW_DIGIT;
        }
    }
}

#define VNNI_ROWS 4

static inline __m512i broadcast4(const int8_t *bytes) {
    int32_t word;
    memcpy(&word, bytes, 4);
    return _mm512_set1_epi32(word);
}

/* y[r, n] for r < m and weight rows [n_begin, n_end) (tiles of 16) from quantized inputs. */
static void int4_vnni_tiles(quantized_rows q, int64_t m, const uint8_t *packed,
                            const uint16_t *scales_zeros, float *y, int64_t n, int64_t k,
                            int64_t n_begin, int64_t n_end) {
    const int64_t groups = k / 32;
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 low_weight = _mm512_set1_ps(1.0f / LOW_DIGIT);
    for (int64_t base = n_begin; base < n_end; base += 16) {
        const uint8_t *tile = packed + base * k / 2;
        for (int64_t r0 = 0; r0 < m; r0 += VNNI_ROWS) {
            const int64_t rows = m - r0 < VNNI_ROWS ? m - r0 : VNNI_ROWS;
            __m512 out[VNNI_ROWS];
            for (int r = 0; r < VNNI_ROWS; r++) out[r] = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *runs = tile + g * 256;
                /* per row: sum hi q and sum lo q, the columns' low and high nibbles apart */
                __m512i high[VNNI_ROWS], low[VNNI_ROWS];
                for (int r = 0; r < VNNI_ROWS; r++) high[r] = low[r] = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++) {
                    const __m512i bytes = _mm512_loadu_si512((const void *)(runs + 64 * s));
                    const __m512i first = _mm512_and_si512(bytes, nibble);
                    const __m512i second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t at = (r0 + r) * k + 32 * g + 8 * s;
                        high[r] = _mm512_dpbusd_epi32(high[r], first, broadcast4(q.hi + at));
                        high[r] = _mm512_dpbusd_epi32(high[r], second, broadcast4(q.hi + at + 4));
                        low[r] = _mm512_dpbusd_epi32(low[r], first, broadcast4(q.lo + at));
                        low[r] = _mm512_dpbusd_epi32(low[r], second, broadcast4(q.lo + at + 4));
                    }
                }
                /* the tile's 16 (scale, zero) pairs: lane j holds row j's, scale low */
                const __m512i lane =
                    _mm512_loadu_si512((const void *)(scales_zeros + (g * n + base) * 2));
                const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(lane, 16));
                const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(lane, high_half));
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t at = (r0 + r) * groups + g;
                    const __m512 xq = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low[r]), low_weight,
                                                      _mm512_cvtepi32_ps(high[r]));
                    const __m512 sx = _mm512_set1_ps(q.sx[at]);
                    const __m512 dx = _mm512_set1_ps(q.dx[at]);
                    const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sx, xq);
                    out[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, dx), centred, out[r]);
                    out[r] = _mm512_fmadd_ps(zero, _mm512_mul_ps(dx, sx), out[r]);
                }
            }
            for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(y + (r0 + r) * n + base, out[r]);
        }
    }
}
#endif

int pagechat_has_vnni(void) {
#if defined(PAGECHAT_VNNI)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] times an int4 weight in the VNNI layout: returns 1 (nothing done)
   where the library was built without AVX512-VNNI, or on bad shapes; 2 out of memory. */
int pagechat_int4_vnni_gemv(const float *x, int64_t m, const uint8_t *packed,
                            const uint16_t *scales_zeros, float *y, int64_t n, int64_t k) {
#if defined(PAGECHAT_VNNI)
    if (n % 16 || k % 32) return 1;
    void *buffer = malloc(quantized_bytes(m, k));
    if (buffer == NULL) return 2;
    const quantized_rows q = quantized_view(buffer, m, k);
    quantize_rows(x, m, k, q);
    int4_vnni_tiles(q, m, packed, scales_zeros, y, n, k, 0, n);
    free(buffer);
    return 0;
#else
    (void)x, (void)m, (void)packed, (void)scales_zeros, (void)y, (void)n, (void)k;
    return 1;
#endif
}

/* The VNNI layout back to dense, rows [n_begin, n_end) (tiles of 16) written transposed as
   pagechat_dequant_int4 writes them: w[n, c] to out[c * out_stride + n - n_begin]. */
static inline void dequant_int4_vnni(const uint8_t *packed, const uint16_t *scales_zeros,
                                     void *out, int64_t n, int64_t k, int64_t n_begin,
                                     int64_t n_end, int64_t out_stride, const int out_fp32) {
    for (int64_t base = n_begin; base < n_end; base += 16) {
        for (int64_t g = 0; g < k / 32; g++) {
            const uint8_t *runs = packed + base * k / 2 + g * 256;
            const uint16_t *pairs = scales_zeros + (g * n + base) * 2;
            for (int s = 0; s < 4; s++) {
                for (int i = 0; i < 4; i++) {
                    const int64_t c = 32 * g + 8 * s + i;
                    const int64_t lo = c * out_stride + base - n_begin;
                    const int64_t hi = (c + 4) * out_stride + base - n_begin;
                    for (int j = 0; j < 16; j++) {
                        const uint8_t b = runs[64 * s + 4 * j + i];
                        STORE(out, out_fp32, lo + j, int4_value(b & 15, pairs + 2 * j));
                        STORE(out, out_fp32, hi + j, int4_value(b >> 4, pairs + 2 * j));
                    }
                }
            }
        }
    }
}

void pagechat_dequant_int4_vnni(const uint8_t *packed, const uint16_t *scales_zeros, void *out,
                                int64_t n, int64_t k, int64_t n_begin, int64_t n_end,
                                int64_t out_stride, int64_t out_fp32) {
    if (out_fp32)
        dequant_int4_vnni(packed, scales_zeros, out, n, k, n_begin, n_end, out_stride, 1);
    else
        dequant_int4_vnni(packed, scales_zeros, out, n, k, n_begin, n_end, out_stride, 0);
}

/* A whole decode step's decoder layers in one call, for a model whose projections are all
   int4 (the VNNI layout) with fp32 activations and an fp32 paged cache: per layer
   RMSNorm, the fused qkv GEMV, RoPE on Q and K, K/V written to their slots, attention over
   each row's context, o_proj, the residual, RMSNorm, gate_up, SiLU(gate) * up, down, the
   residual. The same arithmetic as the torch path op for op (model.py), without its ~25
   small ops a layer: at one row those cost more than the layer's matmuls' own overhead.

   x [m, hidden] is the residual stream, updated in place; cos and sin [m, head_dim] are each
   row's RoPE rows (the sin table signed for rotate_half, as model.rope_tables builds it);
   write_slots [m] is where each row's K/V goes; block_tables [m, table_width] int32 and
   seq_lens [m] int32 are each row's pages and context length, its new token included (the
   step's AttentionMetadata as it is). Returns 0, 1 where memory ran out, 2 where a weight is
   not in whole tiles of 16 rows or AVX512-VNNI is missing, 3 where a write slot, a block or a
   length lies outside the pool (all checked before anything is written).
   Where matmul_ns is not NULL, the nanoseconds spent in the four GEMVs are added to it (for
   benchmarks/engine_step.py's matmul share: no hook sees inside this call). */
typedef struct {
    const uint8_t *packed[4]; /* qkv, o_proj, gate_up, down */
    const uint16_t *pairs[4]; /* their (scale, zero) pairs, [K/32, N, 2] bf16 */
    const float *attn_norm, *mlp_norm;
    float *k_cache, *v_cache; /* [slots, Hkv, D] */
} pagechat_decoder_layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_q_heads, num_kv_heads, head_dim;
    float rms_norm_eps, scale;
    int64_t cache_blocks, block_size; /* the KV pool's, every layer's caches alike */
} pagechat_decoder_shape;

/* g / (1 + exp(-g)) through exp_nonpositive (so that the loop vectorizes): with
   e = exp(-|g|), g / (1 + e) for g >= 0 and g e / (1 + e) below. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g < 0.0f ? g : -g);
    return (g < 0.0f ? g * e : g) / (1.0f + e);
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

#if defined(PAGECHAT_VNNI)
/* A second thread for the stack's GEMVs: each projection's tiles of 64 rows are split
   between the calling thread and this helper. While a stack call runs the helper spins
   between projections (a futex wake-up per projection, ~120 a step, would cost more than
   the split saves); between calls it sleeps on a condition variable, so an idle engine
   leaves the core to the event loop. One stack call at a time uses it (a second engine
   in the process runs its call on one thread). */
/* The rows of the batch a stack call hands one thread for one layer's attention. */
typedef struct {
    const float *qkv; /* [m, qkv_size]: Q at the front of each row */
    const float *k_cache, *v_cache;
    const int64_t *slots; /* [m, max_context] */
    const int32_t *seq_lens;
    float *out;    /* [m, q_size] */
    float *scores; /* this thread's: num_q_heads * max_context */
    int64_t qkv_size, max_context, num_q_heads, num_kv_heads, head_dim;
    float scale;
    float *peaks, *totals; /* this thread's [num_q_heads], for a lone row's context range */
} attention_rows;

/* What a part of a stack call's work is: [n_begin, n_end) counts its unit. */
typedef enum {
    PART_INT4,              /* output rows of int4_vnni_tiles over quantized inputs */
    PART_INT8,              /* output rows of pagechat_int8_gemv */
    PART_ATTENTION_ROWS,    /* rows of the batch's attention */
    PART_ATTENTION_CONTEXT, /* context positions of row 0's attention */
    PART_GATED,             /* elements of SiLU(gate) * up, [m, intermediate] */
} part_kind;

/* Work for the helper (or the caller's own share of it). */
typedef struct {
    part_kind kind;
    quantized_rows xq;  /* int4's input */
    const float *x;     /* int8's input */
    int64_t m, n, k, n_begin, n_end;
    const void *weight; /* packed int4, or int8 rows */
    const uint16_t *scales;
    float *y;
    attention_rows attention;
} gemv_part;

/* Rows [begin, end) of the batch, every head; or, where `one_row` is set, row 0's context
   positions [begin, end) (a batch of one splits its context between the threads, each
   reading half the cache: merge_ranges joins the halves). */
static void attend_rows(const attention_rows *a, int64_t begin, int64_t end, int one_row) {
    const int64_t q_size = a->num_q_heads * a->head_dim;
    if (one_row) {
        attend_row(a->qkv, a->k_cache, a->v_cache, a->slots + begin, end - begin, a->scores,
                   a->out, a->num_q_heads, a->num_kv_heads, a->head_dim, a->scale, 0,
                   a->num_q_heads, a->peaks, a->totals);
        return;
    }
    for (int64_t r = begin; r < end; r++)
        attend_row(a->qkv + r * a->qkv_size, a->k_cache, a->v_cache, a->slots + r * a->max_context,
                   a->seq_lens[r], a->scores, a->out + r * q_size, a->num_q_heads,
                   a->num_kv_heads, a->head_dim, a->scale, 0, a->num_q_heads, NULL, NULL);
}

/* out = the softmax over both ranges: each range's output is normalized by its own total,
   so out = (w1 o1 + w2 o2) / (w1 + w2) with w = total * exp(peak - the larger peak). */
static void merge_ranges(float *out, const float *other, const float *peaks, const float *totals,
                         const float *other_peaks, const float *other_totals, int64_t num_heads,
                         int64_t head_dim) {
    for (int64_t h = 0; h < num_heads; h++) {
        const float top = peaks[h] > other_peaks[h] ? peaks[h] : other_peaks[h];
        const float w1 = totals[h] * expf(peaks[h] - top);
        const float w2 = other_totals[h] * expf(other_peaks[h] - top);
        const float inv = 1.0f / (w1 + w2);
        float *o = out + h * head_dim;
        const float *p = other + h * head_dim;
        for (int64_t i = 0; i < head_dim; i++) o[i] = (w1 * o[i] + w2 * p[i]) * inv;
    }
}

static struct {
    pthread_mutex_t lock; /* guards `stepping`'s changes and the thread's start */
    pthread_cond_t wake;
    pthread_mutex_t owner; /* held by the stack call that uses the helper */
    int started;
    atomic_int stepping;          /* 1 while a stack call may post work: spin, don't sleep */
    atomic_uint posted, finished; /* work counters: the helper's part runs when they differ */
    gemv_part part;
} helper = {.lock = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER,
            .owner = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A spin-wait's n-th turn: pause, and past ~20 us (a projection's half takes 10-100) yield
   the core, so that a third thread (the server's event loop) waiting for one runs now
   instead of at the end of our time slice, while this one has nothing to do. */
#define SPINS_BEFORE_YIELD 4096
static inline void spin_turn(unsigned *spins) {
    if (++*spins < SPINS_BEFORE_YIELD)
        cpu_relax();
    else
        sched_yield();
}

/* act[e] = SiLU(gate) * up for elements e in [begin, end) of [m, inter], from gate_up
   [m, 2 inter] (rows [gate; up]). */
static void gated_rows(const float *gate_up, float *act, int64_t inter, int64_t begin,
                       int64_t end) {
    for (int64_t r = begin / inter; r * inter < end; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *out = act + r * inter;
        const int64_t first = begin > r * inter ? begin - r * inter : 0;
        const int64_t last = end < (r + 1) * inter ? end - r * inter : inter;
        for (int64_t i = first; i < last; i++) out[i] = silu(gate[i]) * up[i];
    }
}

static void run_part(const gemv_part *p) {
    switch (p->kind) {
    case PART_INT4:
        int4_vnni_tiles(p->xq, p->m, p->weight, p->scales, p->y, p->n, p->k, p->n_begin, p->n_end);
        break;
    case PART_INT8:
        pagechat_int8_gemv(p->x, p->m, p->weight, p->scales, p->y, p->n, p->k, p->n_begin,
                           p->n_end);
        break;
    case PART_ATTENTION_ROWS:
    case PART_ATTENTION_CONTEXT:
        attend_rows(&p->attention, p->n_begin, p->n_end, p->kind == PART_ATTENTION_CONTEXT);
        break;
    case PART_GATED:
        gated_rows(p->x, p->y, p->k, p->n_begin, p->n_end);
        break;
    }
}

/* Runs `theirs` on the helper and `mine` on the calling thread, and waits for both. */
static void run_split(const gemv_part *theirs, const gemv_part *mine) {
    helper.part = *theirs;
    const unsigned ticket = atomic_fetch_add_explicit(&helper.posted, 1, memory_order_release) + 1;
    run_part(mine);
    unsigned spins = 0;
    while (atomic_load_explicit(&helper.finished, memory_order_acquire) != ticket)
        spin_turn(&spins);
}

/* `part` with the helper taking rows [middle, n_end) and the caller the rest. */
static void run_halves(const gemv_part *part, int64_t middle) {
    gemv_part theirs = *part, mine = *part;
    theirs.n_begin = middle;
    mine.n_end = middle;
    run_split(&theirs, &mine);
}

static void *helper_main(void *unused) {
    (void)unused;
    unsigned seen = 0;
    for (;;) {
        unsigned spins = 0;
        while (atomic_load_explicit(&helper.posted, memory_order_acquire) == seen) {
            if (atomic_load_explicit(&helper.stepping, memory_order_acquire)) {
                spin_turn(&spins);
                continue;
            }
            pthread_mutex_lock(&helper.lock);
            while (!atomic_load(&helper.stepping) && atomic_load(&helper.posted) == seen)
                pthread_cond_wait(&helper.wake, &helper.lock);
            pthread_mutex_unlock(&helper.lock);
        }
        seen = atomic_load_explicit(&helper.posted, memory_order_acquire);
        run_part(&helper.part);
        atomic_store_explicit(&helper.finished, seen, memory_order_release);
    }
    return NULL;
}

/* A forked child has no helper thread (fork copies only the caller): it starts its own on
   its first split call, from a reset state, instead of spinning for one that is not there. */
static void helper_after_fork(void) {
    pthread_mutex_init(&helper.lock, NULL);
    pthread_cond_init(&helper.wake, NULL);
    pthread_mutex_init(&helper.owner, NULL);
    helper.started = 0;
    atomic_store(&helper.stepping, 0);
    atomic_store(&helper.posted, 0);
    atomic_store(&helper.finished, 0);
}

static pthread_once_t helper_fork_hook = PTHREAD_ONCE_INIT;

static void helper_register_fork_hook(void) { pthread_atfork(NULL, NULL, helper_after_fork); }

/* Takes the helper for one stack call: 1 if it is ours (started and spinning), 0 where it
   could not start or another call holds it (then the call runs on one thread). */
static int helper_take(void) {
    pthread_once(&helper_fork_hook, helper_register_fork_hook);
    if (pthread_mutex_trylock(&helper.owner)) return 0;
    pthread_mutex_lock(&helper.lock);
    if (!helper.started) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, NULL) == 0) {
            pthread_detach(thread);
            helper.started = 1;
        }
    }
    const int ours = helper.started;
    if (ours) {
        atomic_store(&helper.stepping, 1);
        pthread_cond_signal(&helper.wake);
    }
    pthread_mutex_unlock(&helper.lock);
    if (!ours) pthread_mutex_unlock(&helper.owner);
    return ours;
}

static void helper_release(void) {
    pthread_mutex_lock(&helper.lock);
    atomic_store(&helper.stepping, 0);
    pthread_mutex_unlock(&helper.lock);
    pthread_mutex_unlock(&helper.owner);
}

/* One projection of the stack (its shapes were checked on entry): the input quantized into
   `quantized`, then the tiles, split with the helper where `split` is set (it takes the upper half). */
static inline void project(const float *x, int64_t m, const uint8_t *packed,
                           const uint16_t *pairs, float *y, int64_t n, int64_t k, int split,
                           void *quantized, int64_t *matmul_ns) {
    const int64_t start = matmul_ns ? now_ns() : 0;
    const quantized_rows q = quantized_view(quantized, m, k);
    quantize_rows(x, m, k, q);
    if (split) {
        const gemv_part part = {.kind = PART_INT4, .xq = q, .m = m, .n = n, .k = k, .n_end = n,
                                .weight = packed, .scales = pairs, .y = y};
        run_halves(&part, (n / 16 + 1) / 2 * 16); /* the caller's half: the larger */
    } else {
        int4_vnni_tiles(q, m, packed, pairs, y, n, k, 0, n);
    }
    if (matmul_ns) *matmul_ns += now_ns() - start;
}

#endif /* PAGECHAT_VNNI */

/* pagechat_int8_gemv over every row, split with the helper thread where threads is 2 and
   it is free (the LM head of a step the decoder stack ran). */
void pagechat_int8_gemv_threads(const float *x, int64_t m, const int8_t *q,
                                const uint16_t *scales, float *y, int64_t n, int64_t k,
                                int64_t threads) {
#if defined(PAGECHAT_VNNI)
    if (threads > 1 && helper_take()) {
        const gemv_part part = {.kind = PART_INT8, .x = x, .m = m, .n = n, .k = k, .n_end = n,
                                .weight = q, .scales = scales, .y = y};
        run_halves(&part, n / 2);
        helper_release();
        return;
    }
#endif
    (void)threads;
    pagechat_int8_gemv(x, m, q, scales, y, n, k, 0, n);
}

#define MIN_CONTEXT_HALF 32 /* a lone sequence's context splits from 64 positions */

int pagechat_decode_layers(const pagechat_decoder_layer *layers,
                           const pagechat_decoder_shape *shape, float *x, int64_t m,
                           const float *cos, const float *sin, const int64_t *write_slots,
                           const int32_t *block_tables, int64_t table_width, int64_t block_size,
                           const int32_t *seq_lens, int64_t threads, int64_t *matmul_ns) {
#if !defined(PAGECHAT_VNNI)
    (void)layers, (void)shape, (void)x, (void)m, (void)cos, (void)sin, (void)write_slots;
    (void)block_tables, (void)table_width, (void)block_size, (void)seq_lens, (void)threads;
    (void)matmul_ns;
    return 2; /* the weights' layout and kernel are AVX512-VNNI's */
#else
    const int64_t h = shape->hidden, inter = shape->intermediate, d = shape->head_dim;
    const int64_t hq = shape->num_q_heads, hkv = shape->num_kv_heads;
    const int64_t q_size = hq * d, kv_size = hkv * d, qkv_size = q_size + 2 * kv_size;
    /* per row: the normed input, qkv, the attention's output, gate_up, one projection's
       output; then the scores and one head's rotation */
    const int64_t per_row = h + qkv_size + q_size + 2 * inter + inter + h;
    if (qkv_size % 16 || h % 32 || (2 * inter) % 16 || q_size % 32 || inter % 32) return 2;
    if (block_size != shape->block_size) return 3;
    /* Nothing outside the pool is written or read: every write slot and every block a
       context reads lies in it (a few rows: cheap next to the step). */
    int64_t max_context = 0;
    for (int64_t r = 0; r < m; r++) {
        if (write_slots[r] < 0 || write_slots[r] >= shape->cache_blocks * block_size) return 3;
        if (seq_lens[r] < 1 || seq_lens[r] > table_width * block_size) return 3;
        for (int64_t b = 0; b < (seq_lens[r] + block_size - 1) / block_size; b++) {
            const int32_t block = block_tables[r * table_width + b];
            if (block < 0 || block >= shape->cache_blocks) return 3;
        }
        max_context = seq_lens[r] > max_context ? seq_lens[r] : max_context;
    }
    /* each row's context slots, from its block table: once a step, read by every layer */
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(m * max_context));
    float *work =
        malloc(sizeof(float) * (size_t)(m * per_row + 2 * hq * max_context + d + 4 * hq + q_size));
    const int64_t widest = inter > h ? (inter > q_size ? inter : q_size) : (h > q_size ? h : q_size);
    void *quantized = malloc(quantized_bytes(m, widest));
    if (work == NULL || slots == NULL || quantized == NULL) {
        free(slots);
        free(work);
        free(quantized);
        return 1;
    }
    /* one input's quantization at a time, each projection's view sized for its K */
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < seq_lens[r]; c++)
            slots[r * max_context + c] =
                (int64_t)block_tables[r * table_width + c / block_size] * block_size + c % block_size;
    float *normed = work, *qkv = normed + m * h, *attn = qkv + m * qkv_size;
    float *gate_up = attn + m * q_size, *act = gate_up + m * 2 * inter, *proj = act + m * inter;
    /* two threads' scores, then one head's rotation */
    float *scores = proj + m * h, *rotated = scores + 2 * hq * max_context;
    /* a lone row's context halves: both threads' peaks and totals, the helper's output */
    float *halves = rotated + d;
    const int split = threads > 1 && helper_take();
    for (int64_t l = 0; l < shape->num_layers; l++) {
        const pagechat_decoder_layer *layer = layers + l;
        pagechat_rms_norm(x, layer->attn_norm, normed, m, h, shape->rms_norm_eps);
        project(normed, m, layer->packed[0], layer->pairs[0], qkv, qkv_size, h, split, quantized, matmul_ns);
        for (int64_t r = 0; r < m; r++) {
            float *row = qkv + r * qkv_size;
            const float *c = cos + r * d, *s = sin + r * d;
            /* Q and K heads rotate together: x cos + roll(x, D/2) sin, as apply_rope. */
            for (int64_t head = 0; head < hq + hkv; head++) {
                float *v = row + head * d;
                for (int64_t i = 0; i < d; i++) rotated[i] = v[i] * c[i] + v[(i + d / 2) % d] * s[i];
                memcpy(v, rotated, sizeof(float) * (size_t)d);
            }
            const int64_t slot = write_slots[r];
            memcpy(layer->k_cache + slot * kv_size, row + q_size, sizeof(float) * (size_t)kv_size);
            memcpy(layer->v_cache + slot * kv_size, row + q_size + kv_size,
                   sizeof(float) * (size_t)kv_size);
        }
        const attention_rows rows = {qkv,  layer->k_cache, layer->v_cache, slots,
                                     seq_lens, attn, scores, qkv_size, max_context, hq,
                                     hkv,  d,    shape->scale, NULL, NULL};
        if (split && m > 1) {
            /* each thread its own rows, and its own scores */
            gemv_part part = {.kind = PART_ATTENTION_ROWS, .m = m, .n = m, .n_end = m, .attention = rows};
            gemv_part theirs = part, mine = part;
            theirs.n_begin = mine.n_end = (m + 1) / 2;
            theirs.attention.scores = scores + hq * max_context;
            run_split(&theirs, &mine);
        } else if (split && seq_lens[0] >= 2 * MIN_CONTEXT_HALF) {
            /* a lone sequence: each thread half its context, merged */
            const int64_t len = seq_lens[0];
            gemv_part mine = {.kind = PART_ATTENTION_CONTEXT, .m = 1, .n = len, .n_end = len / 2, .attention = rows};
            gemv_part theirs = mine;
            theirs.n_begin = len / 2;
            theirs.n_end = len;
            mine.attention.peaks = halves;
            mine.attention.totals = halves + hq;
            theirs.attention.peaks = halves + 2 * hq;
            theirs.attention.totals = halves + 3 * hq;
            theirs.attention.scores = scores + hq * max_context;
            theirs.attention.out = halves + 4 * hq;
            run_split(&theirs, &mine);
            merge_ranges(attn, halves + 4 * hq, halves, halves + hq, halves + 2 * hq,
                         halves + 3 * hq, hq, d);
        } else {
            attend_rows(&rows, 0, m, 0);
        }
        project(attn, m, layer->packed[1], layer->pairs[1], proj, h, q_size, split, quantized, matmul_ns);
        for (int64_t i = 0; i < m * h; i++) x[i] += proj[i];
        pagechat_rms_norm(x, layer->mlp_norm, normed, m, h, shape->rms_norm_eps);
        project(normed, m, layer->packed[2], layer->pairs[2], gate_up, 2 * inter, h, split,
                quantized, matmul_ns);
        const gemv_part gated = {.kind = PART_GATED, .x = gate_up, .m = m, .n = m * inter, .k = inter,
                                 .n_end = m * inter, .y = act};
        if (split)
            run_halves(&gated, m * inter / 2);
        else
            run_part(&gated);
        project(act, m, layer->packed[3], layer->pairs[3], proj, h, inter, split, quantized,
                matmul_ns);
        for (int64_t i = 0; i < m * h; i++) x[i] += proj[i];
    }
    if (split) helper_release();
    free(slots);
    free(work);
    free(quantized);
    return 0;
#endif
}
