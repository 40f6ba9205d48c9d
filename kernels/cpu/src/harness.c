/* A command-line harness over the kernels, for CPUs the test suite cannot load a library on:
   tests/kernels/test_arm64.py cross-compiles it with every arm64 version and runs it under
   qemu-user, one kernel call per run, on inputs the test wrote and checks against torch.

     harness runs                         the versions this CPU runs, one a line
     harness ISA gemv TYPE M N K THREADS W X Y
     harness ISA gemv_q8 TYPE M N K THREADS W X Y      (the products with int8 inputs)
     harness ISA dequant TYPE N K W OUT
     harness ISA attend CACHE B HQ HKV D C SCALE Q KC VC SLOTS LENS OUT
     harness ISA rope_write CACHE M HQ HKV D CACHE_SLOTS QKV COS SIN SLOTS KC VC QKV' KC' VC'
     harness ISA rms_norm ROWS D EPS X W OUT
     harness ISA silu_mul M INTER GATE_UP OUT
     harness ISA gelu_tanh_mul M INTER GATE_UP OUT
     harness ISA sample ROWS VOCAB WORDS LOGITS ALLOWED TEMPS MIN_P UNIFORMS OUT

   Inputs and outputs are raw little-endian files (a primed name is the output of what the
   unprimed one held). gemv with THREADS 2 runs pc_gemv_threads and its helper thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pagechat_cpu.h"

typedef struct {
    const char *name;
    pc_kernels kernels;
    pc_kernels int8; /* the same with int8 products */
    pc_dequant_fn *dequant;
    pc_sample_fn *sample;
} version;

#define VERSION(isa)                                                                               \
    {.name = #isa,                                                                                 \
     .kernels = {.gemv = pc_gemv_##isa,                                                            \
                 .attend = pc_attend_##isa,                                                        \
                 .rms_norm = pc_rms_norm_##isa,                                                    \
                 .rope_write = pc_rope_write_##isa,                                                \
                 .silu_mul = pc_silu_mul_##isa,                                                    \
                 .gelu_tanh_mul = pc_gelu_tanh_mul_##isa},                                         \
     .int8 = {.gemv = pc_gemv_q8_##isa,                                                            \
              .attend = pc_attend_##isa,                                                           \
              .rms_norm = pc_rms_norm_##isa,                                                       \
              .rope_write = pc_rope_write_##isa,                                                   \
              .silu_mul = pc_silu_mul_##isa,                                                       \
              .gelu_tanh_mul = pc_gelu_tanh_mul_##isa,                                             \
              .prepared_bytes = pc_q8_prepared_bytes_##isa,                                        \
              .prepare = pc_q8_prepare_##isa,                                                      \
              .gemv_prepared = pc_gemv_q8_prepared_##isa},                                         \
     .dequant = pc_dequant_##isa,                                                                  \
     .sample = pc_sample_##isa}

#if defined(__aarch64__)
static const version versions[] = {VERSION(generic), VERSION(neon)};
#else
static const version versions[] = {VERSION(generic), VERSION(avx2), VERSION(avx512), VERSION(vnni),
                                   VERSION(amx)};
#endif
#define VERSIONS ((int)(sizeof versions / sizeof versions[0]))

/* Every buffer the run allocates, freed before it exits: under LeakSanitizer a leak is then
   the kernels' own. */
static void *owned[32];
static int num_owned;

static void *take(size_t size) {
    void *p = malloc(size ? size : 1);
    if (p == NULL || num_owned == 32)
        exit(2);
    return owned[num_owned++] = p;
}

static int finish(int status) {
    while (num_owned)
        free(owned[--num_owned]);
    return status;
}

static void *load(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        perror(path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    const long length = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *data = take((size_t)length + 1);
    if (fread(data, 1, (size_t)length, f) != (size_t)length)
        exit(2);
    fclose(f);
    if (size)
        *size = (size_t)length;
    return data;
}

static void save(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(data, 1, size, f) != size) {
        perror(path);
        exit(2);
    }
    fclose(f);
}

static int64_t num(const char *s) {
    return strtoll(s, NULL, 10);
}

static size_t element_size(int64_t type) {
    return type == PC_F32 ? 4 : 2;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "runs") == 0) {
        for (int i = 0; i < VERSIONS; i++)
            if (pc_cpu_runs(versions[i].name))
                printf("%s\n", versions[i].name);
        return finish(0);
    }
    if (argc < 3)
        return 2;
    const version *v = NULL;
    for (int i = 0; i < VERSIONS; i++)
        if (strcmp(argv[1], versions[i].name) == 0)
            v = &versions[i];
    if (v == NULL || !pc_cpu_runs(v->name)) /* which also asks Linux for AMX's state */
        return 2;
    const char *op = argv[2];
    char **a = argv + 3;
    const int n = argc - 3;
    if ((strcmp(op, "gemv") == 0 || strcmp(op, "gemv_q8") == 0) && n == 8) {
        const int64_t type = num(a[0]), m = num(a[1]), rows = num(a[2]), k = num(a[3]);
        const int64_t row_bytes = k / pc_block_elements(type) * pc_block_bytes(type);
        const uint8_t *w = load(a[5], NULL);
        const float *x = load(a[6], NULL);
        float *y = take(sizeof(float) * (size_t)(m * rows));
        const pc_projection p = {
            .part = {{type, rows, k, row_bytes, w}}, .parts = 1, .n = rows, .k = k};
        const pc_kernels *kernels = strcmp(op, "gemv_q8") == 0 ? &v->int8 : &v->kernels;
        if (pc_gemv_threads(kernels, &p, x, m, y, num(a[4])))
            return finish(1);
        save(a[7], y, sizeof(float) * (size_t)(m * rows));
        return finish(0);
    }
    if (strcmp(op, "dequant") == 0 && n == 5) {
        const int64_t type = num(a[0]), rows = num(a[1]), k = num(a[2]);
        const int64_t row_bytes = k / pc_block_elements(type) * pc_block_bytes(type);
        float *out = take(sizeof(float) * (size_t)(rows * k));
        const uint8_t *w = load(a[3], NULL);
        if (v->dequant(type, w, row_bytes, k, 0, rows, out, k, PC_F32))
            return finish(1);
        save(a[4], out, sizeof(float) * (size_t)(rows * k));
        return finish(0);
    }
    if (strcmp(op, "attend") == 0 && n == 13) {
        const int64_t b = num(a[1]), hq = num(a[2]), d = num(a[4]), context = num(a[5]);
        float *out = take(sizeof(float) * (size_t)(b * hq * d));
        float *scores = take(sizeof(float) * (size_t)(hq * context));
        const pc_attention att = {.q = load(a[7], NULL),
                                  .q_stride = hq * d,
                                  .k_cache = load(a[8], NULL),
                                  .v_cache = load(a[9], NULL),
                                  .cache_type = num(a[0]),
                                  .slots = load(a[10], NULL),
                                  .slot_stride = context,
                                  .seq_lens = load(a[11], NULL),
                                  .out = out,
                                  .scores = scores,
                                  .hq = hq,
                                  .hkv = num(a[3]),
                                  .d = d,
                                  .scale = strtof(a[6], NULL)};
        if (v->kernels.attend(&att, 0, b, 0))
            return finish(1);
        save(a[12], out, sizeof(float) * (size_t)(b * hq * d));
        return finish(0);
    }
    if (strcmp(op, "rope_write") == 0 && n == 15) {
        const int64_t cache = num(a[0]), m = num(a[1]), hq = num(a[2]), hkv = num(a[3]);
        const int64_t d = num(a[4]), slots = num(a[5]);
        float *qkv = load(a[6], NULL);
        void *kc = load(a[10], NULL), *vc = load(a[11], NULL);
        v->kernels.rope_write(qkv, m, (hq + 2 * hkv) * d, hq, hkv, d, load(a[7], NULL),
                              load(a[8], NULL), load(a[9], NULL), kc, vc, cache);
        save(a[12], qkv, sizeof(float) * (size_t)(m * (hq + 2 * hkv) * d));
        save(a[13], kc, element_size(cache) * (size_t)(slots * hkv * d));
        save(a[14], vc, element_size(cache) * (size_t)(slots * hkv * d));
        return finish(0);
    }
    if (strcmp(op, "rms_norm") == 0 && n == 6) {
        const int64_t rows = num(a[0]), d = num(a[1]);
        float *out = take(sizeof(float) * (size_t)(rows * d));
        v->kernels.rms_norm(load(a[3], NULL), load(a[4], NULL), out, rows, d, strtof(a[2], NULL));
        save(a[5], out, sizeof(float) * (size_t)(rows * d));
        return finish(0);
    }
    if ((strcmp(op, "silu_mul") == 0 || strcmp(op, "gelu_tanh_mul") == 0) && n == 4) {
        const int64_t m = num(a[0]), inter = num(a[1]);
        float *out = take(sizeof(float) * (size_t)(m * inter));
        pc_gated_fn *const gated =
            strcmp(op, "silu_mul") == 0 ? v->kernels.silu_mul : v->kernels.gelu_tanh_mul;
        gated(load(a[2], NULL), out, inter, 0, m * inter);
        save(a[3], out, sizeof(float) * (size_t)(m * inter));
        return finish(0);
    }
    if (strcmp(op, "sample") == 0 && n == 9) {
        const int64_t rows = num(a[0]), vocab = num(a[1]), words = num(a[2]);
        int64_t *out = take(sizeof(int64_t) * (size_t)rows);
        if (v->sample(load(a[3], NULL), rows, vocab, vocab, load(a[4], NULL), words,
                      load(a[5], NULL), load(a[6], NULL), load(a[7], NULL), out))
            return finish(1);
        save(a[8], out, sizeof(int64_t) * (size_t)rows);
        return finish(0);
    }
    fprintf(stderr, "unknown command or arguments: %s (%d)\n", op, n);
    return 2;
}
