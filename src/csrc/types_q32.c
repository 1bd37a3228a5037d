/* The 32-element types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (ggml-common.h's layouts). Each
 * product is llama.cpp's: the weight block's integers against the activation block's, summed in
 * integers, scaled by both blocks' scales. */
#include "llmcli_cpu.h"

typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;  /* 18 bytes */
typedef struct { uint16_t d; int8_t qs[QK]; } block_w8_0;       /* 34: Q8_0 weights */

static void dequantize_q4_0(const void *blocks, float *out, int64_t k) {
    const block_q4_0 *b = blocks;
    for (int64_t i = 0; i < k / QK; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK / 2; j++) {
            out[i * QK + j] = ((b[i].qs[j] & 0x0F) - 8) * d;
            out[i * QK + j + QK / 2] = ((b[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static float dot_q4_0(int64_t k, const void *w_row, const void *act_row) {
    const block_q4_0 *w = w_row;
    const block_q8_0 *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        int s = 0;
        for (int j = 0; j < QK / 2; j++) {
            s += ((w[i].qs[j] & 0x0F) - 8) * a[i].qs[j];
            s += ((w[i].qs[j] >> 4) - 8) * a[i].qs[j + QK / 2];
        }
        sum += s * fp16_to_fp32(w[i].d) * fp16_to_fp32(a[i].d);
    }
    return sum;
}

static void dequantize_q8_0(const void *blocks, float *out, int64_t k) {
    const block_w8_0 *b = blocks;
    for (int64_t i = 0; i < k / QK; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK; j++) out[i * QK + j] = b[i].qs[j] * d;
    }
}

static float dot_q8_0(int64_t k, const void *w_row, const void *act_row) {
    const block_w8_0 *w = w_row;
    const block_q8_0 *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        int s = 0;
        for (int j = 0; j < QK; j++) s += w[i].qs[j] * a[i].qs[j];
        sum += s * fp16_to_fp32(w[i].d) * fp16_to_fp32(a[i].d);
    }
    return sum;
}

const weight_type TYPE_Q4_0 = { QK, sizeof(block_q4_0), T_Q8_0, dequantize_q4_0, dot_q4_0 };
const weight_type TYPE_Q8_0 = { QK, sizeof(block_w8_0), T_Q8_0, dequantize_q8_0, dot_q8_0 };
/* Not written yet: llmcli keeps its torch path for these types. */
const weight_type TYPE_Q4_1 = { QK, 20, T_Q8_1, 0, 0 };
const weight_type TYPE_Q5_0 = { QK, 22, T_Q8_0, 0, 0 };
const weight_type TYPE_Q5_1 = { QK, 24, T_Q8_1, 0, 0 };
const weight_type TYPE_IQ4_NL = { QK, 18, T_Q8_0, 0, 0 };
