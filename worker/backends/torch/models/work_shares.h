/* Splitting a parallel loop's items over OpenMP threads so that a thread the OS takes off its core
 * does not stall the others.
 *
 * Why: a worker's OpenMP threads are as many as its cores, and on a small host the gateway, the
 * control plane and the worker's own gRPC thread wake on the same cores during every step. Split
 * in fixed shares, a thread preempted mid-share leaves its peers waiting at the region's barrier
 * until it is scheduled again. Here each thread still starts with its own contiguous share (one
 * weight stream per thread, as the fixed split had), claiming it chunk by chunk from a counter on
 * its own cache line (uncontended), and a thread whose share is done claims the chunks left in
 * the others' shares from the same counters: a preempted thread holds up its peers by at most the
 * chunk it is in. SmolLM2's decode step (150 parallel regions), fixed split -> these shares,
 * medians of 30-40 alternating steps in one process on the 2-core EPYC (GOMP_SPINCOUNT 10,000):
 * beside a process busy 3 ms in every 15, 32 rows at 160 tokens of context 47.9 -> 41.7 and
 * 44.8 -> 42.9 ms, at 1,000 tokens 74.7 -> 65.4 ms; alone, 32 rows 33.9 -> 33.3 and 32.6 -> 32.4
 * ms, one row 9.5 -> 9.0 and 10.1 -> 9.9 ms; SmolLM2's prefill GEMMs at 1,024 rows 535 -> 527 ms.
 *
 * Which thread computes an item never changes what the item computes: kernels whose items write
 * disjoint outputs keep their bits (a GEMM's row blocks, attention's (row, KV head) items).
 */
#ifndef TTSERVE_WORK_SHARES_H
#define TTSERVE_WORK_SHARES_H

#include <omp.h>
#include <stdint.h>

#define SHARES_MAX_THREADS 256

typedef struct {
    int64_t next; /* the share's next unclaimed chunk */
    int64_t end;  /* one past its last */
} __attribute__((aligned(64))) work_share; /* a cache line each: an owner's claims do not contend with its peers' */

typedef struct {
    work_share share[SHARES_MAX_THREADS];
    int64_t threads, items, chunk;
} work_shares;

/* Before the parallel region: `items` in chunks of `chunk`, in contiguous shares, one per thread
 * the region will have (omp_get_max_threads(); a region given fewer threads still runs every
 * chunk, the absent threads' shares claimed by the present ones). */
static inline void shares_init(work_shares *s, int64_t items, int64_t chunk) {
    int64_t threads = omp_get_max_threads();
    if (threads > SHARES_MAX_THREADS) threads = SHARES_MAX_THREADS;
    if (threads < 1) threads = 1;
    const int64_t chunks = chunk > 0 ? (items + chunk - 1) / chunk : 0;
    s->threads = threads;
    s->items = items;
    s->chunk = chunk;
    for (int64_t t = 0; t < threads; t++) {
        s->share[t].next = chunks * t / threads;
        s->share[t].end = chunks * (t + 1) / threads;
    }
}

/* Inside the region: the next [*lo, *hi) of items for the calling thread, 0 once every share is
 * claimed. *from, 0 at the first call, is how far the thread has walked from its own share to
 * the others' (in turn after it). */
static inline int shares_take(work_shares *s, int64_t *from, int64_t *lo, int64_t *hi) {
    const int64_t own = omp_get_thread_num() % s->threads;
    for (; *from < s->threads; (*from)++) {
        work_share *share = &s->share[(own + *from) % s->threads];
        if (__atomic_load_n(&share->next, __ATOMIC_RELAXED) >= share->end) continue;
        const int64_t c = __atomic_fetch_add(&share->next, 1, __ATOMIC_RELAXED);
        if (c >= share->end) continue;
        *lo = c * s->chunk;
        *hi = *lo + s->chunk < s->items ? *lo + s->chunk : s->items;
        return 1;
    }
    return 0;
}

#endif
