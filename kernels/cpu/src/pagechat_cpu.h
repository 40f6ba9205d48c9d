/* pagechat's CPU kernel layer: the types every source file and kernels/cpu's Python share.

   Each kernel is compiled once per instruction set into the same library (kernels/cpu/build.py):
   each of build.py's PER_ISA_SOURCES as pc_<kernel>_<isa> for isa in generic, avx2, avx512,
   vnni, amx (x86-64) or generic, neon (arm64). Which version runs is chosen when the process
   starts, kernel by kernel, from what the CPU can execute (features.c) and a probe of each version
   against the generic one (kernels/cpu/dispatch.py). stack.c, compiled once, runs a whole decode
   step through a table of the chosen versions (pc_kernels).

   Weights are GGUF blocks exactly as a GGUF file stores them (ggml's block layouts, fp16
   scales and mins as stored): a weight [n, k] is n rows of k / block_elements(type) blocks;
   or, for the int8 products, the same bytes with the rows of a type but Q5_0 regrouped eight
   at a time (PC_ROWS_X8 | the type: rows_x8.h). */
#ifndef PAGECHAT_CPU_H
#define PAGECHAT_CPU_H

#include <stdint.h>

/* Weight types, numbered as ggml numbers them (GGMLQuantizationType). */
enum {
    PC_Q4_0 = 2,
    PC_Q4_1 = 3,
    PC_Q5_0 = 6,
    PC_Q8_0 = 8,
    PC_Q4_K = 12,
    PC_Q5_K = 13,
    PC_Q6_K = 14,
    /* Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K with their rows regrouped eight at a time for
       the int8 products (rows_x8.h) */
    PC_ROWS_X8 = 0x100,
    PC_Q4_0_X8 = PC_ROWS_X8 | PC_Q4_0,
    PC_Q4_1_X8 = PC_ROWS_X8 | PC_Q4_1,
    PC_Q8_0_X8 = PC_ROWS_X8 | PC_Q8_0,
    PC_Q4_K_X8 = PC_ROWS_X8 | PC_Q4_K,
    PC_Q5_K_X8 = PC_ROWS_X8 | PC_Q5_K,
    PC_Q6_K_X8 = PC_ROWS_X8 | PC_Q6_K,
};

/* The largest head size the attention and RoPE kernels take (a multiple of 16). */
#define PC_MAX_HEAD_DIM 512

/* Element types of the KV cache and of dense outputs. */
enum { PC_F32 = 0, PC_F16 = 1, PC_BF16 = 2 };

/* Status codes every entry point returns. */
enum {
    PC_OK = 0,
    PC_NO_MEMORY = 1,
    PC_BAD_SHAPE = 2,   /* a type, dimension or alignment the kernel does not take */
    PC_OUT_OF_POOL = 3, /* a slot, block or length outside the KV pool */
};

/* One layer's attention over the paged cache, for a range of a step's rows (or of one row's
   context positions: `pc_attend`'s `context_range`). */
typedef struct {
    const float *q; /* row r's query heads at q + r * q_stride: [hq, d] */
    int64_t q_stride;
    const void *k_cache, *v_cache; /* [slots, hkv, d] of cache_type */
    int64_t cache_type;
    const int64_t *slots; /* row r's context slots at slots + r * slot_stride, in order */
    int64_t slot_stride;
    const int64_t *seq_lens; /* [rows]: each row's context length, its new token included */
    float *out;              /* row r's output at out + r * hq * d */
    float *scores;           /* work: hq * slot_stride floats for the calling thread */
    int64_t hq, hkv, d;
    float scale;
    /* context_range only: each head's largest score and its softmax's sum, for pc_merge */
    float *peaks, *totals;
} pc_attention;

/* The kernels with a version per instruction set, as function types: each version of kernel
   <name> is exported as pc_<name>_<isa> (PC_DECLARE_VERSION below declares them all), and
   kernels/cpu/library.py declares the same prototypes to ctypes (a test compares the two).
   Every one but quantize_q8 and the int8 preparation returns a PC_ status. */

/* y[r, n_begin:n_end] (row r at y + r * ldy) = the m input rows x [m, k] times weight rows
   [n_begin, n_end) of type `type` (row_bytes apart), fp32 inputs (gemv) or int8 (gemv_q8) */
typedef int64_t pc_gemv_fn(int64_t type, const uint8_t *w, int64_t row_bytes, const float *x,
                           int64_t m, int64_t k, float *y, int64_t ldy, int64_t n_begin,
                           int64_t n_end);
/* rows [r_begin, r_end) of a weight dequantized into out (ld apart, element type out_type) */
typedef int64_t pc_dequant_fn(int64_t type, const uint8_t *w, int64_t row_bytes, int64_t k,
                              int64_t r_begin, int64_t r_end, void *out, int64_t ld,
                              int64_t out_type);
/* the `count` rows `ids` of a weight (embedding lookups) dequantized into fp32 out */
typedef int64_t pc_dequant_rows_fn(int64_t type, const uint8_t *w, int64_t row_bytes, int64_t k,
                                   const int64_t *ids, int64_t count, float *out);
typedef int64_t pc_attend_fn(const pc_attention *a, int64_t begin, int64_t end,
                             int64_t context_range);
typedef void pc_rms_norm_fn(const float *x, const float *w, float *out, int64_t rows, int64_t d,
                            float eps);
typedef void pc_rope_write_fn(float *qkv, int64_t m, int64_t qkv_stride, int64_t hq, int64_t hkv,
                              int64_t d, const float *cos, const float *sin, const int64_t *slots,
                              void *k_cache, void *v_cache, int64_t cache_type);
/* The MLP's activations of the gate (times up), and their kernels: act(gate) * up for elements
   [begin, end) of [m, inter], from gate_up [m, 2 inter]. */
enum { PC_SILU = 0, PC_GELU_TANH = 1 };
typedef void pc_gated_fn(const float *gate_up, float *out, int64_t inter, int64_t begin,
                         int64_t end);
/* Products with int8 inputs (products_q8.c): x [m, k] as int8 rows (pc_q8_row_bytes each);
   the bytes an input takes once prepared, its preparation (once, whatever the threads sharing
   its products), the products from it. */
typedef void pc_quantize_q8_fn(const float *x, int64_t m, int64_t k, uint8_t *out);
typedef int64_t pc_prepared_bytes_fn(int64_t m, int64_t k);
typedef void pc_prepare_fn(const float *x, int64_t m, int64_t k, uint8_t *out);
typedef int64_t pc_gemv_prepared_fn(int64_t type, const uint8_t *w, int64_t row_bytes,
                                    const uint8_t *prepared, int64_t m, int64_t k, float *y,
                                    int64_t ldy, int64_t n_begin, int64_t n_end);
/* One token per row of logits [rows, vocab] (stride apart), sample.c says how. */
typedef int64_t pc_sample_fn(const float *logits, int64_t rows, int64_t vocab, int64_t stride,
                             const uint32_t *allowed, int64_t words, const float *temps,
                             const float *min_p, const double *uniforms, int64_t *out);

#define PC_DECLARE_VERSION(isa)                                                                    \
    pc_gemv_fn pc_gemv_##isa, pc_gemv_rowwise_##isa, pc_gemv_q8_##isa;                             \
    pc_dequant_fn pc_dequant_##isa;                                                                \
    pc_dequant_rows_fn pc_dequant_rows_##isa;                                                      \
    pc_attend_fn pc_attend_##isa;                                                                  \
    pc_rms_norm_fn pc_rms_norm_##isa;                                                              \
    pc_rope_write_fn pc_rope_write_##isa;                                                          \
    pc_gated_fn pc_silu_mul_##isa, pc_gelu_tanh_mul_##isa;                                         \
    pc_quantize_q8_fn pc_quantize_q8_##isa;                                                        \
    pc_prepared_bytes_fn pc_q8_prepared_bytes_##isa;                                               \
    pc_prepare_fn pc_q8_prepare_##isa;                                                             \
    pc_gemv_prepared_fn pc_gemv_q8_prepared_##isa;                                                 \
    pc_sample_fn pc_sample_##isa;

/* kernels/cpu/build.py's versions of every architecture */
PC_DECLARE_VERSION(generic)
PC_DECLARE_VERSION(avx2)
PC_DECLARE_VERSION(avx512)
PC_DECLARE_VERSION(vnni)
PC_DECLARE_VERSION(amx)
PC_DECLARE_VERSION(neon)

/* The kernels a decode step runs, one version each (dispatch.py fills it, field by name). */
typedef struct {
    pc_gemv_fn *gemv;
    pc_attend_fn *attend;
    pc_rms_norm_fn *rms_norm;
    pc_rope_write_fn *rope_write;
    pc_gated_fn *silu_mul;
    pc_gated_fn *gelu_tanh_mul;
    /* int8 inputs: the projections' inputs prepared once and their products from them
       (gemv then unused); NULL, all three, where the products take fp32 inputs */
    pc_prepared_bytes_fn *prepared_bytes;
    pc_prepare_fn *prepare;
    pc_gemv_prepared_fn *gemv_prepared;
} pc_kernels;

/* A weight: GGUF blocks, n rows of row_bytes. */
typedef struct {
    int64_t type, n, k, row_bytes;
    const uint8_t *data;
} pc_weight;

/* A projection: up to three weights of one k whose outputs follow one another (a fused qkv
   whose parts a file stores in different types, as Q4_K_M files store V in Q6_K). */
#define PC_MAX_PARTS 3
typedef struct {
    pc_weight part[PC_MAX_PARTS];
    int64_t parts, n, k; /* n: the parts' rows together */
} pc_projection;

/* The layer groups a model's KV pools are split into (service/engine/window_blocks.py: full
   and sliding-window layers), and the RoPE tables its layers rotate by (Gemma's local ones). */
#define PC_MAX_GROUPS 2
#define PC_MAX_ROPES 2

/* The most threads a decode stack's call (or a split GEMV) runs on: the calling one and its
   helpers. */
#define PC_MAX_THREADS 64

/* One decoder layer as pc_decode_layers reads it. A feature a family lacks is NULL (or 0). */
typedef struct {
    pc_projection proj[4]; /* qkv, o_proj, gate_up, down */
    const float *attn_norm, *mlp_norm;
    void *k_cache, *v_cache; /* [slots, hkv, d] of the shape's cache_type, in its group's pool */
    const float *qkv_bias;   /* [q_size + 2 kv_size], added to qkv's output */
    const float *o_bias;     /* [hidden], added to o_proj's */
    const float *q_norm, *k_norm; /* [d]: an RMSNorm over each head of q, of k, before RoPE */
    /* [hidden]: an RMSNorm of the attention's and of the MLP's output before its residual */
    const float *post_attn_norm, *post_mlp_norm;
    int64_t group;  /* the layer group whose pool it is in, and whose step rows it reads */
    int64_t rope;   /* the step's RoPE rows it rotates q and k by */
    int64_t window; /* keys a row sees, its own included; 0: its whole context */
} pc_decoder_layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_q_heads, num_kv_heads, head_dim;
    float rms_norm_eps, scale;           /* scale: the attention's, on q . k */
    int64_t activation;                  /* PC_SILU or PC_GELU_TANH */
    int64_t block_size, cache_type;      /* every pool's */
    int64_t groups;                      /* layer groups, 1 to PC_MAX_GROUPS */
    int64_t cache_blocks[PC_MAX_GROUPS]; /* each group's pool */
    /* 0: a lone sequence's attention may be split into ranges of its context, one a thread
       (its sums then in another order than among other rows); 1: never (batch-invariant) */
    int64_t batch_invariant;
} pc_decoder_shape;

/* A step's m rows, one per token: its context length (its position + 1), its RoPE rows in
   each table, and per layer group the slot its K/V go to and its sequence's pages. */
typedef struct {
    int64_t m;
    const int32_t *seq_lens;                            /* [m] */
    const float *cos[PC_MAX_ROPES], *sin[PC_MAX_ROPES]; /* [m, d]; NULL past those in use */
    const int64_t *write_slots[PC_MAX_GROUPS];          /* [m] */
    const int32_t *block_tables[PC_MAX_GROUPS];         /* [m, table_width] */
    int64_t table_width[PC_MAX_GROUPS];
} pc_step_rows;

/* The entry points compiled once (each file's comment says more). */
/* 1 where the version named `isa` runs on this CPU (features.c) */
int64_t pc_cpu_runs(const char *isa);
/* y [m, w->n] = x [m, k] w^T through the table's product, split between `threads` (stack.c) */
int64_t pc_gemv_threads(const pc_kernels *kernels, const pc_projection *w, const float *x,
                        int64_t m, float *y, int64_t threads);
/* every layer of a decode step in one call (stack.c) */
int64_t pc_decode_layers(const pc_kernels *kernels, const pc_decoder_layer *layers,
                         const pc_decoder_shape *shape, float *x, const pc_step_rows *rows,
                         int64_t threads, int64_t *matmul_ns);
/* a weight's rows regrouped eight at a time, in place, or back (rows_x8.c) */
int64_t pc_rows_x8(int64_t type, uint8_t *w, int64_t row_bytes, int64_t n, int64_t to_x8);

/* The layout of every struct above that Python fills (abi.c): its size and each field's offset
   and size, by name, which kernels/cpu/library.py compares with its ctypes mirrors when it
   loads the library (a mirror that drifted would pass wrong pointers in silence). */
typedef struct {
    const char *name;
    int64_t offset, size;
} pc_field_layout;
typedef struct {
    const char *name;
    int64_t size, fields;
    const pc_field_layout *field;
} pc_struct_layout;
/* the table of layouts, and its length in *count */
const pc_struct_layout *pc_struct_layouts(int64_t *count);

/* Int8 input rows (products_q8.c): a row of k inputs (k a multiple of 32) as
   pc_q8_row_bytes(k) bytes: k int8 values q, then a float scale d per 32 (x ~ d q), then per
   32 the float d * (the sum of their q), then the same per 16. */
static inline int64_t pc_q8_row_bytes(int64_t k) {
    return k + k / 32 * 4 * 2 + k / 16 * 4;
}
static inline const float *pc_q8_scales(const uint8_t *row, int64_t k) {
    return (const float *)(row + k);
}
static inline const float *pc_q8_sums32(const uint8_t *row, int64_t k) {
    return (const float *)(row + k + k / 8);
}
static inline const float *pc_q8_sums16(const uint8_t *row, int64_t k) {
    return (const float *)(row + k + k / 4);
}

/* Elements per block and bytes per block of a weight type; 0 for a type not served. */
static inline int64_t pc_block_elements(int64_t type) {
    switch (type) {
    case PC_Q4_0:
    case PC_Q4_0_X8:
    case PC_Q4_1:
    case PC_Q4_1_X8:
    case PC_Q5_0:
    case PC_Q8_0:
    case PC_Q8_0_X8: return 32;
    case PC_Q4_K:
    case PC_Q4_K_X8:
    case PC_Q5_K:
    case PC_Q5_K_X8:
    case PC_Q6_K:
    case PC_Q6_K_X8: return 256;
    default: return 0;
    }
}

static inline int64_t pc_block_bytes(int64_t type) {
    switch (type) {
    case PC_Q4_0:
    case PC_Q4_0_X8: return 18;
    case PC_Q4_1:
    case PC_Q4_1_X8: return 20;
    case PC_Q5_0: return 22;
    case PC_Q8_0:
    case PC_Q8_0_X8: return 34;
    case PC_Q4_K:
    case PC_Q4_K_X8: return 144;
    case PC_Q5_K:
    case PC_Q5_K_X8: return 176;
    case PC_Q6_K:
    case PC_Q6_K_X8: return 210;
    default: return 0;
    }
}

#endif
