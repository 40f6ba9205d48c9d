/* Weights regrouped eight rows at a time (PC_ROWS_X8 | Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K):
   the int8 products' layout.

   A weight's rows in groups of eight (n a multiple of 8), each group the eight rows' bytes
   (8 row_bytes) in the same place the stored rows would take, so a row's group is at
   w + (j / 8) * 8 * row_bytes. In a group, block b of every row (256 weights each; 32 for
   Q4_0, Q4_1 and Q8_0) takes eight blocks' bytes at b * 8 * block_bytes. Q8_0's
   (X8_Q8_0_BLOCK): d of rows 0-7 (fp16) at [0, 16), then the int8 weights as Q4_K's nibbles
   below, one run at [16, 272). Q4_0's and Q4_1's: d of rows 0-7 at [0, 16) (Q4_1: their m at
   [16, 32)), then the 16 bytes of nibbles of each row as half a run (t < 4), at 16 (Q4_1: 32).
   Q4_K's (X8_Q4_K_BLOCK):

       [0, 16)      d of rows 0-7 (fp16)            [16, 32)   dmin of rows 0-7
       [32, 128)    the 12 bytes of six-bit scales and mins as three words, word w of row r
                    at 32 + 4 (8 w + r)
       [128, 1152)  the nibbles: for each run of 32 stored bytes p < 4 and each t < 8, four
                    bytes of each row r at 128 + 256 p + 32 t + 4 r, its bytes 32 p + 4 t ..

   Q5_K's (X8_Q5_K_BLOCK): Q4_K's first 128 bytes, then the fifth bits (qh) as its nibbles,
   one run at [128, 384), then the nibbles at [384, 1408).

   Q6_K's (X8_Q6_K_BLOCK):

       [0, 16)      d of rows 0-7 (fp16)
       [16, 144)    the int8 scale of each 16 weights g < 16 of each row r at 16 + 8 g + r
       [144, 1168)  the low four bits (ql), as Q4_K's nibbles: runs p < 4 at 144 + 256 p + ...
       [1168, 1680) the high two bits (qh), the same way: runs p < 2 at 1168 + 256 p + ...

   so that one 32-byte load holds four weights of each of the eight rows, one row a 32-bit
   lane, and a product accumulates each row's total in its own lane (dot_u_add, int8.h) with
   no sum across lanes. The same bytes as stored, moved: the file's values exactly. */
#ifndef PAGECHAT_ROWS_X8_H
#define PAGECHAT_ROWS_X8_H

#include <string.h>

#include "pagechat_cpu.h"

#define X8_ROWS 8
#define X8_Q4_0_BLOCK (X8_ROWS * 18)
#define X8_Q4_1_BLOCK (X8_ROWS * 20)
#define X8_Q8_0_BLOCK (X8_ROWS * 34)
#define X8_Q8_0_QS 16
#define X8_Q4_K_BLOCK (X8_ROWS * 144)
#define X8_Q4_K_D 0
#define X8_Q4_K_DMIN 16
#define X8_Q4_K_SCALES 32
#define X8_Q4_K_QS 128
#define X8_Q5_K_BLOCK (X8_ROWS * 176)
#define X8_Q5_K_QH 128
#define X8_Q5_K_QS 384
#define X8_Q6_K_BLOCK (X8_ROWS * 210)
#define X8_Q6_K_D 0
#define X8_Q6_K_SCALES 16
#define X8_Q6_K_QL 144
#define X8_Q6_K_QH 1168

/* `bytes` of stored row `s` at at_row and of its group `g` at at_group, moved one way */
static inline void x8_move(uint8_t *g, int64_t at_group, uint8_t *s, int64_t at_row, size_t bytes,
                           int to_group) {
    if (to_group)
        memcpy(g + at_group, s + at_row, bytes);
    else
        memcpy(s + at_row, g + at_group, bytes);
}

/* runs of 32 stored bytes at `row_at` (`runs` of them) in the four-bytes-a-row layout at
   `group_at`, for row r (`quads` four-byte pieces a run: 8, or 4 for a run of 16) */
static inline void x8_move_quads(uint8_t *g, int64_t group_at, uint8_t *s, int64_t row_at, int runs,
                                 int quads, int r, int to_group) {
    for (int p = 0; p < runs; p++)
        for (int t = 0; t < quads; t++)
            x8_move(g, group_at + 256 * p + 32 * t + 4 * r, s, row_at + 32 * p + 4 * t, 4,
                    to_group);
}
static inline void x8_move_runs(uint8_t *g, int64_t group_at, uint8_t *s, int64_t row_at, int runs,
                                int r, int to_group) {
    x8_move_quads(g, group_at, s, row_at, runs, 8, r, to_group);
}

/* Row r (< 8) of the group at `group` (blocks of its type's weights), as stored, to `row`;
   with `to_group` the other way, from `row` into the group. `type`: PC_Q4_0, PC_Q4_1,
   PC_Q8_0, PC_Q4_K, PC_Q5_K or PC_Q6_K. */
static inline void x8_move_row(int64_t type, uint8_t *group, int64_t blocks, int r, uint8_t *row,
                               int to_group) {
    for (int64_t b = 0; b < blocks; b++) {
        if (type == PC_Q4_0 || type == PC_Q4_1) { /* d (and m), then 16 bytes of nibbles */
            const int64_t bytes = pc_block_bytes(type), scales = type == PC_Q4_0 ? 1 : 2;
            uint8_t *g = group + b * X8_ROWS * bytes, *s = row + b * bytes;
            for (int64_t i = 0; i < scales; i++)
                x8_move(g, 16 * i + 2 * r, s, 2 * i, 2, to_group);
            x8_move_quads(g, 16 * scales, s, 2 * scales, 1, 4, r, to_group);
        } else if (type == PC_Q8_0) {
            uint8_t *g = group + b * X8_Q8_0_BLOCK, *s = row + b * 34;
            x8_move(g, 2 * r, s, 0, 2, to_group);
            x8_move_runs(g, X8_Q8_0_QS, s, 2, 1, r, to_group);
        } else if (type == PC_Q4_K || type == PC_Q5_K) { /* Q5_K: Q4_K's scales, then qh and qs */
            const int64_t bytes = pc_block_bytes(type);
            uint8_t *g = group + b * X8_ROWS * bytes, *s = row + b * bytes;
            x8_move(g, X8_Q4_K_D + 2 * r, s, 0, 2, to_group);
            x8_move(g, X8_Q4_K_DMIN + 2 * r, s, 2, 2, to_group);
            for (int w = 0; w < 3; w++)
                x8_move(g, X8_Q4_K_SCALES + 4 * (8 * w + r), s, 4 + 4 * w, 4, to_group);
            if (type == PC_Q4_K) {
                x8_move_runs(g, X8_Q4_K_QS, s, 16, 4, r, to_group);
            } else {
                x8_move_runs(g, X8_Q5_K_QH, s, 16, 1, r, to_group);
                x8_move_runs(g, X8_Q5_K_QS, s, 48, 4, r, to_group);
            }
        } else {
            uint8_t *g = group + b * X8_Q6_K_BLOCK, *s = row + b * 210;
            x8_move(g, X8_Q6_K_D + 2 * r, s, 208, 2, to_group);
            for (int h = 0; h < 16; h++)
                x8_move(g, X8_Q6_K_SCALES + 8 * h + r, s, 192 + h, 1, to_group);
            x8_move_runs(g, X8_Q6_K_QL, s, 0, 4, r, to_group);
            x8_move_runs(g, X8_Q6_K_QH, s, 128, 2, r, to_group);
        }
    }
}

/* Whether `type` is a regrouped one the kernels read (PC_ROWS_X8 on a type it serves) */
static inline int x8_regrouped(int64_t type) {
    return (type & PC_ROWS_X8) != 0 && pc_block_bytes(type) != 0;
}

/* The stored type of a regrouped one (PC_Q4_K_X8 -> PC_Q4_K), any other type as it is */
static inline int64_t x8_stored_type(int64_t type) {
    return type & ~(int64_t)PC_ROWS_X8;
}

/* Row j of a regrouped weight `w` of `type` (rows of row_bytes) as stored, to `row` */
static inline void x8_row(int64_t type, const uint8_t *w, int64_t row_bytes, int64_t j,
                          uint8_t *row) {
    const int64_t stored = x8_stored_type(type);
    uint8_t *group = (uint8_t *)w + j / X8_ROWS * X8_ROWS * row_bytes;
    x8_move_row(stored, group, row_bytes / pc_block_bytes(stored), (int)(j % X8_ROWS), row, 0);
}

/* The eight rows of a regrouped weight's group at `group` (of `type`), as stored, to out
   (8 rows of row_bytes): x8_move_row's bytes, each run's 8 x 8 four-byte pieces transposed in
   vectors (GCC's vector extension: shuffles on every target), not moved four bytes at a time
   (a third of the time a row read back on its own takes). */
typedef uint32_t x8_quads __attribute__((vector_size(32)));

static inline void x8_transpose_run(const uint8_t *from, uint8_t *to, int64_t row_bytes) {
    x8_quads q[8], t[8];
    for (int i = 0; i < 8; i++)
        memcpy(&q[i], from + 32 * i, 32); /* piece i of each row */
    const x8_quads lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    for (int i = 0; i < 8; i += 2) { /* pairs of rows */
        t[i] = __builtin_shuffle(q[i], q[i + 1], lo);
        t[i + 1] = __builtin_shuffle(q[i], q[i + 1], hi);
    }
    const x8_quads lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            q[i + h] = __builtin_shuffle(t[i + h], t[i + h + 2], lo2);
            q[i + h + 2] = __builtin_shuffle(t[i + h], t[i + h + 2], hi2);
        }
    const x8_quads lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    for (int h = 0; h < 4; h++) {
        t[h] = __builtin_shuffle(q[h], q[h + 4], lo4);
        t[h + 4] = __builtin_shuffle(q[h], q[h + 4], hi4);
    }
    /* t[h] holds rows {0, 4} x {0, 2, 1, 3}[h]'s order: row r is t[index of r] */
    static const int row_of[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int h = 0; h < 8; h++)
        memcpy(to + row_of[h] * row_bytes, &t[h], 32);
}

static inline void x8_group_rows(int64_t type, const uint8_t *group, int64_t row_bytes,
                                 uint8_t *out) {
    const int64_t stored = x8_stored_type(type), bytes = pc_block_bytes(stored);
    const int64_t blocks = row_bytes / bytes;
    int64_t runs_at = 0, runs = 0, row_at = 0; /* the block's whole runs of 32 */
    if (stored == PC_Q8_0)
        runs_at = X8_Q8_0_QS, runs = 1, row_at = 2;
    else if (stored == PC_Q4_K)
        runs_at = X8_Q4_K_QS, runs = 4, row_at = 16;
    else if (stored == PC_Q5_K)
        runs_at = X8_Q5_K_QH, runs = 5, row_at = 16; /* qh then qs, in order both ways */
    else if (stored == PC_Q6_K)
        runs_at = X8_Q6_K_QL, runs = 6, row_at = 0; /* ql then qh, likewise */
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *g = (uint8_t *)group + b * X8_ROWS * bytes;
        for (int p = 0; p < runs; p++)
            x8_transpose_run(g + runs_at + 256 * p, out + b * bytes + row_at + 32 * p, row_bytes);
        for (int r = 0; r < X8_ROWS; r++) { /* the rest, four bytes at a time */
            uint8_t *s = out + r * row_bytes + b * bytes;
            if (runs == 0) { /* Q4_0, Q4_1: half runs */
                x8_move_row(stored, g, 1, r, s, 0);
                continue;
            }
            if (stored == PC_Q8_0) {
                x8_move(g, 2 * r, s, 0, 2, 0);
            } else if (stored == PC_Q6_K) {
                x8_move(g, X8_Q6_K_D + 2 * r, s, 208, 2, 0);
                for (int h = 0; h < 16; h++)
                    x8_move(g, X8_Q6_K_SCALES + 8 * h + r, s, 192 + h, 1, 0);
            } else {
                x8_move(g, X8_Q4_K_D + 2 * r, s, 0, 2, 0);
                x8_move(g, X8_Q4_K_DMIN + 2 * r, s, 2, 2, 0);
                for (int w = 0; w < 3; w++)
                    x8_move(g, X8_Q4_K_SCALES + 4 * (8 * w + r), s, 4 + 4 * w, 4, 0);
            }
        }
    }
}

#endif
