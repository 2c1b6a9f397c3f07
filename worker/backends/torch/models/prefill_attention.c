/* Paged causal attention of prefill chunks for bfloat16 on a CPU, reading vLLM CPU's KV cache
 * layout in place (the layout decode_attention.c reads: per (block, KV head), the keys transposed,
 * [head_dim][block_size], then the values, [block_size][head_dim]).
 *
 * Row r's chunk is its queries query_start_loc[r] .. query_start_loc[r + 1] - 1, the last
 * `qlen` positions of its seq_lens[r] keys (the cached prefix, then the chunk itself, already
 * written): query i sits at position seq_len - qlen + i and attends keys 0 .. that position.
 *
 * Work items are (row, KV head, tile of queries): a tile's queries times the KV head's query
 * heads are up to MAX_M query vectors, all scored against one block of keys at a time, so each
 * block is read and repacked once per tile, not once per query. Items are one thread's each
 * (results never depend on the thread count or on the other rows), the costliest first.
 *
 * Both products are bfloat16 pairs summed in float32 (VDPBF16PS): the block's keys and values are
 * repacked into the pairs each product's operand order wants (a key's dimensions d, d + 1; a
 * dimension's keys t, t + 1), the probabilities rounded to bfloat16 for the second
 * product, as flash attention does on GPUs; the online softmax, its sums and the output
 * accumulators are float32, the output rounded to bfloat16 to nearest even.
 * Compiled by native_build.py (-O3 -march=native -ffast-math, OpenMP from torch's libgomp); only
 * the AVX512-BF16 path exists: without it prefill_attention.py refuses and vLLM's kernel serves.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_M 48         /* query vectors (tile queries x query heads of a KV head) per item */
#define MAX_BLOCK 128
#define MAX_HEAD_DIM 128
#define MR 6             /* query vectors per register tile */
#define NEG_BIG (-1.0e30f) /* below every score; finite, as -ffast-math assumes */

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

int ttserve_prefill_attention_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

int ttserve_prefill_attention_limits(int64_t *max_m, int64_t *max_block, int64_t *max_head_dim) {
    *max_m = MAX_M;
    *max_block = MAX_BLOCK;
    *max_head_dim = MAX_HEAD_DIM;
    return 1;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Word indices that interleave two 32-word vectors a, b: (a0, b0, a1, b1, ... a15, b15), and the
 * same for their upper halves (a16, b16, ...). */
static inline __m512i interleave_low(void) {
    return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}
static inline __m512i interleave_high(void) {
    return _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                            55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
}

/* kp[dp][t] = (K[t][2dp], K[t][2dp + 1]) for t < n (zero from n to the block's next multiple of
 * 32) from K^T [head_dim][block_size]: 16 keys' pairs per vector. */
static void pack_keys(const uint16_t *kt, int64_t n, int64_t block_size, int64_t head_dim, uint32_t *kp) {
    const __m512i lo = interleave_low(), hi = interleave_high();
    for (int64_t t0 = 0; t0 < n; t0 += 32) {
        const int64_t left = n - t0;
        const __mmask32 valid = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
        for (int64_t d = 0; d < head_dim; d += 2) {
            const __m512i r0 = _mm512_maskz_loadu_epi16(valid, kt + d * block_size + t0);
            const __m512i r1 = _mm512_maskz_loadu_epi16(valid, kt + (d + 1) * block_size + t0);
            uint32_t *row = kp + (d / 2) * block_size + t0;
            _mm512_storeu_si512(row, _mm512_permutex2var_epi16(r0, lo, r1));
            _mm512_storeu_si512(row + 16, _mm512_permutex2var_epi16(r0, hi, r1));
        }
    }
}

/* vp[tp][d] = (V[2tp][d], V[2tp + 1][d]) for key pairs below n (a key at n, when n is odd, reads
 * as zero) from V [block_size][head_dim]: 16 dimensions' pairs per vector. */
static void pack_values(const uint16_t *v, int64_t n, int64_t head_dim, uint32_t *vp) {
    const __m512i lo = interleave_low(), hi = interleave_high();
    for (int64_t t = 0; t < n; t += 2) {
        for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
            const int64_t left = head_dim - d0;
            const __mmask32 valid = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
            const __m512i r0 = _mm512_maskz_loadu_epi16(valid, v + t * head_dim + d0);
            const __m512i r1 = t + 1 < n ? _mm512_maskz_loadu_epi16(valid, v + (t + 1) * head_dim + d0)
                                         : _mm512_setzero_si512();
            uint32_t *row = vp + (t / 2) * head_dim + d0;
            _mm512_storeu_si512(row, _mm512_permutex2var_epi16(r0, lo, r1));
            if (left > 16) _mm512_storeu_si512(row + 16, _mm512_permutex2var_epi16(r0, hi, r1));
        }
    }
}

/* s[m][t0 .. t0 + 16 TK) = scale * sum_d q[m][d] K[t][d] for M query vectors (M <= MR) and TK <= 4
 * vectors of keys, the scores in registers (M and TK are literals at every call). */
static inline __attribute__((always_inline)) void qk(const int M, const int TK, const uint32_t *qp, int64_t pairs,
                                                    const uint32_t *kp, int64_t block_size, int64_t t0,
                                                    float scale, float *s) {
    __m512 acc[MR][4];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < TK; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < pairs; dp++) {
        __m512bh k[4];
        for (int j = 0; j < TK; j++) k[j] = (__m512bh)_mm512_loadu_si512(kp + dp * block_size + t0 + 16 * j);
        for (int m = 0; m < M; m++) {
            const __m512bh qm = (__m512bh)_mm512_set1_epi32((int)qp[m * (MAX_HEAD_DIM / 2) + dp]);
            for (int j = 0; j < TK; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], k[j], qm);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int m = 0; m < M; m++)
        for (int j = 0; j < TK; j++) _mm512_storeu_ps(s + m * MAX_BLOCK + t0 + 16 * j, _mm512_mul_ps(acc[m][j], sc));
}

/* acc[m][d0 .. d0 + 16 DV) += sum_tp p[m][tp] . vp[tp][d0 ..] for M query vectors and DV <= 4
 * vectors of dimensions, over `pairs` key pairs. */
static inline __attribute__((always_inline)) void pv(const int M, const int DV, const uint32_t *pp, int64_t pairs,
                                                    const uint32_t *vp, int64_t head_dim, int64_t d0, float *acc) {
    __m512 a[MR][4];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < DV; j++) a[m][j] = _mm512_loadu_ps(acc + m * MAX_HEAD_DIM + d0 + 16 * j);
    for (int64_t tp = 0; tp < pairs; tp++) {
        __m512bh v[4];
        for (int j = 0; j < DV; j++) v[j] = (__m512bh)_mm512_loadu_si512(vp + tp * head_dim + d0 + 16 * j);
        for (int m = 0; m < M; m++) {
            const __m512bh pm = (__m512bh)_mm512_set1_epi32((int)pp[m * (MAX_BLOCK / 2) + tp]);
            for (int j = 0; j < DV; j++) a[m][j] = _mm512_dpbf16_ps(a[m][j], v[j], pm);
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < DV; j++) _mm512_storeu_ps(acc + m * MAX_HEAD_DIM + d0 + 16 * j, a[m][j]);
}

/* The larger of `floor` and the first `seen` scores (none when seen <= 0). */
static inline float block_max(const float *s, int64_t seen, float floor) {
    __m512 best = _mm512_set1_ps(floor);
    for (int64_t t = 0; t < seen; t += 16) {
        const __mmask16 valid = seen - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - t)) - 1);
        best = _mm512_mask_max_ps(best, valid, best, _mm512_maskz_loadu_ps(valid, s + t));
    }
    return _mm512_reduce_max_ps(best);
}

/* e^x for x <= 0 (below -87, 0), float32 to ~2 ulp: 2^(x log2 e) as 2^k times a degree-6
 * polynomial of the fraction in [-1/2, 1/2] (its Taylor series; the remainder is ~1e-7). */
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

/* p[t] = e^(s[t] - m) rounded to bfloat16 (to nearest even) for t < seen, 0 from there to n
 * rounded up to 32 (the value pairs' zero padding); returns the float32 sum of the weights. */
static inline float weigh(const float *s, int64_t seen, int64_t n, float m, uint32_t *p) {
    const __m512 top = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 32) {
        __m512 e[2];
        for (int h = 0; h < 2; h++) {
            const int64_t left = seen - t - 16 * h;
            const __mmask16 valid = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
            e[h] = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t + 16 * h), top)));
            sum = _mm512_add_ps(sum, e[h]);
        }
        _mm512_storeu_si512(p + t / 2, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0])); /* keys t .. t + 31 */
    }
    return _mm512_reduce_add_ps(sum);
}

/* A tile of a row's queries (count of them from its query first) and its cost, for taking the
 * costliest first. */
struct tile_work {
    int64_t cost, row, first, count;
};

static int costlier_first(const void *a, const void *b) {
    const struct tile_work *x = a, *y = b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    return x->row != y->row ? (x->row < y->row ? -1 : 1) : (x->first < y->first ? -1 : x->first > y->first);
}

#define QK_CASE(M_, TK_) case (M_) * 8 + (TK_): qk(M_, TK_, qp[m0], pairs, kp, block_size, t0, scale, s[m0]); break;
#define QK_ROW(M_) QK_CASE(M_, 1) QK_CASE(M_, 2) QK_CASE(M_, 3) QK_CASE(M_, 4)
#define PV_CASE(M_, DV_) case (M_) * 8 + (DV_): pv(M_, DV_, pp[m0], npairs, vp, head_dim, d0, acc[m0]); break;
#define PV_ROW(M_) PV_CASE(M_, 1) PV_CASE(M_, 2) PV_CASE(M_, 3) PV_CASE(M_, 4)

/* One work item: `count` queries of row `row` from its query `first`, each with the `group` query
 * heads of KV head `kv`. */
static void attend_tile(const uint16_t *q, int64_t q_token_stride, int64_t q_head_stride,
                        const uint16_t *key_cache, const uint16_t *value_cache, int64_t block_stride,
                        int64_t head_stride, uint16_t *out, const int32_t *table_row, int64_t token0,
                        int64_t qlen, int64_t seq_len, int64_t first, int64_t count, int64_t kv,
                        int64_t num_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale) {
    uint32_t qp[MAX_M][MAX_HEAD_DIM / 2];                   /* the queries' bfloat16 pairs */
    float acc[MAX_M][MAX_HEAD_DIM];
    float s[MAX_M][MAX_BLOCK];
    uint32_t pp[MAX_M][MAX_BLOCK / 2];                      /* probabilities, bfloat16 pairs */
    uint32_t kp[MAX_HEAD_DIM / 2 * MAX_BLOCK];
    uint32_t vp[MAX_BLOCK / 2 * MAX_HEAD_DIM];
    int64_t last[MAX_M];                                    /* each vector's last key */
    float mx[MAX_M], l[MAX_M];
    const int64_t vectors = count * group, pairs = head_dim / 2;
    for (int64_t i = 0; i < count; i++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t m = i * group + g;
            memcpy(qp[m], q + (token0 + first + i) * q_token_stride + (kv * group + g) * q_head_stride,
                   sizeof(uint16_t) * head_dim);
            memset(acc[m], 0, sizeof(float) * head_dim);
            last[m] = seq_len - qlen + first + i;
            mx[m] = NEG_BIG;
            l[m] = 0.0f;
        }
    const int64_t keys = seq_len - qlen + first + count; /* the tile's last query sees keys < this */
    const int64_t blocks = (keys + block_size - 1) / block_size;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t id = table_row[b];
        const int64_t n = keys - b * block_size < block_size ? keys - b * block_size : block_size;
        pack_keys(key_cache + id * block_stride + kv * head_stride, n, block_size, head_dim, kp);
        pack_values(value_cache + id * block_stride + kv * head_stride, n, head_dim, vp);
        for (int64_t t0 = 0; t0 < n; t0 += 64) {
            const int64_t tk = (n - t0 + 15) / 16 < 4 ? (n - t0 + 15) / 16 : 4;
            for (int64_t m0 = 0; m0 < vectors; m0 += MR) {
                const int64_t mn = vectors - m0 < MR ? vectors - m0 : MR;
                switch (mn * 8 + tk) {
                    QK_ROW(1) QK_ROW(2) QK_ROW(3) QK_ROW(4) QK_ROW(5) QK_ROW(6)
                }
            }
        }
        const int64_t base = b * block_size;
        for (int64_t m = 0; m < vectors; m++) {
            /* Keys past the query's own position (the causal mask) and past n: no weight. */
            const int64_t seen = last[m] - base + 1 < n ? last[m] - base + 1 : n;
            const float m_new = block_max(s[m], seen, mx[m]);
            const float correction = expf(mx[m] - m_new);
            l[m] = l[m] * correction + weigh(s[m], seen, n, m_new, pp[m]);
            mx[m] = m_new;
            if (correction != 1.0f)
                for (int64_t d = 0; d < head_dim; d++) acc[m][d] *= correction;
        }
        const int64_t npairs = (n + 1) / 2;
        for (int64_t m0 = 0; m0 < vectors; m0 += MR) {
            const int64_t mn = vectors - m0 < MR ? vectors - m0 : MR;
            for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
                const int64_t dv = (head_dim - d0) / 16 < 4 ? (head_dim - d0) / 16 : 4;
                switch (mn * 8 + dv) {
                    PV_ROW(1) PV_ROW(2) PV_ROW(3) PV_ROW(4) PV_ROW(5) PV_ROW(6)
                }
            }
        }
    }
    for (int64_t i = 0; i < count; i++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t m = i * group + g;
            uint16_t *o = out + ((token0 + first + i) * num_heads + kv * group + g) * head_dim;
            const float inv = l[m] > 0.0f ? 1.0f / l[m] : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[m][d] * inv);
        }
}
#endif

/* q [tokens, num_heads, head_dim] (token and head strides given, last dim contiguous); out
 * [tokens, num_heads, head_dim] contiguous; block_table [rows, table_width], seq_lens [rows] and
 * query_start_loc [rows + 1] int32. Returns 0, or -1 when the host lacks the memory to plan. */
int ttserve_prefill_attention(const uint16_t *q, int64_t q_token_stride, int64_t q_head_stride,
                              const uint16_t *key_cache, const uint16_t *value_cache, int64_t block_stride,
                              int64_t head_stride, uint16_t *out, const int32_t *block_table, int64_t table_width,
                              const int32_t *seq_lens, const int32_t *query_start_loc, int64_t rows,
                              int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int64_t group = num_heads / kv_heads;
    const int64_t tile = MAX_M / group; /* queries per item */
    int64_t tiles = 0;
    for (int64_t r = 0; r < rows; r++) tiles += (query_start_loc[r + 1] - query_start_loc[r] + tile - 1) / tile;
    struct tile_work *order = malloc(sizeof(struct tile_work) * (tiles ? tiles : 1));
    if (!order) return -1;
    int64_t k = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t qlen = query_start_loc[r + 1] - query_start_loc[r];
        for (int64_t first = 0; first < qlen; first += tile, k++) {
            const int64_t count = qlen - first < tile ? qlen - first : tile;
            order[k] = (struct tile_work){count * (seq_lens[r] - qlen + first + count), r, first, count};
        }
    }
    /* Costliest first (queries times the keys they see), so that the last items taken, which
     * decide when the step ends, are short ones: dynamic, the costs being unequal. */
    qsort(order, (size_t)tiles, sizeof(struct tile_work), costlier_first);
    const int64_t items = tiles * kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const struct tile_work *w = &order[item / kv_heads];
        const int64_t r = w->row;
        attend_tile(q, q_token_stride, q_head_stride, key_cache, value_cache, block_stride, head_stride, out,
                    block_table + r * table_width, query_start_loc[r], query_start_loc[r + 1] - query_start_loc[r],
                    seq_lens[r], w->first, w->count,
                    item % kv_heads, num_heads, group, head_dim, block_size, scale);
    }
    free(order);
    return 0;
#else
    return -1;
#endif
}
