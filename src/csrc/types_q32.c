/* The 32-element types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (ggml-common.h's layouts). Each
 * product is llama.cpp's: the weight block's integers against the activation block's, summed in
 * integers, scaled by both blocks' scales; Q4_1 and Q5_1 add their minimum times the Q8_1
 * activation block's `s` (d · Σqs), the others pair with Q8_0.
 *
 * Every type has a scalar reading of its block into 32 integers, which dequantization and the
 * portable product share. The vector products read the same integers: AVX-512 VNNI four blocks
 * per step (vpdpbusd), AVX2 four (vpmaddubsw), NEON one (vmull_s8); a build with none of them
 * keeps the scalar product, and each vector product hands a row's last blocks to it. */
#include <string.h>

#include "llmcli_cpu.h"

typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;                     /* 18 bytes */
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;                  /* 20 */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;      /* 22 */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_1;   /* 24 */
typedef struct { uint16_t d; int8_t qs[QK]; } block_w8_0;                          /* 34: Q8_0 weights */
typedef block_q4_0 block_iq4_nl; /* 18: same layout, the nibbles index IQ4_NL_VALUES */

_Static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20 && sizeof(block_q5_0) == 22 &&
               sizeof(block_q5_1) == 24 && sizeof(block_w8_0) == 34, "GGUF's block sizes");

/* IQ4_NL's 16 levels (ggml-common.h's kvalues_iq4nl): a non-uniform 4-bit grid. */
static const int8_t IQ4_NL_VALUES[16] = { -127, -104, -83, -65, -49, -35, -22, -10,
                                          1, 13, 25, 38, 53, 69, 89, 113 };

/* Inlined even where the compiler would not: the per-type wrappers pass their block readers as
 * constants, and only inlining turns those into straight-line, vectorizable code. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

static inline float half(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return fp16_to_fp32(h);
#endif
}

static inline uint32_t high_bits(const uint8_t qh[4]) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    return bits;
}

/* ---- Scalar: each block's 32 integers in element order (low nibbles first). ---- */

static inline void nibbles_of(const uint8_t qs[QK / 2], int8_t out[QK], int offset) {
    for (int j = 0; j < QK / 2; j++) {
        out[j] = (int8_t)((qs[j] & 0x0F) - offset);
        out[j + QK / 2] = (int8_t)((qs[j] >> 4) - offset);
    }
}

/* 1 << j for each element j: testing qh against a table, not shifting by j, lets the compiler
 * vectorize the loop on targets without per-lane shifts (SSE2). */
#define FOUR_BITS(j) 1u << (j), 1u << ((j) + 1), 1u << ((j) + 2), 1u << ((j) + 3)
static const uint32_t BIT_OF[QK] = { FOUR_BITS(0), FOUR_BITS(4), FOUR_BITS(8), FOUR_BITS(12),
                                     FOUR_BITS(16), FOUR_BITS(20), FOUR_BITS(24), FOUR_BITS(28) };

static inline void five_bits_of(const uint8_t qs[QK / 2], const uint8_t qh[4], int8_t out[QK], int offset) {
    const uint32_t bits = high_bits(qh);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = (int8_t)(((qs[j] & 0x0F) | (bits & BIT_OF[j] ? 0x10 : 0)) - offset);
        out[j + QK / 2] = (int8_t)(((qs[j] >> 4) | (bits & BIT_OF[j + QK / 2] ? 0x10 : 0)) - offset);
    }
}

static ALWAYS_INLINE void ints_q4_0(const void *b, int8_t out[QK]) {
    nibbles_of(((const block_q4_0 *)b)->qs, out, 8);
}
static ALWAYS_INLINE void ints_q4_1(const void *b, int8_t out[QK]) {
    nibbles_of(((const block_q4_1 *)b)->qs, out, 0);
}
static ALWAYS_INLINE void ints_q5_0(const void *b, int8_t out[QK]) {
    five_bits_of(((const block_q5_0 *)b)->qs, ((const block_q5_0 *)b)->qh, out, 16);
}
static ALWAYS_INLINE void ints_q5_1(const void *b, int8_t out[QK]) {
    five_bits_of(((const block_q5_1 *)b)->qs, ((const block_q5_1 *)b)->qh, out, 0);
}
static ALWAYS_INLINE void ints_q8_0(const void *b, int8_t out[QK]) {
    memcpy(out, ((const block_w8_0 *)b)->qs, QK);
}
static ALWAYS_INLINE void ints_iq4_nl(const void *b, int8_t out[QK]) {
    const block_iq4_nl *x = b;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = IQ4_NL_VALUES[x->qs[j] & 0x0F];
        out[j + QK / 2] = IQ4_NL_VALUES[x->qs[j] >> 4];
    }
}

typedef void (*block_ints)(const void *block, int8_t out[QK]);

/* d · q (+ m for the types with a minimum, whose half sits right after d), as gguf computes it.
 * d · q is exact in float (11 significant bits times at most 5), so a compiler that fuses the sum
 * into an FMA rounds once, as gguf's product-then-sum does. */
static ALWAYS_INLINE void dequantize_blocks(const char *blocks, int bytes, block_ints ints, int has_min, float *out,
                                            int64_t k) {
    int8_t q[QK];
    for (int64_t i = 0; i < k / QK; i++, blocks += bytes) {
        const uint16_t *halves = (const uint16_t *)blocks;
        const float d = fp16_to_fp32(halves[0]), m = has_min ? fp16_to_fp32(halves[1]) : 0.0f;
        ints(blocks, q);
        for (int j = 0; j < QK; j++) {
            const float scaled = d * (float)q[j];
            out[i * QK + j] = has_min ? scaled + m : scaled;
        }
    }
}

/* Σ w·a per block, times both scales; for the types with a minimum, + m · s of the Q8_1 block.
 * Inlined into each type's function with its `ints` known, so the compiler vectorizes the whole. */
static ALWAYS_INLINE float dot_blocks(int64_t k, const char *w, int bytes, block_ints ints, int has_min,
                                      const void *act) {
    int8_t q[QK];
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++, w += bytes) {
        const uint16_t *halves = (const uint16_t *)w;
        const int8_t *a_qs = has_min ? ((const block_q8_1 *)act)[i].qs : ((const block_q8_0 *)act)[i].qs;
        const uint16_t a_d = has_min ? ((const block_q8_1 *)act)[i].d : ((const block_q8_0 *)act)[i].d;
        ints(w, q);
        int s = 0;
        for (int j = 0; j < QK; j++) s += q[j] * a_qs[j];
        sum += (float)s * half(halves[0]) * half(a_d);
        if (has_min) sum += half(halves[1]) * half(((const block_q8_1 *)act)[i].s);
    }
    return sum;
}

/* One type's scalar pair: dequantize_<name> and dot_<name>_scalar. */
#define SCALAR_TYPE(name, block, has_min)                                                          \
    static void dequantize_##name(const void *blocks, float *out, int64_t k) {                    \
        dequantize_blocks(blocks, sizeof(block), ints_##name, has_min, out, k);                    \
    }                                                                                              \
    static float __attribute__((unused)) dot_##name##_scalar(int64_t k, const void *w, const void *a) { \
        return dot_blocks(k, w, sizeof(block), ints_##name, has_min, a);                           \
    }
SCALAR_TYPE(q4_0, block_q4_0, 0)
SCALAR_TYPE(q4_1, block_q4_1, 1)
SCALAR_TYPE(q5_0, block_q5_0, 0)
SCALAR_TYPE(q5_1, block_q5_1, 1)
SCALAR_TYPE(q8_0, block_w8_0, 0)
SCALAR_TYPE(iq4_nl, block_iq4_nl, 0)

/* Where a product reads its activation block: Q8_1 (the types with a minimum) or Q8_0. */
#define ACT_BYTES(has_min) ((has_min) ? (int)sizeof(block_q8_1) : (int)sizeof(block_q8_0))
#define ACT_QS(block, has_min) ((const int8_t *)(block) + ((has_min) ? 4 : 2))
#define ACT_D(block) (((const uint16_t *)(block))[0])
#define ACT_S(block) (((const uint16_t *)(block))[1])

#if defined(__AVX2__) && defined(__F16C__)
/* Four blocks' products x·y of two halves each (field 0: d, field 1: m or s), converted together. */
static inline __m128 half_products_x4(const char *x, int x_bytes, const char *y, int y_bytes, int field) {
#define HALF_AT(base, stride, j) ((const uint16_t *)((base) + (j) * (stride)))[field]
    const __m128i halves = _mm_setr_epi16(
        (short)HALF_AT(x, x_bytes, 0), (short)HALF_AT(x, x_bytes, 1), (short)HALF_AT(x, x_bytes, 2),
        (short)HALF_AT(x, x_bytes, 3), (short)HALF_AT(y, y_bytes, 0), (short)HALF_AT(y, y_bytes, 1),
        (short)HALF_AT(y, y_bytes, 2), (short)HALF_AT(y, y_bytes, 3));
#undef HALF_AT
    const __m256 both = _mm256_cvtph_ps(halves);
    return _mm_mul_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
}

/* Sum of an accumulator's four lanes. */
static inline float sum_of_four(__m128 four) {
    four = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* AVX-512 VNNI: two blocks per 512-bit register (bytes 0–31 the first block's integers, 32–63 the
 * second's). vpdpbusd multiplies unsigned bytes by signed ones, so each type hands it its
 * integers as stored plus an offset (Q4_0: q + 8; Q8_0 and IQ4_NL: q + 128), and the offset times
 * Σa, one more vpdpbusd on the activations alone, is taken off before the block's scale. */
static inline __m512i pair_of(__m256i first, __m256i second) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
}

static inline __m512i nibbles_x2(const uint8_t *qs0, const uint8_t *qs1) {
    const __m512i both = pair_of(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs0)),
                                 _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs1)));
    /* 128-bit lanes 0 and 2 keep the low nibbles, 1 and 3 take the high ones. */
    const __m512i halves = _mm512_mask_blend_epi64(0xCC, both, _mm512_srli_epi16(both, 4));
    return _mm512_and_si512(halves, _mm512_set1_epi8(0x0F));
}

/* Q5's fifth bits: bit j of qh belongs to element j, so the 64 bits are a byte mask. */
static inline __m512i fives_x2(__m512i nibbles, const uint8_t *qh0, const uint8_t *qh1) {
    const __mmask64 fifth = high_bits(qh0) | (uint64_t)high_bits(qh1) << 32;
    return _mm512_mask_add_epi8(nibbles, fifth, nibbles, _mm512_set1_epi8(0x10));
}

typedef __m512i (*stored_ints)(const char *w0, const char *w1);

static inline __m512i q4_0_stored(const char *w0, const char *w1) {
    return nibbles_x2(((const block_q4_0 *)w0)->qs, ((const block_q4_0 *)w1)->qs);
}
static inline __m512i q4_1_stored(const char *w0, const char *w1) {
    return nibbles_x2(((const block_q4_1 *)w0)->qs, ((const block_q4_1 *)w1)->qs);
}
static inline __m512i q5_0_stored(const char *w0, const char *w1) {
    const block_q5_0 *x0 = (const block_q5_0 *)w0, *x1 = (const block_q5_0 *)w1;
    return fives_x2(nibbles_x2(x0->qs, x1->qs), x0->qh, x1->qh);
}
static inline __m512i q5_1_stored(const char *w0, const char *w1) {
    const block_q5_1 *x0 = (const block_q5_1 *)w0, *x1 = (const block_q5_1 *)w1;
    return fives_x2(nibbles_x2(x0->qs, x1->qs), x0->qh, x1->qh);
}
static inline __m512i q8_0_stored(const char *w0, const char *w1) {
    const __m512i q = pair_of(_mm256_loadu_si256((const __m256i *)((const block_w8_0 *)w0)->qs),
                              _mm256_loadu_si256((const __m256i *)((const block_w8_0 *)w1)->qs));
    return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
}
static inline __m512i iq4_nl_stored(const char *w0, const char *w1) {
    const __m512i levels = _mm512_broadcast_i32x4(_mm_xor_si128(
        _mm_loadu_si128((const __m128i *)IQ4_NL_VALUES), _mm_set1_epi8((char)0x80)));
    return _mm512_shuffle_epi8(levels, nibbles_x2(((const block_iq4_nl *)w0)->qs, ((const block_iq4_nl *)w1)->qs));
}

static inline __m512i acts_x2(const char *a0, const char *a1, int has_min) {
    return pair_of(_mm256_loadu_si256((const __m256i *)ACT_QS(a0, has_min)),
                   _mm256_loadu_si256((const __m256i *)ACT_QS(a1, has_min)));
}

/* Four blocks per step, in two registers; their four scales are converted at once and spread
 * over each block's eight lanes. */
static ALWAYS_INLINE float dot_simd(int64_t k, const char *w, int bytes, stored_ints stored, int offset, int has_min,
                                    const char *act, float (*scalar)(int64_t, const void *, const void *)) {
    const int64_t blocks = k / QK;
    const int act_bytes = ACT_BYTES(has_min);
    const __m512i offsets = _mm512_set1_epi8((char)offset);
    const __m512i first_two = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i last_two = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m128 minimums = _mm_setzero_ps();
    int64_t i = 0;
    for (; i + 3 < blocks; i += 4, w += 4 * bytes, act += 4 * act_bytes) {
        const __m512i a01 = acts_x2(act, act + act_bytes, has_min);
        const __m512i a23 = acts_x2(act + 2 * act_bytes, act + 3 * act_bytes, has_min);
        __m512i s01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), stored(w, w + bytes), a01);
        __m512i s23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), stored(w + 2 * bytes, w + 3 * bytes), a23);
        if (offset) {
            s01 = _mm512_sub_epi32(s01, _mm512_dpbusd_epi32(_mm512_setzero_si512(), offsets, a01));
            s23 = _mm512_sub_epi32(s23, _mm512_dpbusd_epi32(_mm512_setzero_si512(), offsets, a23));
        }
        const __m512 scales = _mm512_castps128_ps512(half_products_x4(w, bytes, act, act_bytes, 0));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s01), _mm512_permutexvar_ps(first_two, scales), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s23), _mm512_permutexvar_ps(last_two, scales), acc1);
        if (has_min) minimums = _mm_add_ps(minimums, half_products_x4(w, bytes, act, act_bytes, 1));
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + sum_of_four(minimums);
    for (; i < blocks; i++, w += bytes, act += act_bytes) sum += scalar(QK, w, act);
    return sum;
}

#define SIGNED 128 /* Q8_0's and IQ4_NL's signed integers, handed over + 128 */

#elif defined(__AVX2__)
/* AVX2 (+FMA): one block per 256-bit register, two blocks per step. vpmaddubsw multiplies
 * unsigned bytes by signed ones into int16 pairs: the 4- and 5-bit types give it their integers
 * as stored (q + offset) and take offset · a off the pairs; the signed types (Q8_0, IQ4_NL), whose
 * bytes + 128 would overflow an int16 pair, give it |q| and a carrying q's sign instead. */
#define SIGNED -1

static inline __m256i nibbles_x1(const uint8_t *qs) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

/* Q5's fifth bits: byte j takes qh's byte j / 8, keeps its bit j % 8, and becomes 0x10 if set. */
static inline __m256i fives_x1(__m256i nibbles, const uint8_t *qh) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)high_bits(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

typedef __m256i block_vector; /* one block's 32 integers */
typedef block_vector (*stored_ints)(const char *w);
#define block_nibbles nibbles_x1
#define block_fives fives_x1
static inline __m256i q8_0_stored(const char *w) {
    return _mm256_loadu_si256((const __m256i *)((const block_w8_0 *)w)->qs);
}
static inline __m256i iq4_nl_stored(const char *w) {
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
    return _mm256_shuffle_epi8(levels, nibbles_x1(((const block_iq4_nl *)w)->qs));
}

/* One block's Σ q·a as eight int32 lanes, as floats. */
static ALWAYS_INLINE __m256 block_sums(__m256i q, __m256i a, int offset) {
    __m256i pairs;
    if (offset == SIGNED) {
        pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
    } else {
        pairs = _mm256_maddubs_epi16(q, a);
        if (offset) pairs = _mm256_sub_epi16(pairs, _mm256_maddubs_epi16(_mm256_set1_epi8((char)offset), a));
    }
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* Four blocks per step, one register each; their four scales are converted at once. */
static ALWAYS_INLINE float dot_simd(int64_t k, const char *w, int bytes, stored_ints stored, int offset, int has_min,
                                    const char *act, float (*scalar)(int64_t, const void *, const void *)) {
    const int64_t blocks = k / QK;
    const int act_bytes = ACT_BYTES(has_min);
    __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    __m128 minimums = _mm_setzero_ps();
    int64_t i = 0;
    for (; i + 3 < blocks; i += 4, w += 4 * bytes, act += 4 * act_bytes) {
        const __m128 scales = half_products_x4(w, bytes, act, act_bytes, 0);
        for (int j = 0; j < 4; j++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)ACT_QS(act + j * act_bytes, has_min));
            const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scales), _mm256_set1_epi32(j));
            acc[j] = _mm256_fmadd_ps(block_sums(stored(w + j * bytes), a, offset), scale, acc[j]);
        }
        if (has_min) minimums = _mm_add_ps(minimums, half_products_x4(w, bytes, act, act_bytes, 1));
    }
    const __m256 all = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    float sum = sum_of_four(_mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
    sum += sum_of_four(minimums);
    for (; i < blocks; i++, w += bytes, act += act_bytes) sum += scalar(QK, w, act);
    return sum;
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
/* NEON (AArch64's baseline, no dot-product extension assumed): one block per step, its 32
 * integers made signed (stored minus offset), multiplied by vmull_s8 into int16 and summed in
 * pairs into int32. No ARM machine runs it here: scripts/check_neon_products.c holds it to the
 * scalar product under qemu-aarch64. */
#define SIGNED 0 /* Q8_0's and IQ4_NL's integers are read signed already */

typedef int8x16x2_t block_vector; /* one block's 32 integers */
typedef block_vector (*stored_ints)(const char *w);

static inline int8x16x2_t nibbles_neon(const uint8_t *qs) {
    const uint8x16_t packed = vld1q_u8(qs);
    const int8x16x2_t halves = { { vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0F))),
                                   vreinterpretq_s8_u8(vshrq_n_u8(packed, 4)) } };
    return halves;
}

/* Q5's fifth bits: element j's is bit j % 8 of qh[j / 8]; vtst turns it into a byte mask. */
static inline int8x16x2_t fives_neon(int8x16x2_t nibbles, const uint8_t *qh) {
    static const uint8_t BIT[16] = { 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128 };
    const uint8x16_t bit = vld1q_u8(BIT), fifth = vdupq_n_u8(0x10);
    for (int half_index = 0; half_index < 2; half_index++) {
        const uint8x16_t spread = vcombine_u8(vdup_n_u8(qh[2 * half_index]), vdup_n_u8(qh[2 * half_index + 1]));
        nibbles.val[half_index] = vorrq_s8(nibbles.val[half_index],
                                           vreinterpretq_s8_u8(vandq_u8(vtstq_u8(spread, bit), fifth)));
    }
    return nibbles;
}

#define block_nibbles nibbles_neon
#define block_fives fives_neon
static inline int8x16x2_t q8_0_stored(const char *w) {
    const int8_t *qs = ((const block_w8_0 *)w)->qs;
    const int8x16x2_t q = { { vld1q_s8(qs), vld1q_s8(qs + 16) } };
    return q;
}
static inline int8x16x2_t iq4_nl_stored(const char *w) {
    const int8x16_t levels = vld1q_s8(IQ4_NL_VALUES);
    int8x16x2_t q = nibbles_neon(((const block_iq4_nl *)w)->qs);
    q.val[0] = vqtbl1q_s8(levels, vreinterpretq_u8_s8(q.val[0]));
    q.val[1] = vqtbl1q_s8(levels, vreinterpretq_u8_s8(q.val[1]));
    return q;
}

static inline int32x4_t products_neon(int8x16_t q, int8x16_t a, int32x4_t acc) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(q), vget_low_s8(a)));
    return vpadalq_s16(acc, vmull_high_s8(q, a));
}

static ALWAYS_INLINE float dot_simd(int64_t k, const char *w, int bytes, stored_ints stored, int offset, int has_min,
                                    const char *act, float (*scalar)(int64_t, const void *, const void *)) {
    (void)scalar; /* every block goes through the vector path */
    const int act_bytes = ACT_BYTES(has_min);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++, w += bytes, act += act_bytes) {
        int8x16x2_t q = stored(w);
        if (offset) {
            q.val[0] = vsubq_s8(q.val[0], vdupq_n_s8((int8_t)offset));
            q.val[1] = vsubq_s8(q.val[1], vdupq_n_s8((int8_t)offset));
        }
        const int8_t *a = ACT_QS(act, has_min);
        const int32x4_t first = products_neon(q.val[0], vld1q_s8(a), vdupq_n_s32(0));
        const int32x4_t s = products_neon(q.val[1], vld1q_s8(a + 16), first);
        const uint16_t *halves = (const uint16_t *)w;
        sum += (float)vaddvq_s32(s) * half(halves[0]) * half(ACT_D(act));
        if (has_min) sum += half(halves[1]) * half(ACT_S(act));
    }
    return sum;
}
#endif

#if defined(block_nibbles)
/* The 4- and 5-bit types' readers, alike on the levels that hold one block per register. */
static inline block_vector q4_0_stored(const char *w) { return block_nibbles(((const block_q4_0 *)w)->qs); }
static inline block_vector q4_1_stored(const char *w) { return block_nibbles(((const block_q4_1 *)w)->qs); }
static inline block_vector q5_0_stored(const char *w) {
    return block_fives(block_nibbles(((const block_q5_0 *)w)->qs), ((const block_q5_0 *)w)->qh);
}
static inline block_vector q5_1_stored(const char *w) {
    return block_fives(block_nibbles(((const block_q5_1 *)w)->qs), ((const block_q5_1 *)w)->qh);
}
#endif

#if defined(SIGNED)
/* Each level's dot_simd with a type's reading of its blocks, the offset of its stored integers,
 * and its scalar product for a row's last lone block. */
#define SIMD_DOT(name, block, offset, has_min)                                                     \
    static float dot_##name(int64_t k, const void *w, const void *a) {                             \
        return dot_simd(k, w, sizeof(block), name##_stored, offset, has_min, a, dot_##name##_scalar); \
    }
SIMD_DOT(q4_0, block_q4_0, 8, 0)
SIMD_DOT(q4_1, block_q4_1, 0, 1)
SIMD_DOT(q5_0, block_q5_0, 16, 0)
SIMD_DOT(q5_1, block_q5_1, 0, 1)
SIMD_DOT(q8_0, block_w8_0, SIGNED, 0)
SIMD_DOT(iq4_nl, block_iq4_nl, SIGNED, 0)
#define DOT(name) dot_##name
#else
#define DOT(name) dot_##name##_scalar
#endif

const weight_type TYPE_Q4_0 = { QK, sizeof(block_q4_0), T_Q8_0, dequantize_q4_0, DOT(q4_0) };
const weight_type TYPE_Q4_1 = { QK, sizeof(block_q4_1), T_Q8_1, dequantize_q4_1, DOT(q4_1) };
const weight_type TYPE_Q5_0 = { QK, sizeof(block_q5_0), T_Q8_0, dequantize_q5_0, DOT(q5_0) };
const weight_type TYPE_Q5_1 = { QK, sizeof(block_q5_1), T_Q8_1, dequantize_q5_1, DOT(q5_1) };
const weight_type TYPE_Q8_0 = { QK, sizeof(block_w8_0), T_Q8_0, dequantize_q8_0, DOT(q8_0) };
const weight_type TYPE_IQ4_NL = { QK, sizeof(block_iq4_nl), T_Q8_0, dequantize_iq4_nl, DOT(iq4_nl) };
