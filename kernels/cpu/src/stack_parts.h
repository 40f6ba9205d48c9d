/* The decode stack's parts (stack.c, the one call; helper.c, its helper thread;
   context_views.c, each layer's view of a step's contexts): what they share, hidden inside the
   library. */
#ifndef PAGECHAT_STACK_PARTS_H
#define PAGECHAT_STACK_PARTS_H

#include "pagechat_cpu.h"

#define PC_HIDDEN __attribute__((visibility("hidden")))

/* ---- the helper threads (helper.c) ----------------------------------------------------- */
/* Helpers for a call's work: each GEMV's weight rows, the attention's rows (or a lone row's
   context) and the activation's elements are split between the calling thread and up to
   PC_MAX_THREADS - 1 helpers. While a call runs the helpers spin between parts (a futex
   wake-up per part, ~120 a step, would cost more than the split saves); between calls they
   sleep on a condition variable, so an idle engine leaves the cores to the event loop. One
   call at a time uses them (a second engine in the process runs its call on one thread). */

typedef enum {
    PART_GEMV,              /* weight rows of one projection */
    PART_ATTENTION_ROWS,    /* rows of the batch */
    PART_ATTENTION_CONTEXT, /* context positions of row 0 */
    PART_GATED,             /* elements of act(gate) * up, [m, intermediate] */
} part_kind;

typedef struct {
    part_kind kind;
    const pc_kernels *kernels;
    int64_t begin, end;
    int64_t status;              /* PC_OK, or what went wrong while it ran */
    const pc_projection *weight; /* PART_GEMV: y [m, n] = x [m, k] w^T */
    const float *x;
    const uint8_t *prepared; /* PART_GEMV with int8 inputs: x as kernels->prepare left it */
    int64_t m;
    float *y;
    pc_attention attention;
    int64_t inter, activation; /* PART_GATED: x is gate_up, y the output */
} work_part;

/* Takes the helpers for one call: the threads it may run on, the calling one included (1 to
   `threads`): 1 where none could start or another call holds them. */
PC_HIDDEN int64_t pc_helpers_take(int64_t threads);
/* Gives back what pc_helpers_take(...) returned `threads` for. */
PC_HIDDEN void pc_helpers_release(int64_t threads);
/* `part` on the calling thread. */
PC_HIDDEN void pc_run_part(work_part *part);
/* parts[0] on the calling thread, parts[i] on helper i (count at most what
   pc_helpers_take returned); waits for all, sets each one's status and returns the first
   that is not PC_OK (or PC_OK). */
PC_HIDDEN int64_t pc_run_parts(work_part *parts, int64_t count);
/* `part` cut into at most `threads` even shares, each a multiple of `grain` (the last one
   the rest), run as pc_run_parts does. */
PC_HIDDEN int64_t pc_run_even(const work_part *part, int64_t threads, int64_t grain);

/* ---- each layer's view of the rows' contexts (context_views.c) ------------------------- */
/* The slots a layer reads for each row: its group's pages, from the first position its window
   sees to the row's own. The layers of one group and window read one view, built once a
   step. A model has at most one window (ModelArgs.sliding_window): two views a group. */
#define MAX_VIEWS (2 * PC_MAX_GROUPS)

typedef struct {
    int64_t group, window;
    int64_t *slots; /* [m, stride]: row r's at slots + r * stride */
    int64_t *lens;  /* [m]: how many slots each row reads */
    int64_t stride; /* the most any row reads */
    int64_t shares; /* the attention's parts: rows split so that each reads as much */
    int64_t share_rows[PC_MAX_THREADS + 1]; /* part i takes rows [share_rows[i], [i + 1]) */
} context_view;

/* The views the layers read (their group and window) into `views`, each with its stride;
   checks the step's rows against every pool one of them reads: each row's write slot, its
   length and every block its view reads. Returns the count of views, or -PC_BAD_SHAPE (more
   views than MAX_VIEWS, a RoPE table or group's rows the step lacks) or -PC_OUT_OF_POOL. */
PC_HIDDEN int64_t pc_plan_views(const pc_decoder_layer *layers, const pc_decoder_shape *s,
                                const pc_step_rows *rows, context_view *views);
/* Each row's slots from its group's block table into the view's (`slots`, `lens`: the view's
   memory), and the rows that split its reading into `threads` parts of as much context. */
PC_HIDDEN void pc_fill_view(context_view *view, const pc_step_rows *rows, int64_t bs,
                            int64_t threads, int64_t *slots, int64_t *lens);
/* The view of `group` and `window` among `count`, or -1. */
PC_HIDDEN int64_t pc_find_view(const context_view *views, int64_t count, int64_t group,
                               int64_t window);

#endif
