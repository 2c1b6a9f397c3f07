/* A decode step's decoder layers in one call, for a Llama-family model in bfloat16 on a CPU with
 * AVX512-BF16: what llama.py's kernel path runs layer by layer as ~10 operator calls each (300 a
 * step for SmolLM2's 30 layers), here without a Python or dispatcher hop between them.
 *
 * Per layer: the q/k/v GEMM (bf16_gemm.c, with the projections' bias if any); neox RoPE of q and
 * k at each row's position from the model's cos/sin table; the row's k and v written into the
 * paged KV cache at its slot, in the layout vLLM CPU's cpu_attn_reshape_and_cache writes for its
 * "vec"/"vec16" kernels (per (block, KV head): keys transposed [head_dim][block_size], then
 * values [block_size][head_dim]); paged attention over the row's context (decode_attention.c);
 * the o GEMM; the residual add and RMSNorm; the gated MLP's gate/up GEMM with silu in its
 * epilogue and its down GEMM; the residual add and the next layer's (or the final) RMSNorm.
 *
 * Numerics are the bits of the operators it replaces, mirrored from vLLM CPU's source
 * (csrc/cpu/pos_encoding.cpp and layernorm.cpp, vLLM 0.32) as GCC compiles it (clang ignores the
 * optimize attributes below: the same results to rounding, not to the bit): float32 inside
 * every op, bfloat16 between them (rounded to nearest even), a product added to a sum contracted
 * to one FMA, no other reassociation (those two functions are built without -ffast-math). RoPE:
 * x1 cos - x2 sin and x2 cos + x1 sin from bfloat16 cos and sin. Add-and-RMSNorm: the residual
 * becomes the bfloat16 sum; the squares of the float32 sums accumulate in 8 lanes (lane i: elements
 * i, i + 8, ...) added in lane order; the output is the stored residual times 1/sqrt(mean + eps)
 * times the weight. With ttserve's decode attention on both paths (3+ rows on 2 threads), a step
 * here and operator by operator give the same logits and KV cache bit for bit
 * (tests/test_decode_step.py). Every op is per row, so a row's bits never depend on the other
 * rows of the step. The GEMMs are OpenMP-parallel; RoPE, the cache writes and the attention are
 * one parallel loop over (row, KV head) items (split by work_shares.h, as the GEMMs are), so the
 * writes run on every thread and the lines they dirty are in cache when the same item's attention
 * reads them (at 32 rows on one thread, the transposed keys' scattered writes into cold lines took
 * 4.3 of a 48 ms step; per item, the three together went from 14.5 to 10.7 ms). The norms (a few
 * thousand elements a row) run on the calling thread.
 *
 * Compiled by decode_step.py (native_build.py) like the two kernels it includes.
 */
#include "bf16_gemm.c"
#include "decode_attention.c"

/* The int64 fields of one layer in the table the caller passes: addresses, 0 for none. */
enum { F_QKV, F_QKV_BIAS, F_O, F_O_BIAS, F_GATE_UP, F_DOWN, F_POST_NORM, F_NEXT_NORM, F_KEYS, F_VALUES, F_FIELDS };

int64_t ttserve_decode_step_fields(void) { return F_FIELDS; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* vLLM CPU's ops as GCC builds them: no -ffast-math, a product and a sum contracted to an FMA. */
#define AS_VLLM_BUILDS __attribute__((optimize("no-fast-math", "fp-contract=fast")))

static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

AS_VLLM_BUILDS static void rope_neox(uint16_t *x, int64_t heads, int64_t head_dim, const uint16_t *cos_sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *xh = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = bf16_to_f32(xh[i]), x2 = bf16_to_f32(xh[half + i]);
            const float c = bf16_to_f32(cos_sin[i]), s = bf16_to_f32(cos_sin[half + i]);
            xh[i] = f32_to_bf16(x1 * c - x2 * s);
            xh[half + i] = f32_to_bf16(x2 * c + x1 * s);
        }
    }
}

/* One KV head's key k and value v of one token into its slot. */
static void write_kv(const uint16_t *k, const uint16_t *v, uint16_t *keys, uint16_t *values, int64_t slot,
                     int64_t block_size, int64_t block_stride, int64_t head_stride, int64_t head,
                     int64_t head_dim) {
    const int64_t block = slot / block_size, at = slot % block_size;
    uint16_t *kt = keys + block * block_stride + head * head_stride;
    for (int64_t d = 0; d < head_dim; d++) kt[d * block_size + at] = k[d];
    memcpy(values + block * block_stride + head * head_stride + at * head_dim, v, sizeof(uint16_t) * head_dim);
}

/* residual += x (rounded to bfloat16); x = RMSNorm(residual) * weight; n a multiple of 8. The sum
 * of squares in vLLM CPU's order (layernorm.cpp with BF16Vec8/FP32Vec8): 8 lanes, lane i over
 * elements i, i + 8, ..., then the lanes in order; the division and square root exact. */
AS_VLLM_BUILDS static void add_rms_norm(uint16_t *x, uint16_t *residual, const uint16_t *weight, int64_t n,
                                        float eps) {
    __m256 squares = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 r = _mm256_add_ps(load_bf16x8(x + i), load_bf16x8(residual + i));
        squares = _mm256_add_ps(squares, _mm256_mul_ps(r, r));
        _mm_storeu_si128((__m128i *)(residual + i), (__m128i)_mm256_cvtneps_pbh(r));
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, squares);
    for (int i = 0; i < 8; i++) total += lanes[i];
    const __m256 inverse = _mm256_set1_ps(1.0f / sqrtf(total / (float)n + eps));
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 out = _mm256_mul_ps(_mm256_mul_ps(load_bf16x8(residual + i), inverse), load_bf16x8(weight + i));
        _mm_storeu_si128((__m128i *)(x + i), (__m128i)_mm256_cvtneps_pbh(out));
    }
}

#endif

/* A decode batch's paging for the step below, from the caller's whole batch in one call (what
 * llama.py's general plan computes in ~25 operator calls, ~1 ms of a ~10 ms one-row step once
 * the step's weights have swept the caches): of `rows` rows, the live ones (position >= 0) in row
 * order into live[]; for each, its token, position, cache slot and context length (position + 1);
 * and the live rows' block table, *width entries a row (the most blocks a live row reads): the
 * page table's entries, those past a row's own blocks as block 0 (never read: the attention stops
 * at the context). page_table [rows][stride] int32; block_table room for rows * stride entries.
 * Returns the number of live rows; -1 when a position is at or past max_seq_len, -2 when a block
 * a row reads is outside [0, cache_blocks), -3 when a row needs more than `stride` blocks: the
 * caller takes its general path, which says which. */
int64_t ttserve_decode_paging(int64_t rows, const int64_t *tokens, const int64_t *positions,
                              const int32_t *page_table, int64_t stride, int64_t block_size, int64_t cache_blocks,
                              int64_t max_seq_len, int64_t *live, int64_t *live_tokens, int64_t *live_positions,
                              int64_t *slots, int32_t *seq_lens, int32_t *block_table, int64_t *width) {
    int64_t n = 0, most = 1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = positions[r];
        if (pos < 0)
            continue;
        if (pos >= max_seq_len)
            return -1;
        const int64_t needed = pos / block_size + 1;
        if (needed > stride)
            return -3;
        const int32_t *pt = page_table + r * stride;
        for (int64_t b = 0; b < needed; b++)
            if (pt[b] < 0 || pt[b] >= cache_blocks)
                return -2;
        most = needed > most ? needed : most;
        live[n] = r;
        live_tokens[n] = tokens[r];
        live_positions[n] = pos;
        slots[n] = (int64_t)pt[pos / block_size] * block_size + pos % block_size;
        seq_lens[n] = (int32_t)(pos + 1);
        n++;
    }
    for (int64_t i = 0; i < n; i++) {
        const int32_t *pt = page_table + live[i] * stride;
        const int64_t needed = live_positions[i] / block_size + 1;
        for (int64_t b = 0; b < most; b++)
            block_table[i * most + b] = b < needed ? pt[b] : 0;
    }
    *width = most;
    return n;
}

/* h [rows][hidden]: layer 0's normed input on entry, the final norm's output on return; residual
 * [rows][hidden] the residual stream (the embeddings on entry); scratch at least rows * (q/k/v
 * width + heads * head_dim + hidden + intermediate) elements. layers [num_layers][F_FIELDS];
 * positions, slots [rows] int64; block_table [rows][table_width] and seq_lens [rows] int32 (the
 * context after this step); cos_sin [positions][head_dim]; the KV views' block and head strides
 * in elements. gate_up_width: the gated GEMM's packed outputs (2 x intermediate). */
void ttserve_decode_step(const int64_t *layers, int64_t num_layers, uint16_t *h, uint16_t *residual,
                         uint16_t *scratch, int64_t rows, int64_t hidden, int64_t num_heads, int64_t kv_heads,
                         int64_t head_dim, int64_t intermediate, int64_t gate_up_width, const int64_t *positions,
                         const int64_t *slots, const int32_t *block_table, int64_t table_width,
                         const int32_t *seq_lens, const uint16_t *cos_sin, int64_t block_size,
                         int64_t block_stride, int64_t head_stride, float eps, float scale) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int64_t q_width = num_heads * head_dim, kv_width = kv_heads * head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width, group = num_heads / kv_heads;
    uint16_t *qkv = scratch, *attended = qkv + rows * qkv_width, *a = attended + rows * q_width;
    uint16_t *gated = a + rows * hidden;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *f = layers + l * F_FIELDS;
        uint16_t *keys = (uint16_t *)f[F_KEYS], *values = (uint16_t *)f[F_VALUES];
        ttserve_bf16_gemm(h, hidden, (const uint16_t *)f[F_QKV], (const uint16_t *)f[F_QKV_BIAS], qkv, qkv_width,
                          rows, qkv_width, hidden, PLAIN);
        /* Per (row, KV head) item, on the thread that then attends with them: RoPE of the item's
         * query heads and key, the key and value into the cache (written lines stay in that
         * thread's cache for the attention that reads them next), then attention. An item's
         * heads are its own: no two items write the same element. */
        work_shares shares;
        shares_init(&shares, rows * kv_heads, 1);
#pragma omp parallel
        {
            int64_t from = 0, item, end; /* chunks of one item: end is item + 1 */
            while (shares_take(&shares, &from, &item, &end)) {
                const int64_t r = item / kv_heads, kv = item % kv_heads;
                uint16_t *row = qkv + r * qkv_width;
                uint16_t *k = row + q_width + kv * head_dim, *v = row + q_width + kv_width + kv * head_dim;
                const uint16_t *table = cos_sin + positions[r] * head_dim;
                rope_neox(row + kv * group * head_dim, group, head_dim, table);
                rope_neox(k, 1, head_dim, table);
                write_kv(k, v, keys, values, slots[r], block_size, block_stride, head_stride, kv, head_dim);
                attend_item(qkv, qkv_width, head_dim, keys, values, block_stride, head_stride, attended, block_table,
                            table_width, seq_lens, rows, num_heads, kv_heads, head_dim, block_size, scale, item,
                            1);
            }
        }
        ttserve_bf16_gemm(attended, q_width, (const uint16_t *)f[F_O], (const uint16_t *)f[F_O_BIAS], a, hidden,
                          rows, hidden, q_width, PLAIN);
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm(a + r * hidden, residual + r * hidden, (const uint16_t *)f[F_POST_NORM], hidden, eps);
        ttserve_bf16_gemm(a, hidden, (const uint16_t *)f[F_GATE_UP], NULL, gated, intermediate, rows, gate_up_width,
                          hidden, GLU_SILU);
        ttserve_bf16_gemm(gated, intermediate, (const uint16_t *)f[F_DOWN], NULL, h, hidden, rows, hidden,
                          intermediate, PLAIN);
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm(h + r * hidden, residual + r * hidden, (const uint16_t *)f[F_NEXT_NORM], hidden, eps);
    }
#endif
}
