/* The vector products of the 32-element types against their scalar products, for a target the
 * tests cannot run on: NEON, built with a cross compiler and run under qemu. (On x86 it checks
 * whichever level the flags build.) Random blocks with ordinary scales, activations from the
 * reference quantizer, rows of 11 blocks; exits 1 if any product is off by more than 1e-5 of
 * the row's magnitude.
 *
 *   aarch64-linux-gnu-gcc -O3 -std=gnu11 -Isrc/csrc scripts/check_neon_products.c \
 *       src/csrc/activations.c -o /tmp/check_neon -lm && qemu-aarch64 -L /usr/aarch64-linux-gnu /tmp/check_neon
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../src/csrc/types_q32.c"

typedef float (*dot_fn)(int64_t, const void *, const void *);

static const struct {
    const char *name;
    const weight_type *type;
    dot_fn scalar;
} TYPES[] = {
    { "Q4_0", &TYPE_Q4_0, dot_q4_0_scalar }, { "Q4_1", &TYPE_Q4_1, dot_q4_1_scalar },
    { "Q5_0", &TYPE_Q5_0, dot_q5_0_scalar }, { "Q5_1", &TYPE_Q5_1, dot_q5_1_scalar },
    { "Q8_0", &TYPE_Q8_0, dot_q8_0_scalar }, { "IQ4_NL", &TYPE_IQ4_NL, dot_iq4_nl_scalar },
};

int main(void) {
    enum { K = 11 * QK, ROWS = 64 };
    float x[K];
    block_q8_1 act[K / QK]; /* the larger of the two activation formats */
    static uint8_t rows[ROWS][K / QK * 34];
    int failed = 0;
    srand(7);
    for (int i = 0; i < K; i++) x[i] = (float)rand() / RAND_MAX * 4.0f - 2.0f;
    for (size_t t = 0; t < sizeof TYPES / sizeof TYPES[0]; t++) {
        const weight_type *type = TYPES[t].type;
        if (type->act_type == T_Q8_1) quantize_row_q8_1(x, act, K);
        else quantize_row_q8_0(x, (block_q8_0 *)act, K);
        double worst = 0.0;
        for (int r = 0; r < ROWS; r++) {
            for (int b = 0; b < K / QK; b++) {
                uint8_t *block = rows[r] + b * type->block_bytes;
                for (int j = 0; j < type->block_bytes; j++) block[j] = (uint8_t)rand();
                const uint16_t d = fp32_to_fp16(0.01f + (float)(rand() % 100) * 1e-4f);
                const uint16_t m = fp32_to_fp16(-0.1f + (float)(rand() % 100) * 1e-3f);
                memcpy(block, &d, 2);
                if (type->act_type == T_Q8_1) memcpy(block + 2, &m, 2);
            }
            const float got = type->vec_dot(K, rows[r], act), want = TYPES[t].scalar(K, rows[r], act);
            const double error = fabs(got - want) / fmax(1.0, fabs(want));
            worst = fmax(worst, error);
        }
        printf("%-6s largest relative difference %.2g\n", TYPES[t].name, worst);
        failed |= worst > 1e-5;
    }
    return failed;
}
