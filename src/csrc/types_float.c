/* F16 and BF16 weights: the activation row is rounded to the weights' type once (as llama.cpp's
 * vec_dot_f16/bf16 take it) and each product summed in fp32.
 *
 * The portable path converts by bits, one element at a time, which no compiler vectorizes (a
 * 2816×1024 F16 GEMV took 4.6 ms on 2 threads); the x86 builds convert in registers instead:
 * F16C's vcvtph2ps for fp16, a 16-bit shift for bf16, and AVX-512 BF16's vdpbf16ps, which
 * multiplies bf16 pairs and sums them in fp32 in one instruction, as ggml_vec_dot_bf16 does. */
#include "llmcli_cpu.h"

/* One vector of fp32 lanes, and halves or bf16s read into it, at the widest width the build has. */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 f32_vector;
#define vector_zero _mm512_setzero_ps
#define vector_fma _mm512_fmadd_ps
#define vector_add _mm512_add_ps
#define vector_sum _mm512_reduce_add_ps
#define vector_store _mm512_storeu_ps
#define load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define load_bf16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LANES 8
typedef __m256 f32_vector;
#define vector_zero _mm256_setzero_ps
#define vector_fma _mm256_fmadd_ps
#define vector_add _mm256_add_ps
#define vector_sum hsum_f32x8
#define vector_store _mm256_storeu_ps
#define load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define load_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif

static inline float half_to_fp32(uint16_t h, int bf16) { return bf16 ? bf16_to_fp32(h) : fp16_to_fp32(h); }

/* `bf16` is a constant at every call: each caller gets its own loop, with no test inside. */
static inline void dequantize_halves(const uint16_t *h, float *out, int64_t k, int bf16) {
    int64_t i = 0;
#ifdef LANES
    for (; i + LANES <= k; i += LANES) vector_store(out + i, bf16 ? load_bf16(h + i) : load_f16(h + i));
#endif
    for (; i < k; i++) out[i] = half_to_fp32(h[i], bf16);
}

static inline float dot_halves(const uint16_t *w, const uint16_t *a, int64_t k, int bf16) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef LANES
    /* Four independent accumulators: FMA's latency (4 cycles) would otherwise bound the loop. */
    f32_vector acc[4] = { vector_zero(), vector_zero(), vector_zero(), vector_zero() };
    for (; i + 4 * LANES <= k; i += 4 * LANES)
        for (int j = 0; j < 4; j++) {
            const int64_t at = i + LANES * j;
            acc[j] = bf16 ? vector_fma(load_bf16(w + at), load_bf16(a + at), acc[j])
                          : vector_fma(load_f16(w + at), load_f16(a + at), acc[j]);
        }
    sum = vector_sum(vector_add(vector_add(acc[0], acc[1]), vector_add(acc[2], acc[3])));
#endif
    for (; i < k; i++) sum += half_to_fp32(w[i], bf16) * half_to_fp32(a[i], bf16);
    return sum;
}

static void dequantize_f16(const void *blocks, float *out, int64_t k) { dequantize_halves(blocks, out, k, 0); }

static float dot_f16(int64_t k, const void *w_row, const void *act_row) { return dot_halves(w_row, act_row, k, 0); }

static void dequantize_bf16(const void *blocks, float *out, int64_t k) { dequantize_halves(blocks, out, k, 1); }

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
#else
static float dot_bf16(int64_t k, const void *w_row, const void *act_row) { return dot_halves(w_row, act_row, k, 1); }
#endif

const weight_type TYPE_F16 = { 1, 2, T_F16, dequantize_f16, dot_f16 };
const weight_type TYPE_BF16 = { 1, 2, T_BF16, dequantize_bf16, dot_bf16 };
