/* A whole decode step's decoder layers in one call, and the helper thread that takes half of
   its work. Compiled once: every kernel it runs comes through a pc_kernels table of the
   versions dispatch.py chose for this CPU.

   Per layer: RMSNorm, the fused qkv GEMV (and its bias), an RMSNorm over each head of Q and of
   K, RoPE on Q and K by the layer's tables with K/V written to their slots in the layer's
   group's pool, attention over each row's context (or the last `window` positions of it),
   o_proj (and its bias, and a norm of it), the residual, RMSNorm, gate_up, SiLU(gate) * up or
   tanh-GELU(gate) * up, down (and a norm of it), the residual; each feature where the layer
   has it. The same arithmetic as the torch path op for op (model.py), without its ~25 small
   ops a layer: at one row those cost as much as the layer's matmuls. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pagechat_cpu.h"

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* ---- the helper thread ----------------------------------------------------------------- */
/* A second thread for a call's work: each GEMV's weight rows, the attention's rows (or a lone
   row's context) and the activation's elements are split between the calling thread and this
   helper. While a call runs the helper spins between parts (a futex wake-up per part, ~120 a step,
   would cost more than the split saves); between calls it sleeps on a condition variable, so
   an idle engine leaves the core to the event loop. One call at a time uses it (a second
   engine in the process runs its call on one thread). */

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

/* Rows [begin, end) of a projection: each part's share of them, at its place in y, from the
   inputs as they are or as prepared (int8 inputs). */
static int64_t project_rows(const pc_kernels *kernels, const pc_projection *w, const float *x,
                            const uint8_t *prepared, int64_t m, float *y, int64_t begin,
                            int64_t end) {
    int64_t offset = 0, status = PC_OK;
    for (int64_t i = 0; i < w->parts && status == PC_OK; i++) {
        const pc_weight *p = &w->part[i];
        const int64_t first = begin > offset ? begin : offset;
        const int64_t last = end < offset + p->n ? end : offset + p->n;
        if (first < last && prepared)
            status = kernels->gemv_prepared(p->type, p->data, p->row_bytes, prepared, m, p->k,
                                            y + offset, w->n, first - offset, last - offset);
        else if (first < last)
            status = kernels->gemv(p->type, p->data, p->row_bytes, x, m, p->k, y + offset, w->n,
                                   first - offset, last - offset);
        offset += p->n;
    }
    return status;
}

static void run_part(work_part *p) {
    switch (p->kind) {
    case PART_GEMV:
        p->status =
            project_rows(p->kernels, p->weight, p->x, p->prepared, p->m, p->y, p->begin, p->end);
        break;
    case PART_ATTENTION_ROWS:
    case PART_ATTENTION_CONTEXT:
        p->status =
            p->kernels->attend(&p->attention, p->begin, p->end, p->kind == PART_ATTENTION_CONTEXT);
        break;
    case PART_GATED:
        (p->activation == PC_GELU_TANH ? p->kernels->gelu_tanh_mul : p->kernels->silu_mul)(
            p->x, p->y, p->inter, p->begin, p->end);
        break;
    }
}

static struct {
    pthread_mutex_t lock; /* guards `stepping`'s changes and the thread's start */
    pthread_cond_t wake;
    pthread_mutex_t owner; /* held by the call that uses the helper */
    int started;
    atomic_int stepping;          /* 1 while a call may post work: spin, don't sleep */
    atomic_uint posted, finished; /* work counters: the helper's part runs when they differ */
    work_part part;
} helper = {.lock = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER,
            .owner = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A spin-wait's n-th turn: pause, and past ~20 us (a projection's half takes 10-100) yield
   the core, so that a third thread (the server's event loop) waiting for one runs now
   instead of at the end of our time slice, while this one has nothing to do. */
#define SPINS_BEFORE_YIELD 4096
static inline void spin_turn(unsigned *spins) {
    if (++*spins < SPINS_BEFORE_YIELD)
        cpu_relax();
    else
        sched_yield();
}

static void *helper_main(void *unused) {
    (void)unused;
    unsigned seen = 0;
    for (;;) {
        unsigned spins = 0;
        while (atomic_load_explicit(&helper.posted, memory_order_acquire) == seen) {
            if (atomic_load_explicit(&helper.stepping, memory_order_acquire)) {
                spin_turn(&spins);
                continue;
            }
            pthread_mutex_lock(&helper.lock);
            while (!atomic_load(&helper.stepping) && atomic_load(&helper.posted) == seen)
                pthread_cond_wait(&helper.wake, &helper.lock);
            pthread_mutex_unlock(&helper.lock);
        }
        seen = atomic_load_explicit(&helper.posted, memory_order_acquire);
        run_part(&helper.part);
        atomic_store_explicit(&helper.finished, seen, memory_order_release);
    }
    return NULL;
}

/* A forked child has no helper thread (fork copies only the caller): it starts its own on
   its first split call, from a reset state, instead of spinning for one that is not there. */
static void helper_after_fork(void) {
    pthread_mutex_init(&helper.lock, NULL);
    pthread_cond_init(&helper.wake, NULL);
    pthread_mutex_init(&helper.owner, NULL);
    helper.started = 0;
    atomic_store(&helper.stepping, 0);
    atomic_store(&helper.posted, 0);
    atomic_store(&helper.finished, 0);
}

static pthread_once_t helper_fork_hook = PTHREAD_ONCE_INIT;

static void helper_register_fork_hook(void) {
    pthread_atfork(NULL, NULL, helper_after_fork);
}

/* Takes the helper for one call: 1 if it is ours (started and spinning), 0 where it could
   not start or another call holds it (then the call runs on one thread). */
static int helper_take(void) {
    pthread_once(&helper_fork_hook, helper_register_fork_hook);
    if (pthread_mutex_trylock(&helper.owner))
        return 0;
    pthread_mutex_lock(&helper.lock);
    if (!helper.started) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, NULL) == 0) {
            pthread_detach(thread);
            helper.started = 1;
        }
    }
    const int ours = helper.started;
    if (ours) {
        atomic_store(&helper.stepping, 1);
        pthread_cond_signal(&helper.wake);
    }
    pthread_mutex_unlock(&helper.lock);
    if (!ours)
        pthread_mutex_unlock(&helper.owner);
    return ours;
}

static void helper_release(void) {
    pthread_mutex_lock(&helper.lock);
    atomic_store(&helper.stepping, 0);
    pthread_mutex_unlock(&helper.lock);
    pthread_mutex_unlock(&helper.owner);
}

/* Runs `theirs` on the helper and `mine` on the calling thread, waits for both, and
   returns the first status that is not PC_OK (or PC_OK). */
static int64_t run_split(const work_part *theirs, work_part *mine) {
    helper.part = *theirs;
    const unsigned ticket = atomic_fetch_add_explicit(&helper.posted, 1, memory_order_release) + 1;
    run_part(mine);
    unsigned spins = 0;
    while (atomic_load_explicit(&helper.finished, memory_order_acquire) != ticket)
        spin_turn(&spins);
    return mine->status != PC_OK ? mine->status : helper.part.status;
}

/* `part` whole, or split at `middle` with the helper taking [middle, end); its status. */
static int64_t run_shared(const work_part *part, int split, int64_t middle) {
    work_part theirs = *part, mine = *part;
    if (!split || middle <= part->begin || middle >= part->end) {
        run_part(&mine);
        return mine.status;
    }
    theirs.begin = middle;
    mine.end = middle;
    return run_split(&theirs, &mine);
}

/* out = the softmax over both context ranges: each range's output is normalized by its own
   total, so out = (w1 o1 + w2 o2) / (w1 + w2) with w = total * exp(peak - the larger peak). */
static void merge_ranges(float *out, const float *other, const float *peaks, const float *totals,
                         const float *other_peaks, const float *other_totals, int64_t num_heads,
                         int64_t head_dim) {
    for (int64_t h = 0; h < num_heads; h++) {
        const float top = peaks[h] > other_peaks[h] ? peaks[h] : other_peaks[h];
        const float w1 = totals[h] * expf(peaks[h] - top);
        const float w2 = other_totals[h] * expf(other_peaks[h] - top);
        const float inv = 1.0f / (w1 + w2);
        float *o = out + h * head_dim;
        const float *p = other + h * head_dim;
        for (int64_t i = 0; i < head_dim; i++)
            o[i] = (w1 * o[i] + w2 * p[i]) * inv;
    }
}

/* ---- entry points ---------------------------------------------------------------------- */

static int weight_fits(const pc_projection *w, int64_t n, int64_t k) {
    if (w->n != n || w->k != k || w->parts < 1 || w->parts > PC_MAX_PARTS)
        return 0;
    int64_t rows = 0;
    for (int64_t i = 0; i < w->parts; i++) {
        const pc_weight *p = &w->part[i];
        const int64_t elements = pc_block_elements(p->type);
        if (elements == 0 || p->k != k || k % elements || p->n < 1 ||
            p->row_bytes != k / elements * pc_block_bytes(p->type))
            return 0;
        rows += p->n;
    }
    return rows == n;
}

/* Each layer's projections of the shape's sizes and types the GEMV serves, its group, RoPE
   table and window among those there are. */
static int layers_fit(const pc_decoder_layer *layers, const pc_decoder_shape *s) {
    const int64_t q_size = s->num_q_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    if (s->head_dim % 16 || s->head_dim > PC_MAX_HEAD_DIM || s->num_kv_heads < 1 ||
        s->num_q_heads % s->num_kv_heads)
        return 0;
    if (s->cache_type != PC_F32 && s->cache_type != PC_F16 && s->cache_type != PC_BF16)
        return 0;
    if (s->activation != PC_SILU && s->activation != PC_GELU_TANH)
        return 0;
    if (s->groups < 1 || s->groups > PC_MAX_GROUPS || s->block_size < 1)
        return 0;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const pc_decoder_layer *layer = &layers[l];
        const pc_projection *p = layer->proj;
        if (!weight_fits(&p[0], q_size + 2 * kv_size, s->hidden) ||
            !weight_fits(&p[1], s->hidden, q_size) ||
            !weight_fits(&p[2], 2 * s->intermediate, s->hidden) ||
            !weight_fits(&p[3], s->hidden, s->intermediate))
            return 0;
        if (layer->group < 0 || layer->group >= s->groups || layer->rope < 0 ||
            layer->rope >= PC_MAX_ROPES || layer->window < 0)
            return 0;
    }
    return 1;
}

/* ---- each layer's view of the rows' contexts ------------------------------------------- */

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

/* The first position a row of context length `len` sees through `window` (0: all). */
static inline int64_t first_seen(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

static int64_t find_view(const context_view *views, int64_t count, int64_t group, int64_t window) {
    for (int64_t v = 0; v < count; v++)
        if (views[v].group == group && views[v].window == window)
            return v;
    return -1;
}

/* The views the layers read (their group and window) into `views`, each with its stride;
   checks the step's rows against every pool one of them reads: each row's write slot, its
   length and every block its view reads. Returns the count of views, or -PC_BAD_SHAPE (more
   views than MAX_VIEWS, a RoPE table or group's rows the step lacks) or -PC_OUT_OF_POOL. */
static int64_t plan_views(const pc_decoder_layer *layers, const pc_decoder_shape *s,
                          const pc_step_rows *rows, context_view *views) {
    const int64_t m = rows->m, bs = s->block_size;
    int64_t count = 0;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const pc_decoder_layer *layer = &layers[l];
        if (rows->cos[layer->rope] == NULL || rows->sin[layer->rope] == NULL)
            return -PC_BAD_SHAPE;
        if (find_view(views, count, layer->group, layer->window) >= 0)
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

/* Each row's slots from its group's block table into the view's (`slots`, `lens`: the view's
   memory), and the row that splits its reading in halves. */
static void fill_view(context_view *view, const pc_step_rows *rows, int64_t bs, int64_t *slots,
                      int64_t *lens) {
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
    int64_t split = 1, seen = m > 0 ? lens[0] : 0;
    while (split < m - 1 && 2 * seen < total)
        seen += lens[split++];
    view->balanced_split = split;
}

#define MIN_CONTEXT_HALF 32 /* a lone sequence's context splits from 64 positions */

/* The bytes the projections' inputs take prepared for int8 products: the most any of inputs
   of m rows of these sizes takes (0 where the products take fp32 inputs). */
static int64_t most_prepared_bytes(const pc_kernels *kernels, int64_t m, const int64_t *ks,
                                   int count) {
    int64_t most = 0;
    for (int i = 0; kernels->prepare && i < count; i++) {
        const int64_t bytes = kernels->prepared_bytes(m, ks[i]);
        most = bytes > most ? bytes : most;
    }
    return most;
}

/* One projection of a layer: y = x w^T, split with the helper where `split` is set; with
   int8 products its input prepared first, into `prepared`, on this thread. */
static int64_t project(const pc_kernels *kernels, const pc_projection *w, const float *x, int64_t m,
                       float *y, int split, uint8_t *prepared, int64_t *matmul_ns) {
    const int64_t start = matmul_ns ? now_ns() : 0;
    if (kernels->prepare)
        kernels->prepare(x, m, w->k, prepared);
    const work_part part = {.kind = PART_GEMV,
                            .kernels = kernels,
                            .begin = 0,
                            .end = w->n,
                            .weight = w,
                            .x = x,
                            .prepared = kernels->prepare ? prepared : NULL,
                            .m = m,
                            .y = y};
    const int64_t status = run_shared(&part, split, w->n / 2);
    if (matmul_ns)
        *matmul_ns += now_ns() - start;
    return status;
}

/* y [m, n] = x [m, k] w^T through the table's GEMV, its weight rows split with the helper
   thread where `threads` is 2 and the helper is free (the LM head of a step). */
int64_t pc_gemv_threads(const pc_kernels *kernels, const pc_projection *w, const float *x,
                        int64_t m, float *y, int64_t threads) {
    uint8_t *prepared = NULL;
    if (kernels->prepare && m > 0 &&
        (prepared = malloc((size_t)most_prepared_bytes(kernels, m, &w->k, 1))) == NULL)
        return PC_NO_MEMORY;
    const int split = threads > 1 && helper_take();
    const int64_t status = m > 0 ? project(kernels, w, x, m, y, split, prepared, NULL) : PC_OK;
    if (split)
        helper_release();
    free(prepared);
    return status;
}

/* y[r] += b for each of m rows of n floats. */
static void add_bias(float *y, const float *b, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] += b[i];
}

/* The layer's q and k norms, in place: each of a row's query heads, then each of its key
   heads, an RMSNorm of d (a row's heads are consecutive rows of d for the norm). */
static void norm_heads(const pc_kernels *kernels, const pc_decoder_layer *layer,
                       const pc_decoder_shape *s, float *qkv, int64_t m, int64_t qkv_size) {
    const int64_t hq = s->num_q_heads, hkv = s->num_kv_heads, d = s->head_dim;
    for (int64_t r = 0; r < m; r++) {
        float *q = qkv + r * qkv_size, *k = q + hq * d;
        if (layer->q_norm)
            kernels->rms_norm(q, layer->q_norm, q, hq, d, s->rms_norm_eps);
        if (layer->k_norm)
            kernels->rms_norm(k, layer->k_norm, k, hkv, d, s->rms_norm_eps);
    }
}

/* A sublayer's output y [m, hidden] into the residual stream x: normed first where the layer
   norms it (Gemma's norms after each sublayer). */
static void add_residual(const pc_kernels *kernels, const pc_decoder_shape *s, float *x, float *y,
                         const float *norm, int64_t m) {
    if (norm)
        kernels->rms_norm(y, norm, y, m, s->hidden, s->rms_norm_eps);
    for (int64_t i = 0; i < m * s->hidden; i++)
        x[i] += y[i];
}

/* x [m, hidden] is the residual stream, updated in place; `rows` holds each row's context
   length (its new token included), its RoPE rows in each table (the sin tables signed for
   rotate_half, as model.rope_tables builds them), and per layer group its K/V's write slot
   and its sequence's block table (the step's AttentionMetadata of that group as it is).
   Returns PC_OK, PC_NO_MEMORY (the step is then lost: x and the caches hold a part of it),
   PC_BAD_SHAPE (a weight, head size, group or table the kernels or the rows do not have) or
   PC_OUT_OF_POOL (a write slot, block or length outside its group's pool); the last two are
   checked before anything is written. Where matmul_ns is not NULL, the nanoseconds spent in
   the four GEMVs are added to it (benchmarks/engine_step.py's matmul share: no hook sees
   inside this call). */
int64_t pc_decode_layers(const pc_kernels *kernels, const pc_decoder_layer *layers,
                         const pc_decoder_shape *shape, float *x, const pc_step_rows *rows,
                         int64_t threads, int64_t *matmul_ns) {
    const int64_t m = rows->m, h = shape->hidden, inter = shape->intermediate;
    const int64_t d = shape->head_dim, hq = shape->num_q_heads, hkv = shape->num_kv_heads;
    const int64_t q_size = hq * d, kv_size = hkv * d, qkv_size = q_size + 2 * kv_size;
    if (!layers_fit(layers, shape))
        return PC_BAD_SHAPE;
    /* Nothing outside a pool is written or read: every write slot and every block a view
       reads lies in its group's pool (a few rows: cheap next to the step). */
    context_view views[MAX_VIEWS] = {{0}};
    const int64_t num_views = plan_views(layers, shape, rows, views);
    if (num_views < 0)
        return -num_views;
    int64_t max_context = 0, view_slots = 0;
    for (int64_t v = 0; v < num_views; v++) {
        max_context = views[v].stride > max_context ? views[v].stride : max_context;
        view_slots += m * views[v].stride + m;
    }
    /* per row: the normed input, qkv, the attention's output, gate_up, the activation's
       output, one projection's output; then two threads' scores and a lone row's second
       half */
    const int64_t per_row = h + qkv_size + q_size + 2 * inter + inter + h;
    float *work =
        malloc(sizeof(float) * (size_t)(m * per_row + 2 * hq * max_context + 4 * hq + q_size));
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(view_slots + 1));
    /* int8 products: the one buffer each projection's input is prepared into in turn */
    const int64_t input_sizes[3] = {h, q_size, inter};
    const int64_t prepared_size = most_prepared_bytes(kernels, m, input_sizes, 3);
    uint8_t *prepared = prepared_size ? malloc((size_t)prepared_size) : NULL;
    if (work == NULL || slots == NULL || (prepared_size && prepared == NULL)) {
        free(work);
        free(slots);
        free(prepared);
        return PC_NO_MEMORY;
    }
    /* each view's slots from its group's block tables, once a step, read by its layers */
    for (int64_t v = 0, at = 0; v < num_views; v++) {
        fill_view(&views[v], rows, shape->block_size, slots + at, slots + at + m * views[v].stride);
        at += m * views[v].stride + m;
    }
    float *normed = work, *qkv = normed + m * h, *attn = qkv + m * qkv_size;
    float *gate_up = attn + m * q_size, *act = gate_up + m * 2 * inter, *proj = act + m * inter;
    float *scores = proj + m * h;                  /* [2, hq, max_context]: one per thread */
    float *halves = scores + 2 * hq * max_context; /* peaks and totals of two, the helper's out */
    const int split = threads > 1 && helper_take();
    int64_t status = PC_OK; /* a kernel's failure (out of memory) ends the step: see done */
    for (int64_t l = 0; l < shape->num_layers; l++) {
        const pc_decoder_layer *layer = layers + l;
        const context_view *view = &views[find_view(views, num_views, layer->group, layer->window)];
        kernels->rms_norm(x, layer->attn_norm, normed, m, h, shape->rms_norm_eps);
        if ((status =
                 project(kernels, &layer->proj[0], normed, m, qkv, split, prepared, matmul_ns)))
            goto done;
        if (layer->qkv_bias)
            add_bias(qkv, layer->qkv_bias, m, qkv_size);
        if (layer->q_norm || layer->k_norm)
            norm_heads(kernels, layer, shape, qkv, m, qkv_size);
        kernels->rope_write(qkv, m, qkv_size, hq, hkv, d, rows->cos[layer->rope],
                            rows->sin[layer->rope], rows->write_slots[layer->group], layer->k_cache,
                            layer->v_cache, shape->cache_type);
        const pc_attention attention = {.q = qkv,
                                        .q_stride = qkv_size,
                                        .k_cache = layer->k_cache,
                                        .v_cache = layer->v_cache,
                                        .cache_type = shape->cache_type,
                                        .slots = view->slots,
                                        .slot_stride = view->stride,
                                        .seq_lens = view->lens,
                                        .out = attn,
                                        .scores = scores,
                                        .hq = hq,
                                        .hkv = hkv,
                                        .d = d,
                                        .scale = shape->scale};
        const int64_t lone_len = m == 1 ? view->lens[0] : 0;
        if (split && m == 1 && lone_len >= 2 * MIN_CONTEXT_HALF) {
            /* a lone sequence: each thread half its context, merged */
            work_part mine = {.kind = PART_ATTENTION_CONTEXT,
                              .kernels = kernels,
                              .begin = 0,
                              .end = lone_len / 2,
                              .attention = attention};
            work_part theirs = mine;
            theirs.begin = lone_len / 2;
            theirs.end = lone_len;
            mine.attention.peaks = halves;
            mine.attention.totals = halves + hq;
            theirs.attention.peaks = halves + 2 * hq;
            theirs.attention.totals = halves + 3 * hq;
            theirs.attention.scores = scores + hq * max_context;
            theirs.attention.out = halves + 4 * hq;
            if ((status = run_split(&theirs, &mine)))
                goto done;
            merge_ranges(attn, halves + 4 * hq, halves, halves + hq, halves + 2 * hq,
                         halves + 3 * hq, hq, d);
        } else {
            /* each thread its own rows (as much context to read on both sides: a prefill
               chunk's later rows read more), and its own scores */
            work_part part = {.kind = PART_ATTENTION_ROWS,
                              .kernels = kernels,
                              .begin = 0,
                              .end = m,
                              .attention = attention};
            if (split && m > 1) {
                work_part theirs = part;
                theirs.begin = part.end = view->balanced_split;
                theirs.attention.scores = scores + hq * max_context;
                status = run_split(&theirs, &part);
            } else {
                run_part(&part);
                status = part.status;
            }
            if (status)
                goto done;
        }
        if ((status = project(kernels, &layer->proj[1], attn, m, proj, split, prepared, matmul_ns)))
            goto done;
        if (layer->o_bias)
            add_bias(proj, layer->o_bias, m, h);
        add_residual(kernels, shape, x, proj, layer->post_attn_norm, m);
        kernels->rms_norm(x, layer->mlp_norm, normed, m, h, shape->rms_norm_eps);
        if ((status =
                 project(kernels, &layer->proj[2], normed, m, gate_up, split, prepared, matmul_ns)))
            goto done;
        const work_part gated = {.kind = PART_GATED,
                                 .kernels = kernels,
                                 .begin = 0,
                                 .end = m * inter,
                                 .x = gate_up,
                                 .y = act,
                                 .inter = inter,
                                 .activation = shape->activation};
        run_shared(&gated, split, m * inter / 2);
        if ((status = project(kernels, &layer->proj[3], act, m, proj, split, prepared, matmul_ns)))
            goto done;
        add_residual(kernels, shape, x, proj, layer->post_mlp_norm, m);
    }
done:
    if (split)
        helper_release();
    free(prepared);
    free(slots);
    free(work);
    return status;
}
