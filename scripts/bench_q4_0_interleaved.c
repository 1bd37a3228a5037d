/* Does llama.cpp's repacking pay for a Q4_0 GEMV (m = 1) here? Measures llmcli's kernel, one
 * weight row at a time (src/csrc/types_q32.c, AVX-512 VNNI), against the same blocks interleaved
 * ROWS rows at a time at load (as ggml-cpu's repack.cpp does for Q4_0): block i of rows r..r+ROWS-1
 * stored together as their ROWS fp16 scales, then their ROWS × 16 bytes of nibbles. Each
 * activation block is then loaded, broadcast and offset once for ROWS rows, and the ROWS weight
 * scales convert in one vcvtph2ps. One thread, CPU time, best of the runs; the results of both
 * kernels are compared.
 *
 *   gcc -O3 -std=gnu11 -mavx2 -mfma -mf16c -mbmi2 -mavx512f -mavx512bw -mavx512vl -mavx512dq \
 *       -mavx512vnni -Isrc/csrc [-DROWS=4] scripts/bench_q4_0_interleaved.c src/csrc/activations.c \
 *       -o /tmp/interleaved -lm && /tmp/interleaved 2816 1024
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../src/csrc/types_q32.c"

#ifndef ROWS
#define ROWS 8
#endif
#define GROUPS (ROWS / 4) /* four rows of 16 bytes fill one 512-bit register */

typedef struct { uint16_t d[ROWS]; uint8_t qs[ROWS * QK / 2]; } block_q4_0_interleaved;

static void interleave(const block_q4_0 *w, block_q4_0_interleaved *out, int n, int blocks) {
    for (int r = 0; r < n; r += ROWS)
        for (int i = 0; i < blocks; i++)
            for (int j = 0; j < ROWS; j++) {
                out[r / ROWS * blocks + i].d[j] = w[(r + j) * blocks + i].d;
                memcpy(out[r / ROWS * blocks + i].qs + 16 * j, w[(r + j) * blocks + i].qs, 16);
            }
}

static void dot_interleaved(int blocks, const block_q4_0_interleaved *w, const block_q8_0 *a, float *y) {
    const __m512i low = _mm512_set1_epi8(0x0F), eights = _mm512_set1_epi8(8);
    __m512 acc[GROUPS];
    for (int g = 0; g < GROUPS; g++) acc[g] = _mm512_setzero_ps();
    for (int i = 0; i < blocks; i++) {
        const __m512i a_low = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)a[i].qs));
        const __m512i a_high = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(a[i].qs + 16)));
        const __m512i offset = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), eights, a_low),
                                                   eights, a_high);
        __m128i halves = ROWS == 8 ? _mm_loadu_si128((const __m128i *)w[i].d) : _mm_loadl_epi64((const __m128i *)w[i].d);
        const __m512 scales = _mm512_castps256_ps512(
            _mm256_mul_ps(_mm256_cvtph_ps(halves), _mm256_set1_ps(_cvtsh_ss(a[i].d))));
        for (int g = 0; g < GROUPS; g++) {
            const __m512i q = _mm512_loadu_si512(w[i].qs + 64 * g);
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q, low), a_low);
            s = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srli_epi16(q, 4), low), a_high);
            const __m512i lanes = _mm512_set_epi32(4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 2, 4 * g + 2,
                                                   4 * g + 2, 4 * g + 2, 4 * g + 1, 4 * g + 1, 4 * g + 1, 4 * g + 1,
                                                   4 * g, 4 * g, 4 * g, 4 * g);
            acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, offset)),
                                     _mm512_permutexvar_ps(lanes, scales), acc[g]);
        }
    }
    for (int g = 0; g < GROUPS; g++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc[g]);
        for (int r = 0; r < 4; r++) y[4 * g + r] = lanes[4 * r] + lanes[4 * r + 1] + lanes[4 * r + 2] + lanes[4 * r + 3];
    }
}

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 2816, k = argc > 2 ? atoi(argv[2]) : 1024, blocks = k / QK;
    if (n % ROWS || k % QK) return fprintf(stderr, "n must be a multiple of %d, k of %d\n", ROWS, QK), 2;
    block_q4_0 *w = malloc(sizeof *w * n * blocks);
    block_q4_0_interleaved *packed = malloc(sizeof *packed * n / ROWS * blocks);
    float *x = malloc(sizeof *x * k), *by_row = malloc(sizeof *by_row * n), *by_group = malloc(sizeof *by_group * n);
    block_q8_0 *a = malloc(sizeof *a * blocks);
    srand(1);
    for (int i = 0; i < n * blocks; i++) {
        w[i].d = fp32_to_fp16(0.01f + (rand() % 100) * 1e-4f);
        for (int j = 0; j < 16; j++) w[i].qs[j] = (uint8_t)rand();
    }
    for (int i = 0; i < k; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    quantize_row_q8_0(x, a, k);
    interleave(w, packed, n, blocks);
    double row_best = 1e9, group_best = 1e9;
    for (int run = 0; run < (n * (double)k > 1e8 ? 20 : 200); run++) {
        const double start = cpu_seconds();
        for (int r = 0; r < n; r++) by_row[r] = TYPE_Q4_0.vec_dot(k, w + r * blocks, a);
        const double middle = cpu_seconds();
        for (int r = 0; r < n; r += ROWS) dot_interleaved(blocks, packed + r / ROWS * blocks, a, by_group + r);
        const double end = cpu_seconds();
        row_best = fmin(row_best, middle - start);
        group_best = fmin(group_best, end - middle);
    }
    double most = 0;
    for (int r = 0; r < n; r++) most = fmax(most, fabs(by_row[r] - by_group[r]));
    const double bytes = (double)n * blocks * sizeof(block_q4_0);
    printf("Q4_0 %dx%d, one thread: row at a time %.1f us (%.1f GB/s), %d rows interleaved %.1f us (%.1f GB/s), "
           "%.2fx; largest difference %.2g\n", n, k, row_best * 1e6, bytes / row_best / 1e9, ROWS, group_best * 1e6,
           bytes / group_best / 1e9, row_best / group_best, most);
    return 0;
}
