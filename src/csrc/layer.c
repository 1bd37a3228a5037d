/* A Llama-style block's work around attention, in two calls: everything from the residual
 * stream to q, k and v (norm, products, biases, per-head norms, RoPE), and everything from
 * attention's output back to the residual stream (output product, residual, norm, gated
 * feed-forward, residual). A CPU decode step of the torch path spends more time in the ~30 small
 * calls these replace than in the products; here they are a few loops around the products, in
 * fp32 throughout (the torch path rounds to the model's dtype between them). Attention itself
 * stays with the engine's plan, which owns the cache. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "llmcli_cpu.h"

/* One matrix: its type, its blocks, its rows and an optional fp32 bias. */
typedef struct {
    int type;
    const void *w;
    int64_t n;
    const float *bias;
} matrix;

/* Filled once per layer by llmcli (engine/native/compiled_layer.py), read at every call. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rot_width, intermediate;
    float eps;
    const float *attention_norm, *ffn_norm; /* [hidden] */
    const float *q_norm, *k_norm;           /* [head_dim], or NULL */
    int64_t qkv_parts;                      /* 1: q|k|v one matrix; 3: each its own */
    matrix qkv[3];
    matrix out;
    int64_t gate_up_parts;                  /* 1: gate|up one matrix; 2: each its own */
    matrix gate_up[2];
    matrix down;
} layer_weights;

/* out = x / rms(x) · weight, each of m rows of `width`. */
static void rms_norm(const float *x, const float *weight, float eps, int64_t m, int64_t width, float *out) {
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * width;
        double sum = 0.0;
        for (int64_t j = 0; j < width; j++) sum += (double)row[j] * row[j];
        const float scale = 1.0f / sqrtf((float)(sum / width) + eps);
        for (int64_t j = 0; j < width; j++) out[i * width + j] = row[j] * scale * weight[j];
    }
}

/* y[m, n] (rows y_stride apart) = x · Wᵀ (+ bias), x's rows quantized into `act` for t first
 * unless `act_type` says they are there already. Returns the activation type now in `act`. */
static int product(const matrix *mat, const float *x, int64_t m, int64_t k, char *act, int act_type, float *y,
                   int64_t y_stride, int n_threads) {
    const weight_type *t = weight_type_of(mat->type);
    if (t->act_type != act_type) {
        const int64_t bytes = act_row_bytes(t->act_type, k);
        for (int64_t i = 0; i < m; i++) quantize_act_row(t->act_type, x + i * k, act + i * bytes, k);
    }
    multiply_quantized(t, mat->w, mat->n, k, act, m, y, y_stride, n_threads);
    if (mat->bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < mat->n; j++) y[i * y_stride + j] += mat->bias[j];
    return t->act_type;
}

/* The scratch for activation rows of width k quantized in any format (Q8_K's is the widest). */
static char *activation_scratch(int64_t m, int64_t k) {
    const int64_t widest = act_row_bytes(T_F32, k);
    return malloc((size_t)(m * widest));
}

/* A row of a head: RMS-normed by `weight` where given, then RoPE (rotate-half, as transformers
 * applies it: x·cos + swap(x)·signed_sin over the first rot_width values). */
static void finish_head(float *x, const float *weight, float eps, int64_t d, const void *cos, const void *sin,
                        int rope_dtype, int64_t rope_row, int64_t rot) {
    if (weight) rms_norm(x, weight, eps, 1, d, x); /* in place: each value is read before written */
    float rotated[1024];
    const int64_t half = rot / 2;
    for (int64_t j = 0; j < rot; j++) {
        const float c = load_value(cos, rope_dtype, rope_row * rot + j);
        const float s = load_value(sin, rope_dtype, rope_row * rot + j);
        rotated[j] = x[j] * c + x[j < half ? j + half : j - half] * s;
    }
    memcpy(x, rotated, (size_t)rot * sizeof(float));
}

/* From the residual stream h [m, hidden] (fp32) to q [m, heads, d], k and v [m, kv_heads, d]
 * (in out_dtype: D_F32, D_BF16 or D_F16), RoPE'd by cos and signed sin [m, rot_width] (in rope_dtype). */
LLMCLI_API int llmcli_layer_attention_in(const layer_weights *L, const float *h, int64_t m, const void *cos,
                                         const void *sin, int rope_dtype, void *q, void *k, void *v, int out_dtype,
                                         int n_threads) {
    const int64_t hidden = L->hidden, d = L->head_dim;
    const int64_t q_width = L->heads * d, kv_width = L->kv_heads * d, width = q_width + 2 * kv_width;
    if (d > 1024 || L->rot_width > d) return -1;
    float *x = malloc((size_t)(m * hidden) * sizeof(float));
    float *qkv = malloc((size_t)(m * width) * sizeof(float));
    char *act = activation_scratch(m, hidden);
    if (!x || !qkv || !act) { free(x); free(qkv); free(act); return -2; }
    rms_norm(h, L->attention_norm, L->eps, m, hidden, x);
    int act_type = -1;
    int64_t column = 0;
    for (int64_t p = 0; p < L->qkv_parts; p++) {
        act_type = product(&L->qkv[p], x, m, hidden, act, act_type, qkv + column, width, n_threads);
        column += L->qkv[p].n;
    }
    for (int64_t i = 0; i < m; i++) {
        float *row = qkv + i * width;
        for (int64_t head = 0; head < L->heads + L->kv_heads; head++) {
            const int is_q = head < L->heads;
            finish_head(row + head * d, is_q ? L->q_norm : L->k_norm, L->eps, d, cos, sin, rope_dtype, i,
                        L->rot_width);
        }
        for (int64_t j = 0; j < q_width; j++) store_value(q, out_dtype, i * q_width + j, row[j]);
        for (int64_t j = 0; j < kv_width; j++) {
            store_value(k, out_dtype, i * kv_width + j, row[q_width + j]);
            store_value(v, out_dtype, i * kv_width + j, row[q_width + kv_width + j]);
        }
    }
    free(x); free(qkv); free(act);
    return 0;
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* From attention's output a [m, heads · d] (in a_dtype) and the residual stream h [m, hidden]
 * to the next residual stream h_out = h + o(a), then + down(silu(gate(n)) · up(n)) with n its
 * RMS norm. */
LLMCLI_API int llmcli_layer_feed_forward(const layer_weights *L, const float *h, int64_t m, const void *a,
                                         int a_dtype, float *h_out, int n_threads) {
    const int64_t hidden = L->hidden, inner = L->intermediate, a_width = L->heads * L->head_dim;
    const int64_t widest = a_width > hidden ? a_width : hidden;
    float *x = malloc((size_t)(m * (widest > inner ? widest : inner)) * sizeof(float));
    /* The gate and up rows, then down's output in the same place. */
    float *gate_up = malloc((size_t)(m * (2 * inner > hidden ? 2 * inner : hidden)) * sizeof(float));
    char *act = activation_scratch(m, widest > inner ? widest : inner);
    if (!x || !gate_up || !act) { free(x); free(gate_up); free(act); return -2; }
    for (int64_t i = 0; i < m * a_width; i++) x[i] = load_value(a, a_dtype, i);
    product(&L->out, x, m, a_width, act, -1, h_out, hidden, n_threads);
    for (int64_t i = 0; i < m * hidden; i++) h_out[i] += h[i];
    rms_norm(h_out, L->ffn_norm, L->eps, m, hidden, x);
    int act_type = -1;
    int64_t column = 0;
    for (int64_t p = 0; p < L->gate_up_parts; p++) {
        act_type = product(&L->gate_up[p], x, m, hidden, act, act_type, gate_up + column, 2 * inner, n_threads);
        column += L->gate_up[p].n;
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < inner; j++) {
            const float *row = gate_up + i * 2 * inner;
            x[i * inner + j] = silu(row[j]) * row[inner + j];
        }
    float *down = gate_up;
    product(&L->down, x, m, inner, act, -1, down, hidden, n_threads);
    for (int64_t i = 0; i < m * hidden; i++) h_out[i] += down[i];
    free(x); free(gate_up); free(act);
    return 0;
}
