"""The worker's host heap under glibc: trimmed once after the model loads, then kept.

After the load: loading converts the checkpoint tensor by tensor (float32 on disk to the serving
dtype); glibc keeps the freed float32 buffers in its heap, resident, unless asked to trim.
Measured on SmolLM2 in bf16: ~25 MB of the worker's RSS, for one call at start-up.

While serving: every step allocates and frees the same buffers again (the logits, 6.3 MB at 32
rows of a 49,152-token vocabulary, their float32 and sampled copies, the kernels' scratch, a
prefill's activations). glibc's defaults hand them back to the OS between steps (a buffer above
the mmap threshold is unmapped when freed; a heap top above the trim threshold is trimmed, and
both thresholds only follow what was freed so far), and the next step faults every page in
again, zeroed. Measured on the 2-core EPYC, SmolLM2 bf16 served at c=32 (96 requests, 128 -> 64
tokens): 1.27-1.30M minor faults, ~4,300 a decode step and ~8,800 a prefill step, the worker
51-54 CPU s; with the buffers kept, 0.16M (the KV cache's pages, touched once as blocks are first
written), 47-50 CPU s, and the worker's RSS after the load 18 MiB higher. Output tok/s, three
alternating rounds kept / not: 0.93, 1.04, 1.04 at c=32, 1.04, 1.12, 1.01 at c=8.
"""
from __future__ import annotations

import os

from ttserve.malloc_arenas import libc_function

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on a 64-bit host (HEAP_MAX_SIZE / 2): a buffer at or
# above it is still mapped and unmapped per use (none of SmolLM2's; a larger model's prefill
# activations can be).
KEPT_BUFFER_BYTES = 32 << 20
# The free heap top kept: several steps' transients, so that no step gives pages back.
KEPT_FREE_TOP_BYTES = 256 << 20
# An operator's own settings of either, which win.
_OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def release_free_heap() -> bool:
    """malloc_trim(0) where the C library has it (glibc); False elsewhere (musl, macOS)."""
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def keep_step_buffers() -> bool:
    """Keeps freed buffers up to KEPT_BUFFER_BYTES in the heap and KEPT_FREE_TOP_BYTES of free
    heap top resident (mallopt, which also ends glibc's dynamic mmap threshold); True when set.
    Left alone where an operator set a threshold (MALLOC_*_ or GLIBC_TUNABLES glibc.malloc.*)
    or the C library has no mallopt (musl, macOS)."""
    if any(name in os.environ for name in _OPERATOR_SETTINGS) or "glibc.malloc." in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEPT_BUFFER_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                KEPT_FREE_TOP_BYTES))
