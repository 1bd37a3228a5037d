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

/* A block's largest magnitude (fmaxf over |x|; a NaN in the block is not ordered the same way by
 * the vector max, which no finite activation row meets). */
static inline float block_amax(const float *xs) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xs)),
                                              _mm512_abs_ps(_mm512_loadu_ps(xs + 16))));
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(xs));
    for (int j = 8; j < QK; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + j)));
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
#else
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xs[j]));
    return amax;
#endif
}

/* q = x * id rounded half away from zero, as roundf does in llama.cpp's reference quantizer;
 * returns Σq. The vector paths round the same way: truncate, then step away from zero where the
 * part cut off (exact, |x * id| <= 127) is at least one half. */
static inline int round_block(const float *xs, float id, int8_t *q) {
#if defined(__AVX512F__)
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < QK; j += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xs + j), _mm512_set1_ps(id));
        const __m512 cut = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m512 cut_off = _mm512_abs_ps(_mm512_sub_ps(v, cut));
        const __mmask16 away = _mm512_cmp_ps_mask(cut_off, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
        const __m512 step = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(1.0f)),
            _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u))));
        const __m512i rounded = _mm512_cvttps_epi32(_mm512_mask_add_ps(cut, away, cut, step));
        _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtepi32_epi8(rounded));
        sum = _mm512_add_epi32(sum, rounded);
    }
    return _mm512_reduce_add_epi32(sum);
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256i rounded[4];
    for (int j = 0; j < 4; j++) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xs + 8 * j), _mm256_set1_ps(id));
        const __m256 cut = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 cut_off = _mm256_andnot_ps(sign, _mm256_sub_ps(v, cut));
        const __m256 away = _mm256_cmp_ps(cut_off, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
        const __m256 step = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(sign, v));
        rounded[j] = _mm256_cvttps_epi32(_mm256_add_ps(cut, _mm256_and_ps(away, step)));
    }
    /* packs interleave the 128-bit lanes: the permutation puts the 32 bytes back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(rounded[0], rounded[1]),
                                             _mm256_packs_epi32(rounded[2], rounded[3]));
    const __m256i in_order = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, in_order);
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(rounded[0], rounded[1]),
                                           _mm256_add_epi32(rounded[2], rounded[3]));
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1)));
#else
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        q[j] = (int8_t)roundf(xs[j] * id);
        sum += q[j];
    }
    return sum;
#endif
}

void quantize_row_q8_0(const float *x, block_q8_0 *out, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++) {
        const float d = block_amax(x + i * QK) / 127.0f;
        out[i].d = fp32_to_fp16(d);
        round_block(x + i * QK, d ? 1.0f / d : 0.0f, out[i].qs);
    }
}

void quantize_row_q8_1(const float *x, block_q8_1 *out, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++) {
        const float d = block_amax(x + i * QK) / 127.0f;
        const int sum = round_block(x + i * QK, d ? 1.0f / d : 0.0f, out[i].qs);
        out[i].d = fp32_to_fp16(d);
        out[i].s = fp32_to_fp16((float)sum * d);
    }
}

/* One activation row quantized as `act_type`, for the tests to hold against the reference. */
LLMCLI_API int llmcli_quantize_activations(int act_type, const float *x, int64_t k, void *out) {
    if (k % QK_K && act_type == T_Q8_K) return -1;
    if (k % QK) return -1;
    quantize_act_row(act_type, x, out, k);
    return 0;
}

/* Round half to even by the float trick llama.cpp's nearest_int uses. */
static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* The block's value of largest magnitude, signed: the first such, as the reference's strict `>`
 * keeps it; NaNs never win (their comparisons are false); 0 for a block of zeros. */
static float signed_peak(const float *xs) {
#if defined(__AVX2__)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 peak8 = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 8) /* max_ps returns its second operand where either is NaN */
        peak8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xs + j), magnitude), peak8);
    __m128 peak4 = _mm_max_ps(_mm256_castps256_ps128(peak8), _mm256_extractf128_ps(peak8, 1));
    peak4 = _mm_max_ps(peak4, _mm_movehl_ps(peak4, peak4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(peak4, _mm_movehdup_ps(peak4)));
    if (!amax) return 0.0f;
    const __m256 wanted = _mm256_set1_ps(amax);
    for (int j = 0; j < QK_K; j += 8) {
        const __m256 v = _mm256_loadu_ps(xs + j);
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v, magnitude), wanted, _CMP_EQ_OQ));
        if (hits) return xs[j + __builtin_ctz((unsigned)hits)];
    }
    return 0.0f; /* not reached: amax came from one of them */
#else
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < QK_K; j++) {
        const float ax = fabsf(xs[j]);
        if (ax > amax) { amax = ax; max = xs[j]; }
    }
    return max;
#endif
}

/* qs[j] = min(nearest_int(iscale · xs[j]), 127), the product rounded once before the addition
 * of nearest_int's trick, as the reference rounds it (no fused multiply-add). */
static void quantize_block_q8_K(const float *xs, float iscale, int8_t *qs) {
#if defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(iscale), magic = _mm256_set1_ps(12582912.f);
    const __m256i mantissa = _mm256_set1_epi32(0x007fffff), bias = _mm256_set1_epi32(0x00400000);
    const __m256i top = _mm256_set1_epi32(127), low_byte = _mm256_set1_epi32(0xFF);
    for (int j = 0; j < QK_K; j += 32) {
        __m256i v[4];
        for (int t = 0; t < 4; t++) {
            const __m256 f = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(xs + j + 8 * t), scale), magic);
            const __m256i n = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(f), mantissa), bias);
            /* the low byte, as the scalar (int8_t) cast keeps it: no saturation in the packs */
            v[t] = _mm256_and_si256(_mm256_min_epi32(n, top), low_byte);
        }
        const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(v[0], v[1]), _mm256_packus_epi32(v[2], v[3]));
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lane split */
        _mm256_storeu_si256((__m256i *)(qs + j), _mm256_permutevar8x32_epi32(bytes, order));
    }
#else
    for (int j = 0; j < QK_K; j++) {
        const int v = nearest_int(iscale * xs[j]);
        qs[j] = (int8_t)(v < 127 ? v : 127);
    }
#endif
}

void quantize_row_q8_K(const float *x, block_q8_K *out, int64_t k) {
    for (int64_t i = 0; i < k / QK_K; i++) {
        const float *xs = x + i * QK_K;
        const float max = signed_peak(xs);
        if (!max) {
            out[i].d = 0.0f;
            memset(out[i].qs, 0, QK_K);
        } else {
            const float iscale = -127.f / max;
            quantize_block_q8_K(xs, iscale, out[i].qs);
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
