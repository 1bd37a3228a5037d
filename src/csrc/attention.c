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
 * per query row). Work is (sequence, KV head, span of positions): long spans are split so that
 * two threads stay busy on one sequence of three KV heads, and the spans' partial sums are
 * merged afterwards as flash-decoding merges them. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "llmcli_cpu.h"

#define TILE 32                /* positions scored at once: one row of scores stays in registers */
#define MIN_SPAN 256           /* positions a work item takes at least: below, splitting costs more */
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
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = fp16_to_fp32(h[i]);
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum);
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
        sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i), sum);
    }
    return _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    float total = _mm_cvtss_f32(half);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
#else
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0; /* four chains: the adds need not wait on each other */
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
#endif
}

/* y = y·keep + a·x: a row's weighted sum rescaled for a new maximum and given one more value row. */
static inline void scale_add(float *y, float keep, float a, const float *x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 k = _mm512_set1_ps(keep), w = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(w, _mm512_loadu_ps(x + i), _mm512_mul_ps(k, _mm512_loadu_ps(y + i))));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 k = _mm256_set1_ps(keep), w = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(x + i), _mm256_mul_ps(k, _mm256_loadu_ps(y + i))));
#endif
    for (; i < n; i++) y[i] = y[i] * keep + a * x[i];
}

/* exp(x) for the n ≤ TILE scores of a tile, x ≤ 0 (a score less the row's maximum), −inf → 0.
 * The SIMD builds use Cephes' polynomial (within 2 ulp of expf): one libm call per score was
 * most of a long decode's time. */
#if defined(__AVX512F__)
static inline __m512 exp_ps(__m512 x) {
    const __mmask16 vanishes = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~vanishes, y, _mm512_castsi512_ps(power));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp_ps(__m256 x) {
    const __m256 vanishes = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(vanishes, _mm256_mul_ps(y, _mm256_castsi256_ps(power)));
}
#endif

/* p[i] = exp(s[i] − max) for i < n; returns their sum. */
static float exp_tile(const float *s, float max, float *p, int n) {
    int i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 total = _mm512_setzero_ps();
    for (; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + i), _mm512_set1_ps(max)));
        _mm512_mask_storeu_ps(p + i, in, e);
        total = _mm512_mask_add_ps(total, in, total, e);
    }
    sum = _mm512_reduce_add_ps(total);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 total = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(max)));
        _mm256_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
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
    atomic_long next;           /* the next item a thread takes */
    atomic_int failed;          /* a thread could not get its scratch memory */
} paged_job;

/* The first position any of a sequence's queries sees (the earliest query's window start). */
static int64_t first_seen(const paged_job *job, int64_t length) {
    if (job->window <= 0) return 0;
    const int64_t first = length - job->q_tokens - job->window + 1;
    return first > 0 ? first : 0;
}

typedef struct {
    float *qs;      /* [rows, d]: the queries, scaled */
    float *acc;     /* [rows, d] */
    float *m, *l;   /* [rows] */
    float *kbuf, *vbuf; /* [TILE, d]: a tile's rows widened to fp32 */
    float *s, *p;   /* [rows, TILE] scores, then their exponentials */
} scratch;

/* One item: sequence b, KV head h, positions [start, end) of it, for all G × q_tokens rows. */
static void attend_span(const paged_job *job, const scratch *w, int64_t item) {
    const int64_t G = job->heads / job->kv_heads, Q = job->q_tokens, d = job->d, rows = G * Q;
    const int64_t b = item / (job->kv_heads * job->spans);
    const int64_t h = item / job->spans % job->kv_heads, c = item % job->spans;
    const int64_t length = job->lengths[b], first_query = length - Q, lo = first_seen(job, length);
    const int64_t start = lo + c * job->span;
    const int64_t end = start + job->span < length ? start + job->span : length;
    for (int64_t r = 0; r < rows; r++) { /* row r: query token r / G, head h·G + r % G */
        const int64_t head = h * G + r % G;
        const float *q = job->q + ((b * Q + r / G) * job->heads + head) * d;
        for (int64_t i = 0; i < d; i++) w->qs[r * d + i] = q[i] * job->scale;
        /* The sink joins the softmax once per row: in its first span. */
        const int sink = job->sinks && c == 0;
        w->m[r] = sink ? job->sinks[head] : -INFINITY;
        w->l[r] = sink ? 1.0f : 0.0f;
    }
    memset(w->acc, 0, (size_t)(rows * d) * sizeof(float));
    const int64_t row_stride = job->kv_heads * d, elem = job->dtype == T_F32 ? 4 : 2;
    const int32_t *table = job->tables + b * job->max_blocks;
    const float *krow[TILE], *vrow[TILE];
    for (int64_t pos = start; pos < end;) {
        /* A tile: up to TILE positions inside one block. */
        const int64_t block = table[pos / job->block_size], offset = pos % job->block_size;
        int64_t n = end - pos;
        if (n > TILE) n = TILE;
        if (n > job->block_size - offset) n = job->block_size - offset;
        const int64_t at = ((block * job->block_size + offset) * job->kv_heads + h) * d * elem;
        for (int64_t i = 0; i < n; i++) {
            const char *k = job->keys + at + i * row_stride * elem;
            if (job->dtype == T_F32) krow[i] = (const float *)k;
            else {
                widen_row(job->dtype, k, w->kbuf + i * d, d);
                krow[i] = w->kbuf + i * d;
            }
        }
        int any_weight = 0;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t own = first_query + r / G; /* this row's position: it sees up to it */
            float *s = w->s + r * TILE, tile_max = -INFINITY;
            for (int64_t i = 0; i < n; i++) {
                const int64_t p = pos + i;
                if (p > own || (job->window > 0 && p <= own - job->window)) {
                    s[i] = -INFINITY;
                    continue;
                }
                float score = dot(w->qs + r * d, krow[i], d);
                if (job->softcap > 0) score = job->softcap * tanhf(score / job->softcap);
                s[i] = score;
                if (score > tile_max) tile_max = score;
            }
            if (tile_max == -INFINITY) { /* this row sees none of the tile */
                for (int64_t i = 0; i < n; i++) w->p[r * TILE + i] = 0.0f;
                continue;
            }
            const float max = tile_max > w->m[r] ? tile_max : w->m[r];
            const float keep = expf(w->m[r] - max); /* rescales what came before; 0 from −inf */
            const float sum = exp_tile(s, max, w->p + r * TILE, (int)n);
            w->l[r] = w->l[r] * keep + sum;
            w->m[r] = max;
            if (keep != 1.0f)
                for (int64_t i = 0; i < d; i++) w->acc[r * d + i] *= keep;
            any_weight = 1;
        }
        if (any_weight) {
            for (int64_t i = 0; i < n; i++) {
                const char *v = job->values + at + i * row_stride * elem;
                if (job->dtype == T_F32) vrow[i] = (const float *)v;
                else {
                    widen_row(job->dtype, v, w->vbuf + i * d, d);
                    vrow[i] = w->vbuf + i * d;
                }
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < n; i++) {
                    const float weight = w->p[r * TILE + i];
                    if (weight != 0.0f) scale_add(w->acc + r * d, 1.0f, weight, vrow[i], d);
                }
        }
        pos += n;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (job->spans > 1) { /* merged with the other spans' afterwards */
            float *part = job->partial + (item * rows + r) * (d + 2);
            part[0] = w->m[r];
            part[1] = w->l[r];
            memcpy(part + 2, w->acc + r * d, (size_t)d * sizeof(float));
            continue;
        }
        const float inverse = w->l[r] > 0 ? 1.0f / w->l[r] : 0.0f;
        float *o = job->out + ((b * Q + r / G) * job->heads + h * G + r % G) * d;
        for (int64_t i = 0; i < d; i++) o[i] = w->acc[r * d + i] * inverse;
    }
}

static void attend_items(void *context, int ith, int nth) {
    (void)ith;
    (void)nth;
    paged_job *job = context;
    const int64_t rows = job->heads / job->kv_heads * job->q_tokens, d = job->d;
    const size_t floats = (size_t)(rows * d * 2 + rows * 2 + TILE * d * 2 + rows * TILE * 2);
    float *memory = malloc(floats * sizeof(float));
    if (!memory) {
        atomic_store(&job->failed, 1);
        return;
    }
    scratch w;
    w.qs = memory;
    w.acc = w.qs + rows * d;
    w.m = w.acc + rows * d;
    w.l = w.m + rows;
    w.kbuf = w.l + rows;
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
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < job->kv_heads; h++)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t first_item = (b * job->kv_heads + h) * job->spans;
                float max = -INFINITY, sum = 0.0f;
                for (int64_t c = 0; c < job->spans; c++) {
                    const float m = job->partial[((first_item + c) * rows + r) * (d + 2)];
                    if (m > max) max = m;
                }
                float *o = job->out + ((b * Q + r / G) * job->heads + h * G + r % G) * d;
                memset(o, 0, (size_t)d * sizeof(float));
                if (max == -INFINITY) continue;
                for (int64_t c = 0; c < job->spans; c++) {
                    const float *part = job->partial + ((first_item + c) * rows + r) * (d + 2);
                    if (part[0] == -INFINITY) continue;
                    const float weight = expf(part[0] - max);
                    sum += part[1] * weight;
                    scale_add(o, 1.0f, weight, part + 2, d);
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
        const int64_t lo = first_seen(&job, length);
        for (int64_t i = lo / block_size; i <= (length - 1) / block_size; i++) {
            const int32_t block = tables[b * max_blocks + i];
            if (block < 0 || block >= num_blocks) return -2;
        }
        if (length - lo > longest) longest = length - lo;
        total += length - lo;
    }
    /* Split along the positions only where the (sequence, KV head) pairs are too few to keep
     * every thread busy, and never into spans shorter than MIN_SPAN. */
    if (n_threads < 1) n_threads = 1;
    const int64_t pairs = batch * kv_heads, wanted = (int64_t)n_threads * ITEMS_PER_THREAD;
    int64_t spans = n_threads > 1 && pairs < wanted ? (wanted + pairs - 1) / pairs : 1;
    const int64_t most = (longest + MIN_SPAN - 1) / MIN_SPAN;
    if (spans > most) spans = most > 0 ? most : 1;
    job.spans = spans;
    job.span = (longest + spans - 1) / spans;
    job.items = pairs * spans;
    const int64_t rows = heads / kv_heads * q_tokens;
    if (spans > 1) {
        job.partial = malloc((size_t)(job.items * rows * (head_dim + 2)) * sizeof(float));
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
