/* Paged decode attention for bfloat16 on a CPU, reading vLLM CPU's KV cache layout in place.
 *
 * One query token per row attends to every key of its row (the decode step). Work items are
 * (row, KV head) pairs, each one thread's from its first block to its last, so a row's result
 * never depends on the other rows of the step. Per block, all of a KV head's query heads are
 * scored against up to 64 keys at a time with the scores in registers (the keys are stored
 * transposed, so consecutive keys of one dimension are one vector), then their probabilities
 * weight the values in registers: the block is read once for the whole group, keys in address
 * order. While a block is computed, the next block of the thread's walk is requested into L2
 * (software prefetch, one line per iteration of the block's loops), so a cold cache (the layer's
 * weights have just evicted it) streams instead of stalling each block. decode_attention.py has
 * the figures.
 *
 * Layout (what vLLM CPU's cpu_attn_reshape_and_cache writes for its "vec" and "vec16" ISAs, as
 * measured in tests/test_decode_attention.py): per (block, KV head), the keys transposed,
 * [head_dim][block_size], then the values, [block_size][head_dim]; the caller passes the key and
 * value views' base pointers and their block and head strides in elements.
 *
 * Scores: with AVX512-BF16, query-key products of bfloat16 pairs summed in float32 (VDPBF16PS),
 * times the scale; without it, every key converted to float32 against the scaled query.
 * Softmax is the online (streaming) form in float32, per block; the output is rounded to
 * bfloat16 to nearest even. Compiled by decode_attention.py with -O3 -march=native -ffast-math
 * (vectorized expf from glibc's libmvec) and linked without it (a -ffast-math link adds a
 * constructor that flushes subnormals to zero in every thread of the process that loads it), with
 * OpenMP from the libgomp torch has loaded.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_BLOCK 256
#define MAX_HEAD_DIM 256
#define NEG_BIG (-1.0e30f) /* below every score; finite, as -ffast-math assumes */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* Ask for [p, p + bytes) in L2 (locality 2: prefetcht1), one request per 64-byte line, without
 * waiting for it. Into L1 (prefetcht0) the same requests measured 1.3-1.5x slower cold. */
static inline void prefetch_span(const uint16_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
}

#ifdef __AVX512F__
#include <immintrin.h>
#define TILE 16 /* tokens per vector */

static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* s[g][t0 .. t0 + 16 TN) = sum_d qs[g][d] * K^T[d][t0 ..] for GN <= 4 heads of the group and
 * TN <= 4 vectors of keys, the scores in registers (GN and TN are literals at every call: the
 * loops unroll). d outermost: the keys are read in address order, 32 TN bytes of each row of
 * K^T, which the hardware prefetcher follows through a cold block. */
static inline __attribute__((always_inline)) void qk_tile(const int GN, const int TN, float qs[][MAX_HEAD_DIM],
                                                         const uint16_t *kt, int64_t t0, int64_t block_size,
                                                         int64_t head_dim, float s[][MAX_BLOCK],
                                                         const uint16_t *next) {
    __m512 acc[4][4];
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < TN; j++) acc[g][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d++) {
        if (next) prefetch_span(next + d * block_size, block_size * 2);
        __m512 k[4];
        for (int j = 0; j < TN; j++) k[j] = load_bf16x16(kt + d * block_size + t0 + 16 * j);
        for (int g = 0; g < GN; g++) {
            const __m512 qg = _mm512_set1_ps(qs[g][d]);
            for (int j = 0; j < TN; j++) acc[g][j] = _mm512_fmadd_ps(qg, k[j], acc[g][j]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < TN; j++) _mm512_storeu_ps(s[g] + t0 + 16 * j, acc[g][j]);
}

#ifdef __AVX512BF16__
/* With AVX512-BF16: s[g][t0 .. t0 + 32 TT) = scale * sum_d q[g][d] K^T[d][t0 ..], GN <= 4 heads and
 * TT <= 2 tiles of 32 keys, keys at or past n read as zero. Two dimensions at a time: rows d and
 * d + 1 of K^T interleaved (VPUNPCK{L,H}WD) are 16 keys' (d, d + 1) pairs, the operand order of
 * VDPBF16PS against the broadcast pair qp = (q[d], q[d + 1]): products of bfloat16 pairs summed
 * in float32 with no conversion of the keys. The interleave takes keys 8L + 0..3 (low) and
 * 8L + 4..7 (high) of each 128-bit lane L; one permute per 16 scores restores key order. */
static inline __attribute__((always_inline)) void qk_pairs(const int GN, const int TT, const int32_t qp[][MAX_HEAD_DIM / 2],
                                                          const uint16_t *kt, int64_t t0, int64_t n,
                                                          int64_t block_size, int64_t head_dim, float scale,
                                                          float s[][MAX_BLOCK], const uint16_t *next) {
    __m512 lo[4][2], hi[4][2];
    __mmask32 valid[2];
    for (int j = 0; j < TT; j++) {
        const int64_t left = n - t0 - 32 * j;
        valid[j] = left >= 32 ? (__mmask32)0xFFFFFFFFu : left <= 0 ? (__mmask32)0 : (__mmask32)((1u << left) - 1);
        for (int g = 0; g < GN; g++) lo[g][j] = hi[g][j] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < head_dim; d += 2) {
        if (next) prefetch_span(next + d * block_size, 2 * block_size * 2);
        __m512bh kl[2], kh[2];
        for (int j = 0; j < TT; j++) {
            const __m512i r0 = _mm512_maskz_loadu_epi16(valid[j], kt + d * block_size + t0 + 32 * j);
            const __m512i r1 = _mm512_maskz_loadu_epi16(valid[j], kt + (d + 1) * block_size + t0 + 32 * j);
            kl[j] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            kh[j] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        }
        for (int g = 0; g < GN; g++) {
            const __m512bh qg = (__m512bh)_mm512_set1_epi32(qp[g][d / 2]);
            for (int j = 0; j < TT; j++) {
                lo[g][j] = _mm512_dpbf16_ps(lo[g][j], kl[j], qg);
                hi[g][j] = _mm512_dpbf16_ps(hi[g][j], kh[j], qg);
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < TT; j++) {
            _mm512_storeu_ps(s[g] + t0 + 32 * j, _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][j], first, hi[g][j]), sc));
            _mm512_storeu_ps(s[g] + t0 + 32 * j + 16,
                             _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][j], second, hi[g][j]), sc));
        }
}
#endif

/* acc[g][d0 .. d0+64) += sum_{t < n} p[g][t] * V[t][d0 ..], GN <= 4 heads, 4 vectors of d. */
static inline __attribute__((always_inline)) void pv_tile(const int GN, float p[][MAX_BLOCK], const uint16_t *v,
                                                         int64_t n, int64_t head_dim, int64_t d0, int DV,
                                                         float acc[][MAX_HEAD_DIM], const uint16_t *next) {
    __m512 a[4][4];
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < DV; j++) a[g][j] = _mm512_loadu_ps(acc[g] + d0 + 16 * j);
    for (int64_t t = 0; t < n; t++) {
        if (next) prefetch_span(next + t * head_dim, head_dim * 2);
        __m512 vv[4];
        for (int j = 0; j < DV; j++) vv[j] = load_bf16x16(v + t * head_dim + d0 + 16 * j);
        for (int g = 0; g < GN; g++) {
            const __m512 pg = _mm512_set1_ps(p[g][t]);
            for (int j = 0; j < DV; j++) a[g][j] = _mm512_fmadd_ps(pg, vv[j], a[g][j]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < DV; j++) _mm512_storeu_ps(acc[g] + d0 + 16 * j, a[g][j]);
}
#endif

int ttserve_decode_attention_vector_bits(void) {
#ifdef __AVX512F__
    return 512;
#else
    return 0;
#endif
}

int ttserve_decode_attention_limits(int64_t *max_group, int64_t *max_block, int64_t *max_head_dim) {
    *max_group = MAX_GROUP;
    *max_block = MAX_BLOCK;
    *max_head_dim = MAX_HEAD_DIM;
    return 1;
}

#ifdef __AVX512F__
/* One work item: row `item / kv_heads`'s query heads of KV head `item % kv_heads` against that
 * row's context. `threads`: the stride of the calling thread's walk over items, whose next item's
 * first block is prefetched while this item's last is computed. */
static void attend_item(const uint16_t *q, int64_t q_row_stride, int64_t q_head_stride,
                        const uint16_t *key_cache, const uint16_t *value_cache, int64_t block_stride,
                        int64_t head_stride, uint16_t *out, const int32_t *block_table, int64_t table_width,
                        const int32_t *seq_lens, int64_t rows, int64_t num_heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t item, int64_t threads) {
    const int64_t group = num_heads / kv_heads;
    const int64_t row = item / kv_heads, kv = item % kv_heads;
    const int64_t len = seq_lens[row];
    const int64_t blocks = (len + block_size - 1) / block_size;
#ifdef __AVX512BF16__
    int32_t qp[MAX_GROUP][MAX_HEAD_DIM / 2]; /* the query's bfloat16 pairs, as VDPBF16PS takes them */
#else
    float qs[MAX_GROUP][MAX_HEAD_DIM];
#endif
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float s[MAX_GROUP][MAX_BLOCK];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        const uint16_t *qh = q + row * q_row_stride + (kv * group + g) * q_head_stride;
#ifdef __AVX512BF16__
        memcpy(qp[g], qh, sizeof(uint16_t) * head_dim);
#else
        for (int64_t d = 0; d < head_dim; d++) qs[g][d] = bf16_to_f32(qh[d]) * scale;
#endif
        memset(acc[g], 0, sizeof(float) * head_dim);
        m[g] = NEG_BIG;
        l[g] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t id = block_table[row * table_width + b];
        const uint16_t *kt = key_cache + id * block_stride + kv * head_stride;
        const uint16_t *v = value_cache + id * block_stride + kv * head_stride;
        const int64_t n = (b == blocks - 1) ? len - b * block_size : block_size;
        /* The block after this one in the thread's walk (the item's next, else its next item's
         * first) is requested while this one is computed: a whole block, one line per
         * iteration of the loops over this block's keys and values (a row of K^T per dimension,
         * a row of V per key), so that the requests flow with the work instead of a burst of
         * 256 that the core's miss buffers cannot hold. A partial block (the item's last) has
         * too few keys to spread the next block's values over; it requests them at once. */
        const uint16_t *next_k = NULL, *next_v = NULL;
        {
            int64_t nrow = row, nkv = kv, nb = b + 1;
            if (nb >= blocks) { nrow = (item + threads) / kv_heads; nkv = (item + threads) % kv_heads; nb = 0; }
            if (nrow < rows && nb * block_size < seq_lens[nrow]) {
                const int64_t nid = block_table[nrow * table_width + nb];
                next_k = key_cache + nid * block_stride + nkv * head_stride;
                next_v = value_cache + nid * block_stride + nkv * head_stride;
                if (n < block_size) {
                    prefetch_span(next_v, block_size * head_dim * 2);
                    next_v = NULL;
                }
            }
        }
#ifdef __AVX512BF16__
        for (int64_t t0 = 0; t0 < n; t0 += 64) {
            const int two = n - t0 > 32;
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t gn = group - g0 < 4 ? group - g0 : 4;
                switch (gn * 2 + two) {
                case 2: qk_pairs(1, 1, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                case 3: qk_pairs(1, 2, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                case 4: qk_pairs(2, 1, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                case 5: qk_pairs(2, 2, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                case 6: qk_pairs(3, 1, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                case 7: qk_pairs(3, 2, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                case 8: qk_pairs(4, 1, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                default: qk_pairs(4, 2, qp + g0, kt, t0, n, block_size, head_dim, scale, s + g0, next_k); break;
                }
                next_k = NULL;
            }
        }
#else
        for (int64_t t0 = 0; t0 < n; t0 += 4 * TILE) {
            const int64_t tn = (n - t0 + TILE - 1) / TILE < 4 ? (n - t0 + TILE - 1) / TILE : 4;
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t gn = group - g0 < 4 ? group - g0 : 4;
                switch (gn * 4 + tn) {
                case 5: qk_tile(1, 1, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 6: qk_tile(1, 2, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 7: qk_tile(1, 3, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 8: qk_tile(1, 4, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 9: qk_tile(2, 1, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 10: qk_tile(2, 2, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 11: qk_tile(2, 3, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 12: qk_tile(2, 4, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 13: qk_tile(3, 1, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 14: qk_tile(3, 2, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 15: qk_tile(3, 3, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 16: qk_tile(3, 4, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 17: qk_tile(4, 1, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 18: qk_tile(4, 2, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                case 19: qk_tile(4, 3, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                default: qk_tile(4, 4, qs + g0, kt, t0, block_size, head_dim, s + g0, next_k); break;
                }
                next_k = NULL;
            }
        }
#endif
        for (int64_t g = 0; g < group; g++) {
            float *sg = s[g];
            float block_max = NEG_BIG;
            for (int64_t t = 0; t < n; t++) block_max = sg[t] > block_max ? sg[t] : block_max;
            const float m_new = block_max > m[g] ? block_max : m[g];
            const float correction = expf(m[g] - m_new);
            float sum = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                sg[t] = expf(sg[t] - m_new);
                sum += sg[t];
            }
            l[g] = l[g] * correction + sum;
            m[g] = m_new;
            if (correction != 1.0f) {
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;
            }
        }
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            const int64_t gn = group - g0 < 4 ? group - g0 : 4;
            for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
                const int dv = (int)((head_dim - d0) / 16 < 4 ? (head_dim - d0) / 16 : 4);
                switch (gn * 4 + dv) {
                case 5: pv_tile(1, s + g0, v, n, head_dim, d0, 1, acc + g0, next_v); break;
                case 6: pv_tile(1, s + g0, v, n, head_dim, d0, 2, acc + g0, next_v); break;
                case 7: pv_tile(1, s + g0, v, n, head_dim, d0, 3, acc + g0, next_v); break;
                case 8: pv_tile(1, s + g0, v, n, head_dim, d0, 4, acc + g0, next_v); break;
                case 9: pv_tile(2, s + g0, v, n, head_dim, d0, 1, acc + g0, next_v); break;
                case 10: pv_tile(2, s + g0, v, n, head_dim, d0, 2, acc + g0, next_v); break;
                case 11: pv_tile(2, s + g0, v, n, head_dim, d0, 3, acc + g0, next_v); break;
                case 12: pv_tile(2, s + g0, v, n, head_dim, d0, 4, acc + g0, next_v); break;
                case 13: pv_tile(3, s + g0, v, n, head_dim, d0, 1, acc + g0, next_v); break;
                case 14: pv_tile(3, s + g0, v, n, head_dim, d0, 2, acc + g0, next_v); break;
                case 15: pv_tile(3, s + g0, v, n, head_dim, d0, 3, acc + g0, next_v); break;
                case 16: pv_tile(3, s + g0, v, n, head_dim, d0, 4, acc + g0, next_v); break;
                case 17: pv_tile(4, s + g0, v, n, head_dim, d0, 1, acc + g0, next_v); break;
                case 18: pv_tile(4, s + g0, v, n, head_dim, d0, 2, acc + g0, next_v); break;
                case 19: pv_tile(4, s + g0, v, n, head_dim, d0, 3, acc + g0, next_v); break;
                default: pv_tile(4, s + g0, v, n, head_dim, d0, 4, acc + g0, next_v); break;
                }
                next_v = NULL;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        uint16_t *o = out + (row * num_heads + kv * group + g) * head_dim;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[g][d] * inv);
    }
}
#endif

/* q [rows, num_heads, head_dim] (row and head strides given, last dim contiguous); out likewise,
 * contiguous; block_table [rows, table_width] int32; seq_lens [rows] int32 (a row's keys are
 * positions 0 .. seq_len - 1, its own just written). */
void ttserve_decode_attention(const uint16_t *q, int64_t q_row_stride, int64_t q_head_stride,
                              const uint16_t *key_cache, const uint16_t *value_cache,
                              int64_t block_stride, int64_t head_stride, uint16_t *out,
                              const int32_t *block_table, int64_t table_width, const int32_t *seq_lens,
                              int64_t rows, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                              int64_t block_size, float scale) {
#ifdef __AVX512F__ /* else never called: vector_bits() says 0 and decode_attention.py refuses */
    const int64_t items = rows * kv_heads;
#pragma omp parallel
    {
        /* Items dealt round-robin: a row's KV heads go to different threads, so rows of unequal
         * length spread (cpu_kernels.Attention.plan leaves a step whose longest row outweighs the
         * rest to vLLM's kernel, which splits a row's keys). */
        const int64_t threads = omp_get_num_threads();
        for (int64_t item = omp_get_thread_num(); item < items; item += threads)
            attend_item(q, q_row_stride, q_head_stride, key_cache, value_cache, block_stride, head_stride, out,
                        block_table, table_width, seq_lens, rows, num_heads, kv_heads, head_dim, block_size,
                        scale, item, threads);
    }
#endif
}
