/* F16 and BF16 weights: the activation row is rounded to the weights' type once (as llama.cpp's
 * vec_dot_f16/bf16 take it) and each product summed in fp32.
 *
 * The portable path converts by bits, one element at a time, which no compiler vectorizes (a
 * 2816×1024 F16 GEMV took 4.6 ms on 2 threads); the x86 builds convert in registers instead:
 * F16C's vcvtph2ps for fp16, a 16-bit shift for bf16, and AVX-512 BF16's vdpbf16ps, which
 * multiplies bf16 pairs and sums them in fp32 in one instruction, as ggml_vec_dot_bf16 does. */
#include "llmcli_cpu.h"

#if defined(__AVX2__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static void dequantize_f16(const void *blocks, float *out, int64_t k) {
    const uint16_t *h = blocks;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= k; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= k; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < k; i++) out[i] = fp16_to_fp32(h[i]);
}

#if defined(__AVX512F__)
/* Four independent accumulators: FMA's latency (4 cycles) would otherwise bound the loop. */
static float dot_f16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
    int64_t i = 0;
    for (; i + 64 <= k; i += 64)
        for (int j = 0; j < 4; j++) {
            const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i + 16 * j)));
            const __m512 av = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a + i + 16 * j)));
            acc[j] = _mm512_fmadd_ps(wv, av, acc[j]);
        }
    for (; i + 16 <= k; i += 16) {
        const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i)));
        const __m512 av = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a + i)));
        acc[0] = _mm512_fmadd_ps(wv, av, acc[0]);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    for (; i < k; i++) sum += fp16_to_fp32(w[i]) * fp16_to_fp32(a[i]);
    return sum;
}
#elif defined(__F16C__) && defined(__FMA__)
static float dot_f16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8 * j)));
            const __m256 av = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i + 8 * j)));
            acc[j] = _mm256_fmadd_ps(wv, av, acc[j]);
        }
    float sum = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < k; i++) sum += fp16_to_fp32(w[i]) * fp16_to_fp32(a[i]);
    return sum;
}
#else
static float dot_f16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum += fp16_to_fp32(w[i]) * fp16_to_fp32(a[i]);
    return sum;
}
#endif

static void dequantize_bf16(const void *blocks, float *out, int64_t k) {
    const uint16_t *h = blocks;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= k; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i)));
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= k; i += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; i < k; i++) out[i] = bf16_to_fp32(h[i]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* vdpbf16ps: 32 bf16 pairs per instruction, each pair's two products added into one fp32 lane. */
static float dot_bf16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
    int64_t i = 0;
    for (; i + 128 <= k; i += 128)
        for (int j = 0; j < 4; j++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + i + 32 * j));
            const __m512i av = _mm512_loadu_si512((const void *)(a + i + 32 * j));
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)wv, (__m512bh)av);
        }
    for (; i + 32 <= k; i += 32) {
        const __m512i wv = _mm512_loadu_si512((const void *)(w + i));
        const __m512i av = _mm512_loadu_si512((const void *)(a + i));
        acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)wv, (__m512bh)av);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    for (; i < k; i++) sum += bf16_to_fp32(w[i]) * bf16_to_fp32(a[i]);
    return sum;
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 bf16x8_to_fp32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static float dot_bf16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
        for (int j = 0; j < 4; j++)
            acc[j] = _mm256_fmadd_ps(bf16x8_to_fp32(w + i + 8 * j), bf16x8_to_fp32(a + i + 8 * j), acc[j]);
    float sum = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < k; i++) sum += bf16_to_fp32(w[i]) * bf16_to_fp32(a[i]);
    return sum;
}
#else
static float dot_bf16(int64_t k, const void *w_row, const void *act_row) {
    const uint16_t *w = w_row, *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum += bf16_to_fp32(w[i]) * bf16_to_fp32(a[i]);
    return sum;
}
#endif

const weight_type TYPE_F16 = { 1, 2, T_F16, dequantize_f16, dot_f16 };
const weight_type TYPE_BF16 = { 1, 2, T_BF16, dequantize_bf16, dot_bf16 };
