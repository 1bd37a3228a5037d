/* Measurement only (issue 48): does interleaving 8 rows of Q4_K, in the spirit of llama.cpp's
 * repack.cpp block_q4_Kx8, pay against multiplying one row at a time (src/csrc/types_k.c's
 * dot_q4_K, whose static functions this file includes)? One thread, best of 21 runs, random
 * blocks; m activation rows (1: a decode step's GEMV, 16: a short prefill's).
 *
 *   gcc -O3 -std=gnu11 -fno-math-errno -mavx2 -mfma -mf16c -mbmi2 [-mavx512f -mavx512bw
 *       -mavx512vl -mavx512dq -mavx512vnni] -Isrc/csrc scripts/bench_q4_k_x8.c
 *       src/csrc/activations.c -lm -o /tmp/q4_k_x8 && /tmp/q4_k_x8 M [N K]
 *
 * The layout: per super-block of 8 rows, their fp16 d and dmin side by side, the 6-bit scales
 * unpacked to bytes [sub-block][row] and the minimums [sub-block pair][row][2] (so one madd
 * meets two of the activation's pair sums), then the 4-bit values in groups of 4 bytes per row:
 * [step j of 64 elements][group g of 4 bytes][row]. A 32-byte load is 8 rows × 4 bytes, their low
 * nibbles meet one broadcast 4 activation bytes of sub-block 2j, the high nibbles those of 2j+1:
 * one dpbusd (VNNI) or maddubs+madd (AVX2) per 8 rows × 4 elements, the scales applied once per
 * sub-block with one 32-bit multiply, the super-block's d·dmin in one 8-lane FMA. */
#include <time.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "types_k.c"
typedef struct {
    uint16_t d[8], dmin[8];
    uint8_t scales[8][8];     /* [sub-block][row] */
    uint8_t mins[4][8][2];    /* [sub-block pair][row][which] */
    uint8_t qs[4][8][8][4];   /* [step j][group g][row][4 bytes] */
} block_q4_Kx8; /* 1184 bytes */

static void repack(const block_q4_K *rows[8], int64_t nb, block_q4_Kx8 *out) {
    for (int64_t i = 0; i < nb; i++) {
        for (int r = 0; r < 8; r++) {
            const block_q4_K *b = &rows[r][i];
            out[i].d[r] = b->d; out[i].dmin[r] = b->dmin;
            uint8_t sc[8], mn[8]; scales_mins_k4(b->scales, sc, mn);
            for (int j = 0; j < 8; j++) { out[i].scales[j][r] = sc[j]; out[i].mins[j / 2][r][j % 2] = mn[j]; }
            for (int j = 0; j < 4; j++) for (int g = 0; g < 8; g++) memcpy(out[i].qs[j][g][r], b->qs + 32 * j + 4 * g, 4);
        }
    }
}

/* 8 rows' products with one activation row into y[0..7]. */
static void gemv_x8(int64_t k, const block_q4_Kx8 *w, const block_q8_K *a, float *y) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps(), acc_m = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        __m256i sumi = _mm256_setzero_si256();
        const int32_t *x = (const int32_t *)a[i].qs;
        for (int j = 0; j < 4; j++) {
            __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i v = LOAD256(w[i].qs[j][g]);
#if defined(__AVX512VNNI__)
                lo = _mm256_dpbusd_epi32(lo, _mm256_and_si256(v, nibble), _mm256_set1_epi32(x[16 * j + g]));
                hi = _mm256_dpbusd_epi32(hi, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), _mm256_set1_epi32(x[16 * j + 8 + g]));
#else
                const __m256i ones = _mm256_set1_epi16(1);
                lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, nibble), _mm256_set1_epi32(x[16 * j + g])), ones));
                hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), _mm256_set1_epi32(x[16 * j + 8 + g])), ones));
#endif
            }
            sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(lo, _mm256_cvtepu8_epi32(LOAD64(w[i].scales[2 * j]))));
            sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(hi, _mm256_cvtepu8_epi32(LOAD64(w[i].scales[2 * j + 1]))));
        }
        __m256i summ = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const int16_t *bs = a[i].bsums + 4 * p;
            const __m256i s = _mm256_set1_epi32((uint16_t)(bs[0] + bs[1]) | ((uint32_t)(uint16_t)(bs[2] + bs[3]) << 16));
            summ = _mm256_add_epi32(summ, _mm256_madd_epi16(_mm256_cvtepu8_epi16(LOAD128(w[i].mins[p])), s));
        }
        const __m256 da = _mm256_set1_ps(a[i].d);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtph_ps(LOAD128(w[i].d)), da), _mm256_cvtepi32_ps(sumi), acc);
        acc_m = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtph_ps(LOAD128(w[i].dmin)), da), _mm256_cvtepi32_ps(summ), acc_m);
    }
    _mm256_storeu_ps(y, _mm256_sub_ps(acc, acc_m));
}

#if defined(__AVX512VNNI__)
/* The other way to reuse what is unpacked (a matmul.c change, not a layout's): one Q4_K row
 * against 4 activation rows a call, its values split into nibbles and its scales spread once. */
static void dot_q4_K_x4act(int64_t k, const uint8_t *w, const block_q8_K *a, int64_t act_blocks, float *y) {
    const int block_bytes = sizeof(block_q4_K), qs_at = offsetof(block_q4_K, qs);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512i pair_index[4];
    for (int j = 0; j < 4; j++) pair_index[j] = join_256(_mm256_set1_epi16(2 * j), _mm256_set1_epi16(2 * j + 1));
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m128 acc_mins[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t i = 0; i < k / QK_K; i++, w += block_bytes) {
        uint8_t scales[8];
        for (int r = 0; r < 4; r++) acc_mins[r] = k4_scales_and_mins(w, &a[r * act_blocks + i], scales, acc_mins[r]);
        const __m512i scales16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(LOAD64(scales)));
        __m512i sumi[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int j = 0; j < QK_K / 64; j++) {
            const __m256i q = LOAD256(w + qs_at + 32 * j);
            const __m512i values = _mm512_and_si512(join_256(q, _mm256_srli_epi16(q, 4)), nibble);
            const __m512i sc = _mm512_permutexvar_epi16(pair_index[j], scales16);
            for (int r = 0; r < 4; r++)
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], _mm512_maddubs_epi16(values, LOAD512(a[r * act_blocks + i].qs + 64 * j)), sc);
        }
        for (int r = 0; r < 4; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(k4_scale(w, &a[r * act_blocks + i])), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < 4; r++) y[r] = _mm512_reduce_add_ps(acc[r]) - hsum_ps_128(acc_mins[r]);
}

/* Both at once: 8 interleaved rows against 4 activation rows a call (y: [4][8]). */
static void gemm_x8_4act(int64_t k, const block_q4_Kx8 *w, const block_q8_K *a, int64_t act_blocks, float *y) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[4], acc_m[4];
    for (int r = 0; r < 4; r++) acc[r] = acc_m[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        __m256i sumi[4];
        for (int r = 0; r < 4; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i lo[4], hi[4];
            for (int r = 0; r < 4; r++) lo[r] = hi[r] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i v = LOAD256(w[i].qs[j][g]);
                const __m256i v_lo = _mm256_and_si256(v, nibble), v_hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                for (int r = 0; r < 4; r++) {
                    const int32_t *x = (const int32_t *)a[r * act_blocks + i].qs;
                    lo[r] = _mm256_dpbusd_epi32(lo[r], v_lo, _mm256_set1_epi32(x[16 * j + g]));
                    hi[r] = _mm256_dpbusd_epi32(hi[r], v_hi, _mm256_set1_epi32(x[16 * j + 8 + g]));
                }
            }
            const __m256i sc_lo = _mm256_cvtepu8_epi32(LOAD64(w[i].scales[2 * j]));
            const __m256i sc_hi = _mm256_cvtepu8_epi32(LOAD64(w[i].scales[2 * j + 1]));
            for (int r = 0; r < 4; r++)
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_mullo_epi32(lo[r], sc_lo), _mm256_mullo_epi32(hi[r], sc_hi)));
        }
        const __m256 d8 = _mm256_cvtph_ps(LOAD128(w[i].d)), dmin8 = _mm256_cvtph_ps(LOAD128(w[i].dmin));
        for (int r = 0; r < 4; r++) {
            const block_q8_K *ar = &a[r * act_blocks + i];
            __m256i summ = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                const int16_t *bs = ar->bsums + 4 * p;
                const __m256i s = _mm256_set1_epi32((uint16_t)(bs[0] + bs[1]) | ((uint32_t)(uint16_t)(bs[2] + bs[3]) << 16));
                summ = _mm256_add_epi32(summ, _mm256_madd_epi16(_mm256_cvtepu8_epi16(LOAD128(w[i].mins[p])), s));
            }
            const __m256 da = _mm256_set1_ps(ar->d);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d8, da), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            acc_m[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin8, da), _mm256_cvtepi32_ps(summ), acc_m[r]);
        }
    }
    for (int r = 0; r < 4; r++) _mm256_storeu_ps(y + 8 * r, _mm256_sub_ps(acc[r], acc_m[r]));
}
#endif

static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int64_t n = argc > 2 ? atol(argv[2]) : 2816, k = argc > 3 ? atol(argv[3]) : 1024; int m = argc > 1 ? atoi(argv[1]) : 1;
    const int64_t nb = k / 256;
    float *x = malloc(16 * k * 4); for (int i = 0; i < 16 * k; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    block_q8_K *a = malloc(16 * nb * sizeof(block_q8_K)); for (int j = 0; j < 16; j++) quantize_row_q8_K(x + j * k, a + j * nb, k);
    block_q4_K *w = malloc(n * nb * sizeof(block_q4_K));
    uint8_t *raw = (uint8_t *)w; for (int64_t i = 0; i < n * nb * 144; i++) raw[i] = rand();
    for (int64_t b = 0; b < n * nb; b++) { w[b].d = fp32_to_fp16(1e-3f); w[b].dmin = fp32_to_fp16(2e-3f); }
    block_q4_Kx8 *w8 = malloc(n / 8 * nb * sizeof(block_q4_Kx8));
    for (int64_t r = 0; r < n; r += 8) { const block_q4_K *rows[8]; for (int q = 0; q < 8; q++) rows[q] = w + (r + q) * nb; repack(rows, nb, w8 + r / 8 * nb); }
    float *y1 = malloc(16 * n * 4), *y2 = malloc(16 * n * 4);
    double best1 = 1e9, best2 = 1e9;
    for (int rep = 0; rep < 21; rep++) {
        double t = now();
        for (int64_t r = 0; r < n; r++) for (int i = 0; i < m; i++) y1[i * n + r] = dot_q4_K(k, w + r * nb, a + i * nb);
        t = now() - t; if (t < best1) best1 = t;
        t = now();
        for (int64_t r = 0; r < n; r += 8) for (int i = 0; i < m; i++) { float y[8]; gemv_x8(k, w8 + r / 8 * nb, a + i * nb, y); for (int q = 0; q < 8; q++) y2[i * n + r + q] = y[q]; }
        t = now() - t; if (t < best2) best2 = t;
    }
    double err = 0, top = 0; for (int64_t i = 0; i < m * n; i++) { double e = fabs(y1[i] - y2[i]); if (e > err) err = e; if (fabs(y1[i]) > top) top = fabs(y1[i]); } err /= top;
    printf("n=%ld k=%ld m=%d, 1 thread, best of 21: rows one by one %.0f us, 8 interleaved %.0f us (%.2fx), max rel diff %.1e\n", n, k, m, best1 * 1e6, best2 * 1e6, best1 / best2, err);
#if defined(__AVX512VNNI__)
    if (m % 4 == 0) {
        double best4 = 1e9;
        volatile float kept = 0; /* so the calls are not optimized away */
        float y4[4];
        for (int rep = 0; rep < 21; rep++) {
            double t = now();
            for (int64_t r = 0; r < n; r++)
                for (int i = 0; i < m; i += 4) {
                    dot_q4_K_x4act(k, (const uint8_t *)(w + r * nb), a + i * nb, nb, y4);
                    kept += y4[0] + y4[1] + y4[2] + y4[3];
                }
            t = now() - t; if (t < best4) best4 = t;
        }
        double diff4 = 0;
        for (int64_t r = 0; r < n; r++)
            for (int i = 0; i < m; i += 4) {
                dot_q4_K_x4act(k, (const uint8_t *)(w + r * nb), a + i * nb, nb, y4);
                for (int q = 0; q < 4; q++) diff4 = fmax(diff4, fabs(y4[q] - y1[(i + q) * n + r]) / top);
            }
        printf("one row against 4 activation rows a call: %.0f us (%.2fx one by one), max rel diff %.1e\n", best4 * 1e6,
               best1 / best4, diff4);
        double best84 = 1e9, diff84 = 0;
        float y32[32];
        for (int rep = 0; rep < 21; rep++) {
            double t = now();
            for (int64_t r = 0; r < n; r += 8)
                for (int i = 0; i < m; i += 4) {
                    gemm_x8_4act(k, w8 + r / 8 * nb, a + i * nb, nb, y32);
                    kept += y32[0] + y32[9] + y32[18] + y32[31];
                }
            t = now() - t; if (t < best84) best84 = t;
        }
        for (int64_t r = 0; r < n; r += 8)
            for (int i = 0; i < m; i += 4) {
                gemm_x8_4act(k, w8 + r / 8 * nb, a + i * nb, nb, y32);
                for (int q = 0; q < 32; q++) diff84 = fmax(diff84, fabs(y32[q] - y1[(i + q / 8) * n + r + q % 8]) / top);
            }
        printf("8 interleaved rows against 4 activation rows a call: %.0f us (%.2fx one by one), max rel diff %.1e\n",
               best84 * 1e6, best1 / best84, diff84);
    }
#endif
}
