/* Q4_K weights regrouped eight rows at a time (PC_Q4_K_X8): the int8 products' layout.

   A weight's rows in groups of eight (n a multiple of 8), each group the eight rows' bytes
   (8 row_bytes) in the same place the stored rows would take, so a row's group is at
   w + (j / 8) * 8 * row_bytes. In a group, block b of every row (256 weights each) takes
   X8_Q4_K_BLOCK = 8 * 144 bytes at b * X8_Q4_K_BLOCK:

       [0, 16)      d of rows 0-7 (fp16)            [16, 32)   dmin of rows 0-7
       [32, 128)    the 12 bytes of six-bit scales and mins as three words, word w of row r
                    at 32 + 4 (8 w + r)
       [128, 1152)  the nibbles: for each pair of sub-blocks p and each t < 8, four bytes of
                    each row r at 128 + 256 p + 32 t + 4 r, its stored bytes 32 p + 4 t ..

   so that one 32-byte load holds four weights of each of the eight rows, one row a 32-bit
   lane, and a product accumulates each row's total in its own lane (dot_u, int8.h) with
   no sum across lanes. The same bytes as stored, moved: the file's values exactly. */
#ifndef PAGECHAT_ROWS_X8_H
#define PAGECHAT_ROWS_X8_H

#include <string.h>

#include "pagechat_cpu.h"

#define X8_ROWS 8
#define X8_Q4_K_BLOCK (X8_ROWS * 144)
#define X8_Q4_K_D 0
#define X8_Q4_K_DMIN 16
#define X8_Q4_K_SCALES 32
#define X8_Q4_K_QS 128

/* Row r (< 8) of the group at `group` (blocks of 256 weights each), as stored, to `row`;
   with `to_group` the other way, from `row` into the group. */
static inline void x8_q4_k_move_row(uint8_t *group, int64_t blocks, int r, uint8_t *row,
                                    int to_group) {
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *g = group + b * X8_Q4_K_BLOCK, *s = row + b * 144;
#define PC_MOVE(at_group, at_row, bytes)                                                           \
    (to_group ? memcpy(g + (at_group), s + (at_row), bytes)                                        \
              : memcpy(s + (at_row), g + (at_group), bytes))
        PC_MOVE(X8_Q4_K_D + 2 * r, 0, 2);
        PC_MOVE(X8_Q4_K_DMIN + 2 * r, 2, 2);
        for (int w = 0; w < 3; w++)
            PC_MOVE(X8_Q4_K_SCALES + 4 * (8 * w + r), 4 + 4 * w, 4);
        for (int p = 0; p < 4; p++)
            for (int t = 0; t < 8; t++)
                PC_MOVE(X8_Q4_K_QS + 256 * p + 32 * t + 4 * r, 16 + 32 * p + 4 * t, 4);
#undef PC_MOVE
    }
}

/* Row j of a PC_Q4_K_X8 weight `w` (rows of row_bytes) as stored, to `row` */
static inline void x8_q4_k_row(const uint8_t *w, int64_t row_bytes, int64_t j, uint8_t *row) {
    uint8_t *group = (uint8_t *)w + j / X8_ROWS * X8_ROWS * row_bytes;
    x8_q4_k_move_row(group, row_bytes / 144, (int)(j % X8_ROWS), row, 0);
}

#endif
