/* Q2_K, Q3_K and IQ4_XS (ggml-common.h's layouts: super-blocks of 256), multiplied with
 * activations in Q8_K as llama.cpp does: each 16- or 32-element sub-block's integers against the
 * activations' in integers, times the sub-block's small integer scale, and one float product per
 * super-block. Q2_K's minimums come out of Q8_K's 16-element sums (bsums), never per element. */
#include "llmcli_cpu.h"

typedef struct {
    uint8_t scales[QK_K / 16]; /* per 16 elements: scale (low nibble) and minimum (high) */
    uint8_t qs[QK_K / 4];      /* 2-bit values, four to a byte */
    uint16_t d, dmin;          /* fp16: the scales' scale and the minimums' */
} block_q2_K;                  /* 84 bytes */

typedef struct {
    uint8_t hmask[QK_K / 8]; /* each value's third bit; a clear bit means "minus 4" */
    uint8_t qs[QK_K / 4];    /* each value's two low bits */
    uint8_t scales[12];      /* sixteen 6-bit scales, offset by 32 */
    uint16_t d;
} block_q3_K;                /* 110 bytes */

typedef struct {
    uint16_t d;
    uint16_t scales_h;         /* each 32-element sub-block's scale's two high bits */
    uint8_t scales_l[QK_K / 64]; /* and its four low ones */
    uint8_t qs[QK_K / 2];      /* 4-bit indices into the non-linear table */
} block_iq4_xs;                /* 136 bytes */

/* IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h's kvalues_iq4nl). */
static const int8_t IQ4_LEVELS[16] = { -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113 };

/* Q2_K's element e of a super-block: byte e / 128 * 32 + e % 32, bits 2 * (e / 32 % 4). */
static inline int q2_value(const block_q2_K *b, int e) {
    return (b->qs[e / 128 * 32 + e % 32] >> (2 * (e / 32 % 4))) & 3;
}

/* Q3_K's element e: Q2_K's two low bits, minus 4 where bit e / 32 of hmask[e % 32] is clear. */
static inline int q3_value(const block_q3_K *b, int e) {
    const int low = (b->qs[e / 128 * 32 + e % 32] >> (2 * (e / 32 % 4))) & 3;
    return low - ((b->hmask[e % 32] >> (e / 32)) & 1 ? 0 : 4);
}

/* Q3_K's scale of sub-block j (of 16): four low bits from bytes 0-7, two high from 8-11. */
static inline int q3_scale(const block_q3_K *b, int j) {
    const int low = (b->scales[j % 8] >> (4 * (j / 8))) & 0xF;
    const int high = (b->scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (low | high << 4) - 32;
}

static inline int iq4_xs_scale(const block_iq4_xs *b, int j) {
    const int low = (b->scales_l[j / 2] >> (4 * (j % 2))) & 0xF;
    const int high = (b->scales_h >> (2 * j)) & 3;
    return (low | high << 4) - 32;
}

/* Element l of a 32-element IQ4_XS sub-block's 16 bytes: low nibbles first, then high ones. */
static inline int iq4_value(const uint8_t *qs, int l) {
    return IQ4_LEVELS[l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4];
}

/* gguf rounds d·q and then d·q − m; a fused multiply-add (which -mfma lets the compiler form
 * here) rounds once, yet gives the same bits: d (11 significant bits) times a 4-bit scale times
 * a 2-bit value is exact in fp32, so the product has nothing to round. */
static void dequantize_q2_K(const void *blocks, float *out, int64_t k) {
    const block_q2_K *b = blocks;
    for (int64_t i = 0; i < k / QK_K; i++, out += QK_K) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < QK_K / 16; j++) {
            const float scale = d * (float)(b[i].scales[j] & 0xF);
            const float minimum = dmin * (float)(b[i].scales[j] >> 4);
            for (int e = j * 16; e < j * 16 + 16; e++) out[e] = scale * (float)q2_value(&b[i], e) - minimum;
        }
    }
}

static float dot_q2_K(int64_t k, const void *w_row, const void *act_row) {
    const block_q2_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        int scaled = 0, minimums = 0;
        for (int j = 0; j < QK_K / 16; j++) {
            int dot = 0;
            for (int e = j * 16; e < j * 16 + 16; e++) dot += q2_value(&w[i], e) * a[i].qs[e];
            scaled += (w[i].scales[j] & 0xF) * dot;
            minimums += (w[i].scales[j] >> 4) * a[i].bsums[j];
        }
        sum += a[i].d * fp16_to_fp32(w[i].d) * (float)scaled - a[i].d * fp16_to_fp32(w[i].dmin) * (float)minimums;
    }
    return sum;
}

static void dequantize_q3_K(const void *blocks, float *out, int64_t k) {
    const block_q3_K *b = blocks;
    for (int64_t i = 0; i < k / QK_K; i++, out += QK_K) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK_K / 16; j++) {
            const float scale = d * (float)q3_scale(&b[i], j);
            for (int e = j * 16; e < j * 16 + 16; e++) out[e] = scale * (float)q3_value(&b[i], e);
        }
    }
}

static float dot_q3_K(int64_t k, const void *w_row, const void *act_row) {
    const block_q3_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        int scaled = 0;
        for (int j = 0; j < QK_K / 16; j++) {
            int dot = 0;
            for (int e = j * 16; e < j * 16 + 16; e++) dot += q3_value(&w[i], e) * a[i].qs[e];
            scaled += q3_scale(&w[i], j) * dot;
        }
        sum += a[i].d * fp16_to_fp32(w[i].d) * (float)scaled;
    }
    return sum;
}

static void dequantize_iq4_xs(const void *blocks, float *out, int64_t k) {
    const block_iq4_xs *b = blocks;
    for (int64_t i = 0; i < k / QK_K; i++, out += QK_K) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK_K / 32; j++) {
            const float scale = d * (float)iq4_xs_scale(&b[i], j);
            for (int l = 0; l < 32; l++) out[j * 32 + l] = scale * (float)iq4_value(b[i].qs + 16 * j, l);
        }
    }
}

static float dot_iq4_xs(int64_t k, const void *w_row, const void *act_row) {
    const block_iq4_xs *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        int scaled = 0;
        for (int j = 0; j < QK_K / 32; j++) {
            int dot = 0;
            for (int l = 0; l < 32; l++) dot += iq4_value(w[i].qs + 16 * j, l) * a[i].qs[32 * j + l];
            scaled += iq4_xs_scale(&w[i], j) * dot;
        }
        sum += a[i].d * fp16_to_fp32(w[i].d) * (float)scaled;
    }
    return sum;
}

const weight_type TYPE_Q2_K = { QK_K, sizeof(block_q2_K), T_Q8_K, dequantize_q2_K, dot_q2_K };
const weight_type TYPE_Q3_K = { QK_K, sizeof(block_q3_K), T_Q8_K, dequantize_q3_K, dot_q3_K };
const weight_type TYPE_IQ4_XS = { QK_K, sizeof(block_iq4_xs), T_Q8_K, dequantize_iq4_xs, dot_iq4_xs };
