/* Token sampling from a step's logits: the grammar's allowed-token bits, the temperature,
   min_p and the draw in one pass or two over each row, instead of a dozen vocabulary-wide
   tensor ops (the exp of every id, a float64 cumulative sum, a masked copy per mask).

   The ids are taken 32 at a time, one word of the allowed-token bitmask each (llguidance's
   layout: bit j of word w is id 32 w + j). A word with no bit set is skipped, so a grammar
   that allows few ids costs little. Every version returns the same id for the same inputs:
   each weight is computed elementwise (exp_nonpositive, no contraction), a word's 32 weights
   are summed in one fixed tree, and words are accumulated in order in double. */
#include <math.h>
#include <stdlib.h>

#include "pagechat_cpu.h"
#include "simd.h"

#define WORD 32

/* One word's 32 logits: x itself where the word is whole, else its `count` ids padded with
   -inf in `pad`. */
static inline const float *word_logits(const float *x, int64_t count, float pad[WORD]) {
    if (count == WORD)
        return x;
    for (int j = 0; j < WORD; j++)
        pad[j] = j < count ? x[j] : -INFINITY;
    return pad;
}

/* All ones where bit j of `bits` is set, else 0 (a shift the compiler vectorizes, where
   `(bits >> j) & 1` kept the loops scalar). */
static inline int32_t bit_mask(uint32_t bits, int j) {
    return (int32_t)(bits << (31 - j)) >> 31;
}

/* The largest of v[0..32), by halves: the same comparisons in every version. */
static inline float tree_max(float v[WORD]) {
    for (int j = 0; j < 16; j++)
        v[j] = v[j] >= v[j + 16] ? v[j] : v[j + 16];
    for (int j = 0; j < 8; j++)
        v[j] = v[j] >= v[j + 8] ? v[j] : v[j + 8];
    for (int j = 0; j < 4; j++)
        v[j] = v[j] >= v[j + 4] ? v[j] : v[j + 4];
    for (int j = 0; j < 2; j++)
        v[j] = v[j] >= v[j + 2] ? v[j] : v[j + 2];
    return v[0] >= v[1] ? v[0] : v[1];
}

/* The sum of v[0..32), by halves: the same additions in every version. */
static inline float tree_sum(float v[WORD]) {
    for (int j = 0; j < 16; j++)
        v[j] += v[j + 16];
    for (int j = 0; j < 8; j++)
        v[j] += v[j + 8];
    for (int j = 0; j < 4; j++)
        v[j] += v[j + 4];
    for (int j = 0; j < 2; j++)
        v[j] += v[j + 2];
    return v[0] + v[1];
}

/* The largest logit among the word's allowed ids; -inf where none (NaN counts as none). */
static inline float word_peak(const float *x, uint32_t bits) {
    float v[WORD];
    for (int j = 0; j < WORD; j++) {
        const float xj = x[j];
        v[j] = bit_mask(bits, j) & (xj > -INFINITY) ? xj : -INFINITY;
    }
    return tree_max(v);
}

/* Each id's weight exp((x - peak) / t), 0 where not allowed or below min_p (the weights are
   relative to the likeliest's, 1). */
static inline void word_weights(const float *x, uint32_t bits, float peak, float inv_t, float min_p,
                                float e[WORD]) {
    for (int j = 0; j < WORD; j++) {
        const float xj = x[j];
        const int keep = bit_mask(bits, j) & (xj > -INFINITY);
        const float w = exp_nonpositive(keep ? (xj - peak) * inv_t : 0.0f);
        e[j] = keep & (w >= min_p) ? w : 0.0f;
    }
}

/* One row's id; -1 where no id is allowed. `sums`: one float per word, scratch. */
static int64_t sample_row(const float *x, int64_t vocab, const uint32_t *allowed, int64_t words,
                          float temperature, float min_p, double uniform, float *sums) {
    float pad[WORD];
    float peak = -INFINITY;
    int64_t peak_word = -1;
    for (int64_t w = 0; w < words; w++) {
        if (!allowed[w])
            continue;
        const float p = word_peak(word_logits(x + w * WORD, vocab - w * WORD, pad), allowed[w]);
        if (p > peak) { /* strictly: the first word holding the peak */
            peak = p;
            peak_word = w;
        }
    }
    if (peak_word < 0)
        return -1;
    float e[WORD];
    const float inv_t = 1.0f / temperature;
    if (!(temperature > 0.0f) || !isfinite(inv_t)) { /* greedy: the first id of the largest logit */
        const float *xs = word_logits(x + peak_word * WORD, vocab - peak_word * WORD, pad);
        for (int j = 0; j < WORD; j++)
            if (((allowed[peak_word] >> j) & 1u) && xs[j] == peak)
                return peak_word * WORD + j;
    }
    double total = 0.0;
    for (int64_t w = 0; w < words; w++) {
        sums[w] = 0.0f;
        if (!allowed[w])
            continue;
        word_weights(word_logits(x + w * WORD, vocab - w * WORD, pad), allowed[w], peak, inv_t,
                     min_p, e);
        sums[w] = tree_sum(e);
        total += sums[w];
    }
    /* The first id whose cumulative weight passes the target. */
    const double target = uniform * total;
    double before = 0.0;
    int64_t last_word = -1;
    for (int64_t w = 0; w < words; w++) {
        if (sums[w] <= 0.0f)
            continue;
        last_word = w;
        if (before + sums[w] <= target) {
            before += sums[w];
            continue;
        }
        word_weights(word_logits(x + w * WORD, vocab - w * WORD, pad), allowed[w], peak, inv_t,
                     min_p, e);
        int64_t last = 0;
        for (int j = 0; j < WORD; j++) {
            if (e[j] <= 0.0f)
                continue;
            last = j;
            before += e[j];
            if (before > target)
                return w * WORD + j;
        }
        return w * WORD + last; /* the ids' running sum fell short of the word's tree sum */
    }
    /* Rounding put the target at the total: the last id of weight > 0. */
    word_weights(word_logits(x + last_word * WORD, vocab - last_word * WORD, pad),
                 allowed[last_word], peak, inv_t, min_p, e);
    for (int j = WORD - 1; j > 0; j--)
        if (e[j] > 0.0f)
            return last_word * WORD + j;
    return last_word * WORD;
}

/* One id for each of `rows` rows of logits (row r at logits + r * stride, `vocab` ids), among
   the ids row r's bits allow (allowed + r * words; ids from 32 * words on are not allowed) and
   whose logit is above -inf:
   - temps[r] <= 0: the first id of the largest logit;
   - else a draw from softmax(logits / temps[r]) over those ids, less the ids whose
     probability is below min_p[r] times the likeliest's: the first id whose cumulative
     weight passes uniforms[r] (in [0, 1)) times the total.
   out[r] = -1 where no id is allowed. */
int64_t PC_FN(sample)(const float *logits, int64_t rows, int64_t vocab, int64_t stride,
                      const uint32_t *allowed, int64_t words, const float *temps,
                      const float *min_p, const double *uniforms, int64_t *out) {
    if (vocab < 1 || words < 1 || stride < vocab)
        return PC_BAD_SHAPE;
    const int64_t used = words < (vocab + WORD - 1) / WORD ? words : (vocab + WORD - 1) / WORD;
    float *sums = malloc(sizeof(float) * (size_t)used);
    if (!sums)
        return PC_NO_MEMORY;
    for (int64_t r = 0; r < rows; r++)
        out[r] = sample_row(logits + r * stride, vocab, allowed + r * words, used, temps[r],
                            min_p[r], uniforms[r], sums);
    free(sums);
    return PC_OK;
}
