/* One small vocabulary of vector operations per instruction set, so that each kernel source
   is written once: `vf` is a vector of VF_W floats, `q32` 32 int8 weights.

   The build (kernels/cpu/build.py) defines exactly one of
     PC_ISA_GENERIC  plain C, no intrinsics: the reference every other version is probed
                     against, and the version any CPU can run (the compiler may still
                     vectorize its loops for the baseline: SSE2 on x86-64, NEON on arm64)
     PC_ISA_AVX2     x86-64-v3: AVX2, FMA, F16C
     PC_ISA_AVX512   x86-64-v4: AVX512 F/BW/DQ/VL
     PC_ISA_VNNI     x86-64-v4 with AVX512-VNNI
     PC_ISA_AMX      the VNNI version with Intel's tile unit (AMX-TILE, AMX-BF16, AMX-INT8) for
                     products of many rows (quants.c)
     PC_ISA_NEON     arm64 with NEON and the dot-product instructions (armv8.2-a+dotprod)
   and PC_ISA, the suffix of every exported name (pc_gemv_avx2). */
#ifndef PAGECHAT_SIMD_H
#define PAGECHAT_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PC_CAT_(a, b) a##b
#define PC_CAT(a, b) PC_CAT_(a, b)
/* pc_<name>_<isa>: each version's exported name */
#define PC_FN(name) PC_CAT(PC_CAT(pc_, name), PC_CAT(_, PC_ISA))

#if defined(PC_ISA_AMX)
#define PC_ISA_VNNI 1
#endif
#if defined(PC_ISA_VNNI)
#define PC_ISA_AVX512 1
#endif
#if defined(PC_ISA_AVX512) || defined(PC_ISA_AVX2)
#define PC_X86 1 /* AVX2's integer and F16C instructions, in every x86 version but generic */
#include <immintrin.h>
#endif
#if defined(PC_ISA_NEON)
#include <arm_neon.h>
#endif

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t bits_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* fp16 -> fp32 in plain C, exact and without a branch (so that the generic version's loops
   vectorize): the 15 bits below the sign, moved to fp32's exponent and mantissa positions,
   read as a float and scaled by 2^112 (which rebiases the exponent and turns fp16
   subnormals, read as fp32 subnormals, into their exact value); infinities and NaNs (an
   all-ones exponent) keep their mantissa under an all-ones exponent. */
static inline float fp16_to_f32_c(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t rest = (uint32_t)(h & 0x7FFFu) << 13;
    const uint32_t special = (h & 0x7C00u) == 0x7C00u ? 0x7F800000u : 0u;
    return f32_from_bits(sign | bits_from_f32(f32_from_bits(rest) * 0x1p112f) | special);
}

/* fp32 -> fp16 in plain C, rounded to nearest even as the hardware converts. */
static inline uint16_t f32_to_fp16_c(float f) {
    const uint32_t x = bits_from_f32(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t abs = x & 0x7FFFFFFFu;
    if (abs > 0x7F800000u)
        return sign | 0x7E00u; /* NaN */
    if (abs >= 0x477FF000u)
        return sign | 0x7C00u; /* rounds to 65520 or more: infinity */
    if (abs < 0x38800000u) {
        /* below fp16's smallest normal (2^-14): a multiple of 2^-24, rounded by adding and
           taking away 2^23 (the product is exact) */
        const float units = f32_from_bits(abs) * 0x1p24f;
        return sign | (uint16_t)((units + 0x1p23f) - 0x1p23f);
    }
    uint32_t r = abs - (112u << 23); /* exponent rebiased from 127 to 15 */
    r += 0xFFFu + ((r >> 13) & 1u);  /* round the 13 dropped bits to nearest even */
    return sign | (uint16_t)(r >> 13);
}

static inline float bf16_to_f32(uint16_t b) {
    return f32_from_bits((uint32_t)b << 16);
}

/* fp32 -> bf16, rounded to nearest even as torch rounds (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = bits_from_f32(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their peak, -|g| in SiLU), in plain arithmetic the
   compiler vectorizes (expf is a call per element): 2^(x log2 e) split into an integer
   power, set in the exponent bits, and a fraction's power by a degree-6 polynomial; relative
   error ~2e-7. Below -87 the result is 0, as expf's rounds to. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f; /* x log2 e, in [-125.5, 0] */
    const float whole = __builtin_floorf(t);
    const float f = t - whole; /* in [0, 1) */
    float p = 1.535336188e-4f;
    p = p * f + 1.339887440e-3f;
    p = p * f + 9.618437357e-3f;
    p = p * f + 5.550332471e-2f;
    p = p * f + 2.402264791e-1f;
    p = p * f + 6.931472028e-1f;
    p = p * f + 1.0f;
    return p * f32_from_bits((uint32_t)((int32_t)whole + 127) << 23);
}

/* A GGUF scale (fp16) as a float. */
static inline float fp16_scale(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(PC_X86)
    return _cvtsh_ss(h);
#else
    return fp16_to_f32_c(h);
#endif
}

/* ---- vectors of floats ----------------------------------------------------------------- */
#if defined(PC_ISA_AVX512)
#define VF_W 16
typedef __m512 vf;
static inline vf vf_zero(void) {
    return _mm512_setzero_ps();
}
static inline vf vf_load(const float *p) {
    return _mm512_loadu_ps(p);
}
static inline void vf_store(float *p, vf v) {
    _mm512_storeu_ps(p, v);
}
static inline vf vf_set1(float s) {
    return _mm512_set1_ps(s);
}
static inline vf vf_fma(vf a, vf b, vf c) {
    return _mm512_fmadd_ps(a, b, c);
}
static inline vf vf_add(vf a, vf b) {
    return _mm512_add_ps(a, b);
}
static inline vf vf_mul(vf a, vf b) {
    return _mm512_mul_ps(a, b);
}
static inline float vf_sum(vf v) {
    return _mm512_reduce_add_ps(v);
}
static inline vf vf_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void vf_store_f16(uint16_t *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

#elif defined(PC_ISA_AVX2)
#define VF_W 8
typedef __m256 vf;
static inline vf vf_zero(void) {
    return _mm256_setzero_ps();
}
static inline vf vf_load(const float *p) {
    return _mm256_loadu_ps(p);
}
static inline void vf_store(float *p, vf v) {
    _mm256_storeu_ps(p, v);
}
static inline vf vf_set1(float s) {
    return _mm256_set1_ps(s);
}
static inline vf vf_fma(vf a, vf b, vf c) {
    return _mm256_fmadd_ps(a, b, c);
}
static inline vf vf_add(vf a, vf b) {
    return _mm256_add_ps(a, b);
}
static inline vf vf_mul(vf a, vf b) {
    return _mm256_mul_ps(a, b);
}
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vf_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline void vf_store_f16(uint16_t *p, vf v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#elif defined(PC_ISA_NEON)
#define VF_W 4
typedef float32x4_t vf;
static inline vf vf_zero(void) {
    return vdupq_n_f32(0.0f);
}
static inline vf vf_load(const float *p) {
    return vld1q_f32(p);
}
static inline void vf_store(float *p, vf v) {
    vst1q_f32(p, v);
}
static inline vf vf_set1(float s) {
    return vdupq_n_f32(s);
}
static inline vf vf_fma(vf a, vf b, vf c) {
    return vfmaq_f32(c, a, b);
}
static inline vf vf_add(vf a, vf b) {
    return vaddq_f32(a, b);
}
static inline vf vf_mul(vf a, vf b) {
    return vmulq_f32(a, b);
}
static inline float vf_sum(vf v) {
    return vaddvq_f32(v);
}
static inline vf vf_load_f16(const uint16_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
static inline void vf_store_f16(uint16_t *p, vf v) {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); /* FPCR: round to nearest even */
}
static inline vf vf_load_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(p)), 16));
}

#else /* PC_ISA_GENERIC: eight floats in a struct; its loops are plain C */
#define VF_W 8
typedef struct {
    float v[8];
} vf;
static inline vf vf_zero(void) {
    vf r;
    for (int i = 0; i < 8; i++)
        r.v[i] = 0.0f;
    return r;
}
static inline vf vf_load(const float *p) {
    vf r;
    for (int i = 0; i < 8; i++)
        r.v[i] = p[i];
    return r;
}
static inline void vf_store(float *p, vf v) {
    for (int i = 0; i < 8; i++)
        p[i] = v.v[i];
}
static inline vf vf_set1(float s) {
    vf r;
    for (int i = 0; i < 8; i++)
        r.v[i] = s;
    return r;
}
/* a * b + c: fused where the compiler may fuse (arm64), a multiply and an add on a
   baseline x86-64 (fmaf there would be a library call per element) */
static inline vf vf_fma(vf a, vf b, vf c) {
    for (int i = 0; i < 8; i++)
        c.v[i] = c.v[i] + a.v[i] * b.v[i];
    return c;
}
static inline vf vf_add(vf a, vf b) {
    for (int i = 0; i < 8; i++)
        a.v[i] += b.v[i];
    return a;
}
static inline vf vf_mul(vf a, vf b) {
    for (int i = 0; i < 8; i++)
        a.v[i] *= b.v[i];
    return a;
}
static inline float vf_sum(vf v) {
    /* pairwise, as the vector versions reduce */
    for (int width = 4; width > 0; width /= 2)
        for (int i = 0; i < width; i++)
            v.v[i] += v.v[i + width];
    return v.v[0];
}
static inline vf vf_load_f16(const uint16_t *p) {
    vf r;
    for (int i = 0; i < 8; i++)
        r.v[i] = fp16_to_f32_c(p[i]);
    return r;
}
static inline void vf_store_f16(uint16_t *p, vf v) {
    for (int i = 0; i < 8; i++)
        p[i] = f32_to_fp16_c(v.v[i]);
}
static inline vf vf_load_bf16(const uint16_t *p) {
    vf r;
    for (int i = 0; i < 8; i++)
        r.v[i] = bf16_to_f32(p[i]);
    return r;
}
#endif

/* ---- 32 int8 weights: one GGUF (sub-)block's integers ---------------------------------- */
#define Q32_VECTORS (32 / VF_W)
#if defined(PC_X86)
typedef __m256i q32;
#if defined(PC_ISA_AVX512)
static inline void q32_to_vf(q32 q, vf out[Q32_VECTORS]) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
}
#else
static inline void q32_to_vf(q32 q, vf out[Q32_VECTORS]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
#endif
#elif defined(PC_ISA_NEON)
typedef int8x16x2_t q32;
static inline void q32_to_vf(q32 q, vf out[Q32_VECTORS]) {
    for (int h = 0; h < 2; h++) {
        const int16x8_t lo = vmovl_s8(vget_low_s8(q.val[h])), hi = vmovl_s8(vget_high_s8(q.val[h]));
        out[4 * h + 0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
        out[4 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
        out[4 * h + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
        out[4 * h + 3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
    }
}
#else
typedef struct {
    int8_t v[32];
} q32;
static inline void q32_to_vf(q32 q, vf out[Q32_VECTORS]) {
    for (int j = 0; j < Q32_VECTORS; j++)
        for (int i = 0; i < VF_W; i++)
            out[j].v[i] = (float)q.v[j * VF_W + i];
}
#endif

#endif
