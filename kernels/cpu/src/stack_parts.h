/* The decode stack's parts (stack.c, the one call; helper.c, its helper thread;
   context_views.c, each layer's view of a step's contexts): what they share, hidden inside the
   library. */
#ifndef PAGECHAT_STACK_PARTS_H
#define PAGECHAT_STACK_PARTS_H

#include "pagechat_cpu.h"

#define PC_HIDDEN __attribute__((visibility("hidden")))

/* ---- the helper thread (helper.c) ------------------------------------------------------ */
/* A second thread for a call's work: each GEMV's weight rows, the attention's rows (or a lone
   row's context) and the activation's elements are split between the calling thread and this
   helper. While a call runs the helper spins between parts (a futex wake-up per part, ~120 a
   step, would cost more than the split saves); between calls it sleeps on a condition
   variable, so an idle engine leaves the core to the event loop. One call at a time uses it
   (a second engine in the process runs its call on one thread). */

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

/* Takes the helper for one call: 1 if it is ours (started and spinning), 0 where it could
   not start or another call holds it (then the call runs on one thread). */
PC_HIDDEN int pc_helper_take(void);
PC_HIDDEN void pc_helper_release(void);
/* `part` on the calling thread. */
PC_HIDDEN void pc_run_part(work_part *part);
/* Runs `theirs` on the helper and `mine` on the calling thread, waits for both, and
   returns the first status that is not PC_OK (or PC_OK). */
PC_HIDDEN int64_t pc_run_split(const work_part *theirs, work_part *mine);
/* `part` whole, or split at `middle` with the helper taking [middle, end); its status. */
PC_HIDDEN int64_t pc_run_shared(const work_part *part, int split, int64_t middle);

/* ---- each layer's view of the rows' contexts (context_views.c) ------------------------- */
/* The slots a layer reads for each row: its group's pages, from the first position its window
   sees to the row's own. The layers of one group and window read one view, built once a
   step. A model has at most one window (ModelArgs.sliding_window): two views a group. */
#define MAX_VIEWS (2 * PC_MAX_GROUPS)

typedef struct {
    int64_t group, window;
    int64_t *slots;         /* [m, stride]: row r's at slots + r * stride */
    int64_t *lens;          /* [m]: how many slots each row reads */
    int64_t stride;         /* the most any row reads */
    int64_t balanced_split; /* the row where the attention's split gives each thread half */
} context_view;

/* The views the layers read (their group and window) into `views`, each with its stride;
   checks the step's rows against every pool one of them reads: each row's write slot, its
   length and every block its view reads. Returns the count of views, or -PC_BAD_SHAPE (more
   views than MAX_VIEWS, a RoPE table or group's rows the step lacks) or -PC_OUT_OF_POOL. */
PC_HIDDEN int64_t pc_plan_views(const pc_decoder_layer *layers, const pc_decoder_shape *s,
                                const pc_step_rows *rows, context_view *views);
/* Each row's slots from its group's block table into the view's (`slots`, `lens`: the view's
   memory), and the row that splits its reading in halves. */
PC_HIDDEN void pc_fill_view(context_view *view, const pc_step_rows *rows, int64_t bs,
                            int64_t *slots, int64_t *lens);
/* The view of `group` and `window` among `count`, or -1. */
PC_HIDDEN int64_t pc_find_view(const context_view *views, int64_t count, int64_t group,
                               int64_t window);

#endif
