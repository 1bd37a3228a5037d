/* Activation rows quantized as llama.cpp's reference quantizers do (ggml-quants.c's
 * quantize_row_q8_0_ref, _q8_1_ref, _q8_K_ref), and fp16/bf16 conversions by their bits. */
#include <math.h>
#include <string.h>

#include "llmcli_cpu.h"

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t fp32_to_fp16(float f) {
    /* Round to nearest even, as F16C's vcvtps2ph with rounding mode 0 does. */
    const float scale_to_inf = float_of(0x77800000u);
    const float scale_to_zero = float_of(0x08800000u);
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = bits_of(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = bits_of(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

uint16_t fp32_to_bf16(float f) {
    /* Round to nearest even; a NaN stays a (quiet) NaN. */
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

/* x * id rounded half away from zero, as roundf does in llama.cpp's reference quantizer. */
void quantize_row_q8_0(const float *x, block_q8_0 *out, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++) {
        const float *xs = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xs[j]));
        const float d = amax / 127.0f;
        const float id = d ? 1.0f / d : 0.0f;
        out[i].d = fp32_to_fp16(d);
        for (int j = 0; j < QK; j++) out[i].qs[j] = (int8_t)roundf(xs[j] * id);
    }
}

void quantize_row_q8_1(const float *x, block_q8_1 *out, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++) {
        const float *xs = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xs[j]));
        const float d = amax / 127.0f;
        const float id = d ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            out[i].qs[j] = (int8_t)roundf(xs[j] * id);
            sum += out[i].qs[j];
        }
        out[i].d = fp32_to_fp16(d);
        out[i].s = fp32_to_fp16((float)sum * d);
    }
}

/* Round half to even by the float trick llama.cpp's nearest_int uses. */
static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

void quantize_row_q8_K(const float *x, block_q8_K *out, int64_t k) {
    for (int64_t i = 0; i < k / QK_K; i++) {
        const float *xs = x + i * QK_K;
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            const float ax = fabsf(xs[j]);
            if (ax > amax) { amax = ax; max = xs[j]; }
        }
        if (!amax) {
            out[i].d = 0.0f;
            memset(out[i].qs, 0, QK_K);
        } else {
            const float iscale = -127.f / max;
            for (int j = 0; j < QK_K; j++) {
                const int v = nearest_int(iscale * xs[j]);
                out[i].qs[j] = (int8_t)(v < 127 ? v : 127);
            }
            out[i].d = 1 / iscale;
        }
        for (int j = 0; j < QK_K / 16; j++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += out[i].qs[j * 16 + l];
            out[i].bsums[j] = (int16_t)sum;
        }
    }
}

int64_t act_row_bytes(int act_type, int64_t k) {
    switch (act_type) {
    case T_Q8_0: return k / QK * (int64_t)sizeof(block_q8_0);
    case T_Q8_1: return k / QK * (int64_t)sizeof(block_q8_1);
    case T_Q8_K: return k / QK_K * (int64_t)sizeof(block_q8_K);
    case T_F16: case T_BF16: return k * 2;
    default: return k * 4;
    }
}

void quantize_act_row(int act_type, const float *x, void *out, int64_t k) {
    switch (act_type) {
    case T_Q8_0: quantize_row_q8_0(x, out, k); break;
    case T_Q8_1: quantize_row_q8_1(x, out, k); break;
    case T_Q8_K: quantize_row_q8_K(x, out, k); break;
    case T_F16: for (int64_t i = 0; i < k; i++) ((uint16_t *)out)[i] = fp32_to_fp16(x[i]); break;
    case T_BF16: for (int64_t i = 0; i < k; i++) ((uint16_t *)out)[i] = fp32_to_bf16(x[i]); break;
    default: memcpy(out, x, (size_t)k * 4);
    }
}
