/* Each layer's view of a step's contexts for the decode stack (stack_parts.h): the slots its
   group's block tables give for the positions its window sees, built once a step, and the
   step's rows checked against each group's pool before anything is written. Compiled once,
   beside stack.c. */
#include <stddef.h>

#include "stack_parts.h"

/* The first position a row of context length `len` sees through `window` (0: all). */
static inline int64_t first_seen(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

int64_t pc_find_view(const context_view *views, int64_t count, int64_t group, int64_t window) {
    for (int64_t v = 0; v < count; v++)
        if (views[v].group == group && views[v].window == window)
            return v;
    return -1;
}

int64_t pc_plan_views(const pc_decoder_layer *layers, const pc_decoder_shape *s,
                      const pc_step_rows *rows, context_view *views) {
    const int64_t m = rows->m, bs = s->block_size;
    int64_t count = 0;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const pc_decoder_layer *layer = &layers[l];
        if (rows->cos[layer->rope] == NULL || rows->sin[layer->rope] == NULL)
            return -PC_BAD_SHAPE;
        if (pc_find_view(views, count, layer->group, layer->window) >= 0)
            continue;
        if (count == MAX_VIEWS)
            return -PC_BAD_SHAPE;
        views[count++] = (context_view){.group = layer->group, .window = layer->window};
    }
    for (int64_t v = 0; v < count; v++) {
        const int64_t g = views[v].group, blocks = s->cache_blocks[g];
        const int64_t *write_slots = rows->write_slots[g];
        const int32_t *tables = rows->block_tables[g];
        if (write_slots == NULL || tables == NULL)
            return -PC_BAD_SHAPE;
        for (int64_t r = 0; r < m; r++) {
            const int64_t len = rows->seq_lens[r], first = first_seen(len, views[v].window);
            if (write_slots[r] < 0 || write_slots[r] >= blocks * bs)
                return -PC_OUT_OF_POOL;
            if (len < 1 || len > rows->table_width[g] * bs)
                return -PC_OUT_OF_POOL;
            for (int64_t b = first / bs; b < (len + bs - 1) / bs; b++) {
                const int32_t block = tables[r * rows->table_width[g] + b];
                if (block < 0 || block >= blocks)
                    return -PC_OUT_OF_POOL;
            }
            views[v].stride = len - first > views[v].stride ? len - first : views[v].stride;
        }
    }
    return count;
}

void pc_fill_view(context_view *view, const pc_step_rows *rows, int64_t bs, int64_t threads,
                  int64_t *slots, int64_t *lens) {
    const int64_t m = rows->m, width = rows->table_width[view->group];
    const int32_t *tables = rows->block_tables[view->group];
    view->slots = slots;
    view->lens = lens;
    int64_t total = 0;
    for (int64_t r = 0; r < m; r++) {
        const int64_t first = first_seen(rows->seq_lens[r], view->window);
        lens[r] = rows->seq_lens[r] - first;
        total += lens[r];
        for (int64_t c = 0; c < lens[r]; c++) {
            const int64_t position = first + c;
            slots[r * view->stride + c] =
                (int64_t)tables[r * width + position / bs] * bs + position % bs;
        }
    }
    /* part i ends at the first row where the rows so far read i / shares of the context (a
       prefill chunk's later rows read more), each part at least one row */
    const int64_t shares = threads < m ? threads : m > 0 ? m : 1;
    view->shares = shares;
    view->share_rows[0] = 0;
    int64_t r = 0, seen = 0;
    for (int64_t i = 1; i < shares; i++) {
        do
            seen += lens[r++];
        while (r < m - (shares - i) && seen * shares < i * total);
        view->share_rows[i] = r;
    }
    view->share_rows[shares] = m;
}
