/* Q4_K, Q5_K and Q6_K (ggml-common.h's layouts: super-blocks of 256), multiplied with
 * activations in Q8_K as llama.cpp does: each sub-block's integers against the activation's,
 * summed in integers, scaled by the sub-block's 6- or 8-bit scale; the minimums of Q4_K/Q5_K
 * meet the activation through its 16-element sums (block_q8_K.bsums), never element by element.
 *
 * Every product has a scalar form (the portable path, and the reference the SIMD forms must
 * equal exactly in their integer sums) and, where the build allows, AVX2 and AVX-512 VNNI forms. */
#include <string.h>

#include "llmcli_cpu.h"

typedef struct {
    uint16_t d, dmin;   /* super-block scales of the sub-blocks' scales and minimums */
    uint8_t scales[12]; /* 8 scales and 8 minimums, 6 bits each */
    uint8_t qs[QK_K / 2];
} block_q4_K; /* 144 bytes */

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8]; /* the fifth bit of each value */
    uint8_t qs[QK_K / 2];
} block_q5_K; /* 176 bytes */

typedef struct {
    uint8_t ql[QK_K / 2];  /* low 4 bits */
    uint8_t qh[QK_K / 4];  /* high 2 bits */
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K; /* 210 bytes */

/* The 6-bit scale and minimum of sub-block j (0..7), packed as ggml's get_scale_min_k4. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The eight sub-blocks' scales and minimums of a Q4_K/Q5_K super-block. */
static inline void scales_mins_k4(const uint8_t *packed, uint8_t scales[8], uint8_t mins[8]) {
    for (int j = 0; j < 8; j++) scale_min_k4(j, packed, &scales[j], &mins[j]);
}

/* The values of one Q4_K or Q5_K super-block as integers 0..31 (qh NULL: Q4_K, 0..15), in the
 * order of their elements: sub-block j holds the low nibbles (j even) or the high nibbles
 * (j odd) of qs[32·(j/2) ..], and its fifth bits are bit j of qh. */
static inline void unpack_k4(const uint8_t *qs, const uint8_t *qh, uint8_t out[QK_K]) {
    for (int j = 0; j < QK_K / 64; j++) {
        for (int l = 0; l < 32; l++) {
            out[64 * j + l] = qs[32 * j + l] & 0xF;
            out[64 * j + 32 + l] = qs[32 * j + l] >> 4;
            if (qh) {
                out[64 * j + l] |= ((qh[l] >> (2 * j)) & 1) << 4;
                out[64 * j + 32 + l] |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
        }
    }
}

/* The values of one Q6_K super-block as integers −32..31, in the order of their elements. */
static inline void unpack_q6_K(const block_q6_K *b, int8_t out[QK_K]) {
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b->ql + 64 * half, *qh = b->qh + 32 * half;
        int8_t *y = out + 128 * half;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

/* gguf computes (d·scale)·q − dmin·min in float32 with two roundings; a fused multiply-add
 * (GCC's default contraction under -mfma) rounds once, yet gives the same bits: d (fp16, 11
 * significant bits) · scale (6) · q (5) needs at most 22 bits, so the product is exact. */
static void dequantize_k4(const uint8_t *qs, const uint8_t *qh, const uint8_t *packed,
                          uint16_t d16, uint16_t dmin16, float *out) {
    uint8_t scales[8], mins[8], q[QK_K];
    scales_mins_k4(packed, scales, mins);
    unpack_k4(qs, qh, q);
    const float d = fp16_to_fp32(d16), dmin = fp16_to_fp32(dmin16);
    for (int j = 0; j < 8; j++) {
        const float scale = d * scales[j], min = dmin * mins[j];
        for (int l = 0; l < 32; l++) out[32 * j + l] = scale * q[32 * j + l] - min;
    }
}

static void dequantize_q4_K(const void *blocks, float *out, int64_t k) {
    const block_q4_K *b = blocks;
    for (int64_t i = 0; i < k / QK_K; i++)
        dequantize_k4(b[i].qs, NULL, b[i].scales, b[i].d, b[i].dmin, out + i * QK_K);
}

static void dequantize_q5_K(const void *blocks, float *out, int64_t k) {
    const block_q5_K *b = blocks;
    for (int64_t i = 0; i < k / QK_K; i++)
        dequantize_k4(b[i].qs, b[i].qh, b[i].scales, b[i].d, b[i].dmin, out + i * QK_K);
}

static void dequantize_q6_K(const void *blocks, float *out, int64_t k) {
    const block_q6_K *b = blocks;
    int8_t q[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++) {
        unpack_q6_K(&b[i], q);
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK_K / 16; j++) {
            const float scale = d * b[i].scales[j];
            for (int l = 0; l < 16; l++) out[i * QK_K + 16 * j + l] = scale * q[16 * j + l];
        }
    }
}

/* Σ min_j · (the activation's sum over sub-block j): what the minimums take off the product. */
static inline int mins_dot_bsums(const uint8_t mins[8], const int16_t *bsums) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mins[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

/* The scalar Q4_K/Q5_K product of one super-block: d·Σ scale_j·(q·a)_j − dmin·Σ min_j·Σa_j. */
static inline float dot_k4_block(const uint8_t *qs, const uint8_t *qh, const uint8_t *packed, uint16_t d,
                                 uint16_t dmin, const block_q8_K *a) {
    uint8_t scales[8], mins[8], q[QK_K];
    scales_mins_k4(packed, scales, mins);
    unpack_k4(qs, qh, q);
    int sumi = 0;
    for (int j = 0; j < 8; j++) {
        int s = 0;
        for (int l = 0; l < 32; l++) s += q[32 * j + l] * a->qs[32 * j + l];
        sumi += scales[j] * s;
    }
    return a->d * (fp16_to_fp32(d) * sumi - fp16_to_fp32(dmin) * mins_dot_bsums(mins, a->bsums));
}

static float dot_q4_K_scalar(int64_t k, const void *w_row, const void *act_row) {
    const block_q4_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) sum += dot_k4_block(w[i].qs, NULL, w[i].scales, w[i].d, w[i].dmin, &a[i]);
    return sum;
}

static float dot_q5_K_scalar(int64_t k, const void *w_row, const void *act_row) {
    const block_q5_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++)
        sum += dot_k4_block(w[i].qs, w[i].qh, w[i].scales, w[i].d, w[i].dmin, &a[i]);
    return sum;
}

static float dot_q6_K_scalar(int64_t k, const void *w_row, const void *act_row) {
    const block_q6_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    int8_t q[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++) {
        unpack_q6_K(&w[i], q);
        int sumi = 0;
        for (int j = 0; j < QK_K / 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += q[16 * j + l] * a[i].qs[16 * j + l];
            sumi += w[i].scales[j] * s;
        }
        sum += a[i].d * fp16_to_fp32(w[i].d) * sumi;
    }
    return sum;
}

#define dot_q4_K dot_q4_K_scalar
#define dot_q5_K dot_q5_K_scalar
#define dot_q6_K dot_q6_K_scalar

const weight_type TYPE_Q4_K = { QK_K, sizeof(block_q4_K), T_Q8_K, dequantize_q4_K, dot_q4_K };
const weight_type TYPE_Q5_K = { QK_K, sizeof(block_q5_K), T_Q8_K, dequantize_q5_K, dot_q5_K };
const weight_type TYPE_Q6_K = { QK_K, sizeof(block_q6_K), T_Q8_K, dequantize_q6_K, dot_q6_K };
