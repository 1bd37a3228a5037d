/* Q2_K, Q3_K and IQ4_XS (ggml-common.h's layouts: super-blocks of 256), multiplied with
 * activations in Q8_K as llama.cpp does: each 16- or 32-element sub-block's integers against the
 * activations' in integers, times the sub-block's small integer scale, and one float product per
 * super-block. Q2_K's minimums come out of Q8_K's 16-element sums (bsums), never per element. */
#include <string.h>

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

/* Each type's super-block read once into its 256 small integers: that serves dequantization and
 * the portable product alike, and its fixed-stride loops (unlike an element-at-a-time reading)
 * are ones the compiler vectorizes on any target, NEON included. */

/* Q2_K: byte 32·h + l holds elements 128·h + 32·g + l in bits 2g, 2g + 1. */
static void unpack_q2_K(const block_q2_K *b, int8_t q[QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * g + l] = (int8_t)((b->qs[32 * h + l] >> (2 * g)) & 3);
}

/* Q3_K: Q2_K's two low bits, minus 4 where bit 4h + g of hmask[l] is clear. */
static void unpack_q3_K(const block_q3_K *b, int8_t q[QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                const int low = (b->qs[32 * h + l] >> (2 * g)) & 3;
                const int high = (b->hmask[l] >> (4 * h + g)) & 1;
                q[128 * h + 32 * g + l] = (int8_t)(low - 4 + 4 * high);
            }
}

/* IQ4_XS: sub-block j's 16 bytes hold its first 16 indices in their low nibbles, the rest high. */
static void unpack_iq4_xs(const block_iq4_xs *b, int8_t q[QK_K]) {
    for (int j = 0; j < QK_K / 32; j++)
        for (int l = 0; l < 16; l++) {
            q[32 * j + l] = IQ4_LEVELS[b->qs[16 * j + l] & 0xF];
            q[32 * j + 16 + l] = IQ4_LEVELS[b->qs[16 * j + l] >> 4];
        }
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

static inline int dot_i8(const int8_t *x, const int8_t *y, int n) {
    int sum = 0;
    for (int l = 0; l < n; l++) sum += x[l] * y[l];
    return sum;
}

/* gguf rounds d·q and then d·q − m; a fused multiply-add (which -mfma lets the compiler form
 * here) rounds once, yet gives the same bits: d (11 significant bits) times a 4-bit scale times
 * a 2-bit value is exact in fp32, so the product has nothing to round. */
static void dequantize_q2_K(const void *blocks, float *out, int64_t k) {
    const block_q2_K *b = blocks;
    int8_t q[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++, out += QK_K) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        unpack_q2_K(&b[i], q);
        for (int j = 0; j < QK_K / 16; j++) {
            const float scale = d * (float)(b[i].scales[j] & 0xF);
            const float minimum = dmin * (float)(b[i].scales[j] >> 4);
            for (int e = j * 16; e < j * 16 + 16; e++) out[e] = scale * (float)q[e] - minimum;
        }
    }
}

__attribute__((unused)) static float dot_q2_K(int64_t k, const void *w_row, const void *act_row) {
    const block_q2_K *w = w_row;
    const block_q8_K *a = act_row;
    int8_t q[QK_K];
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        unpack_q2_K(&w[i], q);
        int scaled = 0, minimums = 0;
        for (int j = 0; j < QK_K / 16; j++) {
            scaled += (w[i].scales[j] & 0xF) * dot_i8(q + 16 * j, a[i].qs + 16 * j, 16);
            minimums += (w[i].scales[j] >> 4) * a[i].bsums[j];
        }
        sum += a[i].d * fp16_to_fp32(w[i].d) * (float)scaled - a[i].d * fp16_to_fp32(w[i].dmin) * (float)minimums;
    }
    return sum;
}

/* Q3_K and IQ4_XS are symmetric (a value is d · scale · q, no minimum): one reading of a block
 * into its integers, its sub-blocks' scales and d serves both types' dequantization and product. */
typedef float (*read_symmetric)(const void *block, int8_t q[QK_K], int scales[QK_K / 16]);

static float read_q3_K(const void *block, int8_t q[QK_K], int scales[QK_K / 16]) {
    const block_q3_K *b = block;
    unpack_q3_K(b, q);
    for (int j = 0; j < QK_K / 16; j++) scales[j] = q3_scale(b, j);
    return fp16_to_fp32(b->d);
}

static float read_iq4_xs(const void *block, int8_t q[QK_K], int scales[QK_K / 16]) {
    const block_iq4_xs *b = block;
    unpack_iq4_xs(b, q);
    for (int j = 0; j < QK_K / 32; j++) scales[j] = iq4_xs_scale(b, j);
    return fp16_to_fp32(b->d);
}

static inline void dequantize_symmetric(read_symmetric read, int64_t block_bytes, int sub_blocks,
                                        const void *blocks, float *out, int64_t k) {
    int8_t q[QK_K];
    int scales[QK_K / 16];
    const int size = QK_K / sub_blocks;
    for (int64_t i = 0; i < k / QK_K; i++, out += QK_K) {
        const float d = read((const char *)blocks + i * block_bytes, q, scales);
        for (int j = 0; j < sub_blocks; j++) {
            const float scale = d * (float)scales[j];
            for (int e = j * size; e < j * size + size; e++) out[e] = scale * (float)q[e];
        }
    }
}

static inline float dot_symmetric(read_symmetric read, int64_t block_bytes, int sub_blocks, int64_t k,
                                  const void *w_row, const void *act_row) {
    const block_q8_K *a = act_row;
    int8_t q[QK_K];
    int scales[QK_K / 16];
    const int size = QK_K / sub_blocks;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        const float d = read((const char *)w_row + i * block_bytes, q, scales);
        int scaled = 0;
        for (int j = 0; j < sub_blocks; j++) scaled += scales[j] * dot_i8(q + size * j, a[i].qs + size * j, size);
        sum += a[i].d * d * (float)scaled;
    }
    return sum;
}

static void dequantize_q3_K(const void *blocks, float *out, int64_t k) {
    dequantize_symmetric(read_q3_K, sizeof(block_q3_K), QK_K / 16, blocks, out, k);
}

__attribute__((unused)) static float dot_q3_K(int64_t k, const void *w_row, const void *act_row) {
    return dot_symmetric(read_q3_K, sizeof(block_q3_K), QK_K / 16, k, w_row, act_row);
}

static void dequantize_iq4_xs(const void *blocks, float *out, int64_t k) {
    dequantize_symmetric(read_iq4_xs, sizeof(block_iq4_xs), QK_K / 32, blocks, out, k);
}

__attribute__((unused)) static float dot_iq4_xs(int64_t k, const void *w_row, const void *act_row) {
    return dot_symmetric(read_iq4_xs, sizeof(block_iq4_xs), QK_K / 32, k, w_row, act_row);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* The AVX2 products: 32 elements per instruction, maddubs (unsigned × signed bytes into 16-bit
 * pairs) then madd with each sub-block's scale into 32-bit sums, one fp32 FMA per super-block,
 * llama.cpp's scheme. No 16-bit sum can saturate: |2·3·127| and |2·4·127| are far below 32767. */

/* fp16 to fp32 by F16C's one instruction, not fp16_to_fp32's dozen (it was a call then, and
 * reading the scales this way made these products 11-24 % faster). */
static inline float half_to_fp32(uint16_t h) { return _cvtsh_ss(h); }

/* The 16-bit scales of 8 sub-blocks of 16 sit in both halves of a register; group g (32
 * elements: sub-blocks 2g and 2g + 1) needs sub-block 2g's in the low half, 2g + 1's in the high. */
static inline __m256i scales_of_group(__m256i scales, int g) {
    const __m128i low = _mm_set1_epi16((short)((4 * g + 1) << 8 | 4 * g));
    const __m128i high = _mm_set1_epi16((short)((4 * g + 3) << 8 | (4 * g + 2)));
    return _mm256_shuffle_epi8(scales, _mm256_set_m128i(high, low));
}

/* 8 int16 scales, repeated in both 128-bit halves. */
static inline __m256i both_halves(__m128i scales16) { return _mm256_set_m128i(scales16, scales16); }

static float dot_q2_K_avx2(int64_t k, const void *w_row, const void *act_row) {
    const block_q2_K *w = w_row;
    const block_q8_K *a = act_row;
    const __m256i three = _mm256_set1_epi8(3);
    const __m128i nibble = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        const __m128i packed = _mm_loadu_si128((const __m128i *)w[i].scales);
        const __m256i minimums = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
        const __m256i minimum_sums = _mm256_madd_epi16(minimums, _mm256_loadu_si256((const __m256i *)a[i].bsums));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(-a[i].d * half_to_fp32(w[i].dmin)), _mm256_cvtepi32_ps(minimum_sums), acc);
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_and_si128(packed, nibble));
        const __m256i halves[2] = { both_halves(_mm256_castsi256_si128(scales)),
                                    both_halves(_mm256_extracti128_si256(scales, 1)) };
        __m256i sums = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w[i].qs + 32 * half));
            const int8_t *q8 = a[i].qs + 128 * half;
            for (int g = 0; g < 4; g++) {
                const __m256i values = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * g), three);
                const __m256i pairs = _mm256_maddubs_epi16(values, _mm256_loadu_si256((const __m256i *)(q8 + 32 * g)));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(scales_of_group(halves[half], g), pairs));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i].d * half_to_fp32(w[i].d)), _mm256_cvtepi32_ps(sums), acc);
    }
    return hsum_f32x8(acc);
}

/* Q3_K's sixteen 6-bit scales, minus 32, as bytes (the bit layout in q3_scale, 32 bits at a
 * time). Built from registers: four 32-bit stores read back as one 128-bit load would stall on
 * store forwarding. */
static inline __m128i q3_scales(const block_q3_K *b) {
    uint32_t low[2], high;
    memcpy(low, b->scales, 8);
    memcpy(&high, b->scales + 8, 4);
    const uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
    const __m128i scales = _mm_set_epi32((int)(((low[1] >> 4) & low4) | (((high >> 6) & low2) << 4)),
                                         (int)(((low[0] >> 4) & low4) | (((high >> 4) & low2) << 4)),
                                         (int)((low[1] & low4) | (((high >> 2) & low2) << 4)),
                                         (int)((low[0] & low4) | ((high & low2) << 4)));
    return _mm_sub_epi8(scales, _mm_set1_epi8(32));
}

/* Each value is u − 4, u = its two low bits plus 4 where its high bit is set (0..7, unsigned, as
 * maddubs wants it): Σ scale·(u − 4)·x = Σ scale·u·x − 4·Σ scale·bsum, the last term one madd
 * over Q8_K's 16-element sums per super-block. */
static float dot_q3_K_avx2(int64_t k, const void *w_row, const void *act_row) {
    const block_q3_K *w = w_row;
    const block_q8_K *a = act_row;
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        const __m256i scales = _mm256_cvtepi8_epi16(q3_scales(&w[i]));
        const __m256i offsets = _mm256_madd_epi16(scales, _mm256_loadu_si256((const __m256i *)a[i].bsums));
        const __m256i halves[2] = { both_halves(_mm256_castsi256_si128(scales)),
                                    both_halves(_mm256_extracti128_si256(scales, 1)) };
        const __m256i high_bits = _mm256_loadu_si256((const __m256i *)w[i].hmask);
        __m256i sums = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offsets, 2));
        for (int half = 0; half < 2; half++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w[i].qs + 32 * half));
            const int8_t *q8 = a[i].qs + 128 * half;
            for (int g = 0; g < 4; g++) {
                const int bit = 4 * half + g; /* moved to bit 2 of its byte: worth 4 */
                const __m256i high = bit >= 2 ? _mm256_srli_epi16(high_bits, bit - 2) : _mm256_slli_epi16(high_bits, 2 - bit);
                const __m256i values = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 2 * g), three),
                                                       _mm256_and_si256(high, four));
                const __m256i pairs = _mm256_maddubs_epi16(values, _mm256_loadu_si256((const __m256i *)(q8 + 32 * g)));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(scales_of_group(halves[half], g), pairs));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i].d * half_to_fp32(w[i].d)), _mm256_cvtepi32_ps(sums), acc);
    }
    return hsum_f32x8(acc);
}

/* Signed bytes times signed bytes into 16-bit pairs: maddubs takes the first operand unsigned,
 * so it gets |x| and the second operand takes x's sign. */
static inline __m256i signed_pairs(__m256i x, __m256i y) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

static float dot_iq4_xs_avx2(int64_t k, const void *w_row, const void *act_row) {
    const block_iq4_xs *w = w_row;
    const block_q8_K *a = act_row;
    const __m128i levels = _mm_loadu_si128((const __m128i *)IQ4_LEVELS), nibble = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        __m256i sums = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 32; j++) {
            const __m128i bits = _mm_loadu_si128((const __m128i *)(w[i].qs + 16 * j));
            const __m256i values = _mm256_set_m128i(_mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(bits, 4), nibble)),
                                                    _mm_shuffle_epi8(levels, _mm_and_si128(bits, nibble)));
            const __m256i pairs = signed_pairs(values, _mm256_loadu_si256((const __m256i *)(a[i].qs + 32 * j)));
            sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, _mm256_set1_epi16((short)iq4_xs_scale(&w[i], j))));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i].d * half_to_fp32(w[i].d)), _mm256_cvtepi32_ps(sums), acc);
    }
    return hsum_f32x8(acc);
}
#define DOT_Q2_K dot_q2_K_avx2
#define DOT_Q3_K dot_q3_K_avx2
#define DOT_IQ4_XS dot_iq4_xs_avx2
#else
#define DOT_Q2_K dot_q2_K
#define DOT_Q3_K dot_q3_K
#define DOT_IQ4_XS dot_iq4_xs
#endif

const weight_type TYPE_Q2_K = { QK_K, sizeof(block_q2_K), T_Q8_K, dequantize_q2_K, DOT_Q2_K };
const weight_type TYPE_Q3_K = { QK_K, sizeof(block_q3_K), T_Q8_K, dequantize_q3_K, DOT_Q3_K };
const weight_type TYPE_IQ4_XS = { QK_K, sizeof(block_iq4_xs), T_Q8_K, dequantize_iq4_xs, DOT_IQ4_XS };
