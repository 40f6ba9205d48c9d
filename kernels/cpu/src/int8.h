/* Integer products for int8 inputs: one small vocabulary per instruction set, so that
   products_q8.c is written once. Included after simd.h and blocks.h (the q32 type, q_load).

   dot_u(u, x): 32 unsigned weights (0..127) times 32 int8 inputs, summed in fours into eight
   int32 lanes: lane i holds elements 4i..4i+3. dot_s: the same for signed weights (Q8_0).
   dot_u_scaled(u, x, lo, hi): dot_u with lanes 0-3 (elements 0-15) times `lo` and lanes 4-7
   times `hi` (Q6_K's scale per 16 weights). Every version gives the same integers in the same
   lanes, exactly: the products are at most 63 * 128 * 128 a weight, so nothing overflows,
   and AVX2's saturating pair sums stay under 2^15 (u <= 127, |x| <= 127, and |w| <= 128 for
   dot_s through the sign trick).

   v8 is eight floats (a ymm on x86, two q registers on arm64) whatever the version's vf:
   each output's lanes take the same terms in the same order in every version. v8_set1 and
   friends build one from a weight block's scales without a round trip through memory;
   v8i_totals takes eight dot_u results to their eight totals, one a lane.

   For weights with eight rows in the lanes (rows_x8.h): q_set1_32 puts four inputs in every
   lane, dot_u_add accumulates each lane's products in place, and the v8i bit operations
   unpack eight rows' six-bit scales at once.

   vr and vrf are VR int32 and float lanes, one input row a lane (tiles_q8.c): vr_dot_u(p, u4,
   x) adds to each lane the products of the same four weights (u4, a byte each) with that
   row's four int8 inputs (x, four bytes a lane); vrf_fma fuses where the version's v8_fma
   does, so a row's sums are the same bits in both layouts. */
#ifndef PAGECHAT_INT8_H
#define PAGECHAT_INT8_H

#include "simd.h"

#if defined(PC_X86)
typedef __m256i v8i;
typedef __m256 v8;

static inline v8i dot_u(q32 u, q32 x) {
#if defined(PC_ISA_VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}
static inline v8i dot_u_scaled(q32 u, q32 x, int lo, int hi) {
    const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scales);
}
/* |w| times x with w's sign: the unsigned-by-signed product the instructions take */
static inline v8i dot_s(q32 w, q32 x) {
    return dot_u(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
static inline v8 v8_zero(void) {
    return _mm256_setzero_ps();
}
static inline v8 v8_load(const float *p) {
    return _mm256_loadu_ps(p);
}
static inline v8 v8_set1(float f) {
    return _mm256_set1_ps(f);
}
static inline v8 v8_fma(v8 a, v8 b, v8 c) {
    return _mm256_fmadd_ps(a, b, c);
}
static inline v8 v8_mul(v8 a, v8 b) {
    return _mm256_mul_ps(a, b);
}
static inline void v8_store(float *p, v8 v) {
    _mm256_storeu_ps(p, v);
}
/* acc + float(p) * s, lane by lane */
static inline v8 v8_fma_int(v8i p, float s, v8 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc);
}
/* the eight bytes of `bytes` (the first in lane 0) as floats */
static inline v8 v8_from_u8x8(uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)bytes)));
}
static inline v8 v8_from_s8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* n <= 8 fp16 values at p, p + stride, ... as floats (lanes past n zero), built in a
   register: eight scalar stores read back as a vector would wait for the stores to retire */
static inline v8 v8_from_fp16_strided(const uint8_t *p, int64_t stride, int64_t n) {
    __m128i h = _mm_setzero_si128();
    uint16_t v;
#define PC_LANE(i)                                                                                 \
    do {                                                                                           \
        if (n > i) {                                                                               \
            memcpy(&v, p + i * stride, 2);                                                         \
            h = _mm_insert_epi16(h, v, i);                                                         \
        }                                                                                          \
    } while (0)
    PC_LANE(0);
    PC_LANE(1);
    PC_LANE(2);
    PC_LANE(3);
    PC_LANE(4);
    PC_LANE(5);
    PC_LANE(6);
    PC_LANE(7);
#undef PC_LANE
    return _mm256_cvtph_ps(h);
}
static inline float v8_sum(v8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void q_store(uint8_t *p, q32 q) {
    _mm256_storeu_si256((__m256i *)p, q);
}

static inline v8i v8i_zero(void) {
    return _mm256_setzero_si256();
}
/* the totals of eight dot products' lanes: lane s = the sum of p[s]'s eight lanes */
static inline v8i v8i_totals(const v8i p[8]) {
    const __m256i a =
        _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b =
        _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    /* a: lanes 0-3 the low halves' sums of p[0..3], lanes 4-7 their high halves' (b: p[4..7]) */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}
/* acc + float(p) * s, lane by lane */
static inline v8 v8_fma_ints(v8i p, v8 s, v8 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc);
}
/* ---- eight weight rows in the lanes (rows_x8.h) */
/* four int8 inputs at p in every lane */
static inline q32 q_set1_32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}
/* p + dot_u(u, x) */
static inline v8i dot_u_add(v8i p, q32 u, q32 x) {
#if defined(PC_ISA_VNNI)
    return _mm256_dpbusd_epi32(p, u, x);
#else
    return _mm256_add_epi32(p, dot_u(u, x));
#endif
}
/* p + dot_s(w, x) */
static inline v8i dot_s_add(v8i p, q32 w, q32 x) {
    return dot_u_add(p, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
static inline v8i v8i_load(const uint8_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline v8i v8i_and(v8i a, uint32_t mask) {
    return _mm256_and_si256(a, _mm256_set1_epi32((int)mask));
}
static inline v8i v8i_or(v8i a, v8i b) {
    return _mm256_or_si256(a, b);
}
static inline v8i v8i_shr(v8i a, int n) {
    return _mm256_srli_epi32(a, n);
}
static inline v8i v8i_shl(v8i a, int n) {
    return _mm256_slli_epi32(a, n);
}
static inline v8 v8_from_ints(v8i a) {
    return _mm256_cvtepi32_ps(a);
}
static inline v8i v8i_add(v8i a, v8i b) {
    return _mm256_add_epi32(a, b);
}
static inline v8i v8i_mul(v8i a, v8i b) {
    return _mm256_mullo_epi32(a, b);
}
/* eight int8 values at p as int32 lanes */
static inline v8i v8i_from_s8x8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* Q6_K's high two bits of 32 weights as bits 4-5 of each byte: ((p[e] >> 2 run) & 3) << 4 */
static inline q32 q6_high_bits(const uint8_t *p, int run) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p), bits = _mm256_set1_epi8(0x30);
    switch (run) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(b, 4), bits);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(b, 2), bits);
    case 2: return _mm256_and_si256(b, bits);
    default: return _mm256_and_si256(_mm256_srli_epi16(b, 2), bits);
    }
}
static inline v8 v8_add(v8 a, v8 b) {
    return _mm256_add_ps(a, b);
}
/* eight fp16 values at p */
static inline v8 v8_from_fp16x8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

#if defined(PC_ISA_AVX512)
#define VR 16
typedef __m512i vr;
typedef __m512 vrf;
static inline vr vr_zero(void) {
    return _mm512_setzero_si512();
}
static inline vr vr_load(const int32_t *p) {
    return _mm512_loadu_si512(p);
}
static inline vr vr_sub(vr a, vr b) {
    return _mm512_sub_epi32(a, b);
}
static inline vr vr_add(vr a, vr b) {
    return _mm512_add_epi32(a, b);
}
static inline vr vr_scale(vr a, int32_t s) {
    return _mm512_mullo_epi32(a, _mm512_set1_epi32(s));
}
static inline vr vr_dot_u(vr p, uint32_t u4, vr x) {
#if defined(PC_ISA_VNNI)
    return _mm512_dpbusd_epi32(p, _mm512_set1_epi32((int)u4), x);
#else
    const __m512i pairs = _mm512_maddubs_epi16(_mm512_set1_epi32((int)u4), x);
    return _mm512_add_epi32(p, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
/* vr_dot_u twice: two groups' pair sums added in int16 before they widen (each at most
   2 * 63 * 127: two fit) */
static inline vr vr_dot_u2(vr p, uint32_t u4, vr x, uint32_t v4, vr y) {
#if defined(PC_ISA_VNNI)
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(p, _mm512_set1_epi32((int)u4), x),
                               _mm512_set1_epi32((int)v4), y);
#else
    const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(_mm512_set1_epi32((int)u4), x),
                                           _mm512_maddubs_epi16(_mm512_set1_epi32((int)v4), y));
    return _mm512_add_epi32(p, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
/* signed weights: |w| times x with w's sign (x is never -128) */
static inline vr vr_dot_s(vr p, uint32_t w4, vr x) {
    const __m512i w = _mm512_set1_epi32((int)w4);
    const __m512i signed_x =
        _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
#if defined(PC_ISA_VNNI)
    return _mm512_dpbusd_epi32(p, _mm512_abs_epi8(w), signed_x);
#else
    const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x);
    return _mm512_add_epi32(p, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
static inline vrf vrf_zero(void) {
    return _mm512_setzero_ps();
}
static inline vrf vrf_load(const float *p) {
    return _mm512_loadu_ps(p);
}
static inline void vrf_store(float *p, vrf v) {
    _mm512_storeu_ps(p, v);
}
static inline vrf vrf_set1(float f) {
    return _mm512_set1_ps(f);
}
static inline vrf vrf_add(vrf a, vrf b) {
    return _mm512_add_ps(a, b);
}
static inline vrf vrf_mul(vrf a, vrf b) {
    return _mm512_mul_ps(a, b);
}
static inline vrf vrf_fma(vrf a, vrf b, vrf c) {
    return _mm512_fmadd_ps(a, b, c);
}
static inline vrf vrf_from(vr p) {
    return _mm512_cvtepi32_ps(p);
}
#else
#define VR 8
typedef __m256i vr;
typedef __m256 vrf;
static inline vr vr_zero(void) {
    return _mm256_setzero_si256();
}
static inline vr vr_load(const int32_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline vr vr_sub(vr a, vr b) {
    return _mm256_sub_epi32(a, b);
}
static inline vr vr_add(vr a, vr b) {
    return _mm256_add_epi32(a, b);
}
static inline vr vr_scale(vr a, int32_t s) {
    return _mm256_mullo_epi32(a, _mm256_set1_epi32(s));
}
static inline vr vr_dot_u(vr p, uint32_t u4, vr x) {
#if defined(PC_ISA_VNNI)
    return _mm256_dpbusd_epi32(p, _mm256_set1_epi32((int)u4), x);
#else
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi32((int)u4), x);
    return _mm256_add_epi32(p, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline vr vr_dot_u2(vr p, uint32_t u4, vr x, uint32_t v4, vr y) {
#if defined(PC_ISA_VNNI)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(p, _mm256_set1_epi32((int)u4), x),
                               _mm256_set1_epi32((int)v4), y);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32((int)u4), x),
                                           _mm256_maddubs_epi16(_mm256_set1_epi32((int)v4), y));
    return _mm256_add_epi32(p, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline vr vr_dot_s(vr p, uint32_t w4, vr x) {
    const __m256i w = _mm256_set1_epi32((int)w4);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(p, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline vrf vrf_zero(void) {
    return _mm256_setzero_ps();
}
static inline vrf vrf_load(const float *p) {
    return _mm256_loadu_ps(p);
}
static inline void vrf_store(float *p, vrf v) {
    _mm256_storeu_ps(p, v);
}
static inline vrf vrf_set1(float f) {
    return _mm256_set1_ps(f);
}
static inline vrf vrf_add(vrf a, vrf b) {
    return _mm256_add_ps(a, b);
}
static inline vrf vrf_mul(vrf a, vrf b) {
    return _mm256_mul_ps(a, b);
}
static inline vrf vrf_fma(vrf a, vrf b, vrf c) {
    return _mm256_fmadd_ps(a, b, c);
}
static inline vrf vrf_from(vr p) {
    return _mm256_cvtepi32_ps(p);
}
#endif

#elif defined(PC_ISA_NEON)
typedef int32x4x2_t v8i;
typedef float32x4x2_t v8;

static inline v8i dot_u(q32 u, q32 x) {
    const v8i p = {{vdotq_s32(vdupq_n_s32(0), u.val[0], x.val[0]),
                    vdotq_s32(vdupq_n_s32(0), u.val[1], x.val[1])}};
    return p;
}
static inline v8i dot_u_scaled(q32 u, q32 x, int lo, int hi) {
    v8i p = dot_u(u, x);
    p.val[0] = vmulq_n_s32(p.val[0], lo);
    p.val[1] = vmulq_n_s32(p.val[1], hi);
    return p;
}
static inline v8i dot_s(q32 w, q32 x) {
    return dot_u(w, x); /* sdot multiplies signed by signed */
}
static inline v8 v8_zero(void) {
    const v8 z = {{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}};
    return z;
}
static inline v8 v8_load(const float *p) {
    const v8 v = {{vld1q_f32(p), vld1q_f32(p + 4)}};
    return v;
}
static inline v8 v8_set1(float f) {
    const v8 v = {{vdupq_n_f32(f), vdupq_n_f32(f)}};
    return v;
}
static inline v8 v8_fma(v8 a, v8 b, v8 c) {
    for (int h = 0; h < 2; h++)
        c.val[h] = vfmaq_f32(c.val[h], a.val[h], b.val[h]);
    return c;
}
static inline v8 v8_mul(v8 a, v8 b) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vmulq_f32(a.val[h], b.val[h]);
    return a;
}
static inline void v8_store(float *p, v8 v) {
    vst1q_f32(p, v.val[0]);
    vst1q_f32(p + 4, v.val[1]);
}
static inline v8 v8_fma_int(v8i p, float s, v8 acc) {
    for (int h = 0; h < 2; h++)
        acc.val[h] = vfmaq_n_f32(acc.val[h], vcvtq_f32_s32(p.val[h]), s);
    return acc;
}
static inline v8 v8_from_u8x8(uint64_t bytes) {
    const uint16x8_t wide = vmovl_u8(vcreate_u8(bytes));
    const v8 v = {{vcvtq_f32_u32(vmovl_u16(vget_low_u16(wide))),
                   vcvtq_f32_u32(vmovl_u16(vget_high_u16(wide)))}};
    return v;
}
static inline v8 v8_from_s8x8(const int8_t *p) {
    const int16x8_t wide = vmovl_s8(vld1_s8(p));
    const v8 v = {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))),
                   vcvtq_f32_s32(vmovl_s16(vget_high_s16(wide)))}};
    return v;
}
static inline v8 v8_from_fp16_strided(const uint8_t *p, int64_t stride, int64_t n) {
    uint16x8_t h = vdupq_n_u16(0);
    uint16_t v;
#define PC_LANE(i)                                                                                 \
    do {                                                                                           \
        if (n > i) {                                                                               \
            memcpy(&v, p + i * stride, 2);                                                         \
            h = vsetq_lane_u16(v, h, i);                                                           \
        }                                                                                          \
    } while (0)
    PC_LANE(0);
    PC_LANE(1);
    PC_LANE(2);
    PC_LANE(3);
    PC_LANE(4);
    PC_LANE(5);
    PC_LANE(6);
    PC_LANE(7);
#undef PC_LANE
    const v8 r = {{vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))),
                   vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)))}};
    return r;
}
static inline float v8_sum(v8 v) {
    /* pairwise as the x86 versions reduce: lanes i and i + 4 first */
    const float32x4_t s = vaddq_f32(v.val[0], v.val[1]);
    const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}
static inline void q_store(uint8_t *p, q32 q) {
    vst1q_s8((int8_t *)p, q.val[0]);
    vst1q_s8((int8_t *)p + 16, q.val[1]);
}

static inline v8i v8i_zero(void) {
    const v8i z = {{vdupq_n_s32(0), vdupq_n_s32(0)}};
    return z;
}
static inline v8i v8i_totals(const v8i p[8]) {
    int32x4_t t[8];
    for (int s = 0; s < 8; s++)
        t[s] = vaddq_s32(p[s].val[0], p[s].val[1]);
    const v8i totals = {{vpaddq_s32(vpaddq_s32(t[0], t[1]), vpaddq_s32(t[2], t[3])),
                         vpaddq_s32(vpaddq_s32(t[4], t[5]), vpaddq_s32(t[6], t[7]))}};
    return totals;
}
static inline v8 v8_fma_ints(v8i p, v8 s, v8 acc) {
    for (int h = 0; h < 2; h++)
        acc.val[h] = vfmaq_f32(acc.val[h], vcvtq_f32_s32(p.val[h]), s.val[h]);
    return acc;
}
static inline q32 q_set1_32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    const int8x16_t b = vreinterpretq_s8_u32(vdupq_n_u32(v));
    const q32 q = {{b, b}};
    return q;
}
static inline v8i dot_u_add(v8i p, q32 u, q32 x) {
    for (int h = 0; h < 2; h++)
        p.val[h] = vdotq_s32(p.val[h], u.val[h], x.val[h]);
    return p;
}
static inline v8i dot_s_add(v8i p, q32 w, q32 x) {
    return dot_u_add(p, w, x); /* sdot multiplies signed by signed */
}
static inline v8i v8i_load(const uint8_t *p) {
    const v8i v = {{vld1q_s32((const int32_t *)p), vld1q_s32((const int32_t *)p + 4)}};
    return v;
}
static inline v8i v8i_and(v8i a, uint32_t mask) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vandq_s32(a.val[h], vdupq_n_s32((int32_t)mask));
    return a;
}
static inline v8i v8i_or(v8i a, v8i b) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vorrq_s32(a.val[h], b.val[h]);
    return a;
}
static inline v8i v8i_shr(v8i a, int n) {
    for (int h = 0; h < 2; h++)
        a.val[h] =
            vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a.val[h]), vdupq_n_s32(-n)));
    return a;
}
static inline v8i v8i_shl(v8i a, int n) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vshlq_s32(a.val[h], vdupq_n_s32(n));
    return a;
}
static inline v8 v8_from_ints(v8i a) {
    const v8 v = {{vcvtq_f32_s32(a.val[0]), vcvtq_f32_s32(a.val[1])}};
    return v;
}
static inline v8i v8i_add(v8i a, v8i b) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vaddq_s32(a.val[h], b.val[h]);
    return a;
}
static inline v8i v8i_mul(v8i a, v8i b) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vmulq_s32(a.val[h], b.val[h]);
    return a;
}
static inline v8i v8i_from_s8x8(const uint8_t *p) {
    const int16x8_t wide = vmovl_s8(vld1_s8((const int8_t *)p));
    const v8i v = {{vmovl_s16(vget_low_s16(wide)), vmovl_s16(vget_high_s16(wide))}};
    return v;
}
static inline q32 q6_high_bits(const uint8_t *p, int run) {
    const int8x16_t shift = vdupq_n_s8((int8_t)(4 - 2 * run)), bits = vdupq_n_s8(0x30);
    q32 q;
    for (int h = 0; h < 2; h++) {
        const uint8x16_t b = vld1q_u8(p + 16 * h);
        q.val[h] = vandq_s8(vreinterpretq_s8_u8(vshlq_u8(b, shift)), bits);
    }
    return q;
}
static inline v8 v8_add(v8 a, v8 b) {
    for (int h = 0; h < 2; h++)
        a.val[h] = vaddq_f32(a.val[h], b.val[h]);
    return a;
}
static inline v8 v8_from_fp16x8(const uint8_t *p) {
    const uint16x8_t h = vld1q_u16((const uint16_t *)p);
    const v8 v = {{vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))),
                   vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)))}};
    return v;
}

#define VR 4
typedef int32x4_t vr;
typedef float32x4_t vrf;
static inline vr vr_zero(void) {
    return vdupq_n_s32(0);
}
static inline vr vr_load(const int32_t *p) {
    return vld1q_s32(p);
}
static inline vr vr_sub(vr a, vr b) {
    return vsubq_s32(a, b);
}
static inline vr vr_add(vr a, vr b) {
    return vaddq_s32(a, b);
}
static inline vr vr_scale(vr a, int32_t s) {
    return vmulq_n_s32(a, s);
}
static inline vr vr_dot_u(vr p, uint32_t u4, vr x) {
    return vdotq_s32(p, vreinterpretq_s8_u32(vdupq_n_u32(u4)), vreinterpretq_s8_s32(x));
}
static inline vr vr_dot_u2(vr p, uint32_t u4, vr x, uint32_t v4, vr y) {
    return vr_dot_u(vr_dot_u(p, u4, x), v4, y);
}
static inline vr vr_dot_s(vr p, uint32_t w4, vr x) {
    return vr_dot_u(p, w4, x); /* sdot multiplies signed by signed */
}
static inline vrf vrf_zero(void) {
    return vdupq_n_f32(0.0f);
}
static inline vrf vrf_load(const float *p) {
    return vld1q_f32(p);
}
static inline void vrf_store(float *p, vrf v) {
    vst1q_f32(p, v);
}
static inline vrf vrf_set1(float f) {
    return vdupq_n_f32(f);
}
static inline vrf vrf_add(vrf a, vrf b) {
    return vaddq_f32(a, b);
}
static inline vrf vrf_mul(vrf a, vrf b) {
    return vmulq_f32(a, b);
}
static inline vrf vrf_fma(vrf a, vrf b, vrf c) {
    return vfmaq_f32(c, a, b);
}
static inline vrf vrf_from(vr p) {
    return vcvtq_f32_s32(p);
}

#else /* generic */
typedef struct {
    int32_t v[8];
} v8i;
typedef struct {
    float v[8];
} v8;

static inline v8i dot_u_scaled(q32 u, q32 x, int lo, int hi) {
    v8i p;
    for (int i = 0; i < 8; i++) {
        int32_t sum = 0;
        for (int e = 4 * i; e < 4 * i + 4; e++)
            sum += (int32_t)(uint8_t)u.v[e] * x.v[e];
        p.v[i] = sum * (i < 4 ? lo : hi);
    }
    return p;
}
static inline v8i dot_u(q32 u, q32 x) {
    return dot_u_scaled(u, x, 1, 1);
}
static inline v8i dot_s(q32 w, q32 x) {
    v8i p;
    for (int i = 0; i < 8; i++) {
        int32_t sum = 0;
        for (int e = 4 * i; e < 4 * i + 4; e++)
            sum += (int32_t)w.v[e] * x.v[e];
        p.v[i] = sum;
    }
    return p;
}
static inline v8 v8_zero(void) {
    v8 z;
    for (int i = 0; i < 8; i++)
        z.v[i] = 0.0f;
    return z;
}
static inline v8 v8_load(const float *p) {
    v8 v;
    for (int i = 0; i < 8; i++)
        v.v[i] = p[i];
    return v;
}
static inline v8 v8_set1(float f) {
    v8 v;
    for (int i = 0; i < 8; i++)
        v.v[i] = f;
    return v;
}
/* a * b + c as a multiply and an add (see simd.h's vf_fma) */
static inline v8 v8_fma(v8 a, v8 b, v8 c) {
    for (int i = 0; i < 8; i++)
        c.v[i] = c.v[i] + a.v[i] * b.v[i];
    return c;
}
static inline v8 v8_mul(v8 a, v8 b) {
    for (int i = 0; i < 8; i++)
        a.v[i] *= b.v[i];
    return a;
}
static inline void v8_store(float *p, v8 v) {
    for (int i = 0; i < 8; i++)
        p[i] = v.v[i];
}
static inline v8 v8_fma_int(v8i p, float s, v8 acc) {
    for (int i = 0; i < 8; i++)
        acc.v[i] = acc.v[i] + (float)p.v[i] * s;
    return acc;
}
static inline v8 v8_from_u8x8(uint64_t bytes) {
    v8 v;
    for (int i = 0; i < 8; i++)
        v.v[i] = (float)((bytes >> (8 * i)) & 0xFF);
    return v;
}
static inline v8 v8_from_s8x8(const int8_t *p) {
    v8 v;
    for (int i = 0; i < 8; i++)
        v.v[i] = (float)p[i];
    return v;
}
static inline v8 v8_from_fp16_strided(const uint8_t *p, int64_t stride, int64_t n) {
    v8 v;
    for (int64_t i = 0; i < 8; i++) {
        uint16_t h = 0;
        if (i < n)
            memcpy(&h, p + i * stride, 2);
        v.v[i] = fp16_to_f32_c(h);
    }
    return v;
}
static inline float v8_sum(v8 v) {
    for (int width = 4; width > 0; width /= 2)
        for (int i = 0; i < width; i++)
            v.v[i] += v.v[i + width];
    return v.v[0];
}
static inline void q_store(uint8_t *p, q32 q) {
    memcpy(p, q.v, 32);
}

static inline v8i v8i_zero(void) {
    v8i z;
    for (int i = 0; i < 8; i++)
        z.v[i] = 0;
    return z;
}
static inline v8i v8i_totals(const v8i p[8]) {
    v8i totals;
    for (int s = 0; s < 8; s++) {
        int32_t sum = 0;
        for (int i = 0; i < 8; i++)
            sum += p[s].v[i];
        totals.v[s] = sum;
    }
    return totals;
}
static inline v8 v8_fma_ints(v8i p, v8 s, v8 acc) {
    for (int i = 0; i < 8; i++)
        acc.v[i] = acc.v[i] + (float)p.v[i] * s.v[i];
    return acc;
}
static inline q32 q_set1_32(const uint8_t *p) {
    q32 q;
    for (int i = 0; i < 32; i++)
        q.v[i] = (int8_t)p[i % 4];
    return q;
}
static inline v8i dot_u_add(v8i p, q32 u, q32 x) {
    const v8i d = dot_u(u, x);
    for (int i = 0; i < 8; i++)
        p.v[i] += d.v[i];
    return p;
}
static inline v8i dot_s_add(v8i p, q32 w, q32 x) {
    const v8i d = dot_s(w, x);
    for (int i = 0; i < 8; i++)
        p.v[i] += d.v[i];
    return p;
}
static inline v8i v8i_load(const uint8_t *p) {
    v8i v;
    memcpy(v.v, p, sizeof v.v);
    return v;
}
static inline v8i v8i_and(v8i a, uint32_t mask) {
    for (int i = 0; i < 8; i++)
        a.v[i] = (int32_t)((uint32_t)a.v[i] & mask);
    return a;
}
static inline v8i v8i_or(v8i a, v8i b) {
    for (int i = 0; i < 8; i++)
        a.v[i] = (int32_t)((uint32_t)a.v[i] | (uint32_t)b.v[i]);
    return a;
}
static inline v8i v8i_shr(v8i a, int n) {
    for (int i = 0; i < 8; i++)
        a.v[i] = (int32_t)((uint32_t)a.v[i] >> n);
    return a;
}
static inline v8i v8i_shl(v8i a, int n) {
    for (int i = 0; i < 8; i++)
        a.v[i] = (int32_t)((uint32_t)a.v[i] << n);
    return a;
}
static inline v8 v8_from_ints(v8i a) {
    v8 v;
    for (int i = 0; i < 8; i++)
        v.v[i] = (float)a.v[i];
    return v;
}
static inline v8i v8i_add(v8i a, v8i b) {
    for (int i = 0; i < 8; i++)
        a.v[i] += b.v[i];
    return a;
}
static inline v8i v8i_mul(v8i a, v8i b) {
    for (int i = 0; i < 8; i++)
        a.v[i] *= b.v[i];
    return a;
}
static inline v8i v8i_from_s8x8(const uint8_t *p) {
    v8i v;
    for (int i = 0; i < 8; i++)
        v.v[i] = (int8_t)p[i];
    return v;
}
static inline q32 q6_high_bits(const uint8_t *p, int run) {
    q32 q;
    for (int i = 0; i < 32; i++)
        q.v[i] = (int8_t)(((p[i] >> (2 * run)) & 3) << 4);
    return q;
}
static inline v8 v8_add(v8 a, v8 b) {
    for (int i = 0; i < 8; i++)
        a.v[i] += b.v[i];
    return a;
}
static inline v8 v8_from_fp16x8(const uint8_t *p) {
    v8 v;
    for (int i = 0; i < 8; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        v.v[i] = fp16_to_f32_c(h);
    }
    return v;
}

#define VR 8
typedef struct {
    int32_t v[8];
} vr;
typedef struct {
    float v[8];
} vrf;
static inline vr vr_zero(void) {
    vr r;
    for (int i = 0; i < VR; i++)
        r.v[i] = 0;
    return r;
}
static inline vr vr_load(const int32_t *p) {
    vr r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline vr vr_sub(vr a, vr b) {
    for (int i = 0; i < VR; i++)
        a.v[i] -= b.v[i];
    return a;
}
static inline vr vr_add(vr a, vr b) {
    for (int i = 0; i < VR; i++)
        a.v[i] += b.v[i];
    return a;
}
static inline vr vr_scale(vr a, int32_t s) {
    for (int i = 0; i < VR; i++)
        a.v[i] *= s;
    return a;
}
static inline vr vr_dot_u(vr p, uint32_t u4, vr x) {
    for (int i = 0; i < VR; i++)
        for (int e = 0; e < 4; e++)
            p.v[i] += (int32_t)((u4 >> (8 * e)) & 0xFF) * (int8_t)((uint32_t)x.v[i] >> (8 * e));
    return p;
}
static inline vr vr_dot_u2(vr p, uint32_t u4, vr x, uint32_t v4, vr y) {
    return vr_dot_u(vr_dot_u(p, u4, x), v4, y);
}
static inline vr vr_dot_s(vr p, uint32_t w4, vr x) {
    for (int i = 0; i < VR; i++)
        for (int e = 0; e < 4; e++)
            p.v[i] += (int8_t)(w4 >> (8 * e)) * (int8_t)((uint32_t)x.v[i] >> (8 * e));
    return p;
}
static inline vrf vrf_zero(void) {
    vrf r;
    for (int i = 0; i < VR; i++)
        r.v[i] = 0.0f;
    return r;
}
static inline vrf vrf_load(const float *p) {
    vrf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void vrf_store(float *p, vrf v) {
    memcpy(p, v.v, sizeof v.v);
}
static inline vrf vrf_set1(float f) {
    vrf r;
    for (int i = 0; i < VR; i++)
        r.v[i] = f;
    return r;
}
static inline vrf vrf_add(vrf a, vrf b) {
    for (int i = 0; i < VR; i++)
        a.v[i] += b.v[i];
    return a;
}
static inline vrf vrf_mul(vrf a, vrf b) {
    for (int i = 0; i < VR; i++)
        a.v[i] *= b.v[i];
    return a;
}
/* a multiply and an add, as v8_fma */
static inline vrf vrf_fma(vrf a, vrf b, vrf c) {
    for (int i = 0; i < VR; i++)
        c.v[i] = c.v[i] + a.v[i] * b.v[i];
    return c;
}
static inline vrf vrf_from(vr p) {
    vrf r;
    for (int i = 0; i < VR; i++)
        r.v[i] = (float)p.v[i];
    return r;
}
#endif

#endif
