/* The elementwise steps of a decoder layer: RMSNorm, RoPE with the K/V write into the paged
   cache, SiLU(gate) * up and tanh-GELU(gate) * up. Plain loops the compiler vectorizes for
   each instruction set, and the vector conversions of simd.h where the cache is 16-bit. */
#include "pagechat_cpu.h"
#include "simd.h"

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for rows r of d floats, in fp32. */
void PC_FN(rms_norm)(const float *x, const float *w, float *out, int64_t rows, int64_t d,
                     float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * d;
        float *dst = out + r * d;
        vf acc = vf_zero();
        int64_t i = 0;
        for (; i + VF_W <= d; i += VF_W) {
            const vf v = vf_load(row + i);
            acc = vf_fma(v, v, acc);
        }
        float squares = vf_sum(acc);
        for (; i < d; i++)
            squares += row[i] * row[i];
        const float inv = 1.0f / sqrtf(squares / (float)d + eps);
        for (int64_t j = 0; j < d; j++)
            dst[j] = row[j] * inv * w[j];
    }
}

/* d floats to a cache row of `type` */
static inline void store_row(void *cache, int64_t at, const float *src, int64_t d, int64_t type) {
    if (type == PC_F32) {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)d);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    int64_t i = 0;
    if (type == PC_F16) {
        for (; i + VF_W <= d; i += VF_W)
            vf_store_f16(dst + i, vf_load(src + i));
        for (; i < d; i++)
            dst[i] = f32_to_fp16_c(src[i]);
    } else {
        for (; i < d; i++)
            dst[i] = f32_to_bf16(src[i]);
    }
}

/* For each of m rows of qkv (row r at qkv + r * qkv_stride: hq query heads, hkv key heads,
   hkv value heads of d floats): Q and K rotated in place by that row's RoPE rows (cos and
   sin [m, d], sin signed for rotate_half: x cos + roll(x, d / 2) sin, as model.apply_rope),
   then K and V written to cache slot slots[r] ([slots, hkv, d] of cache_type). */
void PC_FN(rope_write)(float *qkv, int64_t m, int64_t qkv_stride, int64_t hq, int64_t hkv,
                       int64_t d, const float *cos, const float *sin, const int64_t *slots,
                       void *k_cache, void *v_cache, int64_t cache_type) {
    const int64_t half = d / 2;
    float rotated[PC_MAX_HEAD_DIM];
    for (int64_t r = 0; r < m; r++) {
        float *row = qkv + r * qkv_stride;
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t head = 0; head < hq + hkv; head++) {
            float *x = row + head * d;
            for (int64_t i = 0; i < half; i++)
                rotated[i] = x[i] * c[i] + x[i + half] * s[i];
            for (int64_t i = half; i < d; i++)
                rotated[i] = x[i] * c[i] + x[i - half] * s[i];
            memcpy(x, rotated, sizeof(float) * (size_t)d);
        }
        const int64_t at = slots[r] * hkv * d;
        store_row(k_cache, at, row + hq * d, hkv * d, cache_type);
        store_row(v_cache, at, row + (hq + hkv) * d, hkv * d, cache_type);
    }
}

/* g / (1 + exp(-g)) through exp_nonpositive (so that the loop vectorizes): with
   e = exp(-|g|), g / (1 + e) for g >= 0 and g e / (1 + e) below. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g < 0.0f ? g : -g);
    return (g < 0.0f ? g * e : g) / (1.0f + e);
}

/* GELU's tanh approximation, g (1 + tanh(y)) / 2 with y = sqrt(2 / pi) (g + 0.044715 g^3),
   as torch's gelu(approximate="tanh"). (1 + tanh(y)) / 2 is the sigmoid of 2 y, taken as SiLU
   takes its own: with e = exp(-2 |y|), g / (1 + e) for y >= 0 and g e / (1 + e) below (no
   1 + tanh that cancels where y is far below 0). */
static inline float gelu_tanh(float g) {
    const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = exp_nonpositive(y < 0.0f ? 2.0f * y : -2.0f * y);
    return (y < 0.0f ? g * e : g) / (1.0f + e);
}

/* out[e] = act(gate) * up for elements e in [begin, end) of [m, inter], from gate_up
   [m, 2 inter] (each row [gate; up]); `activation` a constant, so each loop is its own. */
static inline __attribute__((always_inline)) void gated(const float *gate_up, float *out,
                                                        int64_t inter, int64_t begin, int64_t end,
                                                        const int64_t activation) {
    for (int64_t r = begin / inter; r * inter < end; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *dst = out + r * inter;
        const int64_t first = begin > r * inter ? begin - r * inter : 0;
        const int64_t last = end < (r + 1) * inter ? end - r * inter : inter;
        for (int64_t i = first; i < last; i++)
            dst[i] = (activation == PC_SILU ? silu(gate[i]) : gelu_tanh(gate[i])) * up[i];
    }
}

void PC_FN(silu_mul)(const float *gate_up, float *out, int64_t inter, int64_t begin, int64_t end) {
    gated(gate_up, out, inter, begin, end, PC_SILU);
}

void PC_FN(gelu_tanh_mul)(const float *gate_up, float *out, int64_t inter, int64_t begin,
                          int64_t end) {
    gated(gate_up, out, inter, begin, end, PC_GELU_TANH);
}
