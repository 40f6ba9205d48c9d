/* The int8 products of many input rows (prompts, large batches): weight rows laid out once,
   input rows side by side in the lanes of a vector.

   A vector holds VR input rows (16 with AVX512, 8 with AVX2 and the generic version, 4 with
   NEON), four int8 inputs of each to a lane: one instruction (VNNI's dpbusd, NEON's sdot,
   AVX2's maddubs and madd) adds four weights' products to every row at once, the weights'
   four bytes broadcast. So each sub-block of 32 costs eight such instructions for VR rows,
   and its float work (the total times a d_x, the offsets) is done once for all VR rows, where
   a row at a time pays it per row and sub-block.

   Each row's output is the same bits as products_q8.c's for that row: the same exact integer
   total per sub-block, then per lane of eight the same fp32 operations in the same order
   (`canonical order` there), here done with the rows in the lanes instead. */
#include <stdlib.h>

#include "pagechat_cpu.h"
#include "simd.h"

#include "blocks.h"
#include "int8.h"
#include "rows_x8.h"
#include "weights_q8.h"

/* ---- the inputs, side by side ------------------------------------------------------------- */
/* VR input rows as the tiles read them (rows past m zero): for each group of four inputs,
   VR int32 (the four bytes of each row); for each sub-block of 32, VR scales d_x, VR sums
   d_x sum(q) and VR integer sums of q (Q8_0 on VNNI); for each 16, VR sums d_x sum(q). */
typedef struct {
    int32_t *groups; /* [k / 4][VR] */
    float *scales;   /* [k / 32][VR] */
    float *sums32;   /* [k / 32][VR] */
    int32_t *qsums;  /* [k / 32][VR] */
    float *sums16;   /* [k / 16][VR] */
} side_by_side;

static int64_t side_by_side_bytes(int64_t k) { /* one vector of VR rows */
    return VR * (k + k / 32 * 12 + k / 16 * 4);
}

/* Input rows a vector holds side by side. */
int64_t PC_FN(q8_vector_rows)(void) {
    return VR;
}

/* The bytes of m rows of k inputs side by side (whole vectors of VR rows). */
int64_t PC_FN(q8_side_by_side_bytes)(int64_t m, int64_t k) {
    return (m + VR - 1) / VR * side_by_side_bytes(k);
}

static side_by_side side_by_side_at(uint8_t *at, int64_t k) {
    const side_by_side t = {(int32_t *)at, (float *)(at + VR * k), (float *)(at + VR * (k + k / 8)),
                            (int32_t *)(at + VR * (k + k / 4)),
                            (float *)(at + VR * (k + k / 32 * 12))};
    return t;
}

/* input rows [r0, r0 + VR) of xq (m rows of pc_q8_row_bytes(k)) side by side into t */
static void put_side_by_side(const uint8_t *xq, int64_t m, int64_t k, int64_t r0, side_by_side t) {
    const int64_t ldx = pc_q8_row_bytes(k);
    for (int64_t l = 0; l < VR; l++) {
        const int64_t r = r0 + l;
        const uint8_t *row = r < m ? xq + r * ldx : NULL;
        for (int64_t g = 0; g < k / 4; g++) {
            int32_t v = 0;
            if (row)
                memcpy(&v, row + 4 * g, 4);
            t.groups[g * VR + l] = v;
        }
        for (int64_t s = 0; s < k / 32; s++) {
            int32_t total = 0;
            for (int e = 0; row && e < 32; e++)
                total += ((const int8_t *)row)[32 * s + e];
            t.scales[s * VR + l] = row ? pc_q8_scales(row, k)[s] : 0.0f;
            t.sums32[s * VR + l] = row ? pc_q8_sums32(row, k)[s] : 0.0f;
            t.qsums[s * VR + l] = total;
        }
        for (int64_t h = 0; h < k / 16; h++)
            t.sums16[h * VR + l] = row ? pc_q8_sums16(row, k)[h] : 0.0f;
    }
}

/* The int8 rows xq [m] side by side into `out` (pc_q8_side_by_side_bytes), vector by vector. */
void PC_FN(q8_side_by_side)(const uint8_t *xq, int64_t m, int64_t k, uint8_t *out) {
    for (int64_t b = 0; b < (m + VR - 1) / VR; b++)
        put_side_by_side(xq, m, k, b * VR, side_by_side_at(out + b * side_by_side_bytes(k), k));
}

/* ---- the weights, laid out ---------------------------------------------------------------- */
/* A weight row chunk by chunk (CHUNK sub-blocks, the last one padded): its integers (32 bytes
   a sub-block), then each chunk's a (8 floats), b (16: per 32 in the first 8, or per 16) and
   Q6_K's scales per 16 (16 int16). */
#define LAID_OUT_CHUNK_BYTES (CHUNK * 32 + CHUNK * 4 + 2 * CHUNK * 4 + 2 * CHUNK * 2)

typedef struct {
    const uint8_t *ints;
    const float *a, *b;
    const int16_t *sc;
} laid_out;

static inline laid_out laid_out_at(const uint8_t *at, int64_t subs) {
    const int64_t chunks = (subs + CHUNK - 1) / CHUNK;
    const uint8_t *a = at + chunks * CHUNK * 32;
    const laid_out l = {at, (const float *)a, (const float *)(a + chunks * CHUNK * 4),
                        (const int16_t *)(a + chunks * CHUNK * 12)};
    return l;
}

/* How many weight rows ahead the lay-out prefetches (quants.c says why). */
#define PREFETCH_ROWS 16

#define DEFINE_LAY_OUT(T, SUBS, BYTES, KIND)                                                       \
    static void lay_out_##T(const uint8_t *row, int64_t row_bytes, int64_t subs, uint8_t *out) {   \
        const int64_t chunks = (subs + CHUNK - 1) / CHUNK;                                         \
        uint8_t *ints = out;                                                                       \
        float *a = (float *)(out + chunks * CHUNK * 32), *b = a + chunks * CHUNK;                  \
        int16_t *sc = (int16_t *)(b + 2 * chunks * CHUNK);                                         \
        for (int64_t first = 0; first < subs; first += CHUNK) {                                    \
            const int64_t n = subs - first < CHUNK ? subs - first : CHUNK;                         \
            const uint8_t *ahead = row + PREFETCH_ROWS * row_bytes + first / SUBS * BYTES;         \
            for (int64_t at = 0; at < (n + SUBS - 1) / SUBS * BYTES; at += 64)                     \
                __builtin_prefetch(ahead + at);                                                    \
            const chunk_scales c = chunk_##T(row, first, n);                                       \
            v8_store(a + first, c.a);                                                              \
            v8_store(b + 2 * first, c.b[0]);                                                       \
            v8_store(b + 2 * first + 8, c.b[1]);                                                   \
            for (int64_t s = first; s < first + n; s++) {                                          \
                const uint8_t *block = row + s / SUBS * BYTES;                                     \
                q_store(ints + 32 * s, ints_##T(block, (int)(s % SUBS)));                          \
                if (KIND == DOT_SCALED)                                                            \
                    for (int h = 0; h < 2; h++)                                                    \
                        sc[2 * s + h] = q6_scale(block, 2 * (s % SUBS) + h);                       \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_LAY_OUT(q4_0, 1, 18, DOT_U)
DEFINE_LAY_OUT(q4_1, 1, 20, DOT_U)
DEFINE_LAY_OUT(q5_0, 1, 22, DOT_U)
DEFINE_LAY_OUT(q8_0, 1, 34, DOT_S)
DEFINE_LAY_OUT(q4_k, 8, 144, DOT_U)
DEFINE_LAY_OUT(q5_k, 8, 176, DOT_U)
DEFINE_LAY_OUT(q6_k, 8, 210, DOT_SCALED)

typedef void (*lay_out_fn)(const uint8_t *row, int64_t row_bytes, int64_t subs, uint8_t *out);

/* ---- the tiles ---------------------------------------------------------------------------- */
/* Weight rows laid out together (TJ): each reads the same input vectors, so the more the
   fewer times the inputs stream from L2 (AVX512's four: 284-297 GFLOP/s a thread where two
   gave 231-263, docs/perf.md); each takes 8 accumulators of VR lanes, more than the
   registers hold at four, and four chains of integer sums. */
#if defined(PC_ISA_AVX512)
#define TJ 4
#elif defined(PC_ISA_AVX2)
#define TJ 2
#else
#define TJ 2
#endif

static inline uint32_t four_bytes(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* sub-block s's exact integer total for J weight rows against VR input rows. Each row's sum
   runs in four chains, two per half of 16 (groups 0 and 2, 1 and 3, 4 and 6, 5 and 7: Q6_K
   scales each half), added at the end: one chain of eight dependent dot instructions would
   wait on their latency. */
#define PARTS 4

static inline
    __attribute__((always_inline)) void sub_totals(const laid_out *w, side_by_side x, int64_t s,
                                                   vr p[TJ], const int J, const int kind) {
    vr part[TJ][PARTS];
    for (int j = 0; j < J; j++)
        for (int i = 0; i < PARTS; i++)
            part[j][i] = vr_zero();
    const int32_t *groups = x.groups + 8 * s * VR;
    if (kind == DOT_S) {
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const vr xv = vr_load(groups + g * VR);
            for (int j = 0; j < J; j++) {
                const uint32_t w4 = four_bytes(w[j].ints + 32 * s + 4 * g);
                vr *acc = &part[j][g % 2 + 2 * (g / 4)];
#if defined(PC_ISA_VNNI)
                /* signed weights plus 128 as unsigned bytes; 128 sum(q) taken away below */
                *acc = vr_dot_u(*acc, w4 ^ 0x80808080u, xv);
#else
                *acc = vr_dot_s(*acc, w4, xv);
#endif
            }
        }
    } else {
        /* chain c takes groups g and g + 2 (g = 0, 1, 4, 5), two at a time */
#pragma GCC unroll 4
        for (int c = 0; c < PARTS; c++) {
            const int g = c + (c & 2);
            const vr xv = vr_load(groups + g * VR), yv = vr_load(groups + (g + 2) * VR);
            for (int j = 0; j < J; j++) {
                const uint8_t *u = w[j].ints + 32 * s + 4 * g;
                part[j][c] = vr_dot_u2(part[j][c], four_bytes(u), xv, four_bytes(u + 8), yv);
            }
        }
    }
    for (int j = 0; j < J; j++) {
        const vr low = vr_add(part[j][0], part[j][1]), high = vr_add(part[j][2], part[j][3]);
        p[j] = kind == DOT_SCALED
                   ? vr_add(vr_scale(low, w[j].sc[2 * s]), vr_scale(high, w[j].sc[2 * s + 1]))
                   : vr_add(low, high);
    }
#if defined(PC_ISA_VNNI)
    if (kind == DOT_S) {
        const vr bias = vr_scale(vr_load(x.qsums + s * VR), 128);
        for (int j = 0; j < J; j++)
            p[j] = vr_sub(p[j], bias);
    }
#endif
}

/* a weight row's eight lanes and tail summed (v8_sum's tree: lanes l and l + 4, then those two
   apart, then the last two) into y[l * ldy] for input rows l < rows */
static inline void store_total(const float acc[CHUNK][VR], const float tail[VR], float *y,
                               int64_t ldy, int64_t rows) {
    vrf t[4];
    for (int l = 0; l < 4; l++)
        t[l] = vrf_add(vrf_load(acc[l]), vrf_load(acc[l + 4]));
    const vrf total = vrf_add(vrf_add(vrf_add(t[0], t[2]), vrf_add(t[1], t[3])), vrf_load(tail));
    float lanes[VR];
    vrf_store(lanes, total);
    for (int64_t l = 0; l < rows; l++)
        y[l * ldy] = lanes[l];
}

/* J laid-out weight rows against the VR rows of x: y[l * ldy + j] for rows l < rows. The
   eight canonical lanes of each weight row live in memory (L1), loaded and stored once a
   sub-block: in registers, they and the integer sums' chains did not fit, and the compiler's
   spills landed inside the chains (docs/perf.md, "int8 inputs"). */
static inline __attribute__((always_inline)) void tile(const laid_out *w, side_by_side x, int64_t k,
                                                       float *y, int64_t ldy, int64_t rows,
                                                       const int J, const int kind,
                                                       const int offsets) {
    const int64_t subs = k / 32;
    float acc[TJ][CHUNK][VR], tail[TJ][VR];
    for (int j = 0; j < J; j++) {
        vrf_store(tail[j], vrf_zero());
        for (int l = 0; l < CHUNK; l++)
            vrf_store(acc[j][l], vrf_zero());
    }
    for (int64_t first = 0; first < subs; first += CHUNK) {
        const int64_t n = subs - first < CHUNK ? subs - first : CHUNK;
#pragma GCC unroll 1
        for (int l = 0; l < CHUNK; l++) {
            if (l >= n) { /* as products_q8.c: a part chunk's missing lanes add 0 * 0 */
                for (int j = 0; j < J; j++)
                    vrf_store(acc[j][l], vrf_fma(vrf_zero(), vrf_zero(), vrf_load(acc[j][l])));
                continue;
            }
            const int64_t s = first + l;
            vr p[TJ];
            sub_totals(w, x, s, p, J, kind);
            const vrf dx = vrf_load(x.scales + s * VR);
            for (int j = 0; j < J; j++) {
                const vrf scale = vrf_mul(vrf_set1(w[j].a[s]), dx);
                vrf_store(acc[j][l], vrf_fma(vrf_from(p[j]), scale, vrf_load(acc[j][l])));
            }
        }
        for (int j = 0; j < J; j++) {
            const float *b = w[j].b + 2 * first;
#pragma GCC unroll 1
            for (int l = 0; l < CHUNK && offsets != OFFSETS_NONE; l++) {
                vrf a = vrf_load(acc[j][l]);
                if (offsets == OFFSETS_16) {
                    const float *sums = x.sums16 + 2 * first * VR;
                    a = vrf_fma(vrf_set1(b[l]), vrf_load(sums + l * VR), a);
                    a = vrf_fma(vrf_set1(b[l + 8]), vrf_load(sums + (l + 8) * VR), a);
                } else if (n == CHUNK) {
                    a = vrf_fma(vrf_set1(b[l]), vrf_load(x.sums32 + (first + l) * VR), a);
                } else if (l < n) { /* a part chunk's offsets one by one into the tail */
                    const vrf term = vrf_mul(vrf_set1(b[l]), vrf_load(x.sums32 + (first + l) * VR));
                    vrf_store(tail[j], vrf_add(vrf_load(tail[j]), term));
                }
                vrf_store(acc[j][l], a);
            }
        }
    }
    for (int j = 0; j < J; j++)
        store_total(acc[j], tail[j], y + j, ldy, rows);
}

/* The weight rows' integer product and offsets (weights_q8.h), as one number: the types
   that share both share a tile (five types share DOT_U with offsets per 32). */
enum { TILE_U32, TILE_S, TILE_SCALED16 };

/* J laid-out weight rows (TJ, or fewer one at a time) against the VR rows of x */
static void tile_rows(const laid_out *rows, side_by_side x, int64_t k, float *y, int64_t ldy,
                      int64_t rows_here, int J, int form) {
    for (int i = 0; J < TJ && i < J; i++) {
        const laid_out *w = rows + i;
        switch (form) {
        case TILE_U32: tile(w, x, k, y + i, ldy, rows_here, 1, DOT_U, OFFSETS_32); break;
        case TILE_S: tile(w, x, k, y + i, ldy, rows_here, 1, DOT_S, OFFSETS_NONE); break;
        default: tile(w, x, k, y + i, ldy, rows_here, 1, DOT_SCALED, OFFSETS_16); break;
        }
    }
    if (J < TJ)
        return;
    switch (form) {
    case TILE_U32: tile(rows, x, k, y, ldy, rows_here, TJ, DOT_U, OFFSETS_32); break;
    case TILE_S: tile(rows, x, k, y, ldy, rows_here, TJ, DOT_S, OFFSETS_NONE); break;
    default: tile(rows, x, k, y, ldy, rows_here, TJ, DOT_SCALED, OFFSETS_16); break;
    }
}

#if defined(PC_ISA_AMX)
/* ---- AMX: the integer totals from Intel's tile unit ---------------------------------------- */
/* One tile product (TDPBUSD, or TDPBSSD for Q8_0's signed weights) gives a sub-block's exact
   integer totals for 16 laid-out weight rows (the A tile: 16 rows of the sub-block's 32 bytes,
   a laid-out row's stride apart) against the 16 input rows of a vector (the B tile: the
   sub-block's eight groups of four bytes per row, side by side as they already are): 16 x 16
   totals where the VNNI tile takes 128 dot instructions. The totals go through L1, a chunk of them
   at a time, and from there the float work is tile()'s, operation for operation, so each output is
   the same bits as every other path's. */
#define AMX_J 16

/* palette 1: tiles 0-3 the totals (16 weight rows x 16 input rows), 4-5 weight rows (16 x 32
   bytes: a sub-block each), 6-7 input groups (8 x 64 bytes: a sub-block's of 16 rows) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

static void load_tile_config(void) {
    tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = t >= 4 && t < 6 ? 32 : 64;
        config.rows[t] = t >= 6 ? 8 : 16;
    }
    _tile_loadconfig(&config);
}

/* sub-block s's totals into tile c (tile numbers are immediates, hence a macro): the weight
   rows from `ints` (AMX_J rows `stride` apart) into tile a, the input groups from x into b */
#define AMX_TOTAL(c, a, b, s, sign)                                                                \
    do {                                                                                           \
        _tile_loadd(a, ints + 32 * (s), stride);                                                   \
        _tile_loadd(b, x.groups + 8 * (s) * VR, 4 * VR);                                           \
        _tile_zero(c);                                                                             \
        if (sign)                                                                                  \
            _tile_dpbssd(c, a, b);                                                                 \
        else                                                                                       \
            _tile_dpbusd(c, a, b);                                                                 \
    } while (0)

/* sub-blocks [first, first + n) of a chunk: their totals into totals[l][j] (32 bytes deep),
   four products in flight before their stores */
static inline __attribute__((always_inline)) void chunk_totals(const uint8_t *ints, int64_t stride,
                                                               side_by_side x, int64_t first,
                                                               int64_t n, int32_t *totals,
                                                               const int kind) {
    const int64_t T = AMX_J * VR; /* one tile of totals */
    const int sign = kind == DOT_S;
    for (int64_t l = 0; l < n; l += 4) {
        const int64_t s = first + l;
        AMX_TOTAL(0, 4, 6, s, sign);
        if (l + 1 < n)
            AMX_TOTAL(1, 5, 7, s + 1, sign);
        if (l + 2 < n)
            AMX_TOTAL(2, 4, 6, s + 2, sign);
        if (l + 3 < n)
            AMX_TOTAL(3, 5, 7, s + 3, sign);
        _tile_stored(0, totals + l * T, 4 * VR);
        if (l + 1 < n)
            _tile_stored(1, totals + (l + 1) * T, 4 * VR);
        if (l + 2 < n)
            _tile_stored(2, totals + (l + 2) * T, 4 * VR);
        if (l + 3 < n)
            _tile_stored(3, totals + (l + 3) * T, 4 * VR);
    }
}

/* The totals of one chunk: 16 x 16 for each of its sub-blocks */
#define CHUNK_TOTALS (CHUNK * AMX_J * VR)

/* J (<= AMX_J) laid-out weight rows, AMX_J strides apart from `ints`, against the VR rows of x:
   tile()'s float work on the tile unit's totals, each lane's operations in tile()'s order (a
   sub-block's product, then its offsets). The next chunk's tile products are issued before
   this chunk's float work, so the tile unit runs beside it. `scratch`: AMX_J * (CHUNK + 1) * VR
   floats, then 2 * CHUNK_TOTALS int32. */
static inline __attribute__((always_inline)) void
amx_tile(const laid_out *w, int64_t stride, side_by_side x, int64_t k, float *y, int64_t ldy,
         int64_t rows, int J, const int kind, const int offsets, float *scratch) {
    const int64_t subs = k / 32;
    float (*acc)[CHUNK][VR] = (float (*)[CHUNK][VR])scratch;
    float (*tail)[VR] = (float (*)[VR])(scratch + AMX_J * CHUNK * VR);
    int32_t *totals = (int32_t *)(scratch + AMX_J * (CHUNK + 1) * VR);
    for (int j = 0; j < J; j++) {
        vrf_store(tail[j], vrf_zero());
        for (int l = 0; l < CHUNK; l++)
            vrf_store(acc[j][l], vrf_zero());
    }
    chunk_totals(w[0].ints, stride, x, 0, subs < CHUNK ? subs : CHUNK, totals, kind);
    for (int64_t first = 0; first < subs; first += CHUNK) {
        const int64_t n = subs - first < CHUNK ? subs - first : CHUNK;
        const int32_t *these = totals + (first / CHUNK % 2) * CHUNK_TOTALS;
        if (first + CHUNK < subs) {
            const int64_t next = subs - first - CHUNK < CHUNK ? subs - first - CHUNK : CHUNK;
            chunk_totals(w[0].ints, stride, x, first + CHUNK, next,
                         totals + (first / CHUNK % 2 ^ 1) * CHUNK_TOTALS, kind);
        }
        for (int j = 0; j < J; j++) {
            const float *b = w[j].b + 2 * first;
            for (int l = 0; l < CHUNK; l++) {
                vrf a = vrf_load(acc[j][l]);
                if (l >= n) { /* as tile(): a part chunk's missing lanes add 0 * 0 */
                    vrf_store(acc[j][l], vrf_fma(vrf_zero(), vrf_zero(), a));
                    continue;
                }
                const int64_t s = first + l;
                const vr p = vr_load(these + (l * AMX_J + j) * VR);
                const vrf scale = vrf_mul(vrf_set1(w[j].a[s]), vrf_load(x.scales + s * VR));
                a = vrf_fma(vrf_from(p), scale, a);
                if (offsets == OFFSETS_32 && n == CHUNK) {
                    a = vrf_fma(vrf_set1(b[l]), vrf_load(x.sums32 + s * VR), a);
                } else if (offsets == OFFSETS_32) { /* a part chunk's offsets into the tail */
                    const vrf term = vrf_mul(vrf_set1(b[l]), vrf_load(x.sums32 + s * VR));
                    vrf_store(tail[j], vrf_add(vrf_load(tail[j]), term));
                }
                vrf_store(acc[j][l], a);
            }
        }
    }
    for (int j = 0; j < J; j++)
        store_total(acc[j], tail[j], y + j, ldy, rows);
}

/* the types the tile unit serves here: TILE_U32's and TILE_S's (Q6_K keeps VNNI's tiles) */
static void amx_tile_rows(const laid_out *rows, int64_t stride, side_by_side x, int64_t k, float *y,
                          int64_t ldy, int64_t rows_here, int J, int form, float *scratch) {
    if (form == TILE_S)
        amx_tile(rows, stride, x, k, y, ldy, rows_here, J, DOT_S, OFFSETS_NONE, scratch);
    else
        amx_tile(rows, stride, x, k, y, ldy, rows_here, J, DOT_U, OFFSETS_32, scratch);
}
#endif

/* `x8`: the weight is regrouped (its type, rows_x8.h), each group of rows taken back to its
   stored bytes first (x8_group_rows); 0 where it is not */
static int64_t tiles(lay_out_fn lay_out, int form, const uint8_t *w, int64_t row_bytes,
                     const uint8_t *inputs, int64_t m, int64_t k, float *y, int64_t ldy,
                     int64_t n_begin, int64_t n_end, int64_t x8) {
    const int64_t subs = k / 32, vectors = (m + VR - 1) / VR;
    const int64_t stride = (subs + CHUNK - 1) / CHUNK * LAID_OUT_CHUNK_BYTES;
    const int64_t vector_bytes = side_by_side_bytes(k);
#if defined(PC_ISA_AMX)
    /* weight rows AMX_J at a time, and the float work's accumulators and totals (amx_tile).
       Q6_K's halves took longer on the tile unit than in VNNI's tiles (Xeon, AMX: 30.1 against
       24.1 ms, 128 x 8192 x 2048), so it keeps those. */
    const int amx = form != TILE_SCALED16;
    enum { MOST = AMX_J };
    const int64_t scratch_bytes =
        (int64_t)(AMX_J * (CHUNK + 1) * VR * sizeof(float) + 2 * CHUNK_TOTALS * sizeof(int32_t));
#else
    const int amx = 0;
    enum { MOST = TJ };
    const int64_t scratch_bytes = 0;
#endif
    const int64_t step = amx ? MOST : TJ;
    const int64_t stored_bytes = x8 ? X8_ROWS * row_bytes : 0;
    uint8_t *buf = malloc((size_t)(step * stride + stored_bytes + scratch_bytes + 64));
    if (buf == NULL)
        return PC_NO_MEMORY;
    uint8_t *stored = buf + step * stride; /* x8: the group `group`'s rows as stored */
#if defined(PC_ISA_AMX)
    /* a last step's rows past n_end are read by the tile unit and their totals dropped: zero
       rather than whatever malloc left */
    float *scratch = (float *)(((uintptr_t)(stored + stored_bytes) + 63) & ~(uintptr_t)63);
    if (amx) {
        memset(buf, 0, (size_t)(step * stride));
        load_tile_config();
    }
#endif
    int64_t group = -1;
    for (int64_t j = n_begin; j < n_end; j += step) {
        const int J = n_end - j < step ? (int)(n_end - j) : (int)step;
        laid_out rows[MOST];
        for (int i = 0; i < J; i++) {
            const uint8_t *row = w + (j + i) * row_bytes;
            if (x8) {
                if ((j + i) / X8_ROWS != group) {
                    group = (j + i) / X8_ROWS;
                    x8_group_rows(x8, w + group * X8_ROWS * row_bytes, row_bytes, stored);
                    /* the lay-out's prefetch reads the copy: the group two ahead, here */
                    const uint8_t *ahead = w + (group + 2) * X8_ROWS * row_bytes;
                    for (int64_t at = 0; at < X8_ROWS * row_bytes; at += 64)
                        __builtin_prefetch(ahead + at);
                }
                row = stored + (j + i) % X8_ROWS * row_bytes;
            }
            lay_out(row, row_bytes, subs, buf + i * stride);
            rows[i] = laid_out_at(buf + i * stride, subs);
        }
        for (int64_t b = 0; b < vectors; b++) {
            const int64_t r0 = b * VR, rows_here = m - r0 < VR ? m - r0 : VR;
            const side_by_side x = side_by_side_at((uint8_t *)inputs + b * vector_bytes, k);
#if defined(PC_ISA_AMX)
            if (amx) {
                amx_tile_rows(rows, stride, x, k, y + r0 * ldy + j, ldy, rows_here, J, form,
                              scratch);
                continue;
            }
#endif
            tile_rows(rows, x, k, y + r0 * ldy + j, ldy, rows_here, J, form);
        }
    }
#if defined(PC_ISA_AMX)
    if (amx)
        _tile_release();
#endif
    free(buf);
    return PC_OK;
}

/* y[r * ldy + j] for weight rows [n_begin, n_end) of `type` against m input rows side by
   side (`inputs`, pc_q8_side_by_side's layout): PC_OK, PC_NO_MEMORY (nothing written) or
   PC_BAD_SHAPE. */
int64_t PC_FN(q8_tiles)(int64_t type, const uint8_t *w, int64_t row_bytes, const uint8_t *inputs,
                        int64_t m, int64_t k, float *y, int64_t ldy, int64_t n_begin,
                        int64_t n_end) {
    /* a regrouped weight (rows_x8.h) as its stored type, each group read back as stored */
    const int64_t x8 = x8_regrouped(type) ? type : 0;
#define TILES(T, FORM)                                                                             \
    tiles(lay_out_##T, FORM, w, row_bytes, inputs, m, k, y, ldy, n_begin, n_end, x8)
    switch (x8 ? x8_stored_type(type) : type) {
    case PC_Q4_0: return TILES(q4_0, TILE_U32);
    case PC_Q4_1: return TILES(q4_1, TILE_U32);
    case PC_Q5_0: return TILES(q5_0, TILE_U32);
    case PC_Q8_0: return TILES(q8_0, TILE_S);
    case PC_Q4_K: return TILES(q4_k, TILE_U32);
    case PC_Q5_K: return TILES(q5_k, TILE_U32);
    case PC_Q6_K: return TILES(q6_k, TILE_SCALED16);
    default: return PC_BAD_SHAPE;
    }
#undef TILES
}
