/* The entry points llmcli calls (models/cpu_kernels.py, through ctypes): y = x · Wᵀ on a
 * matrix kept as the file's blocks, which CPU features this build uses, and dequantization. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "llmcli_cpu.h"

const weight_type *const WEIGHT_TYPES[T_COUNT] = {
    [T_F16] = &TYPE_F16, [T_BF16] = &TYPE_BF16,
    [T_Q4_0] = &TYPE_Q4_0, [T_Q4_1] = &TYPE_Q4_1, [T_Q5_0] = &TYPE_Q5_0, [T_Q5_1] = &TYPE_Q5_1,
    [T_Q8_0] = &TYPE_Q8_0, [T_IQ4_NL] = &TYPE_IQ4_NL,
    [T_Q2_K] = &TYPE_Q2_K, [T_Q3_K] = &TYPE_Q3_K, [T_Q4_K] = &TYPE_Q4_K, [T_Q5_K] = &TYPE_Q5_K,
    [T_Q6_K] = &TYPE_Q6_K, [T_IQ4_XS] = &TYPE_IQ4_XS,
};

static const weight_type *type_of(int type) {
    if (type < 0 || type >= T_COUNT) return NULL;
    const weight_type *t = WEIGHT_TYPES[type];
    return t && t->vec_dot ? t : NULL;
}

/* Which instruction sets this build was compiled for (the loader checks the CPU has them). */
enum { F_AVX2 = 1, F_FMA = 2, F_F16C = 4, F_AVX512F = 8, F_AVX512BW = 16, F_AVX512VL = 32,
       F_AVX512VNNI = 64, F_AVX512BF16 = 128, F_NEON = 256, F_AVX512DQ = 512, F_BMI2 = 1024 };

LLMCLI_API int llmcli_build_features(void) {
    int f = 0;
#ifdef __AVX2__
    f |= F_AVX2;
#endif
#ifdef __FMA__
    f |= F_FMA;
#endif
#ifdef __F16C__
    f |= F_F16C;
#endif
#ifdef __BMI2__
    f |= F_BMI2;
#endif
#ifdef __AVX512F__
    f |= F_AVX512F;
#endif
#ifdef __AVX512BW__
    f |= F_AVX512BW;
#endif
#ifdef __AVX512VL__
    f |= F_AVX512VL;
#endif
#ifdef __AVX512DQ__
    f |= F_AVX512DQ;
#endif
#ifdef __AVX512VNNI__
    f |= F_AVX512VNNI;
#endif
#ifdef __AVX512BF16__
    f |= F_AVX512BF16;
#endif
#ifdef __ARM_NEON
    f |= F_NEON;
#endif
    return f;
}

/* What the running CPU (and its operating system) can execute, in the same bits. Only the
 * portable build's answer is asked for: it runs on every CPU. */
LLMCLI_API int llmcli_cpu_features(void) {
    int f = 0;
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    /* libgcc's and compiler-rt's checks include the OS's support (XGETBV) for the registers. */
    if (__builtin_cpu_supports("avx2")) f |= F_AVX2;
    if (__builtin_cpu_supports("fma")) f |= F_FMA;
    if (__builtin_cpu_supports("f16c")) f |= F_F16C;
    if (__builtin_cpu_supports("bmi2")) f |= F_BMI2;
    if (__builtin_cpu_supports("avx512f")) f |= F_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= F_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) f |= F_AVX512VL;
    if (__builtin_cpu_supports("avx512dq")) f |= F_AVX512DQ;
    if (__builtin_cpu_supports("avx512vnni")) f |= F_AVX512VNNI;
    if (__builtin_cpu_supports("avx512bf16")) f |= F_AVX512BF16;
#endif
#ifdef __ARM_NEON
    f |= F_NEON;
#endif
    return f;
}

/* 1 where this build multiplies `type` (a GGUF type id), else 0. */
LLMCLI_API int llmcli_has_type(int type) { return type_of(type) != NULL; }

LLMCLI_API int64_t llmcli_block_elems(int type) {
    const weight_type *t = type_of(type);
    return t ? t->block_elems : 0;
}

LLMCLI_API int64_t llmcli_block_bytes(int type) {
    const weight_type *t = type_of(type);
    return t ? t->block_bytes : 0;
}

/* `rows` rows of `k` values from their blocks, as gguf.quants.dequantize reads them. */
LLMCLI_API int llmcli_dequantize(int type, const void *blocks, int64_t rows, int64_t k, float *out) {
    const weight_type *t = type_of(type);
    if (!t || !t->dequantize_row || k % t->block_elems) return -1;
    const int64_t row_bytes = k / t->block_elems * t->block_bytes;
    for (int64_t r = 0; r < rows; r++)
        t->dequantize_row((const char *)blocks + r * row_bytes, out + r * k, k);
    return 0;
}

typedef struct {
    const weight_type *t;
    const char *blocks;
    int64_t rows, k, row_bytes;
    void *out;
    int out_dtype;
} dequantize_job;

static void dequantize_rows(void *context, int ith, int nth) {
    const dequantize_job *job = context;
    float *row = job->out_dtype == D_F32 ? NULL : malloc((size_t)job->k * sizeof(float));
    const int64_t first = job->rows * ith / nth, last = job->rows * (ith + 1) / nth;
    for (int64_t r = first; r < last; r++) {
        const char *blocks = job->blocks + r * job->row_bytes;
        if (!row) {
            job->t->dequantize_row(blocks, (float *)job->out + r * job->k, job->k);
            continue;
        }
        job->t->dequantize_row(blocks, row, job->k);
        for (int64_t j = 0; j < job->k; j++) store_value(job->out, job->out_dtype, r * job->k + j, row[j]);
    }
    free(row);
}

/* As llmcli_dequantize, on n_threads, the values written in out_dtype (D_F32, D_BF16, D_F16):
 * a prefill's products dequantize a matrix once and multiply it by torch's GEMM. */
LLMCLI_API int llmcli_dequantize_to(int type, const void *blocks, int64_t rows, int64_t k, void *out,
                                    int out_dtype, int n_threads) {
    const weight_type *t = type_of(type);
    if (!t || !t->dequantize_row || k % t->block_elems) return -1;
    dequantize_job job = { t, blocks, rows, k, k / t->block_elems * t->block_bytes, out, out_dtype };
    pool_run(dequantize_rows, &job, n_threads);
    return 0;
}

typedef struct {
    const weight_type *t;
    const char *w;
    int64_t n, k, m, w_row_bytes, act_bytes;
    const char *act;  /* m quantized activation rows */
    void *y;          /* [m, n] in y_dtype, rows y_stride apart */
    int y_dtype;
    int64_t y_stride;
    atomic_llong next_run; /* the next run of rows a thread takes */
} product_job;

#define RUN_ROWS 64 /* rows a thread takes at a time (a whole number of cache lines of y in fp32 and
                       * in 16 bits): a late thread's share is taken by the others */

/* The threads take runs of RUN_ROWS weight rows from a shared counter (a thread the scheduler
 * runs late finds its share taken, rather than holding everyone up) and multiply each with every
 * activation row: a weight row is read from memory once and stays in cache for all m. */
static void product_rows(void *context, int ith, int nth) {
    (void)ith;
    (void)nth;
    product_job *job = context;
    for (;;) {
    const int64_t first = atomic_fetch_add(&job->next_run, 1) * RUN_ROWS;
    if (first >= job->n) break;
    const int64_t last = first + RUN_ROWS < job->n ? first + RUN_ROWS : job->n;
    for (int64_t r = first; r < last; r++) {
        const char *w_row = job->w + r * job->w_row_bytes;
        for (int64_t i = 0; i < job->m; i++) {
            const float v = job->t->vec_dot(job->k, w_row, job->act + i * job->act_bytes);
            store_value(job->y, job->y_dtype, i * job->y_stride + r, v);
        }
    }
    }
}

typedef struct {
    const weight_type *t;
    const void *x;    /* [m, k] in x_dtype */
    int x_dtype;
    char *act;
    int64_t m, k, act_bytes;
} quantize_job;

static void quantize_rows(void *context, int ith, int nth) {
    const quantize_job *job = context;
    float row[4096];
    for (int64_t i = ith; i < job->m; i += nth) {
        char *out = job->act + i * job->act_bytes;
        if (job->x_dtype == D_F32) {
            quantize_act_row(job->t->act_type, (const float *)job->x + i * job->k, out, job->k);
            continue;
        }
        /* A 16-bit row widened in pieces of whole activation blocks (QK_K divides 4096). */
        for (int64_t start = 0; start < job->k; start += 4096) {
            const int64_t count = job->k - start < 4096 ? job->k - start : 4096;
            for (int64_t j = 0; j < count; j++) row[j] = load_value(job->x, job->x_dtype, i * job->k + start + j);
            quantize_act_row(job->t->act_type, row, out + act_row_bytes(job->t->act_type, start), count);
        }
    }
}

const weight_type *weight_type_of(int type) { return type_of(type); }

/* The products of m activation rows already quantized to t's format with every weight row. */
static void multiply(const weight_type *t, const void *w, int64_t n, int64_t k, const char *act, int64_t m,
                     void *y, int y_dtype, int64_t y_stride, int n_threads) {
    product_job p = { t, w, n, k, m, k / t->block_elems * t->block_bytes, act_row_bytes(t->act_type, k), act,
                      y, y_dtype, y_stride, 0 };
    pool_run(product_rows, &p, n_threads);
}

void multiply_quantized(const weight_type *t, const void *w, int64_t n, int64_t k, const char *act, int64_t m,
                        float *y, int64_t y_stride, int n_threads) {
    multiply(t, w, n, k, act, m, y, D_F32, y_stride, n_threads);
}

/* y[m, n] = x[m, k] · W[n, k]ᵀ, W being n rows of `type` blocks; x and y each in fp32, bf16 or
 * fp16 (x_dtype, y_dtype: the model's own, so no conversion call around each product). 0, or -1
 * where this build has no kernel for the type or k is not a whole number of its blocks (the
 * caller keeps its path). */
LLMCLI_API int llmcli_matmul(int type, const void *w, int64_t n, int64_t k, const void *x, int x_dtype,
                             int64_t m, void *y, int y_dtype, int n_threads) {
    const weight_type *t = type_of(type);
    if (!t || k % t->block_elems || k % 32) return -1;
    const int64_t act_bytes = act_row_bytes(t->act_type, k);
    char stack_act[16384];
    char *act = act_bytes * m <= (int64_t)sizeof stack_act ? stack_act : malloc((size_t)(act_bytes * m));
    if (!act) return -2;
    quantize_job q = { t, x, x_dtype, act, m, k, act_bytes };
    if (m == 1) quantize_rows(&q, 0, 1); /* one row: not worth waking the pool */
    else pool_run(quantize_rows, &q, n_threads);
    multiply(t, w, n, k, act, m, y, y_dtype, n, n_threads);
    if (act != stack_act) free(act);
    return 0;
}
