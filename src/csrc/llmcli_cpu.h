/* llmcli's CPU kernels: GGUF blocks multiplied as llama.cpp multiplies them.
 *
 * One set of sources, compiled three times by setup.py (portable, AVX2, AVX-512): each build
 * chooses its code by the instruction sets its compiler flags allow (__AVX2__, __AVX512VNNI__,
 * __ARM_NEON, ...), and llmcli (models/cpu_kernels.py) loads the best build the running CPU can
 * execute. Nothing here links against Python or torch: every function takes plain pointers. */
#ifndef LLMCLI_CPU_H
#define LLMCLI_CPU_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#ifdef _WIN32
#define LLMCLI_API __declspec(dllexport)
#else
#define LLMCLI_API __attribute__((visibility("default")))
#endif

/* ggml's type ids, as GGUF files store them. */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q8_1 = 9,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_Q8_K = 15,
    T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30, T_COUNT = 40
};

#define QK 32    /* elements in a block of the 32-element types */
#define QK_K 256 /* elements in a super-block of the K-quants and IQ4_XS */

/* The activation formats llama.cpp pairs the weight types with: a row of x is quantized once
 * into one of these, then dotted with every weight row. */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;               /* 34 bytes */
typedef struct { uint16_t d; uint16_t s; int8_t qs[QK]; } block_q8_1;   /* 36: s = d * sum(qs) */
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K; /* 292 */

/* A weight type: its block, how to read it back (exactly as gguf.quants.dequantize does), which
 * activation format it is multiplied with, and the product of one weight row with one quantized
 * activation row of `k` elements. */
typedef struct {
    int block_elems;      /* elements per block */
    int block_bytes;      /* bytes per block */
    int act_type;         /* T_Q8_0, T_Q8_1, T_Q8_K, T_F16, T_BF16 or T_F32 */
    void (*dequantize_row)(const void *blocks, float *out, int64_t k);
    float (*vec_dot)(int64_t k, const void *w_row, const void *act_row);
} weight_type;

/* Filled by each type's file (types_*.c); NULL where a build has no kernel for a type. */
extern const weight_type *const WEIGHT_TYPES[T_COUNT];
extern const weight_type TYPE_F16, TYPE_BF16;
extern const weight_type TYPE_Q4_0, TYPE_Q4_1, TYPE_Q5_0, TYPE_Q5_1, TYPE_Q8_0, TYPE_IQ4_NL;
extern const weight_type TYPE_Q2_K, TYPE_Q3_K, TYPE_Q4_K, TYPE_Q5_K, TYPE_Q6_K, TYPE_IQ4_XS;

/* Activation rows: bytes per row of k elements, and the quantizer (activations.c). */
int64_t act_row_bytes(int act_type, int64_t k);
void quantize_act_row(int act_type, const float *x, void *out, int64_t k);
void quantize_row_q8_0(const float *x, block_q8_0 *out, int64_t k);
void quantize_row_q8_1(const float *x, block_q8_1 *out, int64_t k);
void quantize_row_q8_K(const float *x, block_q8_K *out, int64_t k);

/* fp16 and bf16 to and from fp32, by their bits (no compiler support needed). Reading is inline:
 * a call per value (or per block scale) cost more than the conversion, and kept the compiler from
 * vectorizing the portable F16 loops. */
static inline float fp16_to_fp32(uint16_t h) {
    /* Maratyszcza's FP16 conversion: exact for every half, subnormals included. */
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    union { uint32_t u; float f; } scale = { 0x7800000u }, normalized = { (two_w >> 4) + exp_offset },
                                   denormalized = { (two_w >> 17) | (126u << 23) }, result;
    normalized.f *= scale.f;
    denormalized.f -= 0.5f;
    const uint32_t denormalized_cutoff = 1u << 27;
    result.u = sign | (two_w < denormalized_cutoff ? denormalized.u : normalized.u);
    return result.f;
}
uint16_t fp32_to_fp16(float f);
static inline float bf16_to_fp32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}
uint16_t fp32_to_bf16(float f);

/* The dtypes rows come in and go out in: the model's own, so no conversion call is needed. */
enum { D_F32 = 0, D_BF16 = 1, D_F16 = 2 };

static inline float load_value(const void *p, int dtype, int64_t i) {
    if (dtype == D_BF16) return bf16_to_fp32(((const uint16_t *)p)[i]);
    if (dtype == D_F16) return fp16_to_fp32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store_value(void *p, int dtype, int64_t i, float v) {
    if (dtype == D_BF16) ((uint16_t *)p)[i] = fp32_to_bf16(v);
    else if (dtype == D_F16) ((uint16_t *)p)[i] = fp32_to_fp16(v);
    else ((float *)p)[i] = v;
}

/* A type's kernels, or NULL where this build has none (matmul.c). */
const weight_type *weight_type_of(int type);
/* y[m, n] (rows y_stride apart, fp32) = activation rows already quantized to t's format · Wᵀ. */
void multiply_quantized(const weight_type *t, const void *w, int64_t n, int64_t k, const char *act, int64_t m,
                        float *y, int64_t y_stride, int n_threads);

#if defined(__AVX2__)
/* The sum of a vector's eight floats. */
static inline float hsum_f32x8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The thread pool (pool.c): `task(context, ith, nth)` on nth threads, the caller being ith 0. */
typedef void (*pool_task)(void *context, int ith, int nth);
void pool_run(pool_task task, void *context, int n_threads);

#endif
