/* The 32-element types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (ggml-common.h's layouts). Each
 * product is llama.cpp's: the weight block's integers against the activation block's, summed in
 * integers, scaled by both blocks' scales; Q4_1 and Q5_1 add their minimum times the Q8_1
 * activation block's `s` (d · Σqs), the others pair with Q8_0.
 *
 * Every type has a scalar reading of its block into 32 integers, which dequantization and the
 * portable product share. The AVX2 and AVX-512 (VNNI) products read the same integers with
 * vector instructions, two blocks per step; a build without them keeps the scalar product. */
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

static inline void five_bits_of(const uint8_t qs[QK / 2], const uint8_t qh[4], int8_t out[QK], int offset) {
    const uint32_t bits = high_bits(qh);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = (int8_t)(((qs[j] & 0x0F) | ((bits >> j & 1) << 4)) - offset);
        out[j + QK / 2] = (int8_t)(((qs[j] >> 4) | ((bits >> (j + QK / 2) & 1) << 4)) - offset);
    }
}

static void ints_q4_0(const void *b, int8_t out[QK]) { nibbles_of(((const block_q4_0 *)b)->qs, out, 8); }
static void ints_q4_1(const void *b, int8_t out[QK]) { nibbles_of(((const block_q4_1 *)b)->qs, out, 0); }
static void ints_q5_0(const void *b, int8_t out[QK]) {
    five_bits_of(((const block_q5_0 *)b)->qs, ((const block_q5_0 *)b)->qh, out, 16);
}
static void ints_q5_1(const void *b, int8_t out[QK]) {
    five_bits_of(((const block_q5_1 *)b)->qs, ((const block_q5_1 *)b)->qh, out, 0);
}
static void ints_q8_0(const void *b, int8_t out[QK]) { memcpy(out, ((const block_w8_0 *)b)->qs, QK); }
static void ints_iq4_nl(const void *b, int8_t out[QK]) {
    const block_iq4_nl *x = b;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = IQ4_NL_VALUES[x->qs[j] & 0x0F];
        out[j + QK / 2] = IQ4_NL_VALUES[x->qs[j] >> 4];
    }
}

typedef void (*block_ints)(const void *block, int8_t out[QK]);

/* d · q (+ m for the types with a minimum, whose half sits right after d), as gguf computes it:
 * a product rounded to float, then the sum. GCC would fuse the two into one FMA (another
 * rounding) in the builds that have FMA, so it is told not to. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void dequantize_blocks(const char *blocks, int bytes, block_ints ints, int has_min,
                                     float *out, int64_t k) {
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

/* Σ w·a per block, times both scales; for the types with a minimum, + m · s of the Q8_1 block. */
static inline float dot_blocks(int64_t k, const char *w, int bytes, block_ints ints, int has_min,
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

#define DOT(name) dot_##name##_scalar

const weight_type TYPE_Q4_0 = { QK, sizeof(block_q4_0), T_Q8_0, dequantize_q4_0, DOT(q4_0) };
const weight_type TYPE_Q4_1 = { QK, sizeof(block_q4_1), T_Q8_1, dequantize_q4_1, DOT(q4_1) };
const weight_type TYPE_Q5_0 = { QK, sizeof(block_q5_0), T_Q8_0, dequantize_q5_0, DOT(q5_0) };
const weight_type TYPE_Q5_1 = { QK, sizeof(block_q5_1), T_Q8_1, dequantize_q5_1, DOT(q5_1) };
const weight_type TYPE_Q8_0 = { QK, sizeof(block_w8_0), T_Q8_0, dequantize_q8_0, DOT(q8_0) };
const weight_type TYPE_IQ4_NL = { QK, sizeof(block_iq4_nl), T_Q8_0, dequantize_iq4_nl, DOT(iq4_nl) };
