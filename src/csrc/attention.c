/* Decode attention over a paged KV pool, read in place (engine/native/paged_cpu.py calls it).
 *
 * Keys and values live in blocks of `block_size` positions, [num_blocks, block_size, kv_heads,
 * head_dim], in the KV cache's own dtype (fp32, fp16 or bf16); each sequence names its blocks in
 * a row of a block table. Gathering a sequence's blocks into one tensor before torch's SDPA cost
 * +8 % at 300 tokens and +37 % at 1,000 (issue 28), so this reads each block where it lies.
 *
 * Each sequence brings its last `q_tokens` tokens' queries (one for a decode step, a few for a
 * speculative check), each attending causally to the positions up to its own, optionally within
 * a sliding window, with Gemma 2's soft cap on scores and gpt-oss's per-head sink logit. The G
 * query heads that share a KV head are scored together, so each key and value row is read once
 * for all of them; the softmax is online and in fp32 (a running maximum, sum and weighted sum
 * per query row). Work is (sequence, span of positions), all KV heads together: a long sequence
 * is split so that every thread stays busy on it, and the spans' partial sums are merged
 * afterwards as flash-decoding merges them. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "llmcli_cpu.h"

#define TILE 16                /* positions scored at once: one vector of scores (AVX-512), two (AVX2) */
#define MIN_SPAN 256           /* positions a work item takes at least (chosen, not measured: each span
                                * costs a partial sum per query row and its merge) */
#define ITEMS_PER_THREAD 4     /* enough items that threads finishing early find more */

/* ---------------------------------------------------------------------------------------------
 * Rows of head_dim values: fp16/bf16 widened to fp32, dot products and y += a·x. */

static void widen_row(int dtype, const void *src, float *dst, int64_t n) {
    int64_t i = 0;
    const uint16_t *h = src;
    if (dtype == T_BF16) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i)));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
#elif defined(__AVX2__)
        for (; i + 8 <= n; i += 8) {
            const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
#endif
        for (; i < n; i++) dst[i] = bf16_to_fp32(h[i]);
    } else { /* T_F16 */
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = fp16_to_fp32(h[i]);
    }
}

/* Four lanes of the compiler's generic vectors: SSE2 in the portable x86-64 build, NEON on arm64. */
typedef float f32x4 __attribute__((vector_size(16)));

static inline f32x4 load4(const float *p) {
    f32x4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The few products past the AVX2 build's whole vectors of a row. */
static inline float dot_tail(const float *a, const float *b, int64_t n) {
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

#if defined(__AVX512F__)
/* The 16 sums of 16 vectors' lanes, as one vector: a transposing tree of adds, 45 operations
 * where 16 horizontal sums take 128. */
static inline __m512 sum_lanes16(__m512 v[16]) {
    __m512 t[8], u[4];
    for (int j = 0; j < 8; j++)
        t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
        u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* u[j]: each 128-bit lane holds part of the sums of vectors 4j .. 4j + 3. */
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 sum_lanes8(__m256 v[8]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* s[r·TILE + i] = qs_r · k_i for every row r and the TILE key rows `k` (those past the tile's
 * end repeat one of its rows: their scores are masked afterwards). The key rows are read from
 * L1 once per query row; the sums are made across positions at once, not one by one. */
static void score_tile(const float *qs, int64_t rows, const float *const *k, int64_t d, float *s) {
    for (int64_t r = 0; r < rows; r++) {
        const float *q = qs + r * d;
#if defined(__AVX512F__)
        __m512 acc[TILE];
        for (int i = 0; i < TILE; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            const __mmask16 in = d - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - c)) - 1);
            const __m512 qc = _mm512_maskz_loadu_ps(in, q + c);
            for (int i = 0; i < TILE; i++) acc[i] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(in, k[i] + c), acc[i]);
        }
        _mm512_storeu_ps(s + r * TILE, sum_lanes16(acc));
#elif defined(__AVX2__) && defined(__FMA__)
        const int64_t whole = d & ~(int64_t)7;
        for (int half = 0; half < TILE; half += 8) {
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t c = 0; c < whole; c += 8) {
                const __m256 qc = _mm256_loadu_ps(q + c);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[half + i] + c), acc[i]);
            }
            _mm256_storeu_ps(s + r * TILE + half, sum_lanes8(acc));
            if (whole < d)
                for (int i = 0; i < 8; i++) s[r * TILE + half + i] += dot_tail(q + whole, k[half + i] + whole, d - whole);
        }
#else
        f32x4 acc[TILE];
        const int64_t whole = d & ~(int64_t)3;
        for (int i = 0; i < TILE; i++) acc[i] = (f32x4){ 0 };
        for (int64_t c = 0; c < whole; c += 4) {
            const f32x4 qc = load4(q + c);
            for (int i = 0; i < TILE; i++) acc[i] += qc * load4(k[i] + c);
        }
        for (int i = 0; i < TILE; i++) {
            float total = (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]);
            for (int64_t c = whole; c < d; c++) total += q[c] * k[i][c];
            s[r * TILE + i] = total;
        }
#endif
    }
}

/* acc_r = acc_r·keep[r] + Σ_i p[r·TILE + i]·v_i over the tile's n value rows, for the rows
 * that saw some of the tile (keep[r] < 0 marks one that did not). Up to four vectors of a row
 * are summed side by side: one chain of adds alone waits on each add's latency. */
static void accumulate_tile(float *acc, const float *keep, const float *p, int64_t rows, const float *const *v,
                            int64_t n, int64_t d) {
    for (int64_t r = 0; r < rows; r++) {
        if (keep[r] < 0) continue;
        float *a = acc + r * d;
        const float *w = p + r * TILE;
        int64_t c = 0;
#if defined(__AVX512F__)
        const __m512 kept = _mm512_set1_ps(keep[r]);
        for (; c < d; c += 64) {
            __mmask16 in[4];
            __m512 sum[4];
            for (int j = 0; j < 4; j++) {
                const int64_t left = d - c - 16 * j;
                in[j] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
                sum[j] = _mm512_mul_ps(kept, _mm512_maskz_loadu_ps(in[j], a + c + 16 * j));
            }
            for (int64_t i = 0; i < n; i++) {
                const __m512 weight = _mm512_set1_ps(w[i]);
                for (int j = 0; j < 4; j++)
                    sum[j] = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(in[j], v[i] + c + 16 * j), sum[j]);
            }
            for (int j = 0; j < 4; j++) _mm512_mask_storeu_ps(a + c + 16 * j, in[j], sum[j]);
        }
#else
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 kept = _mm256_set1_ps(keep[r]);
        for (; c + 32 <= d; c += 32) {
            __m256 sum[4];
            for (int j = 0; j < 4; j++) sum[j] = _mm256_mul_ps(kept, _mm256_loadu_ps(a + c + 8 * j));
            for (int64_t i = 0; i < n; i++) {
                const __m256 weight = _mm256_set1_ps(w[i]);
                for (int j = 0; j < 4; j++) sum[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v[i] + c + 8 * j), sum[j]);
            }
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(a + c + 8 * j, sum[j]);
        }
        for (; c + 8 <= d; c += 8) {
            __m256 sum = _mm256_mul_ps(kept, _mm256_loadu_ps(a + c));
            for (int64_t i = 0; i < n; i++) sum = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), _mm256_loadu_ps(v[i] + c), sum);
            _mm256_storeu_ps(a + c, sum);
        }
#else
        for (; c + 16 <= d; c += 16) {
            f32x4 sum[4];
            for (int j = 0; j < 4; j++) sum[j] = load4(a + c + 4 * j) * keep[r];
            for (int64_t i = 0; i < n; i++)
                for (int j = 0; j < 4; j++) sum[j] += load4(v[i] + c + 4 * j) * w[i];
            memcpy(a + c, sum, sizeof sum);
        }
#endif
        for (int64_t x = c; x < d; x++) a[x] *= keep[r];
        for (int64_t i = 0; i < n; i++)
            for (int64_t x = c; x < d; x++) a[x] += w[i] * v[i][x];
#endif
    }
}

/* exp(x) for the n ≤ TILE scores of a tile, x ≤ 0 (a score less the row's maximum), −inf → 0:
 * Cephes' polynomial (within 2 ulp of expf) on eight lanes of the compiler's generic vectors,
 * so that every build has it (AVX2 in the SIMD builds, SSE2 or NEON pairs in the portable one).
 * One libm call per score was most of a long decode's time. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* p[0..7] = exp(s[0..7] − max), added to *total too (vectors passed by address: by value they
 * would change the portable build's calling convention, which the compiler warns of). */
static inline void exp8(const float *s, float max, float *p, f32x8 *total) {
    f32x8 x;
    memcpy(&x, s, sizeof x);
    x -= max;
    const f32x8 floor = (f32x8){ 0 } - 87.0f;
    const i32x8 vanishes = x < floor;
    x = (f32x8)(((i32x8)x & ~vanishes) | ((i32x8)floor & vanishes));
    const float magic = 12582912.0f; /* 1.5 · 2^23: adding it rounds to an integer */
    const f32x8 n = (x * 1.44269504088896341f + magic) - magic;
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    f32x8 y = (f32x8){ 0 } + 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    const i32x8 power = (__builtin_convertvector(n, i32x8) + 127) << 23;
    const f32x8 e = (f32x8)((i32x8)(y * (f32x8)power) & ~vanishes);
    memcpy(p, &e, sizeof e);
    *total += e;
}

/* p[i] = exp(s[i] − max) for i < n; returns their sum. */
static float exp_tile(const float *s, float max, float *p, int n) {
    int i = 0;
    f32x8 total = { 0 };
    for (; i + 8 <= n; i += 8) exp8(s + i, max, p + i, &total);
    float sum = ((total[0] + total[1]) + (total[2] + total[3])) + ((total[4] + total[5]) + (total[6] + total[7]));
    for (; i < n; i++) sum += p[i] = expf(s[i] - max);
    return sum;
}

/* --------------------------------------------------------------------------------------------- */

typedef struct {
    int dtype;
    const float *q;             /* [batch, q_tokens, heads, d], fp32 */
    const char *keys, *values;  /* [num_blocks, block_size, kv_heads, d] */
    const int32_t *tables;      /* [batch, max_blocks] */
    const int32_t *lengths;     /* [batch]: positions held, the queries' own included */
    const float *sinks;         /* [heads] or NULL */
    int64_t max_blocks, q_tokens, heads, kv_heads, d, block_size, window;
    float scale, softcap;       /* softcap 0: none; window 0: none */
    int64_t span, spans;        /* positions per work item, items per (sequence, KV head) */
    int64_t items;
    float *out;                 /* [batch, q_tokens, heads, d], fp32 */
    float *partial;             /* spans > 1: [items, rows, d + 2] (max, sum, weighted sum) */
    _Atomic int64_t next;       /* the next item a thread takes */
    atomic_int failed;          /* a thread could not get its scratch memory */
} paged_job;

/* The start of the block holding the first position any of a sequence's queries sees (the
 * earliest query's window start): the spans start on blocks, so that tiles are whole blocks. */
static int64_t first_block_start(const paged_job *job, int64_t length) {
    if (job->window <= 0) return 0;
    const int64_t first = length - job->q_tokens - job->window + 1;
    return first > 0 ? first - first % job->block_size : 0;
}

typedef struct {
    float *qs;          /* [rows, d]: the queries, scaled */
    float *acc;         /* [rows, d] */
    float *m, *l, *keep; /* [rows]: running maximum and sum; a tile's rescaling of what came before */
    float *kbuf, *vbuf; /* [TILE, d]: a tile's rows widened to fp32 */
    float *s, *p;       /* [rows, TILE] scores, then their exponentials */
} scratch;

/* The TILE rows of a tile of n positions starting at `row` (rows of kv_heads · d elements), as
 * fp32 rows: the pool's own where it holds fp32, else widened into `buffer`. Past n, the first
 * row again: read, scored, then masked. */
static void tile_rows(int dtype, const char *row, int64_t stride, int64_t n, int64_t d, float *buffer,
                      const float *rows[TILE]) {
    for (int64_t i = 0; i < n; i++) {
        if (dtype == T_F32) rows[i] = (const float *)row + i * stride;
        else {
            widen_row(dtype, (const uint16_t *)row + i * stride, buffer + i * d, d);
            rows[i] = buffer + i * d;
        }
    }
    for (int64_t i = n; i < TILE; i++) rows[i] = rows[0];
}

/* One tile of n positions from `pos`, for KV head h's G × q_tokens rows (from `first_row` of the
 * item's): their scores, the online softmax's step, and the values' weighted sum. */
static void attend_tile(const paged_job *job, const scratch *w, int64_t h, int64_t pos, int64_t n,
                        int64_t first_query, int64_t at, int64_t next_at) {
    const int64_t G = job->heads / job->kv_heads, d = job->d, rows = G * job->q_tokens;
    const int64_t first_row = h * rows, stride = job->kv_heads * d, elem = job->dtype == T_F32 ? 4 : 2;
    const int64_t head_at = at + h * d * elem;
    if (next_at >= 0) /* this KV head's rows of the next tile */
        for (int64_t i = 0; i < TILE; i++)
            for (int64_t byte = 0; byte < d * elem; byte += 64) {
                const int64_t where = next_at + (i * stride + h * d) * elem + byte;
                __builtin_prefetch(job->keys + where, 0, 2);
                __builtin_prefetch(job->values + where, 0, 2);
            }
    const float *krow[TILE], *vrow[TILE];
    float *m = w->m + first_row, *l = w->l + first_row, *keep = w->keep + first_row;
    tile_rows(job->dtype, job->keys + head_at, stride, n, d, w->kbuf, krow);
    score_tile(w->qs + first_row * d, rows, krow, d, w->s);
    int any_weight = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t own = first_query + r / G; /* this row's position: it sees up to it */
        float *score = w->s + r * TILE, tile_max = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = pos + i;
            if (p > own || (job->window > 0 && p <= own - job->window)) score[i] = -INFINITY;
            else if (job->softcap > 0) score[i] = job->softcap * tanhf(score[i] / job->softcap);
            if (score[i] > tile_max) tile_max = score[i];
        }
        if (tile_max == -INFINITY) { /* this row sees none of the tile */
            keep[r] = -1.0f;
            continue;
        }
        const float max = tile_max > m[r] ? tile_max : m[r];
        keep[r] = expf(m[r] - max); /* rescales what came before; 0 from −inf */
        l[r] = l[r] * keep[r] + exp_tile(score, max, w->p + r * TILE, (int)n);
        m[r] = max;
        any_weight = 1;
    }
    if (!any_weight) return;
    tile_rows(job->dtype, job->values + head_at, stride, n, d, w->vbuf, vrow);
    accumulate_tile(w->acc + first_row * d, keep, w->p, rows, vrow, n, d);
}

/* One item: sequence b's positions [start, end), for every row of it (KV head by KV head, each
 * of its G query heads for each query token). All KV heads of a position lie side by side in a
 * block, so walking them together reads the pool in order; one item per KV head would read it
 * in strides the prefetchers follow badly (an fp32 decode at 4,000 tokens took 1.8× longer). */
static void attend_span(const paged_job *job, const scratch *w, int64_t item) {
    const int64_t G = job->heads / job->kv_heads, Q = job->q_tokens, d = job->d, rows = G * Q;
    const int64_t b = item / job->spans, c = item % job->spans;
    const int64_t length = job->lengths[b], first_query = length - Q, lo = first_block_start(job, length);
    const int64_t start = lo + c * job->span;
    const int64_t end = start + job->span < length ? start + job->span : length;
    const int64_t all_rows = rows * job->kv_heads;
    for (int64_t row = 0; row < all_rows; row++) { /* KV head h, query token t, query head h·G + g */
        const int64_t h = row / rows, t = row % rows / G, head = h * G + row % G;
        const float *q = job->q + ((b * Q + t) * job->heads + head) * d;
        for (int64_t i = 0; i < d; i++) w->qs[row * d + i] = q[i] * job->scale;
        /* The sink joins the softmax once per row: in its first span. */
        const int sink = job->sinks && c == 0;
        w->m[row] = sink ? job->sinks[head] : -INFINITY;
        w->l[row] = sink ? 1.0f : 0.0f;
    }
    memset(w->acc, 0, (size_t)(all_rows * d) * sizeof(float));
    const int64_t elem = job->dtype == T_F32 ? 4 : 2;
    const int32_t *table = job->tables + b * job->max_blocks;
    for (int64_t pos = start; pos < end;) {
        /* A tile: up to TILE positions inside one block. */
        const int64_t block = table[pos / job->block_size], offset = pos % job->block_size;
        int64_t n = end - pos;
        if (n > TILE) n = TILE;
        if (n > job->block_size - offset) n = job->block_size - offset;
        const int64_t at = (block * job->block_size + offset) * job->kv_heads * d * elem;
        int64_t next_at = -1;
        const int64_t next_pos = pos + n, next_offset = next_pos % job->block_size;
        if (end - next_pos >= TILE && job->block_size - next_offset >= TILE) {
            /* A whole next tile: its rows are fetched while this one is worked on (the stream
             * prefetchers stop where the table jumps to another block). */
            const int64_t next = table[next_pos / job->block_size];
            next_at = (next * job->block_size + next_offset) * job->kv_heads * d * elem;
        }
        for (int64_t h = 0; h < job->kv_heads; h++) attend_tile(job, w, h, pos, n, first_query, at, next_at);
        pos += n;
    }
    for (int64_t row = 0; row < all_rows; row++) {
        if (job->spans > 1) { /* merged with the other spans' afterwards */
            float *part = job->partial + (item * all_rows + row) * (d + 2);
            part[0] = w->m[row];
            part[1] = w->l[row];
            memcpy(part + 2, w->acc + row * d, (size_t)d * sizeof(float));
            continue;
        }
        const int64_t h = row / rows, t = row % rows / G, head = h * G + row % G;
        const float inverse = w->l[row] > 0 ? 1.0f / w->l[row] : 0.0f;
        float *o = job->out + ((b * Q + t) * job->heads + head) * d;
        for (int64_t i = 0; i < d; i++) o[i] = w->acc[row * d + i] * inverse;
    }
}

static void attend_items(void *context, int ith, int nth) {
    (void)ith;
    (void)nth;
    paged_job *job = context;
    /* Every row of an item; the scores and their exponentials for one KV head's rows at a time. */
    const int64_t all_rows = job->heads * job->q_tokens, rows = all_rows / job->kv_heads, d = job->d;
    const size_t floats = (size_t)(all_rows * d * 2 + all_rows * 3 + TILE * d * 2 + rows * TILE * 2);
    float *memory = malloc(floats * sizeof(float));
    if (!memory) {
        atomic_store(&job->failed, 1);
        return;
    }
    scratch w;
    w.qs = memory;
    w.acc = w.qs + all_rows * d;
    w.m = w.acc + all_rows * d;
    w.l = w.m + all_rows;
    w.keep = w.l + all_rows;
    w.kbuf = w.keep + all_rows;
    w.vbuf = w.kbuf + TILE * d;
    w.s = w.vbuf + TILE * d;
    w.p = w.s + rows * TILE;
    for (;;) {
        const int64_t item = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (item >= job->items) break;
        attend_span(job, &w, item);
    }
    free(memory);
}

/* The spans of each (sequence, KV head) made one: each rescaled to the largest maximum. */
static void merge_spans(const paged_job *job, int64_t batch) {
    const int64_t G = job->heads / job->kv_heads, Q = job->q_tokens, d = job->d, rows = G * Q;
    const int64_t all_rows = rows * job->kv_heads;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t row = 0; row < all_rows; row++) {
            const float *first = job->partial + (b * job->spans * all_rows + row) * (d + 2);
            const int64_t next_span = all_rows * (d + 2);
            float max = -INFINITY, sum = 0.0f;
            for (int64_t c = 0; c < job->spans; c++)
                if (first[c * next_span] > max) max = first[c * next_span];
            const int64_t h = row / rows, t = row % rows / G, head = h * G + row % G;
            float *o = job->out + ((b * Q + t) * job->heads + head) * d;
            memset(o, 0, (size_t)d * sizeof(float));
            if (max == -INFINITY) continue;
            for (int64_t c = 0; c < job->spans; c++) {
                const float *part = first + c * next_span;
                if (part[0] == -INFINITY) continue;
                const float weight = expf(part[0] - max);
                sum += part[1] * weight;
                for (int64_t i = 0; i < d; i++) o[i] += weight * part[i + 2];
            }
            const float inverse = sum > 0 ? 1.0f / sum : 0.0f;
            for (int64_t i = 0; i < d; i++) o[i] *= inverse;
        }
}

/* Attention of each sequence's last `q_tokens` queries over its blocks. `dtype`: the pool's,
 * T_F32, T_F16 or T_BF16. `window` ≤ 0: none; `softcap` ≤ 0: none; `sinks` NULL: none.
 * 0, or −1 for shapes this kernel does not take (the caller keeps its own path), −2 where a
 * length or a block id lies outside the pool, −3 where memory ran out. */
LLMCLI_API int llmcli_paged_attention(int dtype, const float *q, const void *keys, const void *values,
                                      const int32_t *tables, int64_t max_blocks, int64_t num_blocks,
                                      const int32_t *lengths, const float *sinks, int64_t batch,
                                      int64_t q_tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale, int64_t window, float softcap,
                                      float *out, int n_threads) {
    if ((dtype != T_F32 && dtype != T_F16 && dtype != T_BF16) || batch < 1 || q_tokens < 1 || kv_heads < 1 ||
        heads < kv_heads || heads % kv_heads || head_dim < 1 || block_size < 1 || max_blocks < 1)
        return -1;
    paged_job job = { .dtype = dtype, .q = q, .keys = keys, .values = values, .tables = tables,
                      .lengths = lengths, .sinks = sinks, .max_blocks = max_blocks, .q_tokens = q_tokens,
                      .heads = heads, .kv_heads = kv_heads, .d = head_dim, .block_size = block_size,
                      .window = window > 0 ? window : 0, .scale = scale, .softcap = softcap > 0 ? softcap : 0,
                      .out = out };
    int64_t longest = 0, total = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t length = lengths[b];
        if (length < q_tokens || length > max_blocks * block_size) return -2;
        const int64_t lo = first_block_start(&job, length);
        for (int64_t i = lo / block_size; i <= (length - 1) / block_size; i++) {
            const int32_t block = tables[b * max_blocks + i];
            if (block < 0 || block >= num_blocks) return -2;
        }
        if (length - lo > longest) longest = length - lo;
        total += length - lo;
    }
    /* Split along the positions only where the sequences are too few to keep every thread busy,
     * and never into spans shorter than MIN_SPAN. */
    if (n_threads < 1) n_threads = 1;
    const int64_t wanted = (int64_t)n_threads * ITEMS_PER_THREAD;
    int64_t spans = n_threads > 1 && batch < wanted ? (wanted + batch - 1) / batch : 1;
    const int64_t most = (longest + MIN_SPAN - 1) / MIN_SPAN;
    if (spans > most) spans = most > 0 ? most : 1;
    job.spans = spans;
    job.span = (longest + spans - 1) / spans;
    job.span += (block_size - job.span % block_size) % block_size; /* whole blocks */
    job.items = batch * spans;
    if (spans > 1) {
        job.partial = malloc((size_t)(job.items * heads * q_tokens * (head_dim + 2)) * sizeof(float));
        if (!job.partial) return -3;
    }
    atomic_init(&job.next, 0);
    atomic_init(&job.failed, 0);
    /* A thread per share of work worth waking it for: a short decode is over before it wakes. */
    const int64_t work = total * kv_heads * head_dim * (heads / kv_heads) * q_tokens;
    int threads = n_threads;
    if (threads > job.items) threads = (int)job.items;
    if (work < 65536) threads = 1;
    pool_run(attend_items, &job, threads);
    if (spans > 1 && !atomic_load(&job.failed)) merge_spans(&job, batch);
    free(job.partial);
    return atomic_load(&job.failed) ? -3 : 0;
}
