/* y = x W^T (+ b) in bfloat16 on a CPU with AVX512-BF16, from a weight packed once at load.
 *
 * Packed layout (bf16_gemm.py packs it): the [n, k] weight, padded with zeros to whole tiles of
 * 32 outputs and an even k, as [n / 32][k / 2][32][2]: per tile, per pair of inputs, the 32
 * outputs' two weights side by side. That is the operand order of VDPBF16PS, so one 64-byte load
 * is 16 outputs' products for two inputs and the accumulators hold outputs, never partial dot
 * products (no horizontal sums); and a tile is one contiguous stream, 128 bytes per input pair,
 * which the hardware prefetcher follows. A decode step reads every weight once: with a few rows
 * the GEMM is bound by that read, and this layout keeps it there (bf16_gemm.py has the figures).
 *
 * Work: items are (tile, block of up to ROWS rows) pairs, tile-major, and each thread starts on a
 * contiguous share of them (work_shares.h: a thread off its core mid-share has the rest of its
 * share taken by the others), in chunks of at most one tile's row blocks: a tile's weight, once
 * read, serves its next row blocks from the thread's cache, and a prefill's row blocks spread over
 * threads where the tiles alone are too few (576 outputs are 18 tiles). A decode step's items are
 * its tiles. A block's rows are in registers (2 accumulators per row, the weight loaded once for
 * them). (Chunking a prefill's rows so that each chunk's inputs stay in L2 while every tile passes
 * over them measured no faster at 2048 rows on the 2-core EPYC: its L3 serves them.) A row's
 * outputs are summed in one order, input pair after input pair, whatever the number of rows or
 * threads: a row's bits never depend on the other rows of the GEMM (batch invariant).
 * Between one row block and a prefill's many, a GEMM is bound by neither the weight read nor the
 * arithmetic alone but by their sum: a tile's first block waits on memory, its others on the
 * FMA units. So from 2 to 8 blocks, the first block of each tile prefetches the next tile (the
 * next item of the thread's share, usually) into L2 as it goes, two lines per input pair: on the
 * 2-core EPYC, SmolLM2's layers took 5-15% less time at 24-48 rows (16 rows: 12 + 4, no worse),
 * none at 1-12 rows (one block: nothing to overlap) or 128 (compute-bound; the prefetched tile
 * would wait in L2 behind many blocks' activations).
 * Accumulation is float32 (VDPBF16PS: products of bfloat16 pairs added to float32, subnormal
 * inputs and results as zero), the bias is added in float32, and the result is rounded to
 * bfloat16 to nearest even, once (VCVTNE2PS2BF16: subnormal results as zero).
 *
 * Epilogues: PLAIN stores the n outputs. GLU_* (a gated MLP's gate and up projections in one
 * GEMM) read a weight whose tiles are 16 gate outputs then the same 16 up outputs, and store
 * act(gate) * up in float32 rounded once, n / 2 outputs, act silu or gelu with tanh: the
 * [rows, intermediate] activations are written once.
 *
 * Compiled by bf16_gemm.py (native_build.py) with -O3 -march=native -ffast-math -fopenmp, linked
 * without -ffast-math; OpenMP from the libgomp torch has loaded.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "work_shares.h"

#define TILE_N 32
#define ROWS 12 /* rows per register pass: 24 accumulators, 2 weight vectors, a broadcast */
#define PREFETCH_MAX_BLOCKS 8 /* rows up to 96: the next tile stays in L2 until its turn */

enum { PLAIN = 0, GLU_SILU = 1, GLU_GELU_TANH = 2 };

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* e^x, float32, ~1e-7 relative: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-6
 * Taylor polynomial. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load_bias16(const uint16_t *bias, int64_t at, int64_t n) {
    if (!bias || at >= n)
        return _mm512_setzero_ps();
    const __mmask16 valid = n - at >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - at)) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(valid, bias + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* MR (a literal at every call: the loops unroll, the accumulators stay in registers) rows of x
 * through one tile. */
static inline __attribute__((always_inline)) void tile_rows(
    const int MR, const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
    uint16_t *y, int64_t y_stride, int64_t tile, int64_t n, int64_t k, int epilogue, const uint16_t *next) {
    __m512 a0[ROWS], a1[ROWS];
    for (int m = 0; m < MR; m++) {
        a0[m] = _mm512_setzero_ps();
        a1[m] = _mm512_setzero_ps();
    }
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * TILE_N);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 2 * TILE_N + TILE_N);
        if (next) { /* the next tile's two lines for this pair, into L2 */
            __builtin_prefetch((const char *)(next + p * 2 * TILE_N), 0, 2);
            __builtin_prefetch((const char *)(next + p * 2 * TILE_N) + 64, 0, 2);
        }
        for (int m = 0; m < MR; m++) {
            int32_t pair; /* two bf16 inputs; memcpy: x is 2-byte aligned and not an int32 object */
            memcpy(&pair, x + m * x_stride + 2 * p, sizeof pair);
            const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            a0[m] = _mm512_dpbf16_ps(a0[m], w0, b);
            a1[m] = _mm512_dpbf16_ps(a1[m], w1, b);
        }
    }
    if (epilogue != PLAIN) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int m = 0; m < MR; m++) {
            const __m512 g = a0[m];
            __m512 act;
            if (epilogue == GLU_SILU) { /* g / (1 + e^-g) */
                act = _mm512_div_ps(g, _mm512_add_ps(one, exp512(-g)));
            } else { /* g/2 (1 + tanh(z)) = g / (1 + e^-2z), z = sqrt(2/pi) (g + 0.044715 g^3): no cancellation */
                const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                               _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g),
                                                               _mm512_mul_ps(g, g), g));
                act = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), z))));
            }
            const __m512 h = _mm512_mul_ps(act, a1[m]);
            _mm256_storeu_si256((__m256i *)(y + m * y_stride + tile * (TILE_N / 2)), (__m256i)_mm512_cvtneps_pbh(h));
        }
        return;
    }
    const int64_t at = tile * TILE_N;
    const __m512 b0 = load_bias16(bias, at, n), b1 = load_bias16(bias, at + 16, n);
    const __mmask32 valid = n - at >= TILE_N ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (n - at)) - 1);
    for (int m = 0; m < MR; m++) {
        const __m512i out = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(a1[m], b1), _mm512_add_ps(a0[m], b0));
        _mm512_mask_storeu_epi16(y + m * y_stride + at, valid, out);
    }
}

static void row_block(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t y_stride, int64_t rows, int64_t tile, int64_t n, int64_t k, int epilogue,
                      const uint16_t *next) {
    switch (rows < ROWS ? rows : ROWS) {
#define CASE(MR) case MR: tile_rows(MR, x, x_stride, w, bias, y, y_stride, tile, n, k, epilogue, next); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
    }
}
#endif

/* 512 when this build has the AVX512-BF16 path, else 0 (bf16_gemm.py then refuses). */
int ttserve_bf16_gemm_vector_bits(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 512;
#else
    return 0;
#endif
}

int64_t ttserve_bf16_gemm_tile(void) { return TILE_N; }

/* x [rows][k] (row stride x_stride elements, k even), packed [ceil(n / 32)][k / 2][32][2], bias
 * [n] or NULL (PLAIN only), y [rows][n] (GLU_*: n / 2, n a multiple of 32) at row stride y_stride. */
void ttserve_bf16_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                       uint16_t *y, int64_t y_stride, int64_t rows, int64_t n, int64_t k, int epilogue) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int64_t tiles = (n + TILE_N - 1) / TILE_N, blocks = (rows + ROWS - 1) / ROWS;
    /* Chunks of about an eighth of a thread's share, at most one tile's row blocks. */
    const int64_t items = tiles * blocks;
    int64_t chunk = items / (8 * omp_get_max_threads());
    chunk = chunk < 1 ? 1 : chunk > blocks ? blocks : chunk;
    /* Whether each tile's first block prefetches the next tile (the top says when). */
    const int prefetch = blocks >= 2 && blocks <= PREFETCH_MAX_BLOCKS;
    work_shares shares;
    shares_init(&shares, items, chunk);
#pragma omp parallel
    {
        int64_t from = 0, lo, hi;
        while (shares_take(&shares, &from, &lo, &hi))
            for (int64_t item = lo; item < hi; item++) {
                const int64_t tile = item / blocks, b = item % blocks, r = b * ROWS;
                const uint16_t *next = prefetch && b == 0 && tile + 1 < tiles ? packed + (tile + 1) * k * TILE_N : NULL;
                row_block(x + r * x_stride, x_stride, packed + tile * k * TILE_N, bias, y + r * y_stride, y_stride,
                          rows - r, tile, n, k, epilogue, next);
            }
    }
#endif
}
