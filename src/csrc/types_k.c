/* Q4_K, Q5_K and Q6_K (ggml-common.h's layouts: super-blocks of 256), multiplied with
 * activations in Q8_K as llama.cpp does: each sub-block's integers against the activation's,
 * summed in integers, scaled by the sub-block's 6- or 8-bit scale; the minimums of Q4_K/Q5_K
 * meet the activation through its 16-element sums (block_q8_K.bsums), never element by element.
 *
 * Every product has a scalar form (the portable path, and the reference the SIMD forms must
 * equal exactly in their integer sums) and, where the build allows, AVX2 and AVX-512 VNNI forms. */
#include <stddef.h>
#include <string.h>

#include "llmcli_cpu.h"

typedef struct {
    uint16_t d, dmin;   /* super-block scales of the sub-blocks' scales and minimums */
    uint8_t scales[12]; /* 8 scales and 8 minimums, 6 bits each */
    uint8_t qs[QK_K / 2];
} block_q4_K; /* 144 bytes */

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8]; /* the fifth bit of each value */
    uint8_t qs[QK_K / 2];
} block_q5_K; /* 176 bytes */

typedef struct {
    uint8_t ql[QK_K / 2];  /* low 4 bits */
    uint8_t qh[QK_K / 4];  /* high 2 bits */
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K; /* 210 bytes */

/* The eight 6-bit scales and minimums of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4,
 * four at a time): bytes 0..3 hold scales 0..3 and, in their top two bits, the high bits of
 * scales 4..7; bytes 4..7 the same for the minimums; bytes 8..11 the low nibbles of scales 4..7
 * (low half) and minimums 4..7 (high half). Read as little-endian words, as every target is. */
static inline void scales_mins_k4(const uint8_t *packed, uint8_t scales[8], uint8_t mins[8]) {
    uint32_t w[3];
    memcpy(w, packed, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint32_t s[2] = { w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & low2) << 4) };
    const uint32_t m[2] = { w[1] & low6, ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4) };
    memcpy(scales, s, 8);
    memcpy(mins, m, 8);
}

/* The values of one Q4_K or Q5_K super-block as integers 0..31 (qh NULL: Q4_K, 0..15), in the
 * order of their elements: sub-block j holds the low nibbles (j even) or the high nibbles
 * (j odd) of qs[32·(j/2) ..], and its fifth bits are bit j of qh. */
static inline void unpack_k4(const uint8_t *qs, const uint8_t *qh, uint8_t out[QK_K]) {
    for (int j = 0; j < QK_K / 64; j++) {
        for (int l = 0; l < 32; l++) {
            out[64 * j + l] = qs[32 * j + l] & 0xF;
            out[64 * j + 32 + l] = qs[32 * j + l] >> 4;
            if (qh) {
                out[64 * j + l] |= ((qh[l] >> (2 * j)) & 1) << 4;
                out[64 * j + 32 + l] |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
        }
    }
}

/* The values of one Q6_K super-block as integers −32..31, in the order of their elements. */
static inline void unpack_q6_K(const block_q6_K *b, int8_t out[QK_K]) {
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b->ql + 64 * half, *qh = b->qh + 32 * half;
        int8_t *y = out + 128 * half;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

/* gguf computes (d·scale)·q − dmin·min in float32 with two roundings; a fused multiply-add
 * (GCC's default contraction under -mfma) rounds once, yet gives the same bits: d (fp16, 11
 * significant bits) · scale (6) · q (5) needs at most 22 bits, so the product is exact. */
static void dequantize_k4(const uint8_t *qs, const uint8_t *qh, const uint8_t *packed,
                          uint16_t d16, uint16_t dmin16, float *out) {
    uint8_t scales[8], mins[8], q[QK_K];
    scales_mins_k4(packed, scales, mins);
    unpack_k4(qs, qh, q);
    const float d = fp16_to_fp32(d16), dmin = fp16_to_fp32(dmin16);
    for (int j = 0; j < 8; j++) {
        const float scale = d * scales[j], min = dmin * mins[j];
        for (int l = 0; l < 32; l++) out[32 * j + l] = scale * q[32 * j + l] - min;
    }
}

static void dequantize_q4_K(const void *blocks, float *out, int64_t k) {
    const block_q4_K *b = blocks;
    for (int64_t i = 0; i < k / QK_K; i++)
        dequantize_k4(b[i].qs, NULL, b[i].scales, b[i].d, b[i].dmin, out + i * QK_K);
}

static void dequantize_q5_K(const void *blocks, float *out, int64_t k) {
    const block_q5_K *b = blocks;
    for (int64_t i = 0; i < k / QK_K; i++)
        dequantize_k4(b[i].qs, b[i].qh, b[i].scales, b[i].d, b[i].dmin, out + i * QK_K);
}

static void dequantize_q6_K(const void *blocks, float *out, int64_t k) {
    const block_q6_K *b = blocks;
    int8_t q[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++) {
        unpack_q6_K(&b[i], q);
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK_K / 16; j++) {
            const float scale = d * b[i].scales[j];
            for (int l = 0; l < 16; l++) out[i * QK_K + 16 * j + l] = scale * q[16 * j + l];
        }
    }
}

/* The scalar products are the portable path, and where a SIMD form replaces them they stay
 * compiled (unused) so that every build checks them. */
#if defined(__GNUC__)
#define PORTABLE_PATH __attribute__((unused))
#else
#define PORTABLE_PATH
#endif

/* Σ min_j · (the activation's sum over sub-block j): what the minimums take off the product. */
static inline int mins_dot_bsums(const uint8_t mins[8], const int16_t *bsums) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mins[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

/* The scalar Q4_K/Q5_K product of one super-block: d·Σ scale_j·(q·a)_j − dmin·Σ min_j·Σa_j. */
static inline float dot_k4_block(const uint8_t *qs, const uint8_t *qh, const uint8_t *packed, uint16_t d,
                                 uint16_t dmin, const block_q8_K *a) {
    uint8_t scales[8], mins[8], q[QK_K];
    scales_mins_k4(packed, scales, mins);
    unpack_k4(qs, qh, q);
    int sumi = 0;
    for (int j = 0; j < 8; j++) {
        int s = 0;
        for (int l = 0; l < 32; l++) s += q[32 * j + l] * a->qs[32 * j + l];
        sumi += scales[j] * s;
    }
    return a->d * (fp16_to_fp32(d) * sumi - fp16_to_fp32(dmin) * mins_dot_bsums(mins, a->bsums));
}

PORTABLE_PATH static float dot_q4_K_scalar(int64_t k, const void *w_row, const void *act_row) {
    const block_q4_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) sum += dot_k4_block(w[i].qs, NULL, w[i].scales, w[i].d, w[i].dmin, &a[i]);
    return sum;
}

PORTABLE_PATH static float dot_q5_K_scalar(int64_t k, const void *w_row, const void *act_row) {
    const block_q5_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++)
        sum += dot_k4_block(w[i].qs, w[i].qh, w[i].scales, w[i].d, w[i].dmin, &a[i]);
    return sum;
}

PORTABLE_PATH static float dot_q6_K_scalar(int64_t k, const void *w_row, const void *act_row) {
    const block_q6_K *w = w_row;
    const block_q8_K *a = act_row;
    float sum = 0.0f;
    int8_t q[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++) {
        unpack_q6_K(&w[i], q);
        int sumi = 0;
        for (int j = 0; j < QK_K / 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += q[16 * j + l] * a[i].qs[16 * j + l];
            sumi += w[i].scales[j] * s;
        }
        sum += a[i].d * fp16_to_fp32(w[i].d) * sumi;
    }
    return sum;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* SIMD: maddubs multiplies the weights' unsigned values (≤ 63) by the activations' signed bytes
 * and adds neighbours into 16 bits without saturating (63·127·2 < 2^15); madd (or VNNI's dpwssd,
 * which also adds into the accumulator) applies the sub-block's scale while adding into 32 bits.
 * The minimums (Q4_K/Q5_K) and Q6_K's offset of 32 meet the activation's 16-element sums once a
 * super-block. The integer sums equal the scalar ones exactly; only the float scaling differs
 * in the order of its roundings. */
#define LOAD128(p) _mm_loadu_si128((const __m128i *)(p))
#define LOAD64(p) _mm_loadl_epi64((const __m128i *)(p))
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))

/* The super-block scales: F16C's one instruction, where fp16_to_fp32 (another file, so never
 * inlined) would cost a call and a dozen integer operations per super-block. */
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum_ps_128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Σ min_j · (bsums[2j] + bsums[2j+1]), four lanes of 32 bits. */
static inline __m128i mins_dot_bsums_128(const uint8_t mins[8], const int16_t *bsums) {
    const __m128i pairs = _mm_hadd_epi16(LOAD128(bsums), LOAD128(bsums + 8));
    return _mm_madd_epi16(_mm_cvtepu8_epi16(LOAD64(mins)), pairs);
}

/* Q6_K's offset: its values are stored as 0..63, so −32·Σ scale_j·bsums_j, eight lanes. */
static inline __m256i q6_offset_256(const int8_t *scales, const int16_t *bsums) {
    const __m256i sums = _mm256_madd_epi16(_mm256_cvtepi8_epi16(LOAD128(scales)), LOAD256(bsums));
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 5));
}

/* Per super-block w of Q4_K/Q5_K: its scales unpacked, and the minimums' share,
 * d·dmin·Σ min_j·Σa_j, added into four lanes of acc. */
static inline __m128 k4_scales_and_mins(const uint8_t *w, const block_q8_K *a, uint8_t scales[8], __m128 acc) {
    uint8_t mins[8];
    scales_mins_k4(w + 4, scales, mins);
    const __m128 scale = _mm_set1_ps(a->d * half_to_float(((const uint16_t *)w)[1]));
    return _mm_fmadd_ps(scale, _mm_cvtepi32_ps(mins_dot_bsums_128(mins, a->bsums)), acc);
}

/* What a Q4_K/Q5_K super-block's integer sum is multiplied by: its d and the activation's. */
static inline float k4_scale(const uint8_t *w, const block_q8_K *a) {
    return a->d * half_to_float(*(const uint16_t *)w);
}

/* Q5_K's 32 bytes of fifth bits (qh_at 0: Q4_K has none). */
static inline __m256i fifth_bits(const uint8_t *w, int qh_at) {
    return qh_at ? LOAD256(w + qh_at) : _mm256_setzero_si256();
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
/* AVX-512: 64 weights a step, a whole pair of Q4_K/Q5_K sub-blocks or four of Q6_K's, the
 * scales spread by one permute and applied by dpwssd. Measured on this EPYC (Zen 4, one thread,
 * 2816×1024, m = 16, best of 15): Q4_K 780 µs against AVX2's 821, Q5_K 890 against 1150, Q6_K
 * 620 against 1025. */
#define LOAD512(p) _mm512_loadu_si512((const void *)(p))

/* 256 bits below, 256 above. */
static inline __m512i join_256(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

/* A Q4_K or Q5_K row (qh_at 0: Q4_K, no fifth bits). */
static inline float dot_k4_simd(int64_t k, const uint8_t *w, int block_bytes, int qs_at, int qh_at,
                                const block_q8_K *a) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), bit_4 = _mm512_set1_epi8(0x10);
    /* Shifts by 16-bit lane: the low half of a 512-bit step takes the low nibbles (and bit 2j of
     * qh, moved to bit 4), the high half the high nibbles (and bit 2j+1), from the same 32 bytes in
     * both halves. */
    const __m512i low_then_high = join_256(_mm256_setzero_si256(), _mm256_set1_epi16(4));
    const __m512i to_bit_4 = join_256(_mm256_set1_epi16(4), _mm256_set1_epi16(3));
    __m512i pair_index[4]; /* 16-bit lanes: scale 2j below, 2j+1 above */
    for (int j = 0; j < 4; j++) pair_index[j] = join_256(_mm256_set1_epi16(2 * j), _mm256_set1_epi16(2 * j + 1));
    __m512 acc = _mm512_setzero_ps();
    __m128 acc_mins = _mm_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++, w += block_bytes) {
        uint8_t scales[8];
        acc_mins = k4_scales_and_mins(w, &a[i], scales, acc_mins);
        const __m512i scales16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(LOAD64(scales)));
        __m512i high = _mm512_broadcast_i64x4(fifth_bits(w, qh_at)), sumi = _mm512_setzero_si512();
        for (int j = 0; j < QK_K / 64; j++) {
            const __m512i q = _mm512_broadcast_i64x4(LOAD256(w + qs_at + 32 * j));
            __m512i values = _mm512_and_si512(_mm512_srlv_epi16(q, low_then_high), nibble);
            if (qh_at) {
                values = _mm512_or_si512(values, _mm512_and_si512(_mm512_sllv_epi16(high, to_bit_4), bit_4));
                high = _mm512_srli_epi16(high, 2);
            }
            const __m512i p = _mm512_maddubs_epi16(values, LOAD512(a[i].qs + 64 * j));
            sumi = _mm512_dpwssd_epi32(sumi, p, _mm512_permutexvar_epi16(pair_index[j], scales16));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(k4_scale(w, &a[i])), _mm512_cvtepi32_ps(sumi), acc);
    }
    return _mm512_reduce_add_ps(acc) - hsum_ps_128(acc_mins);
}

/* Q6_K: values 0..63 against the activations, less 32·Σ scale_j·bsums_j. */
static float dot_q6_K(int64_t k, const void *w_row, const void *act_row) {
    const block_q6_K *w = w_row;
    const block_q8_K *a = act_row;
    const __m512i nibble = _mm512_set1_epi8(0x0F), bits_4_5 = _mm512_set1_epi8(0x30);
    /* 16-bit lanes: scales 4g .. 4g+3, eight lanes (16 elements) each */
    const __m512i lane = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                          13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i quad_index[4];
    for (int g = 0; g < 4; g++) quad_index[g] = _mm512_add_epi16(_mm512_set1_epi16(4 * g), _mm512_srli_epi16(lane, 3));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        const __m512i scales16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(LOAD128(w[i].scales)));
        __m512i sumi = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            /* elements 0..63 of the half: low nibbles of ql, bits 0-1 then 2-3 of qh; 64..127:
             * high nibbles, bits 4-5 then 6-7 */
            const __m512i ql = LOAD512(w[i].ql + 64 * half);
            const __m256i qh = LOAD256(w[i].qh + 32 * half);
            const __m512i h = join_256(qh, _mm256_srli_epi16(qh, 2));
            const __m512i h_first = _mm512_and_si512(_mm512_slli_epi16(h, 4), bits_4_5);
            const __m512i h_second = _mm512_and_si512(h, bits_4_5);
            const __m512i first = _mm512_or_si512(_mm512_and_si512(ql, nibble), h_first);
            const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble), h_second);
            const int8_t *x = a[i].qs + 128 * half;
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(first, LOAD512(x)),
                                       _mm512_permutexvar_epi16(quad_index[2 * half], scales16));
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(second, LOAD512(x + 64)),
                                       _mm512_permutexvar_epi16(quad_index[2 * half + 1], scales16));
        }
        const __m256i halves = _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
        const __m256i total = _mm256_add_epi32(halves, q6_offset_256(w[i].scales, a[i].bsums));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i].d * half_to_float(w[i].d)), _mm256_cvtepi32_ps(total), acc);
    }
    return hsum_f32x8(acc);
}
#else
/* AVX2: 32 weights a step. */

/* The shuffle that fills every 16-bit element with element e of its 128-bit lane. */
static inline __m256i spread_one(int e) { return _mm256_set1_epi16((int16_t)(0x0100 + 0x0202 * e)); }

/* The shuffle that fills the low 128-bit lane with 16-bit element 2t of each lane and the high
 * lane with element 2t+1. */
static inline __m256i spread_pairs(int t) {
    const int16_t low = (int16_t)(0x0100 + 0x0404 * t), high = (int16_t)(low + 0x0202);
    return _mm256_set_m128i(_mm_set1_epi16(high), _mm_set1_epi16(low));
}

/* A Q4_K or Q5_K row (qh_at 0: Q4_K, no fifth bits). */
static inline float dot_k4_simd(int64_t k, const uint8_t *w, int block_bytes, int qs_at, int qh_at,
                                const block_q8_K *a) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), bit_4 = _mm256_set1_epi8(0x10);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc_mins = _mm_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++, w += block_bytes) {
        uint8_t scales[8];
        acc_mins = k4_scales_and_mins(w, &a[i], scales, acc_mins);
        __m256i sumi = _mm256_setzero_si256(), high = fifth_bits(w, qh_at);
        const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(LOAD64(scales)));
        for (int j = 0; j < QK_K / 64; j++) {
            const __m256i q = LOAD256(w + qs_at + 32 * j);
            __m256i lo = _mm256_and_si256(q, nibble);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
            if (qh_at) {
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(high, 4), bit_4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(high, 3), bit_4));
                high = _mm256_srli_epi16(high, 2);
            }
            const __m256i p_lo = _mm256_maddubs_epi16(lo, LOAD256(a[i].qs + 64 * j));
            const __m256i p_hi = _mm256_maddubs_epi16(hi, LOAD256(a[i].qs + 64 * j + 32));
            const __m256i scale_lo = _mm256_shuffle_epi8(scales16, spread_one(2 * j));
            const __m256i scale_hi = _mm256_shuffle_epi8(scales16, spread_one(2 * j + 1));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_lo, scale_lo));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_hi, scale_hi));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(k4_scale(w, &a[i])), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_f32x8(acc) - hsum_ps_128(acc_mins);
}

/* 0..63 from four bits of `low` (the low nibble, or the high one where `high_nibble`) and the two
 * bits of `high` at bit `pair_at`, moved to bits 4-5 in place (one shift, one mask). */
static inline __m256i six_bits(__m256i low, int high_nibble, __m256i high, int pair_at) {
    const __m256i l = _mm256_and_si256(high_nibble ? _mm256_srli_epi16(low, 4) : low, _mm256_set1_epi8(0x0F));
    const __m256i h = pair_at < 4   ? _mm256_slli_epi16(high, 4 - pair_at)
                      : pair_at > 4 ? _mm256_srli_epi16(high, pair_at - 4)
                                    : high;
    return _mm256_or_si256(l, _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
}

/* Q6_K: values 0..63 against the activations, less 32·Σ scale_j·bsums_j. */
static float dot_q6_K(int64_t k, const void *w_row, const void *act_row) {
    const block_q6_K *w = w_row;
    const block_q8_K *a = act_row;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        __m256i sumi = q6_offset_256(w[i].scales, a[i].bsums);
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = LOAD256(w[i].ql + 64 * half), ql1 = LOAD256(w[i].ql + 64 * half + 32);
            const __m256i qh = LOAD256(w[i].qh + 32 * half);
            const __m256i q[4] = { six_bits(ql0, 0, qh, 0), six_bits(ql1, 0, qh, 2), six_bits(ql0, 1, qh, 4),
                                   six_bits(ql1, 1, qh, 6) };
            /* This half's eight scales in 16 bits, in both 128-bit lanes, for a shuffle to spread
             * scales 2t and 2t+1 over the two 16-element halves of step t. */
            const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(LOAD64(w[i].scales + 8 * half)));
            for (int t = 0; t < 4; t++) {
                const __m256i p = _mm256_maddubs_epi16(q[t], LOAD256(a[i].qs + 128 * half + 32 * t));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(scales, spread_pairs(t))));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i].d * half_to_float(w[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_f32x8(acc);
}
#endif

static float dot_q4_K(int64_t k, const void *w_row, const void *act_row) {
    return dot_k4_simd(k, w_row, sizeof(block_q4_K), offsetof(block_q4_K, qs), 0, act_row);
}

static float dot_q5_K(int64_t k, const void *w_row, const void *act_row) {
    return dot_k4_simd(k, w_row, sizeof(block_q5_K), offsetof(block_q5_K, qs), offsetof(block_q5_K, qh), act_row);
}
#else
#define dot_q4_K dot_q4_K_scalar
#define dot_q5_K dot_q5_K_scalar
#define dot_q6_K dot_q6_K_scalar
#endif

const weight_type TYPE_Q4_K = { QK_K, sizeof(block_q4_K), T_Q8_K, dequantize_q4_K, dot_q4_K };
const weight_type TYPE_Q5_K = { QK_K, sizeof(block_q5_K), T_Q8_K, dequantize_q5_K, dot_q5_K };
const weight_type TYPE_Q6_K = { QK_K, sizeof(block_q6_K), T_Q8_K, dequantize_q6_K, dot_q6_K };
