/* Each GGUF weight type as the int8 products read it: w = a u + b, with u a small unsigned
   integer (its nibbles, five or six bits; Q8_0's signed bytes), a per 32 weights and b per 32
   (Q6_K: per 16, with an int8 scale per 16 inside the integer product and a per 256). Read
   a chunk at a time: CHUNK sub-blocks of 32, a K type's block or eight blocks of the others.
   Included by products_q8.c and tiles_q8.c, once per instruction set. */
#ifndef PAGECHAT_WEIGHTS_Q8_H
#define PAGECHAT_WEIGHTS_Q8_H

#include "pagechat_cpu.h"
#include "simd.h"

#include "blocks.h"
#include "int8.h"

#define CHUNK 8

/* A chunk's scales as vectors (built in registers from the blocks as stored): a per
   sub-block (lanes past the chunk's sub-blocks zero), b per 32 (b[0]; Q6_K per 16: b[0] the
   first eight, b[1] the rest). */
typedef struct {
    v8 a, b[2];
} chunk_scales;

/* chunk_<type>(row, first, n): the scales of sub-blocks [first, first + n) of a row (first a
   multiple of CHUNK); ints_<type>(block, s): sub-block s's integers u (blocks.h's
   unpack_<type> without the offsets, which are in b). */
static inline chunk_scales chunk_q4_0(const uint8_t *row, int64_t first, int64_t n) {
    const v8 d = v8_from_fp16_strided(row + first * 18, 18, n);
    const chunk_scales c = {d, {v8_mul(d, v8_set1(-8.0f)), v8_zero()}};
    return c;
}
static inline q32 ints_q4_0(const uint8_t *block, int s) {
    (void)s;
    return nibbles_16(block + 2);
}

static inline chunk_scales chunk_q4_1(const uint8_t *row, int64_t first, int64_t n) {
    const chunk_scales c = {v8_from_fp16_strided(row + first * 20, 20, n),
                            {v8_from_fp16_strided(row + first * 20 + 2, 20, n), v8_zero()}};
    return c;
}
static inline q32 ints_q4_1(const uint8_t *block, int s) {
    (void)s;
    return nibbles_16(block + 4);
}

static inline chunk_scales chunk_q5_0(const uint8_t *row, int64_t first, int64_t n) {
    const v8 d = v8_from_fp16_strided(row + first * 22, 22, n);
    const chunk_scales c = {d, {v8_mul(d, v8_set1(-16.0f)), v8_zero()}};
    return c;
}
static inline q32 ints_q5_0(const uint8_t *block, int s) {
    (void)s;
    uint32_t high;
    memcpy(&high, block + 2, sizeof high);
    return q_or(nibbles_16(block + 6), bits_16(high));
}

static inline chunk_scales chunk_q8_0(const uint8_t *row, int64_t first, int64_t n) {
    const chunk_scales c = {v8_from_fp16_strided(row + first * 34, 34, n), {v8_zero(), v8_zero()}};
    return c;
}
static inline q32 ints_q8_0(const uint8_t *block, int s) {
    (void)s;
    return q_load(block + 2);
}

/* Q4_K and Q5_K: a = d scale, b = -dmin min; the eight six-bit scales and mins of the 12
   bytes after d and dmin, unpacked word-wise (scale j < 4: the low six bits of byte j, min j:
   of byte j + 4; j >= 4: four bits of byte j + 4 and the top two of byte j - 4 or j) */
static inline chunk_scales k_scales(const uint8_t *block) {
    uint32_t w[3];
    memcpy(w, block + 4, sizeof w);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
    const uint32_t scales_03 = w[0] & low6, mins_03 = w[1] & low6;
    const uint32_t scales_47 = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);
    const uint32_t mins_47 = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);
    const chunk_scales c = {
        v8_mul(v8_set1(fp16_scale(block)), v8_from_u8x8(scales_03 | (uint64_t)scales_47 << 32)),
        {v8_mul(v8_set1(-fp16_scale(block + 2)), v8_from_u8x8(mins_03 | (uint64_t)mins_47 << 32)),
         v8_zero()}};
    return c;
}

static inline chunk_scales chunk_q4_k(const uint8_t *row, int64_t first, int64_t n) {
    (void)n;
    return k_scales(row + first / 8 * 144);
}
static inline q32 ints_q4_k(const uint8_t *block, int s) {
    return nibbles_32(block + 16 + 32 * (s / 2), s & 1);
}

static inline chunk_scales chunk_q5_k(const uint8_t *row, int64_t first, int64_t n) {
    (void)n;
    return k_scales(row + first / 8 * 176);
}
static inline q32 ints_q5_k(const uint8_t *block, int s) {
    return q_or(nibbles_32(block + 48 + 32 * (s / 2), s & 1),
                q_shl4(shifted_bits(block + 16, s, 1)));
}

/* Q6_K: a = d, the int8 scale per 16 inside the integer product (`q6_scale`), b = -32 d scale */
static inline chunk_scales chunk_q6_k(const uint8_t *row, int64_t first, int64_t n) {
    (void)n;
    const uint8_t *block = row + first / 8 * 210;
    const int8_t *scales = (const int8_t *)(block + 192);
    const float d = fp16_scale(block + 208);
    const chunk_scales c = {v8_set1(d),
                            {v8_mul(v8_set1(-32.0f * d), v8_from_s8x8(scales)),
                             v8_mul(v8_set1(-32.0f * d), v8_from_s8x8(scales + 8))}};
    return c;
}
static inline q32 ints_q6_k(const uint8_t *block, int s) {
    const int half = s / 4, run = s % 4;
    const q32 low = nibbles_32(block + 64 * half + 32 * (run & 1), run >= 2);
    return q_or(low, q_shl4(shifted_bits(block + 128 + 32 * half, 2 * run, 3)));
}
static inline int16_t q6_scale(const uint8_t *block, int64_t g) {
    return ((const int8_t *)(block + 192))[g];
}

/* Which integer product a type's integers take (int8.h), and which offsets it has. */
enum { DOT_U, DOT_S, DOT_SCALED };
enum { OFFSETS_NONE, OFFSETS_32, OFFSETS_16 };

/* The products of many input rows (tiles_q8.c), which products_q8.c's entry points call: how
   many rows a vector holds, the bytes and layout of the rows side by side, their products. */
int64_t PC_FN(q8_vector_rows)(void);
int64_t PC_FN(q8_side_by_side_bytes)(int64_t m, int64_t k);
void PC_FN(q8_side_by_side)(const uint8_t *xq, int64_t m, int64_t k, uint8_t *out);
int64_t PC_FN(q8_tiles)(int64_t type, const uint8_t *w, int64_t row_bytes, const uint8_t *inputs,
                        int64_t m, int64_t k, float *y, int64_t ldy, int64_t n_begin,
                        int64_t n_end);

#endif
