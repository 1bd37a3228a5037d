/* F16 and BF16 weights: the activation row is rounded to the weights' type once (as llama.cpp's
 * vec_dot_f16/bf16 take it) and each product summed in fp32. */
#include "llmcli_cpu.h"

static void dequantize_f16(const void *blocks, float *out, int64_t k) {
    const uint16_t *h = blocks;
    for (int64_t i = 0; i < k; i++) out[i] = fp16_to_fp32(h[i]);
}

static float dot_f16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum += fp16_to_fp32(w[i]) * fp16_to_fp32(a[i]);
    return sum;
}

static void dequantize_bf16(const void *blocks, float *out, int64_t k) {
    const uint16_t *h = blocks;
    for (int64_t i = 0; i < k; i++) out[i] = bf16_to_fp32(h[i]);
}

static float dot_bf16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum += bf16_to_fp32(w[i]) * bf16_to_fp32(a[i]);
    return sum;
}

const weight_type TYPE_F16 = { 1, 2, T_F16, dequantize_f16, dot_f16 };
const weight_type TYPE_BF16 = { 1, 2, T_BF16, dequantize_bf16, dot_bf16 };
