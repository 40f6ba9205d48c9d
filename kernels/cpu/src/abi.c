/* The layout of every struct kernels/cpu's Python fills (pagechat_cpu.h), as this compiler
   lays it out: kernels/cpu/library.py compares each with its ctypes mirror, field by field,
   when it loads the library. Compiled once: the layouts are the same in every version. */
#include <stddef.h>

#include "pagechat_cpu.h"

#define FIELD(type, name) {#name, (int64_t)offsetof(type, name), (int64_t)sizeof(((type *)0)->name)}
#define LAYOUT(type, fields)                                                                       \
    {#type, (int64_t)sizeof(type), sizeof(fields) / sizeof(fields[0]), fields}

static const pc_field_layout attention[] = {
    FIELD(pc_attention, q),           FIELD(pc_attention, q_stride),   FIELD(pc_attention, k_cache),
    FIELD(pc_attention, v_cache),     FIELD(pc_attention, cache_type), FIELD(pc_attention, slots),
    FIELD(pc_attention, slot_stride), FIELD(pc_attention, seq_lens),   FIELD(pc_attention, out),
    FIELD(pc_attention, scores),      FIELD(pc_attention, hq),         FIELD(pc_attention, hkv),
    FIELD(pc_attention, d),           FIELD(pc_attention, scale),      FIELD(pc_attention, peaks),
    FIELD(pc_attention, totals),
};

static const pc_field_layout kernels[] = {
    FIELD(pc_kernels, gemv),           FIELD(pc_kernels, attend),
    FIELD(pc_kernels, rms_norm),       FIELD(pc_kernels, rope_write),
    FIELD(pc_kernels, silu_mul),       FIELD(pc_kernels, gelu_tanh_mul),
    FIELD(pc_kernels, prepared_bytes), FIELD(pc_kernels, prepare),
    FIELD(pc_kernels, gemv_prepared),
};

static const pc_field_layout weight[] = {
    FIELD(pc_weight, type),      FIELD(pc_weight, n),    FIELD(pc_weight, k),
    FIELD(pc_weight, row_bytes), FIELD(pc_weight, data),
};

static const pc_field_layout projection[] = {
    FIELD(pc_projection, part),
    FIELD(pc_projection, parts),
    FIELD(pc_projection, n),
    FIELD(pc_projection, k),
};

static const pc_field_layout decoder_layer[] = {
    FIELD(pc_decoder_layer, proj),          FIELD(pc_decoder_layer, attn_norm),
    FIELD(pc_decoder_layer, mlp_norm),      FIELD(pc_decoder_layer, k_cache),
    FIELD(pc_decoder_layer, v_cache),       FIELD(pc_decoder_layer, qkv_bias),
    FIELD(pc_decoder_layer, o_bias),        FIELD(pc_decoder_layer, q_norm),
    FIELD(pc_decoder_layer, k_norm),        FIELD(pc_decoder_layer, post_attn_norm),
    FIELD(pc_decoder_layer, post_mlp_norm), FIELD(pc_decoder_layer, group),
    FIELD(pc_decoder_layer, rope),          FIELD(pc_decoder_layer, window),
};

static const pc_field_layout decoder_shape[] = {
    FIELD(pc_decoder_shape, num_layers),   FIELD(pc_decoder_shape, hidden),
    FIELD(pc_decoder_shape, intermediate), FIELD(pc_decoder_shape, num_q_heads),
    FIELD(pc_decoder_shape, num_kv_heads), FIELD(pc_decoder_shape, head_dim),
    FIELD(pc_decoder_shape, rms_norm_eps), FIELD(pc_decoder_shape, scale),
    FIELD(pc_decoder_shape, activation),   FIELD(pc_decoder_shape, block_size),
    FIELD(pc_decoder_shape, cache_type),   FIELD(pc_decoder_shape, groups),
    FIELD(pc_decoder_shape, cache_blocks), FIELD(pc_decoder_shape, batch_invariant),
};

static const pc_field_layout step_rows[] = {
    FIELD(pc_step_rows, m),           FIELD(pc_step_rows, seq_lens),
    FIELD(pc_step_rows, cos),         FIELD(pc_step_rows, sin),
    FIELD(pc_step_rows, write_slots), FIELD(pc_step_rows, block_tables),
    FIELD(pc_step_rows, table_width),
};

static const pc_struct_layout layouts[] = {
    LAYOUT(pc_attention, attention),
    LAYOUT(pc_kernels, kernels),
    LAYOUT(pc_weight, weight),
    LAYOUT(pc_projection, projection),
    LAYOUT(pc_decoder_layer, decoder_layer),
    LAYOUT(pc_decoder_shape, decoder_shape),
    LAYOUT(pc_step_rows, step_rows),
};

const pc_struct_layout *pc_struct_layouts(int64_t *count) {
    *count = (int64_t)(sizeof(layouts) / sizeof(layouts[0]));
    return layouts;
}
