/* GGUF weight blocks, read as stored: matrix-vector products with fp32 inputs (decode) and
   dequantization to dense rows (the dense path of large steps, embedding lookups).

   Every type is read 32 weights at a time (a block of Q4_0/Q4_1/Q5_0/Q8_0, a sub-block of
   the K types' super-blocks of 256; blocks.h): its integers as floats and its scales as the
   file stores them, w = d q + m (d per 16 weights for Q6_K, per 32 for the others). Dequantized,
   that is gguf's value for value: d q is exact in fp32 for every type here (at most
   11 + 8 + 6 bits), so d q + m rounds once, fused or not. Products with the input are fp32
   dot products of those values (up to four input rows as d sum q x + m sum x per sub-block,
   more through tiles of dequantized rows): what the dequantized fp32 model computes, in
   another order of additions, never through int8 inputs.

   A row's output is the same bits at one to four rows (GEMV_ROWS), whatever the call's
   split into weight rows; from five rows the tiles of dequantized rows compute it in another
   order, within fp32 rounding of it. The AMX version takes steps of 32 rows and more through
   Intel's tile unit, fp32 as three bf16 products (within ~2^-16 of |x| |w|: see there). */
#include <stdlib.h>

#include "pagechat_cpu.h"
#include "simd.h"

#include "blocks.h"
#include "rows_x8.h"

/* ---- kernels per type ------------------------------------------------------------------ */
#define GEMV_ROWS 4 /* input rows whose dot products share one pass over a block's weights */
#if defined(PC_ISA_GENERIC)
#define DOT_J 1 /* weight rows one input row's products take together (more spill on SSE2) */
#else
#define DOT_J 4
#endif

/* How many weight rows ahead the one-to-four-row products prefetch: the rows they read are
   short runs (a row of k = 640 in Q8_0 is 680 bytes) that the hardware's stream prefetchers do
   not ramp up on, so from memory a large LM head read at a quarter of the machine's bandwidth
   (docs/perf-history.md, "Gemma 3 270M against llama-server"). */
#define PREFETCH_ROWS 16

/* Steps of more rows dequantize TILE_J weight rows into L1, then take TILE_R input rows at a
   time against them: TILE_J x TILE_R accumulators in registers, each weight vector loaded
   once per TILE_R rows and each input vector once per TILE_J weight rows. */
#if defined(PC_ISA_AVX512)
#define TILE_J 6 /* 24 of the 32 zmm registers accumulate (fastest: docs/perf-history.md) */
#define TILE_R 4
#elif defined(PC_ISA_NEON)
#define TILE_J 4 /* 16 of the 32 q registers */
#define TILE_R 4
#elif defined(PC_ISA_AVX2)
#define TILE_J 3 /* 12 of the 16 ymm registers (the fastest shape: docs/perf-history.md) */
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
        for (int r = 0; r < R; r++)
            acc[j][r] = vf_zero();
    for (int64_t c = 0; c < k; c += VF_W) {
        vf wv[TILE_J];
        for (int j = 0; j < J; j++)
            wv[j] = vf_load(w + j * k + c);
        for (int r = 0; r < R; r++) {
            const vf xv = vf_load(x + r * k + c);
            for (int j = 0; j < J; j++)
                acc[j][r] = vf_fma(wv[j], xv, acc[j][r]);
        }
    }
    for (int j = 0; j < J; j++)
        for (int r = 0; r < R; r++)
            y[r * ldy + j] = vf_sum(acc[j][r]);
}

/* Input rows [0, m) against J dequantized weight rows (J constant): TILE_R rows at a time,
   then the rest in one smaller tile. */
static inline __attribute__((always_inline)) void dense_rows(const float *w, const float *x,
                                                             int64_t m, int64_t k, float *y,
                                                             int64_t ldy, const int J) {
    int64_t r = 0;
    for (; r + TILE_R <= m; r += TILE_R)
        dense_tile(w, x + r * k, k, y + r * ldy, ldy, J, TILE_R);
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
    for (int j = 0; j < rows; j++)
        dense_rows(w + j * k, x, m, k, y + j, ldy, 1);
}

/* Input rows a pass of the tiles takes: all of them where they fit INPUT_BYTES (each weight
   row's tile streams them all once), else equal blocks that do, each block passing over the
   weights again (dequantizing them again: ~1% of a block's products). 1 MB: half a 2-MB L2,
   so a prompt chunk's inputs stream from L2, not L3 (why: docs/perf.md, "A prompt chunk's
   products: inputs blocked for L2"). */
#define INPUT_BYTES (1 << 20)

static int64_t input_block(int64_t m, int64_t k) {
    const int64_t bytes = m * k * (int64_t)sizeof(float);
    if (bytes <= INPUT_BYTES)
        return m;
    const int64_t blocks = (bytes + INPUT_BYTES - 1) / INPUT_BYTES;
    return (m + blocks - 1) / blocks;
}

/* For each type (SUBS sub-blocks of 32 in a block of BYTES; MIN: it has mins; TWO: two scales
   a sub-block):
   - weights_<type>: 32 weights as vf, d q + m each (gguf's values: see the top);
   - row_<type>: a row dequantized, for the tiles above GEMV_ROWS input rows;
   - dots_<type>: J weight rows against up to GEMV_ROWS input rows, each sub-block's products
     summed over its integers first, then scaled once (d sum q x), its min added as m times
     the input's sum over the sub-block (`sums`, computed once a call): a third fewer
     floating-point operations than d q + m weight by weight, where a batch-1 step is bound
     by them; the same sums whatever J and the number of rows;
   - gemv_<type>: the product over rows [n_begin, n_end). */
#define DEFINE_TYPE(T, SUBS, BYTES, MIN, TWO)                                                      \
    static inline void weights_##T(const uint8_t *block, int s, vf w[Q32_VECTORS]) {               \
        vf q[Q32_VECTORS];                                                                         \
        float d[2], m;                                                                             \
        integers_##T(block, s, q, d, &m);                                                          \
        for (int v = 0; v < Q32_VECTORS; v++)                                                      \
            w[v] = vf_fma(q[v], vf_set1(d[v * VF_W / 16]), vf_set1(m));                            \
    }                                                                                              \
    static void row_##T(const uint8_t *row, int64_t k, float *out) {                               \
        const int64_t row_bytes = k / (32 * SUBS) * BYTES;                                         \
        for (const uint8_t *block = row; block < row + row_bytes; block += BYTES)                  \
            for (int s = 0; s < SUBS; s++, out += 32) {                                            \
                if (s == 0)                                                                        \
                    __builtin_prefetch(block + PREFETCH_ROWS * row_bytes);                         \
                vf w[Q32_VECTORS];                                                                 \
                weights_##T(block, s, w);                                                          \
                for (int v = 0; v < Q32_VECTORS; v++)                                              \
                    vf_store(out + v * VF_W, w[v]);                                                \
            }                                                                                      \
    }                                                                                              \
    static inline __attribute__((always_inline)) void dots_##T(                                    \
        const uint8_t *row, int64_t row_bytes, const float *x, const float *sums, int64_t k,       \
        float *y, int64_t ldy, const int J, const int rows) {                                      \
        vf acc[DOT_J > 2 ? DOT_J : 2][GEMV_ROWS]; /* two input rows take two weight rows */        \
        float mins[DOT_J > 2 ? DOT_J : 2][GEMV_ROWS];                                              \
        for (int j = 0; j < J; j++)                                                                \
            for (int r = 0; r < rows; r++)                                                         \
                acc[j][r] = vf_zero(), mins[j][r] = 0.0f;                                          \
        const float *xc = x;                                                                       \
        int64_t group = 0;                                                                         \
        for (int64_t at = 0; at < k / (32 * SUBS) * BYTES; at += BYTES)                            \
            for (int s = 0; s < SUBS; s++, xc += 32, group++)                                      \
                for (int j = 0; j < J; j++) {                                                      \
                    vf q[Q32_VECTORS];                                                             \
                    float d[2], m;                                                                 \
                    if (s == 0)                                                                    \
                        __builtin_prefetch(row + (j + PREFETCH_ROWS) * row_bytes + at);            \
                    integers_##T(row + j * row_bytes + at, s, q, d, &m);                           \
                    for (int r = 0; r < rows; r++) {                                               \
                        const float *xr = xc + r * k;                                              \
                        if (TWO) {                                                                 \
                            vf lo = vf_mul(q[0], vf_load(xr));                                     \
                            vf hi = vf_mul(q[Q32_VECTORS / 2], vf_load(xr + 16));                  \
                            for (int v = 1; v < Q32_VECTORS / 2; v++) {                            \
                                lo = vf_fma(q[v], vf_load(xr + v * VF_W), lo);                     \
                                hi = vf_fma(q[Q32_VECTORS / 2 + v], vf_load(xr + 16 + v * VF_W),   \
                                            hi);                                                   \
                            }                                                                      \
                            acc[j][r] = vf_fma(vf_set1(d[0]), lo, acc[j][r]);                      \
                            acc[j][r] = vf_fma(vf_set1(d[1]), hi, acc[j][r]);                      \
                        } else {                                                                   \
                            vf p = vf_mul(q[0], vf_load(xr));                                      \
                            for (int v = 1; v < Q32_VECTORS; v++)                                  \
                                p = vf_fma(q[v], vf_load(xr + v * VF_W), p);                       \
                            acc[j][r] = vf_fma(vf_set1(d[0]), p, acc[j][r]);                       \
                        }                                                                          \
                        if (MIN)                                                                   \
                            mins[j][r] += m * sums[r * (k / 32) + group];                          \
                    }                                                                              \
                }                                                                                  \
        for (int j = 0; j < J; j++)                                                                \
            for (int r = 0; r < rows; r++)                                                         \
                y[r * ldy + j] = vf_sum(acc[j][r]) + mins[j][r];                                   \
    }                                                                                              \
    static void gemv_##T(const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,           \
                         int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end,         \
                         float *buf) {                                                             \
        if (m > GEMV_ROWS) {                                                                       \
            for (int64_t j = n_begin; j < n_end; j += TILE_J) {                                    \
                const int rows = n_end - j < TILE_J ? (int)(n_end - j) : TILE_J;                   \
                for (int i = 0; i < rows; i++)                                                     \
                    row_##T(w + (j + i) * row_bytes, k, buf + i * k);                              \
                dense_block(buf, rows, x, m, k, y + j, ldy);                                       \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        if (MIN)                                                                                   \
            group_sums(x, m, k, buf);                                                              \
        /* one input row: DOT_J weight rows together, so that that many chains of dependent        \
           FMAs run at once (one row's chain alone waited on the FMA latency) */                   \
        int64_t j = n_begin;                                                                       \
        if (m == 1)                                                                                \
            for (; j + DOT_J <= n_end; j += DOT_J)                                                 \
                dots_##T(w + j * row_bytes, row_bytes, x, buf, k, y + j, ldy, DOT_J, 1);           \
        if (m == 2)                                                                                \
            for (; j + 2 <= n_end; j += 2)                                                         \
                dots_##T(w + j * row_bytes, row_bytes, x, buf, k, y + j, ldy, 2, 2);               \
        for (; j < n_end; j++) {                                                                   \
            const uint8_t *row = w + j * row_bytes;                                                \
            switch (m) {                                                                           \
            case 1: dots_##T(row, row_bytes, x, buf, k, y + j, ldy, 1, 1); break;                  \
            case 2: dots_##T(row, row_bytes, x, buf, k, y + j, ldy, 1, 2); break;                  \
            case 3: dots_##T(row, row_bytes, x, buf, k, y + j, ldy, 1, 3); break;                  \
            default: dots_##T(row, row_bytes, x, buf, k, y + j, ldy, 1, 4); break;                 \
            }                                                                                      \
        }                                                                                          \
    }

/* sums[r * (k / 32) + g]: input row r's sum over elements [32 g, 32 g + 32) */
static void group_sums(const float *x, int64_t m, int64_t k, float *sums) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < k / 32; g++) {
            float total = 0.0f;
            for (int i = 0; i < 32; i++)
                total += x[r * k + 32 * g + i];
            sums[r * (k / 32) + g] = total;
        }
}

DEFINE_TYPE(q4_0, 1, 18, 0, 0)
DEFINE_TYPE(q4_1, 1, 20, 1, 0)
DEFINE_TYPE(q5_0, 1, 22, 0, 0)
DEFINE_TYPE(q8_0, 1, 34, 0, 0)
DEFINE_TYPE(q4_k, 8, 144, 1, 0)
DEFINE_TYPE(q5_k, 8, 176, 1, 0)
DEFINE_TYPE(q6_k, 8, 210, 0, 1)

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

#if defined(PC_ISA_AMX)
/* ---- AMX: steps of AMX_ROWS input rows and more ----------------------------------------- */
/* Intel's tile unit multiplies bf16 pairs into fp32 sums, 16 x 16 outputs over 32 products
   in one instruction. Each fp32 value v is taken as two bf16s, hi = bf16(v) and lo = bf16(v -
   hi) (v to 16 of its 24 bits), and w x as wh xh + wh xl + wl xh: three tile products that
   keep the sum within ~2^-16 of |w| |x| (the term dropped, wl xl, is under 2^-16 of it), where
   one bf16 product would be 2^-8 off. The weights are the tiles' A side (16 rows of a weight,
   row-major as dequantized), the inputs their B side (pairs of k interleaved, laid out once a
   call), so a sum tile holds 16 outputs of 16 input rows, transposed on the way out. */
#define AMX_ROWS 32

/* the tile registers' shapes (palette 1): 0-3 sums (2 x 2 blocks of 16 weight rows by 16
   input rows), 4-5 two blocks of weight rows, 6-7 two of input rows; each 16 rows of 64
   bytes. Per 32 of k: 12 products over 10 loads, four sums independent of one another. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} amx_config;

/* v[0..count) as hi[i] + lo[i], each rounded to the nearest bf16: simd.h's f32_to_bf16 without
   its NaN case (the inputs are finite), so that the loop vectorizes */
static inline uint16_t bf16_of_finite(float f) {
    const uint32_t u = bits_from_f32(f);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void split_bf16(const float *v, int64_t count, uint16_t *hi, uint16_t *lo) {
    for (int64_t i = 0; i < count; i++) {
        hi[i] = bf16_of_finite(v[i]);
        lo[i] = bf16_of_finite(v[i] - bf16_to_f32(hi[i]));
    }
}

/* The input rows as B tiles, each tile's 1 KB contiguous: 16 input rows x 32 of k, pairs of k
   interleaved; tile (g, c / 32) of 16-row group g at (g * k / 32 + c / 32) * 512, element (r,
   c) within it at [c % 32 / 2][r % 16][c % 2]: a 16 x 16 transpose of bf16 pairs from the
   rows as split (`rows`, [m, k] hi then lo). Rows past m stay zero. */
static void input_pairs(const uint16_t *rows, int64_t m, int64_t k, uint16_t *hi, uint16_t *lo) {
    for (int half = 0; half < 2; half++) {
        const uint32_t *src = (const uint32_t *)(rows + half * m * k);
        uint32_t *dst = (uint32_t *)(half ? lo : hi);
        for (int64_t r = 0; r < m; r++)
            for (int64_t p = 0; p < k / 2; p++)
                dst[(r / 16 * (k / 32) + p / 16) * 256 + p % 16 * 16 + r % 16] = src[r * k / 2 + p];
    }
}

/* 32 weight rows from j0 (cols of them real, the rest zero) as hi and lo bf16 rows [32, k] */
static void weight_rows(row_fn row, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t j0,
                        int64_t cols, float *w32, uint16_t *hi, uint16_t *lo) {
    for (int64_t j = 0; j < cols; j++)
        row(w + (j0 + j) * row_bytes, k, w32 + j * k);
    memset(w32 + cols * k, 0, sizeof(float) * (size_t)((32 - cols) * k));
    split_bf16(w32, 32 * k, hi, lo);
}

/* a stored sum tile (`sums`: 16 weight rows x 16 input rows) to y, transposed: input rows from
   r0 (those under m), weight rows j0 to j0 + cols */
static inline void store_sums(const float *sums, float *y, int64_t ldy, int64_t m, int64_t r0,
                              int64_t j0, int64_t cols) {
    for (int64_t r = 0; r < 16 && r0 + r < m; r++)
        for (int64_t j = 0; j < cols; j++)
            y[(r0 + r) * ldy + j0 + j] = sums[j * 16 + r];
}

/* the 2 x 2 sums: tile 0 weights 0-15 x inputs 0-15, 1 weights 0-15 x inputs 16-31, 2 weights
   16-31 x inputs 0-15, 3 weights 16-31 x inputs 16-31 (tile numbers are immediates) */
#define AMX_SUMS()                                                                                 \
    do {                                                                                           \
        _tile_dpbf16ps(0, 4, 6);                                                                   \
        _tile_dpbf16ps(1, 4, 7);                                                                   \
        _tile_dpbf16ps(2, 5, 6);                                                                   \
        _tile_dpbf16ps(3, 5, 7);                                                                   \
    } while (0)

static int64_t gemv_amx(row_fn row, const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,
                        int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end) {
    const int64_t padded = (m + 31) / 32 * 32; /* input rows in pairs of 16-row groups */
    uint16_t *xs = calloc((size_t)(2 * padded * k + 2 * 32 * k + 2 * m * k), sizeof(uint16_t));
    float *w32 = malloc(sizeof(float) * (size_t)(32 * k + 16 * 16));
    if (xs == NULL || w32 == NULL) {
        free(xs);
        free(w32);
        return PC_NO_MEMORY;
    }
    uint16_t *x_hi = xs, *x_lo = xs + padded * k;
    uint16_t *w_hi = xs + 2 * padded * k, *w_lo = w_hi + 32 * k;
    float *sums = w32 + 32 * k;
    uint16_t *rows = w_lo + 32 * k; /* x split, row-major: hi [m, k] then lo */
    split_bf16(x, m * k, rows, rows + m * k);
    input_pairs(rows, m, k, x_hi, x_lo);
    amx_config config = {.palette = 1};
    for (int t = 0; t < 8; t++)
        config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    const int64_t ws = k * (int64_t)sizeof(uint16_t);
    for (int64_t j0 = n_begin; j0 < n_end; j0 += 32) {
        const int64_t cols = n_end - j0 < 32 ? n_end - j0 : 32;
        weight_rows(row, w, row_bytes, k, j0, cols, w32, w_hi, w_lo);
        const uint16_t *wh0 = w_hi, *wh1 = w_hi + 16 * k, *wl0 = w_lo, *wl1 = w_lo + 16 * k;
        for (int64_t r0 = 0; r0 < padded; r0 += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < k; c += 32) {
                const int64_t at = (r0 / 16 * (k / 32) + c / 32) * 512; /* group r0 */
                const int64_t next = at + k / 32 * 512;                 /* group r0 + 16 */
                _tile_loadd(4, wh0 + c, ws);
                _tile_loadd(5, wh1 + c, ws);
                _tile_loadd(6, x_hi + at, 64);
                _tile_loadd(7, x_hi + next, 64);
                AMX_SUMS(); /* wh xh */
                _tile_loadd(6, x_lo + at, 64);
                _tile_loadd(7, x_lo + next, 64);
                AMX_SUMS(); /* wh xl */
                _tile_loadd(4, wl0 + c, ws);
                _tile_loadd(5, wl1 + c, ws);
                _tile_loadd(6, x_hi + at, 64);
                _tile_loadd(7, x_hi + next, 64);
                AMX_SUMS(); /* wl xh */
            }
            const int64_t low = cols < 16 ? cols : 16, high = cols - low;
            _tile_stored(0, sums, 64);
            store_sums(sums, y, ldy, m, r0, j0, low);
            _tile_stored(1, sums, 64);
            store_sums(sums, y, ldy, m, r0 + 16, j0, low);
            if (high > 0) {
                _tile_stored(2, sums, 64);
                store_sums(sums, y, ldy, m, r0, j0 + 16, high);
                _tile_stored(3, sums, 64);
                store_sums(sums, y, ldy, m, r0 + 16, j0 + 16, high);
            }
        }
    }
    _tile_release();
    free(xs);
    free(w32);
    return PC_OK;
}
#endif

/* ---- entry points ---------------------------------------------------------------------- */

int64_t PC_FN(gemv)(int64_t type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,
                    int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end);

/* PC_FN(gemv) of a regrouped weight (rows_x8.h): each group's rows in the range taken back
   to their stored bytes, then the stored type's product over them */
static int64_t gemv_x8(int64_t type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,
                       int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end) {
    uint8_t *stored = malloc((size_t)(X8_ROWS * row_bytes));
    if (stored == NULL)
        return PC_NO_MEMORY;
    int64_t status = PC_OK;
    for (int64_t g = n_begin / X8_ROWS * X8_ROWS; g < n_end && status == PC_OK; g += X8_ROWS) {
        const int64_t lo = g > n_begin ? g : n_begin;
        const int64_t hi = g + X8_ROWS < n_end ? g + X8_ROWS : n_end;
        for (int64_t j = lo; j < hi; j++)
            x8_row(type, w, row_bytes, j, stored + (j - g) * row_bytes);
        status = PC_FN(gemv)(x8_stored_type(type), stored, row_bytes, x, m, k, y + g, ldy, lo - g,
                             hi - g);
    }
    free(stored);
    return status;
}

/* y[r * ldy + j] = sum_c x[r * k + c] w[j, c] for input rows r < m and weight rows j in
   [n_begin, n_end): w is n rows of row_bytes (k / block_elements(type) blocks each), x is
   [m, k] fp32 (k a multiple of the type's block), y fp32. The caller checked the shapes.
   Returns PC_OK, or PC_NO_MEMORY (nothing written) where its buffer could not be had. */
int64_t PC_FN(gemv)(int64_t type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,
                    int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end) {
    if (m < 1 || n_begin >= n_end)
        return PC_OK;       /* nothing to compute (a step with no sample) */
    if (x8_regrouped(type)) /* a layout for the int8 products: a group at a time as stored */
        return gemv_x8(type, w, row_bytes, x, m, k, y, ldy, n_begin, n_end);
    const int64_t block = m > GEMV_ROWS ? input_block(m, k) : m;
    if (block < m) { /* each block a product of its own (the amx path's split inputs too) */
        for (int64_t r = 0; r < m; r += block) {
            const int64_t rows = m - r < block ? m - r : block;
            const int64_t status = PC_FN(gemv)(type, w, row_bytes, x + r * k, rows, k, y + r * ldy,
                                               ldy, n_begin, n_end);
            if (status != PC_OK)
                return status;
        }
        return PC_OK;
    }
#if defined(PC_ISA_AMX)
    if (m >= AMX_ROWS && row_kernel(type) != NULL)
        return gemv_amx(row_kernel(type), w, row_bytes, x, m, k, y, ldy, n_begin, n_end);
#endif
    /* tiles above GEMV_ROWS rows take TILE_J dequantized rows, fewer rows their inputs'
       sums over each sub-block */
    const int64_t floats = m > GEMV_ROWS ? TILE_J * k : m * (k / 32);
    float *row_buf = malloc(sizeof(float) * (size_t)(floats ? floats : 1));
    if (row_buf == NULL)
        return PC_NO_MEMORY;
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
    return PC_OK;
}

/* PC_FN(gemv) at most GEMV_ROWS input rows a call: each row's output the same bits whatever
   else the call holds (a row's output is at one to four rows), so a step's rows are each
   computed as if alone (batch-invariant decoding), at the cost of one pass over the weights
   for every four rows where tiles would take many at once. */
int64_t PC_FN(gemv_rowwise)(int64_t type, const uint8_t *w, int64_t row_bytes, const float *x,
                            int64_t m, int64_t k, float *y, int64_t ldy, int64_t n_begin,
                            int64_t n_end) {
    for (int64_t r = 0; r < m; r += GEMV_ROWS) {
        const int64_t rows = m - r < GEMV_ROWS ? m - r : GEMV_ROWS;
        const int64_t status =
            PC_FN(gemv)(type, w, row_bytes, x + r * k, rows, k, y + r * ldy, ldy, n_begin, n_end);
        if (status != PC_OK)
            return status;
    }
    return PC_OK;
}

/* Weight rows [r_begin, r_end) dense: row r to out + (r - r_begin) * ld, as fp32 or bf16
   (out_type PC_F32 / PC_BF16), each weight the value gguf's dequantization gives. */
int64_t PC_FN(dequant)(int64_t type, const uint8_t *w, int64_t row_bytes, int64_t k,
                       int64_t r_begin, int64_t r_end, void *out, int64_t ld, int64_t out_type) {
    const int x8 = x8_regrouped(type);
    const row_fn row = row_kernel(x8 ? x8_stored_type(type) : type);
    if (row == NULL || (out_type != PC_F32 && out_type != PC_BF16))
        return PC_BAD_SHAPE;
    /* a bf16 row's floats first, a regrouped row's stored bytes after them */
    uint8_t *buf = malloc(sizeof(float) * (size_t)k + (x8 ? (size_t)row_bytes : 0));
    if (buf == NULL)
        return PC_NO_MEMORY;
    uint8_t *stored = buf + sizeof(float) * (size_t)k;
    for (int64_t r = r_begin; r < r_end; r++) {
        const uint8_t *source = w + r * row_bytes;
        if (x8) {
            x8_row(type, w, row_bytes, r, stored);
            source = stored;
        }
        if (out_type == PC_F32) {
            row(source, k, (float *)out + (r - r_begin) * ld);
            continue;
        }
        row(source, k, (float *)buf);
        uint16_t *dst = (uint16_t *)out + (r - r_begin) * ld;
        for (int64_t c = 0; c < k; c++)
            dst[c] = f32_to_bf16(((float *)buf)[c]);
    }
    free(buf);
    return PC_OK;
}

/* Rows ids[0..count) of a weight, dense fp32, to out [count, k]: an embedding lookup. */
int64_t PC_FN(dequant_rows)(int64_t type, const uint8_t *w, int64_t row_bytes, int64_t k,
                            const int64_t *ids, int64_t count, float *out) {
    const int x8 = x8_regrouped(type);
    const row_fn row = row_kernel(x8 ? x8_stored_type(type) : type);
    if (row == NULL)
        return PC_BAD_SHAPE;
    uint8_t *stored = x8 ? malloc((size_t)row_bytes) : NULL;
    if (x8 && stored == NULL)
        return PC_NO_MEMORY;
    for (int64_t i = 0; i < count; i++) {
        if (x8)
            x8_row(type, w, row_bytes, ids[i], stored);
        row(x8 ? stored : w + ids[i] * row_bytes, k, out + i * k);
    }
    free(stored);
    return PC_OK;
}
