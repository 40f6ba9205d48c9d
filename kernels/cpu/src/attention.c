/* Decode attention straight through the paged KV cache: for each row (a sequence's one new
   token) and query head h, out[h] = softmax(scale q[h] . k[slot]) . v[slot] over the row's
   context slots, read in place (no gathered copy of K/V, no padded SDPA). The cache holds
   fp32, fp16 or bf16; each K and V element is widened to fp32 as it is loaded, and all
   arithmetic is fp32. Query head h reads KV head h / (hq / hkv). */
#include <stdlib.h>

#include "pagechat_cpu.h"
#include "simd.h"

/* A KV head's query heads are scored HEADS_TOGETHER at a time, so each K and V element is
   loaded and widened once for them all (and their FMA chains run side by side); V_VECTORS
   vectors of each head's output are accumulated in registers at a time (AVX2's 16 registers
   hold 4 heads x 2 and the loads; AVX512's 32, 4 x 4). Each head's sums run in the same order
   as one head alone: the result does not depend on the grouping. */
#define HEADS_TOGETHER 4
#define V_VECTORS (VF_W == 16 ? 4 : 2)

static inline __attribute__((always_inline)) vf load_kv(const void *cache, int64_t at,
                                                        const int64_t type) {
    if (type == PC_F16)
        return vf_load_f16((const uint16_t *)cache + at);
    if (type == PC_BF16)
        return vf_load_bf16((const uint16_t *)cache + at);
    return vf_load((const float *)cache + at);
}

/* Query heads from h0 taken together: up to HEADS_TOGETHER, within h0's group (a KV head's
   query heads are consecutive) */
static inline int64_t heads_together(int64_t h0, int64_t group) {
    const int64_t in_group = group - h0 % group;
    return in_group < HEADS_TOGETHER ? in_group : HEADS_TOGETHER;
}

/* The largest and the sum of s[0..len), len >= 1, each over LANES interleaved partial results
   combined in one fixed order: lanes the compiler vectorizes (a single running value is one
   dependent chain the compiler may not reorder), and the same sums in every version. */
#define LANES 8

static inline float largest(const float *s, int64_t len) {
    float part[LANES];
    for (int j = 0; j < LANES; j++)
        part[j] = s[0];
    int64_t c = 0;
    for (; c + LANES <= len; c += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] = s[c + j] > part[j] ? s[c + j] : part[j];
    for (; c < len; c++)
        part[0] = s[c] > part[0] ? s[c] : part[0];
    float peak = part[0];
    for (int j = 1; j < LANES; j++)
        peak = part[j] > peak ? part[j] : peak;
    return peak;
}

static inline float sum(const float *s, int64_t len) {
    float part[LANES] = {0};
    int64_t c = 0;
    for (; c + LANES <= len; c += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] += s[c + j];
    for (; c < len; c++)
        part[0] += s[c];
    float total = 0.0f;
    for (int j = 0; j < LANES; j++)
        total += part[j];
    return total;
}

/* One row's attention over `len` context slots `ctx`: out [hq, d] from q [hq, d]. Where
   peaks is set, each head's largest score and softmax sum go there (a part of the context,
   merged with the other part's by pc_merge). */
static inline __attribute__((always_inline)) void attend_one(const pc_attention *a, const float *q,
                                                             const int64_t *ctx, int64_t len,
                                                             float *out, float *peaks,
                                                             float *totals, const int64_t type) {
    const int64_t hq = a->hq, hkv = a->hkv, d = a->d, group = hq / hkv;
    float *scores = a->scores; /* [hq, len] */
    for (int64_t c = 0; c < len; c++) {
        for (int64_t h0 = 0, heads; h0 < hq; h0 += heads) {
            heads = heads_together(h0, group);
            const int64_t k_at = ctx[c] * hkv * d + h0 / group * d;
            vf acc[HEADS_TOGETHER];
            for (int j = 0; j < HEADS_TOGETHER; j++)
                acc[j] = vf_zero();
            for (int64_t i = 0; i < d; i += VF_W) {
                const vf k = load_kv(a->k_cache, k_at + i, type);
                for (int j = 0; j < HEADS_TOGETHER; j++)
                    if (j < heads)
                        acc[j] = vf_fma(vf_load(q + (h0 + j) * d + i), k, acc[j]);
            }
            for (int j = 0; j < HEADS_TOGETHER; j++)
                if (j < heads)
                    scores[(h0 + j) * len + c] = a->scale * vf_sum(acc[j]);
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        float *s = scores + h * len;
        const float peak = largest(s, len);
        for (int64_t c = 0; c < len; c++)
            s[c] = exp_nonpositive(s[c] - peak);
        const float total = sum(s, len);
        if (peaks)
            peaks[h] = peak, totals[h] = total;
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < len; c++)
            s[c] *= inv;
    }
    for (int64_t h0 = 0, heads; h0 < hq; h0 += heads) {
        heads = heads_together(h0, group);
        const int64_t head = h0 / group * d;
        for (int64_t i0 = 0; i0 < d; i0 += V_VECTORS * VF_W) {
            const int64_t vectors = d - i0 < V_VECTORS * VF_W ? (d - i0) / VF_W : V_VECTORS;
            vf acc[HEADS_TOGETHER][V_VECTORS];
            for (int j = 0; j < HEADS_TOGETHER; j++)
                for (int v = 0; v < V_VECTORS; v++)
                    acc[j][v] = vf_zero();
            for (int64_t c = 0; c < len; c++) {
                const int64_t v_at = ctx[c] * hkv * d + head + i0;
                for (int v = 0; v < V_VECTORS; v++) {
                    if (v >= vectors)
                        break;
                    const vf value = load_kv(a->v_cache, v_at + v * VF_W, type);
                    for (int j = 0; j < HEADS_TOGETHER; j++)
                        if (j < heads)
                            acc[j][v] =
                                vf_fma(vf_set1(scores[(h0 + j) * len + c]), value, acc[j][v]);
                }
            }
            for (int j = 0; j < HEADS_TOGETHER; j++)
                for (int v = 0; v < V_VECTORS; v++)
                    if (j < heads && v < vectors)
                        vf_store(out + (h0 + j) * d + i0 + v * VF_W, acc[j][v]);
        }
    }
}

static inline __attribute__((always_inline)) void attend_typed(const pc_attention *a, int64_t begin,
                                                               int64_t end, int64_t context_range,
                                                               const int64_t type) {
    if (context_range) {
        attend_one(a, a->q, a->slots + begin, end - begin, a->out, a->peaks, a->totals, type);
        return;
    }
    for (int64_t r = begin; r < end; r++)
        attend_one(a, a->q + r * a->q_stride, a->slots + r * a->slot_stride, a->seq_lens[r],
                   a->out + r * a->hq * a->d, NULL, NULL, type);
}

#if defined(PC_ISA_GENERIC)
/* The generic version widens a 16-bit context into fp32 first, one row at a time in a loop
   the compiler vectorizes, then attends over the copy: widening element by element inside
   the products kept them from vectorizing (an fp16 cache ran 7x slower than bf16 there). */
static int64_t attend_widened(const pc_attention *a, int64_t begin, int64_t end,
                              int64_t context_range) {
    const int64_t row = a->hkv * a->d, type = a->cache_type;
    const int64_t most = context_range ? end - begin : a->slot_stride;
    float *k = malloc(sizeof(float) * (size_t)(2 * most * row + 1));
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(most + 1));
    if (k == NULL || slots == NULL) {
        free(k);
        free(slots);
        return PC_NO_MEMORY;
    }
    float *v = k + most * row;
    for (int64_t c = 0; c < most; c++)
        slots[c] = c;
    pc_attention wide = *a;
    wide.k_cache = k, wide.v_cache = v, wide.cache_type = PC_F32, wide.slots = slots;
    for (int64_t r = context_range ? 0 : begin; r < (context_range ? 1 : end); r++) {
        const int64_t *ctx = context_range ? a->slots + begin : a->slots + r * a->slot_stride;
        const int64_t len = context_range ? end - begin : a->seq_lens[r];
        for (int64_t c = 0; c < len; c++) {
            const uint16_t *ks = (const uint16_t *)a->k_cache + ctx[c] * row;
            const uint16_t *vs = (const uint16_t *)a->v_cache + ctx[c] * row;
            float *kd = k + c * row, *vd = v + c * row;
            if (type == PC_F16)
                for (int64_t i = 0; i < row; i++)
                    kd[i] = fp16_to_f32_c(ks[i]), vd[i] = fp16_to_f32_c(vs[i]);
            else
                for (int64_t i = 0; i < row; i++)
                    kd[i] = bf16_to_f32(ks[i]), vd[i] = bf16_to_f32(vs[i]);
        }
        if (context_range) {
            attend_one(&wide, a->q, slots, len, a->out, a->peaks, a->totals, PC_F32);
        } else {
            attend_one(&wide, a->q + r * a->q_stride, slots, len, a->out + r * a->hq * a->d, NULL,
                       NULL, PC_F32);
        }
    }
    free(k);
    free(slots);
    return PC_OK;
}
#endif

/* Rows [begin, end) of `a`; or, where context_range is set, row 0's context positions
   [begin, end), with its heads' peaks and totals recorded. Returns PC_BAD_SHAPE for a head
   size the vectors do not divide or a cache type not served, PC_NO_MEMORY where a buffer
   could not be had. */
int64_t PC_FN(attend)(const pc_attention *a, int64_t begin, int64_t end, int64_t context_range) {
    if (a->d % 16 || a->d > PC_MAX_HEAD_DIM || a->hkv < 1 || a->hq % a->hkv)
        return PC_BAD_SHAPE;
    switch (a->cache_type) {
    case PC_F32: attend_typed(a, begin, end, context_range, PC_F32); return PC_OK;
#if defined(PC_ISA_GENERIC)
    case PC_F16:
    case PC_BF16: return attend_widened(a, begin, end, context_range);
#else
    case PC_F16: attend_typed(a, begin, end, context_range, PC_F16); return PC_OK;
    case PC_BF16: attend_typed(a, begin, end, context_range, PC_BF16); return PC_OK;
#endif
    default: return PC_BAD_SHAPE;
    }
}
