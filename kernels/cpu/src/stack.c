/* A whole decode step's decoder layers in one call, its work shared with helper threads
   (helper.c). Compiled once: every kernel it runs comes through a pc_kernels table of the
   versions dispatch.py chose for this CPU.

   Per layer: RMSNorm, the fused qkv GEMV (and its bias), an RMSNorm over each head of Q and of
   K, RoPE on Q and K by the layer's tables with K/V written to their slots in the layer's
   group's pool, attention over each row's context (or the last `window` positions of it),
   o_proj (and its bias, and a norm of it), the residual, RMSNorm, gate_up, SiLU(gate) * up or
   tanh-GELU(gate) * up, down (and a norm of it), the residual; each feature where the layer
   has it. The same arithmetic as the torch path op for op (model.py), without its ~25 small
   ops a layer: at one row those cost as much as the layer's matmuls. */
#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "stack_parts.h"

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* out = the softmax over two context ranges: each range's output is normalized by its own
   total, so out = (w1 o1 + w2 o2) / (w1 + w2) with w = total * exp(peak - the larger peak);
   peaks and totals become those of both ranges, so that a third merges the same way. */
static void merge_ranges(float *out, const float *other, float *peaks, float *totals,
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
        peaks[h] = top;
        totals[h] = w1 + w2;
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

/* a lone sequence's context splits in ranges of 32 positions or more; a projection's rows in
   shares of a multiple of 16 (a vector of rows) */
#define MIN_CONTEXT_PART 32
#define GEMV_GRAIN 16

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

/* One projection of a layer: y = x w^T, its rows split between `threads`; with int8 products
   its input prepared first, into `prepared`, on this thread. */
static int64_t project(const pc_kernels *kernels, const pc_projection *w, const float *x, int64_t m,
                       float *y, int64_t threads, uint8_t *prepared, int64_t *matmul_ns) {
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
    const int64_t status = pc_run_even(&part, threads, GEMV_GRAIN);
    if (matmul_ns)
        *matmul_ns += now_ns() - start;
    return status;
}

/* y [m, n] = x [m, k] w^T through the table's GEMV, its weight rows split between up to
   `threads` threads where the helpers are free (the LM head of a step). */
int64_t pc_gemv_threads(const pc_kernels *kernels, const pc_projection *w, const float *x,
                        int64_t m, float *y, int64_t threads) {
    uint8_t *prepared = NULL;
    if (kernels->prepare && m > 0 &&
        (prepared = malloc((size_t)most_prepared_bytes(kernels, m, &w->k, 1))) == NULL)
        return PC_NO_MEMORY;
    const int64_t ours = pc_helpers_take(threads);
    const int64_t status = m > 0 ? project(kernels, w, x, m, y, ours, prepared, NULL) : PC_OK;
    pc_helpers_release(ours);
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
    const int64_t num_views = pc_plan_views(layers, shape, rows, views);
    if (num_views < 0)
        return -num_views;
    int64_t max_context = 0, view_slots = 0;
    for (int64_t v = 0; v < num_views; v++) {
        max_context = views[v].stride > max_context ? views[v].stride : max_context;
        view_slots += m * views[v].stride + m;
    }
    /* the threads this call runs on: the slots' views split the attention's rows for them */
    const int64_t ours = pc_helpers_take(threads);
    /* per row: the normed input, qkv, the attention's output, gate_up, the activation's
       output, one projection's output; then each thread's scores, and each part of a lone
       row's context its peaks, totals and (past the first) output */
    const int64_t per_row = h + qkv_size + q_size + 2 * inter + inter + h;
    float *work = malloc(
        sizeof(float) * (size_t)(m * per_row + ours * hq * max_context + ours * (2 * hq + q_size)));
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(view_slots + 1));
    /* int8 products: the one buffer each projection's input is prepared into in turn */
    const int64_t input_sizes[3] = {h, q_size, inter};
    const int64_t prepared_size = most_prepared_bytes(kernels, m, input_sizes, 3);
    uint8_t *prepared = prepared_size ? malloc((size_t)prepared_size) : NULL;
    if (work == NULL || slots == NULL || (prepared_size && prepared == NULL)) {
        pc_helpers_release(ours);
        free(work);
        free(slots);
        free(prepared);
        return PC_NO_MEMORY;
    }
    /* each view's slots from its group's block tables, once a step, read by its layers */
    for (int64_t v = 0, at = 0; v < num_views; v++) {
        pc_fill_view(&views[v], rows, shape->block_size, ours, slots + at,
                     slots + at + m * views[v].stride);
        at += m * views[v].stride + m;
    }
    float *normed = work, *qkv = normed + m * h, *attn = qkv + m * qkv_size;
    float *gate_up = attn + m * q_size, *act = gate_up + m * 2 * inter, *proj = act + m * inter;
    float *scores = proj + m * h;                     /* [ours, hq, max_context] */
    float *ranges = scores + ours * hq * max_context; /* [ours, 2 hq + q_size] */
    int64_t status = PC_OK; /* a kernel's failure (out of memory) ends the step: see done */
    for (int64_t l = 0; l < shape->num_layers; l++) {
        const pc_decoder_layer *layer = layers + l;
        const context_view *view =
            &views[pc_find_view(views, num_views, layer->group, layer->window)];
        kernels->rms_norm(x, layer->attn_norm, normed, m, h, shape->rms_norm_eps);
        if ((status = project(kernels, &layer->proj[0], normed, m, qkv, ours, prepared, matmul_ns)))
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
        work_part parts[PC_MAX_THREADS];
        const int64_t lone_len = m == 1 && !shape->batch_invariant ? view->lens[0] : 0;
        const int64_t context_parts =
            lone_len / MIN_CONTEXT_PART < ours ? lone_len / MIN_CONTEXT_PART : ours;
        if (context_parts > 1) {
            /* a lone sequence: each thread a range of its context, merged in order */
            for (int64_t i = 0; i < context_parts; i++) {
                float *range = ranges + i * (2 * hq + q_size);
                parts[i] = (work_part){.kind = PART_ATTENTION_CONTEXT,
                                       .kernels = kernels,
                                       .begin = lone_len * i / context_parts,
                                       .end = lone_len * (i + 1) / context_parts,
                                       .attention = attention};
                parts[i].attention.peaks = range;
                parts[i].attention.totals = range + hq;
                parts[i].attention.scores = scores + i * hq * max_context;
                if (i > 0)
                    parts[i].attention.out = range + 2 * hq;
            }
            if ((status = pc_run_parts(parts, context_parts)))
                goto done;
            for (int64_t i = 1; i < context_parts; i++) {
                float *range = ranges + i * (2 * hq + q_size);
                merge_ranges(attn, range + 2 * hq, ranges, ranges + hq, range, range + hq, hq, d);
            }
        } else {
            /* each thread its own rows, as much context to read for each, and its own scores */
            for (int64_t i = 0; i < view->shares; i++) {
                parts[i] = (work_part){.kind = PART_ATTENTION_ROWS,
                                       .kernels = kernels,
                                       .begin = view->share_rows[i],
                                       .end = view->share_rows[i + 1],
                                       .attention = attention};
                parts[i].attention.scores = scores + i * hq * max_context;
            }
            if ((status = pc_run_parts(parts, view->shares)))
                goto done;
        }
        if ((status = project(kernels, &layer->proj[1], attn, m, proj, ours, prepared, matmul_ns)))
            goto done;
        if (layer->o_bias)
            add_bias(proj, layer->o_bias, m, h);
        add_residual(kernels, shape, x, proj, layer->post_attn_norm, m);
        kernels->rms_norm(x, layer->mlp_norm, normed, m, h, shape->rms_norm_eps);
        if ((status =
                 project(kernels, &layer->proj[2], normed, m, gate_up, ours, prepared, matmul_ns)))
            goto done;
        const work_part gated = {.kind = PART_GATED,
                                 .kernels = kernels,
                                 .begin = 0,
                                 .end = m * inter,
                                 .x = gate_up,
                                 .y = act,
                                 .inter = inter,
                                 .activation = shape->activation};
        pc_run_even(&gated, ours, GEMV_GRAIN);
        if ((status = project(kernels, &layer->proj[3], act, m, proj, ours, prepared, matmul_ns)))
            goto done;
        add_residual(kernels, shape, x, proj, layer->post_mlp_norm, m);
    }
done:
    pc_helpers_release(ours);
    free(prepared);
    free(slots);
    free(work);
    return status;
}
