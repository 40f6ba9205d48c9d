/* A weight's rows (any type but Q5_0) regrouped eight at a time (rows_x8.h), in place, and
   back: done once a weight, where it is loaded for the int8 products. Compiled once: it only
   moves bytes. */
#include <stdlib.h>

#include "pagechat_cpu.h"
#include "rows_x8.h"

/* The n rows of row_bytes at w (of any type but Q5_0, as stored; n a multiple of 8) to their
   regrouped layout (`to_x8` 1), or from it back as stored (0). Returns PC_OK, PC_BAD_SHAPE
   (nothing moved) or PC_NO_MEMORY (nothing moved). */
int64_t pc_rows_x8(int64_t type, uint8_t *w, int64_t row_bytes, int64_t n, int64_t to_x8) {
    if (type == PC_Q5_0 || pc_block_bytes(type) == 0 || (type & PC_ROWS_X8) || n % X8_ROWS != 0 ||
        row_bytes <= 0 || row_bytes % pc_block_bytes(type) != 0)
        return PC_BAD_SHAPE;
    const int64_t blocks = row_bytes / pc_block_bytes(type);
    uint8_t *copy = malloc((size_t)(X8_ROWS * row_bytes));
    if (copy == NULL)
        return PC_NO_MEMORY;
    for (int64_t g = 0; g < n; g += X8_ROWS) {
        uint8_t *group = w + g * row_bytes;
        memcpy(copy, group, (size_t)(X8_ROWS * row_bytes));
        for (int r = 0; r < X8_ROWS; r++) {
            if (to_x8)
                x8_move_row(type, group, blocks, r, copy + r * row_bytes, 1);
            else
                x8_move_row(type, copy, blocks, r, group + r * row_bytes, 0);
        }
    }
    free(copy);
    return PC_OK;
}
