/* GGUF weight blocks times int8 inputs: the products of `--matmul-inputs int8`.

   The input rows are quantized once a call, 32 elements at a time as ggml's Q8_0 quantizes
   them (x ~ d q, d = max |x| / 127, q rounded to the nearest integer): a scale per 32 inputs
   kept the bundled model's perplexity within 0.2% of fp32 inputs where one per 64 cost 0.3%
   and one per 256 (ggml's Q8_K) 1.3% (docs/perf.md, "int8 inputs"). Each weight is taken as
   its block stores it, w = a u + b (weights_q8.h), so a product is

       sum over each 32: a d_x sum(u q)  +  sum over each 32 (Q6_K 16): b (d_x sum q)

   with sum(u q) exact in int32 (int8.h) and the rest fp32.

   NOTE: one output's terms are always taken in one order, the canonical order, on every path
   and row count: chunk by chunk of eight sub-blocks, lane l of eight fp32 accumulators takes
   sub-block l's exact integer total times a d_x (one fp32 product), then the chunk's offsets
   (per 32: lane l takes b d_x sum(q) of sub-block l; per 16: groups l, then l + 8); a row's
   last, part chunk adds 0 * 0 in its missing lanes and its offsets one by one into a tail;
   the output is the eight lanes summed pairwise as v8_sum sums them, plus the tail. This
   file takes one to four input rows a row at a time, straight from the blocks; tiles_q8.c
   takes more, the rows side by side in vector lanes. So a row's output is the same bits
   whatever else the call holds (batch-invariant), in every version. */
#include <stdlib.h>

#include "pagechat_cpu.h"
#include "simd.h"

#include "blocks.h"
#include "int8.h"
#include "rows_x8.h"
#include "weights_q8.h"
/* ---- the inputs ------------------------------------------------------------------------ */

/* Rows x [m, k] (k a multiple of 32) as int8 rows (pagechat_cpu.h's q8 layout). Every version
   computes the same values: each step is one IEEE operation on one element. A block of 32
   with an infinite or NaN input gets the scale NaN, so its outputs are NaN, as fp32's are.
   Written for the compiler to vectorize every loop: the largest |x| as the largest of its
   bits (a non-negative float's bits order as its value does), integer reductions only. */
void PC_FN(quantize_q8)(const float *x, int64_t m, int64_t k, uint8_t *out) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        uint8_t *row = out + r * pc_q8_row_bytes(k);
        int8_t *q = (int8_t *)row;
        float *scales = (float *)pc_q8_scales(row, k), *sums32 = (float *)pc_q8_sums32(row, k);
        float *sums16 = (float *)pc_q8_sums16(row, k);
        for (int64_t g = 0; g < k / 32; g++) {
            uint32_t bits[32], peak = 0, special = 0;
            memcpy(bits, xr + 32 * g, sizeof bits);
            for (int i = 0; i < 32; i++) {
                const uint32_t magnitude = bits[i] & 0x7FFFFFFFu;
                peak = magnitude > peak ? magnitude : peak;
                special |= (bits[i] & 0x7F800000u) == 0x7F800000u; /* infinity or NaN */
            }
            int8_t *qg = q + 32 * g;
            if (special) {
                memset(qg, 0, 32);
                scales[g] = sums32[g] = sums16[2 * g] = sums16[2 * g + 1] = __builtin_nanf("");
                continue;
            }
            const float amax = f32_from_bits(peak), d = amax / 127.0f;
            const float inv = amax > 0.0f ? 1.0f / d : 0.0f;
            const float *v = xr + 32 * g;
            int32_t n[32];
            for (int i = 0; i < 32; i++) /* to nearest, ties to even: add, take away 1.5 * 2^23 */
                n[i] = (int32_t)((v[i] * inv + 0x1.8p23f) - 0x1.8p23f); /* |v inv| <= 127.01 */
            int32_t low = 0, high = 0;
            for (int i = 0; i < 16; i++)
                low += n[i], high += n[16 + i];
            for (int i = 0; i < 32; i++)
                qg[i] = (int8_t)n[i];
            scales[g] = d;
            sums32[g] = d * (float)(low + high);
            sums16[2 * g] = d * (float)low;
            sums16[2 * g + 1] = d * (float)high;
        }
    }
}

/* ---- one to four input rows, read from the blocks as stored ------------------------------ */
/* How many weight rows ahead the products prefetch (quants.c says why), every cache line of
   the part of the row a chunk reads (a chunk of Q8_0 spans five lines, of Q6_K four). */
#define PREFETCH_ROWS 16

static inline void prefetch_span(const uint8_t *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64)
        __builtin_prefetch(p + at);
    __builtin_prefetch(p + bytes - 1);
}

/* a chunk's a d_x for one input row (`dx` its scales from the chunk's first sub-block);
   lanes past n zero */
static inline __attribute__((always_inline)) v8 chunk_products(v8 a, const float *dx, int64_t n) {
    if (n == CHUNK)
        return v8_mul(a, v8_load(dx));
    float lanes[CHUNK], s[CHUNK];
    v8_store(lanes, a);
    for (int64_t i = 0; i < CHUNK; i++)
        s[i] = i < n ? lanes[i] * dx[i] : 0.0f;
    return v8_load(s);
}

/* the offsets of a chunk of n sub-blocks against one input row (`row`, from sub-block
   `first`), in the canonical order */
static inline __attribute__((always_inline)) void chunk_offsets(const v8 b[2], const uint8_t *row,
                                                                int64_t k, int64_t first, int64_t n,
                                                                v8 *acc, float *tail,
                                                                const int offsets) {
    if (offsets == OFFSETS_16) { /* Q6_K: always whole chunks */
        const float *sums = pc_q8_sums16(row, k) + 2 * first;
        *acc = v8_fma(b[0], v8_load(sums), *acc);
        *acc = v8_fma(b[1], v8_load(sums + 8), *acc);
    } else if (offsets == OFFSETS_32) {
        const float *sums = pc_q8_sums32(row, k) + first;
        if (n == CHUNK) {
            *acc = v8_fma(b[0], v8_load(sums), *acc);
        } else {
            float lanes[CHUNK];
            v8_store(lanes, b[0]);
            for (int64_t i = 0; i < n; i++)
                *tail += lanes[i] * sums[i];
        }
    }
}

/* the exact integer total of each of a chunk's sub-blocks (none past n) against one input
   row's chunk (`x`, its first sub-block's int8 values), from their integers `u` */
static inline __attribute__((always_inline)) v8i chunk_totals(const q32 u[CHUNK],
                                                              const int16_t sc[2 * CHUNK],
                                                              const uint8_t *x, int64_t n,
                                                              const int kind) {
    v8i p[CHUNK];
    for (int i = 0; i < CHUNK; i++) {
        const q32 xq = q_load(x + 32 * (i < n ? i : 0));
        const v8i dot = kind == DOT_S        ? dot_s(u[i], xq)
                        : kind == DOT_SCALED ? dot_u_scaled(u[i], xq, sc[2 * i], sc[2 * i + 1])
                                             : dot_u(u[i], xq);
        p[i] = i < n ? dot : v8i_zero();
    }
    return v8i_totals(p);
}

/* For each type T (SUBS sub-blocks of 32 in a block of BYTES, its integer product KIND and
   its OFFSETS): one weight row from `row` against R <= 4 input rows, in the canonical order:
   each chunk's integers unpacked once, then taken against every input row. */
#define DEFINE_ROW(T, SUBS, BYTES, KIND, OFFSETS)                                                  \
    static void row_##T(const uint8_t *row, int64_t row_bytes, const uint8_t *x, int64_t k,        \
                        float *y, int64_t ldy, int64_t R) {                                        \
        const int64_t subs = k / 32, ldx = pc_q8_row_bytes(k);                                     \
        v8 acc[4];                                                                                 \
        float tail[4];                                                                             \
        for (int64_t r = 0; r < R; r++)                                                            \
            acc[r] = v8_zero(), tail[r] = 0.0f;                                                    \
        for (int64_t first = 0; first < subs; first += CHUNK) {                                    \
            const int64_t n = subs - first < CHUNK ? subs - first : CHUNK;                         \
            prefetch_span(row + PREFETCH_ROWS * row_bytes + first / SUBS * BYTES,                  \
                          (n + SUBS - 1) / SUBS * BYTES);                                          \
            const chunk_scales c = chunk_##T(row, first, n);                                       \
            /* a K type's chunk is one block; the others' eight blocks of one sub-block */         \
            const uint8_t *base = row + first / SUBS * BYTES;                                      \
            q32 u[CHUNK];                                                                          \
            int16_t sc[2 * CHUNK];                                                                 \
            for (int i = 0; i < CHUNK; i++) {                                                      \
                const int at = i < n ? i : 0;                                                      \
                const uint8_t *block = base + (SUBS == 1 ? at * BYTES : 0);                        \
                u[i] = ints_##T(block, SUBS == 1 ? 0 : at);                                        \
                for (int h = 0; KIND == DOT_SCALED && h < 2; h++)                                  \
                    sc[2 * i + h] = q6_scale(block, 2 * at + h);                                   \
            }                                                                                      \
            for (int64_t r = 0; r < R; r++) {                                                      \
                const uint8_t *xr = x + r * ldx;                                                   \
                const v8i totals = n == CHUNK ? chunk_totals(u, sc, xr + 32 * first, CHUNK, KIND)  \
                                              : chunk_totals(u, sc, xr + 32 * first, n, KIND);     \
                const v8 s = chunk_products(c.a, pc_q8_scales(xr, k) + first, n);                  \
                acc[r] = v8_fma_ints(totals, s, acc[r]);                                           \
                chunk_offsets(c.b, xr, k, first, n, &acc[r], &tail[r], OFFSETS);                   \
            }                                                                                      \
        }                                                                                          \
        for (int64_t r = 0; r < R; r++)                                                            \
            y[r * ldy] = v8_sum(acc[r]) + tail[r];                                                 \
    }                                                                                              \
    static void few_##T(const uint8_t *w, int64_t row_bytes, const uint8_t *x, int64_t m,          \
                        int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end) {        \
        for (int64_t j = n_begin; j < n_end; j++)                                                  \
            row_##T(w + j * row_bytes, row_bytes, x, k, y + j, ldy, m);                            \
    }

DEFINE_ROW(q4_0, 1, 18, DOT_U, OFFSETS_32)
DEFINE_ROW(q4_1, 1, 20, DOT_U, OFFSETS_32)
DEFINE_ROW(q5_0, 1, 22, DOT_U, OFFSETS_32)
DEFINE_ROW(q8_0, 1, 34, DOT_S, OFFSETS_NONE)
DEFINE_ROW(q4_k, 8, 144, DOT_U, OFFSETS_32)
DEFINE_ROW(q5_k, 8, 176, DOT_U, OFFSETS_32)
DEFINE_ROW(q6_k, 8, 210, DOT_SCALED, OFFSETS_16)

/* ---- weights with eight rows in the lanes (rows_x8.h) ------------------------------------- */
#define FEW_ROWS 4 /* up to this many input rows a row at a time; more, side by side */
/* Up to this many input rows, a regrouped weight's groups take them four at a time; more,
   side by side (each weight row read back as stored) */
#define X8_FEW_ROWS 16
/* How many blocks of a group ahead Q6_K's products prefetch: its sub-blocks read their
   block's integers out of order (one run of high bits serves four of them), which the
   hardware's stream prefetch follows less well (18.0 against 12.6 GB/s from memory, one
   thread on Zen 4; 2 and 8 blocks: 17.3); Q4_K reads its blocks in order, and prefetching
   them slowed it (19 against 22 GB/s) */
#define X8_PREFETCH_BLOCKS 4
/* byte `at` of each lane, as floats */
static inline v8 lane_bytes(v8i packed, int at) {
    return v8_from_ints(v8i_and(v8i_shr(packed, 8 * at), 0xFF));
}

/* Each input row's eight accumulators (lane l of the row path's) and its tail (the row path's
   part chunk's offsets), zero */
static inline __attribute__((always_inline)) void x8_start(v8 acc[4][CHUNK], v8 tail[4],
                                                           const int R) {
    for (int r = 0; r < R; r++) {
        for (int l = 0; l < CHUNK; l++)
            acc[r][l] = v8_zero();
        tail[r] = v8_zero();
    }
}

/* Each input row's outputs, its eight rows', to y + r ldy: the accumulators summed in v8_sum's
   tree, lane by lane, plus the tail, as the row path ends */
static inline __attribute__((always_inline)) void x8_finish(v8 acc[4][CHUNK], const v8 tail[4],
                                                            const int R, float *y, int64_t ldy) {
    for (int r = 0; r < R; r++) {
        const v8 even = v8_add(v8_add(acc[r][0], acc[r][4]), v8_add(acc[r][2], acc[r][6]));
        const v8 odd = v8_add(v8_add(acc[r][1], acc[r][5]), v8_add(acc[r][3], acc[r][7]));
        v8_store(y + r * ldy, v8_add(v8_add(even, odd), tail[r]));
    }
}

/* The eight rows of a PC_Q4_K_X8 `group` (`fifth`: PC_Q5_K_X8, a fifth bit a weight) against
   R <= 4 input rows (x, rows ldx apart), to y + r ldy [0..8). Lane j is weight row j's, and its
   terms are taken in the canonical order: acc[r][l] here is lane l of the row path's accumulators
   (row_q4_k), each sub-block's exact total times a d_x, then its offset, and the end is v8_sum's
   tree. So each output is the row path's bits, read without a sum across lanes: the integers of a
   sub-block build up in their row's lane. A sub-block's weights are unpacked once for the R input
   rows. */
static inline __attribute__((always_inline)) void group_k_x8(const uint8_t *group, int64_t k,
                                                             const uint8_t *x, int64_t ldx,
                                                             float *y, int64_t ldy, const int R,
                                                             const int fifth) {
    const int64_t block_bytes = fifth ? X8_Q5_K_BLOCK : X8_Q4_K_BLOCK;
    const int64_t qs_at = fifth ? X8_Q5_K_QS : X8_Q4_K_QS;
    v8 acc[4][CHUNK], tail[4];
    x8_start(acc, tail, R);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *g = group + b * block_bytes;
        const v8 d = v8_from_fp16x8(g + X8_Q4_K_D);
        const v8 neg_dmin = v8_mul(v8_from_fp16x8(g + X8_Q4_K_DMIN), v8_set1(-1.0f));
        /* k_scales (weights_q8.h), eight rows at once */
        const v8i w0 = v8i_load(g + X8_Q4_K_SCALES), w1 = v8i_load(g + X8_Q4_K_SCALES + 32);
        const v8i w2 = v8i_load(g + X8_Q4_K_SCALES + 64);
        const v8i scales[2] = {
            v8i_and(w0, 0x3F3F3F3Fu),
            v8i_or(v8i_and(w2, 0x0F0F0F0Fu), v8i_shl(v8i_and(v8i_shr(w0, 6), 0x03030303u), 4))};
        const v8i mins[2] = {v8i_and(w1, 0x3F3F3F3Fu),
                             v8i_or(v8i_and(v8i_shr(w2, 4), 0x0F0F0F0Fu),
                                    v8i_shl(v8i_and(v8i_shr(w1, 6), 0x03030303u), 4))};
        for (int l = 0; l < CHUNK; l++) {
            const uint8_t *qs = g + qs_at + 256 * (l / 2);
            q32 u[8];
            for (int t = 0; t < 8; t++) {
                u[t] = nibbles_32(qs + 32 * t, l & 1);
                if (fifth) /* Q5_K: bit l of each qh byte, the weight's 16 */
                    u[t] = q_or(u[t], q_shl4(shifted_bits(g + X8_Q5_K_QH + 32 * t, l, 1)));
            }
            const v8 a = v8_mul(d, lane_bytes(scales[l / 4], l % 4));
            const v8 offset = v8_mul(neg_dmin, lane_bytes(mins[l / 4], l % 4));
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = x + r * ldx, *xs = xr + 256 * b + 32 * l;
                v8i total = v8i_zero();
                for (int t = 0; t < 8; t++)
                    total = dot_u_add(total, u[t], q_set1_32(xs + 4 * t));
                const float dx = pc_q8_scales(xr, k)[8 * b + l];
                acc[r][l] = v8_fma_ints(total, v8_mul(a, v8_set1(dx)), acc[r][l]);
                acc[r][l] = v8_fma(offset, v8_set1(pc_q8_sums32(xr, k)[8 * b + l]), acc[r][l]);
            }
        }
    }
    x8_finish(acc, tail, R, y, ldy);
}

/* The eight rows of a PC_Q6_K_X8 `group` against R <= 4 input rows, as group_k_x8: lane l
   of the row path's accumulators (row_q6_k) is acc[r][l], each sub-block's exact total (its
   two 16s' int8 scales inside the integers) times d d_x, then lane l's offsets, of the 16s l
   and 8 + l. */
static inline __attribute__((always_inline)) void group_q6_k_x8(const uint8_t *group, int64_t k,
                                                                const uint8_t *x, int64_t ldx,
                                                                float *y, int64_t ldy,
                                                                const int R) {
    v8 acc[4][CHUNK], tail[4];
    x8_start(acc, tail, R);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *g = group + b * X8_Q6_K_BLOCK, *scales = g + X8_Q6_K_SCALES;
        prefetch_span(g + X8_PREFETCH_BLOCKS * X8_Q6_K_BLOCK, X8_Q6_K_BLOCK);
        const v8 d = v8_from_fp16x8(g + X8_Q6_K_D), neg32d = v8_mul(d, v8_set1(-32.0f));
        for (int l = 0; l < CHUNK; l++) {
            const int half = l / 4, run = l % 4;
            const uint8_t *ql = g + X8_Q6_K_QL + 256 * (2 * half + (run & 1));
            const uint8_t *qh = g + X8_Q6_K_QH + 256 * half;
            q32 u[8];
            for (int t = 0; t < 8; t++)
                u[t] = q_or(nibbles_32(ql + 32 * t, run >= 2), q6_high_bits(qh + 32 * t, run));
            const v8i scale_lo = v8i_from_s8x8(scales + 8 * (2 * l));
            const v8i scale_hi = v8i_from_s8x8(scales + 8 * (2 * l + 1));
            const v8 offset_lo = v8_mul(neg32d, v8_from_s8x8((const int8_t *)scales + 8 * l));
            const v8 offset_hi = v8_mul(neg32d, v8_from_s8x8((const int8_t *)scales + 8 * (8 + l)));
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = x + r * ldx, *xs = xr + 256 * b + 32 * l;
                v8i lo = v8i_zero(), hi = v8i_zero();
                for (int t = 0; t < 4; t++) {
                    lo = dot_u_add(lo, u[t], q_set1_32(xs + 4 * t));
                    hi = dot_u_add(hi, u[4 + t], q_set1_32(xs + 16 + 4 * t));
                }
                const v8i total = v8i_add(v8i_mul(lo, scale_lo), v8i_mul(hi, scale_hi));
                const float dx = pc_q8_scales(xr, k)[8 * b + l];
                const float *sums = pc_q8_sums16(xr, k) + 16 * b;
                acc[r][l] = v8_fma_ints(total, v8_mul(d, v8_set1(dx)), acc[r][l]);
                acc[r][l] = v8_fma(offset_lo, v8_set1(sums[l]), acc[r][l]);
                acc[r][l] = v8_fma(offset_hi, v8_set1(sums[8 + l]), acc[r][l]);
            }
        }
    }
    x8_finish(acc, tail, R, y, ldy);
}

/* The eight rows of a PC_Q4_0_X8 `group` (`with_m`: PC_Q4_1_X8) against R <= 4 input rows, as
   group_k_x8: lane l of the row path's accumulators (row_q4_0, row_q4_1) is acc[r][l],
   block 8 c + l's exact total times d d_x, then its offset (-8 d, or m) times d_x sum(q); a
   row's last, part chunk adds 0 * 0 in its missing lanes and its offsets one by one into
   the tail, as the row path does. */
static inline __attribute__((always_inline)) void group_legacy_x8(const uint8_t *group, int64_t k,
                                                                  const uint8_t *x, int64_t ldx,
                                                                  float *y, int64_t ldy,
                                                                  const int R, const int with_m) {
    const int64_t block_bytes = with_m ? X8_Q4_1_BLOCK : X8_Q4_0_BLOCK, qs_at = with_m ? 32 : 16;
    v8 acc[4][CHUNK], tail[4];
    x8_start(acc, tail, R);
    const int64_t blocks = k / 32;
    for (int64_t first = 0; first < blocks; first += CHUNK) {
        const int whole = blocks - first >= CHUNK;
        for (int l = 0; l < CHUNK; l++) {
            const int64_t b = first + l;
            if (b >= blocks) {
                for (int r = 0; r < R; r++)
                    acc[r][l] = v8_fma_ints(v8i_zero(), v8_zero(), acc[r][l]);
                continue;
            }
            const uint8_t *g = group + b * block_bytes;
            const v8 d = v8_from_fp16x8(g);
            const v8 offset = with_m ? v8_from_fp16x8(g + 16) : v8_mul(d, v8_set1(-8.0f));
            q32 u[8];
            for (int t = 0; t < 4; t++) {
                u[t] = nibbles_32(g + qs_at + 32 * t, 0);     /* weights 4 t .. */
                u[4 + t] = nibbles_32(g + qs_at + 32 * t, 1); /* and 16 + 4 t .. */
            }
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = x + r * ldx, *xs = xr + 32 * b;
                v8i total = v8i_zero();
                for (int t = 0; t < 4; t++) {
                    total = dot_u_add(total, u[t], q_set1_32(xs + 4 * t));
                    total = dot_u_add(total, u[4 + t], q_set1_32(xs + 16 + 4 * t));
                }
                const float dx = pc_q8_scales(xr, k)[b], sum = pc_q8_sums32(xr, k)[b];
                acc[r][l] = v8_fma_ints(total, v8_mul(d, v8_set1(dx)), acc[r][l]);
                if (whole)
                    acc[r][l] = v8_fma(offset, v8_set1(sum), acc[r][l]);
                else
                    tail[r] = v8_add(tail[r], v8_mul(offset, v8_set1(sum)));
            }
        }
    }
    x8_finish(acc, tail, R, y, ldy);
}

/* The eight rows of a PC_Q8_0_X8 `group` against R <= 4 input rows, as group_k_x8: lane l
   of the row path's accumulators (row_q8_0) is acc[r][l], block 8 c + l's exact total times
   d d_x; a row's last, part chunk adds 0 * 0 in its missing lanes, as the row path does. */
static inline __attribute__((always_inline)) void group_q8_0_x8(const uint8_t *group, int64_t k,
                                                                const uint8_t *x, int64_t ldx,
                                                                float *y, int64_t ldy,
                                                                const int R) {
    v8 acc[4][CHUNK], tail[4];
    x8_start(acc, tail, R);
    const int64_t blocks = k / 32;
    for (int64_t first = 0; first < blocks; first += CHUNK) {
        for (int l = 0; l < CHUNK; l++) {
            const int64_t b = first + l;
            if (b >= blocks) {
                for (int r = 0; r < R; r++)
                    acc[r][l] = v8_fma_ints(v8i_zero(), v8_zero(), acc[r][l]);
                continue;
            }
            const uint8_t *g = group + b * X8_Q8_0_BLOCK;
            const v8 d = v8_from_fp16x8(g);
            q32 w[8];
            for (int t = 0; t < 8; t++)
                w[t] = q_load(g + X8_Q8_0_QS + 32 * t);
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = x + r * ldx, *xs = xr + 32 * b;
                v8i total = v8i_zero();
                for (int t = 0; t < 8; t++)
                    total = dot_s_add(total, w[t], q_set1_32(xs + 4 * t));
                const float dx = pc_q8_scales(xr, k)[b];
                acc[r][l] = v8_fma_ints(total, v8_mul(d, v8_set1(dx)), acc[r][l]);
            }
        }
    }
    x8_finish(acc, tail, R, y, ldy);
}

/* a regrouped group against m input rows, four at a time */
#define GROUP_ROWS(T, KERNEL, ...)                                                                 \
    static void group_rows_##T(const uint8_t *group, int64_t k, const uint8_t *x, int64_t m,       \
                               float *y, int64_t ldy) {                                            \
        const int64_t ldx = pc_q8_row_bytes(k);                                                    \
        for (int64_t r = 0; r < m; r += 4) {                                                       \
            const uint8_t *xr = x + r * ldx;                                                       \
            float *yr = y + r * ldy;                                                               \
            switch (m - r < 4 ? m - r : 4) {                                                       \
            case 1: KERNEL(group, k, xr, ldx, yr, ldy, 1, ##__VA_ARGS__); break;                   \
            case 2: KERNEL(group, k, xr, ldx, yr, ldy, 2, ##__VA_ARGS__); break;                   \
            case 3: KERNEL(group, k, xr, ldx, yr, ldy, 3, ##__VA_ARGS__); break;                   \
            default: KERNEL(group, k, xr, ldx, yr, ldy, 4, ##__VA_ARGS__); break;                  \
            }                                                                                      \
        }                                                                                          \
    }
GROUP_ROWS(q4_0_x8, group_legacy_x8, 0)
GROUP_ROWS(q4_1_x8, group_legacy_x8, 1)
GROUP_ROWS(q8_0_x8, group_q8_0_x8)
GROUP_ROWS(q4_k_x8, group_k_x8, 0)
GROUP_ROWS(q5_k_x8, group_k_x8, 1)
GROUP_ROWS(q6_k_x8, group_q6_k_x8)

/* Rows [n_begin, n_end) of a regrouped weight (`type`) against m input rows: whole groups
   eight lanes at a time, a row of a group the range cuts through as stored (`row`: row_bytes
   of scratch) by the row path, four input rows at a time. */
static void few_x8(int64_t type, const uint8_t *w, int64_t row_bytes, const uint8_t *x, int64_t m,
                   int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end, uint8_t *row) {
    for (int64_t j = n_begin; j < n_end;) {
        if (j % X8_ROWS == 0 && n_end - j >= X8_ROWS) {
            const uint8_t *group = w + j * row_bytes;
            if (type == PC_Q4_0_X8)
                group_rows_q4_0_x8(group, k, x, m, y + j, ldy);
            else if (type == PC_Q4_1_X8)
                group_rows_q4_1_x8(group, k, x, m, y + j, ldy);
            else if (type == PC_Q8_0_X8)
                group_rows_q8_0_x8(group, k, x, m, y + j, ldy);
            else if (type == PC_Q4_K_X8)
                group_rows_q4_k_x8(group, k, x, m, y + j, ldy);
            else if (type == PC_Q5_K_X8)
                group_rows_q5_k_x8(group, k, x, m, y + j, ldy);
            else
                group_rows_q6_k_x8(group, k, x, m, y + j, ldy);
            j += X8_ROWS;
            continue;
        }
        x8_row(type, w, row_bytes, j, row);
        for (int64_t r = 0; r < m; r += FEW_ROWS) {
            const int64_t R = m - r < FEW_ROWS ? m - r : FEW_ROWS;
            const uint8_t *xr = x + r * pc_q8_row_bytes(k);
            if (type == PC_Q4_0_X8)
                row_q4_0(row, row_bytes, xr, k, y + r * ldy + j, ldy, R);
            else if (type == PC_Q4_1_X8)
                row_q4_1(row, row_bytes, xr, k, y + r * ldy + j, ldy, R);
            else if (type == PC_Q8_0_X8)
                row_q8_0(row, row_bytes, xr, k, y + r * ldy + j, ldy, R);
            else if (type == PC_Q4_K_X8)
                row_q4_k(row, row_bytes, xr, k, y + r * ldy + j, ldy, R);
            else if (type == PC_Q5_K_X8)
                row_q5_k(row, row_bytes, xr, k, y + r * ldy + j, ldy, R);
            else
                row_q6_k(row, row_bytes, xr, k, y + r * ldy + j, ldy, R);
        }
        j++;
    }
}

/* Input rows a product of many takes in one pass over the weights: as many as keep their
   side-by-side layout under INPUT_BYTES, a whole number of vectors of them, so that those
   rows stay in L2 while each weight row streams past them (as quants.c's). */
#define INPUT_BYTES (1 << 20)

/* ---- entry points ---------------------------------------------------------------------- */

/* The bytes pc_q8_prepare writes for m rows of k inputs. */
int64_t PC_FN(q8_prepared_bytes)(int64_t m, int64_t k) {
    const int64_t rows = m * pc_q8_row_bytes(k);
    return m > FEW_ROWS ? rows + PC_FN(q8_side_by_side_bytes)(m, k) : rows;
}

/* Rows x [m, k] as the int8 products take them, into `out` (pc_q8_prepared_bytes): the int8
   rows, and for more than FEW_ROWS rows their side-by-side layout after them. Done once per
   input, however many threads then share its products. */
void PC_FN(q8_prepare)(const float *x, int64_t m, int64_t k, uint8_t *out) {
    PC_FN(quantize_q8)(x, m, k, out);
    if (m > FEW_ROWS)
        PC_FN(q8_side_by_side)(out, m, k, out + m * pc_q8_row_bytes(k));
}

/* y[r * ldy + j] = sum_c x[r * k + c] w[j, c] for weight rows [n_begin, n_end), from the
   inputs as pc_q8_prepare laid them out. Returns PC_OK, PC_NO_MEMORY (nothing written) or
   PC_BAD_SHAPE (a type it does not serve). */
int64_t PC_FN(gemv_q8_prepared)(int64_t type, const uint8_t *w, int64_t row_bytes,
                                const uint8_t *prepared, int64_t m, int64_t k, float *y,
                                int64_t ldy, int64_t n_begin, int64_t n_end) {
    if (m < 1 || n_begin >= n_end)
        return PC_OK;
    if (x8_regrouped(type) && m <= X8_FEW_ROWS) {
        const int cut = n_begin % X8_ROWS != 0 || n_end % X8_ROWS != 0;
        uint8_t *row = cut ? malloc((size_t)row_bytes) : NULL;
        if (cut && row == NULL)
            return PC_NO_MEMORY;
        few_x8(type, w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end, row);
        free(row);
        return PC_OK;
    }
    if (m > FEW_ROWS) {
        const uint8_t *inputs = prepared + m * pc_q8_row_bytes(k);
        const int64_t width = PC_FN(q8_vector_rows)();
        const int64_t vector_bytes = PC_FN(q8_side_by_side_bytes)(width, k);
        const int64_t vectors = INPUT_BYTES / vector_bytes > 1 ? INPUT_BYTES / vector_bytes : 1;
        for (int64_t r = 0; r < m; r += vectors * width) {
            const int64_t rows = m - r < vectors * width ? m - r : vectors * width;
            const int64_t status =
                PC_FN(q8_tiles)(type, w, row_bytes, inputs + r / width * vector_bytes, rows, k,
                                y + r * ldy, ldy, n_begin, n_end);
            if (status != PC_OK)
                return status;
        }
        return PC_OK;
    }
    switch (type) {
    case PC_Q4_0: few_q4_0(w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end); break;
    case PC_Q4_1: few_q4_1(w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end); break;
    case PC_Q5_0: few_q5_0(w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end); break;
    case PC_Q8_0: few_q8_0(w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end); break;
    case PC_Q4_K: few_q4_k(w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end); break;
    case PC_Q5_K: few_q5_k(w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end); break;
    case PC_Q6_K: few_q6_k(w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end); break;
    default: return PC_BAD_SHAPE;
    }
    return PC_OK;
}

/* pc_gemv's interface and shapes with int8 inputs: the inputs prepared here, into a buffer
   of the call's own. Returns PC_OK, or PC_NO_MEMORY with nothing written. */
int64_t PC_FN(gemv_q8)(int64_t type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t m,
                       int64_t k, float *y, int64_t ldy, int64_t n_begin, int64_t n_end) {
    if (m < 1 || n_begin >= n_end)
        return PC_OK;
    uint8_t *prepared = malloc((size_t)PC_FN(q8_prepared_bytes)(m, k));
    if (prepared == NULL)
        return PC_NO_MEMORY;
    PC_FN(q8_prepare)(x, m, k, prepared);
    const int64_t status =
        PC_FN(gemv_q8_prepared)(type, w, row_bytes, prepared, m, k, y, ldy, n_begin, n_end);
    free(prepared);
    return status;
}
