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

int pagechat_paged_decode(const float *q, const float *k_cache, const float *v_cache,
                          const int64_t *slots, const int64_t *seq_lens, float *out,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t max_context, float scale, int64_t b_begin, int64_t b_end) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per cache slot */
    /* scores[hq * max_context + c]; a slot's K (and later V) rows for every head are read
       together, front to back: the context streams through once, not once per head. */
    float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * max_context));
    if (scores == NULL) return 1;
    for (int64_t b = b_begin; b < b_end; b++) {
        const int64_t len = seq_lens[b];
        const int64_t *ctx = slots + b * max_context;
        const float *qb = q + b * num_q_heads * head_dim;
        for (int64_t c = 0; c < len; c++) {
            const float *k = k_cache + ctx[c] * row;
            for (int64_t hq = 0; hq < num_q_heads; hq++)
                scores[hq * max_context + c] =
                    scale * dot_f32(qb + hq * head_dim, k + (hq / group) * head_dim, head_dim);
        }
        for (int64_t hq = 0; hq < num_q_heads; hq++) {
            float *s = scores + hq * max_context;
            float peak = -INFINITY, total = 0.0f;
            for (int64_t c = 0; c < len; c++) peak = s[c] > peak ? s[c] : peak;
            for (int64_t c = 0; c < len; c++) s[c] = exp_nonpositive(s[c] - peak);
            for (int64_t c = 0; c < len; c++) total += s[c];
            const float inv = 1.0f / total;
            for (int64_t c = 0; c < len; c++) s[c] *= inv;
        }
        float *o = out + b * num_q_heads * head_dim;
        for (int64_t i = 0; i < num_q_heads * head_dim; i++) o[i] = 0.0f;
        for (int64_t c = 0; c < len; c++) {
            const float *v = v_cache + ctx[c] * row;
            for (int64_t hq = 0; hq < num_q_heads; hq++) {
                const float p = scores[hq * max_context + c];
                const float *vh = v + (hq / group) * head_dim;
                float *oh = o + hq * head_dim;
                for (int64_t i = 0; i < head_dim; i++) oh[i] += p * vh[i];
            }
        }
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
