"""ttserve's own paged causal attention for prefill chunks in bfloat16 on a CPU
(prefill_attention.c), built on the host that runs it.

Why: vLLM CPU's kernel ("vec" ISA, no AMX) scores and weighs in float32 FMAs, 88-145 GFLOP/s on
the 2-core EPYC, where the bfloat16 pair products (VDPBF16PS) that ttserve's GEMMs run at ~400
could do the same work. Measured on SmolLM2's heads (9 query / 3 KV, head_dim 64, blocks of
64), 30 layers, each with vLLM's KV write (benchmarks/prefill_attention.py): 1.65-1.75x vLLM's
kernel at 4 and 8 prompts of 128 tokens (~160 against ~95 GFLOP/s), 1.8-1.9x for a 512-token
chunk over 512-4,096 tokens of context (~260 against ~145); SmolLM2's prefill step of such a chunk
1.36x as fast at 2,048 tokens, 1.52x at 4,096.

Where: the model decides once, at allocate_kv_cache, whether its prefill steps may use it
(`unavailable()`: this host, the dtype, the shapes, the cache layout);
cpu_kernels.Attention.plan decides per step whether a step has the work items to fill the
threads. Batch invariance keeps vLLM's kernel (its bits per row are the contract there).

Built and loaded by native_build.py. Without a compiler, a writable cache, AVX512-BF16 or torch
on that one OpenMP runtime, `unavailable()` says why and vLLM's kernel serves every step.
TTSERVE_PREFILL_ATTENTION=vllm turns it off (an A/B switch for benchmarks).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import vllm_cache_layout

SOURCE = Path(__file__).with_name("prefill_attention.c")
OFF_SWITCH = "TTSERVE_PREFILL_ATTENTION"
_I, _P = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float]

_kernel: ctypes._CFuncPtr | None = None
_limits: vllm_cache_layout.Limits = (0, 0, 0)  # its first: query vectors per work item
_why: str | None = None  # None: not tried; "": loaded; else why not


def _load() -> str:
    """Builds and loads the kernel once per process; "" when it serves, else why not."""
    global _kernel, _limits, _why
    if _why is not None:
        return _why
    loaded = vllm_cache_layout.load_kernel(SOURCE, OFF_SWITCH, "ttserve_prefill_attention_available",
                                           "this CPU has no AVX512-BF16 (the kernel's only path)",
                                           "ttserve_prefill_attention_limits")
    if isinstance(loaded, str):
        _why = loaded
        return _why
    library, _limits = loaded
    _kernel = library.ttserve_prefill_attention
    _kernel.argtypes, _kernel.restype = _ARGTYPES, ctypes.c_int
    _why = ""
    return _why


def unavailable(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                kernel_isa: str) -> str:
    """Why the kernel cannot run this attention, on a cache vLLM's `kernel_isa` kernel lays out,
    here; "" when it can."""
    why = vllm_cache_layout.unreadable(dtype, kernel_isa) or _load()
    return why or vllm_cache_layout.shape_refusal(num_heads, num_kv_heads, head_dim, block_size, *_limits,
                                                  block_multiple=32)


def fills_threads(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                  threads: int) -> bool:
    """Whether the kernel's work items (row, KV head, tile of queries) keep `threads` threads busy
    on this step: at least two items a thread, and no item above half a thread's share of the
    work (queries times the keys each sees), so that taking the costliest first ends the step
    within 1.5 shares. A few queries of one long row fail the second (vLLM's kernel splits the
    row's keys over the threads instead)."""
    group = num_heads // num_kv_heads
    tile = max(1, _limits[0] // group)  # prefill_attention.c's queries per item
    items = sum(-(-q // tile) for q in query_lens) * num_kv_heads
    total = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens)) * num_kv_heads
    costliest = max((min(q, tile) * s for q, s in zip(query_lens, seq_lens) if q), default=0)
    return items >= 2 * threads and costliest * 2 * threads <= total


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      scale: float) -> None:
    """out[t] = softmax(q[t] K_r^T * scale) V_r over the keys of row r up to token t's own
    position, for every token t of row r's chunk (query_start_loc[r] .. [r + 1]), the chunk being
    the last tokens of its seq_lens[r]: q [tokens, heads, head_dim] (last dim contiguous), out
    contiguous, the caches vLLM CPU's [blocks, kv_heads, block_size, head_dim] views;
    block_table, seq_lens and query_start_loc contiguous int32. unavailable() must have said ""
    for these shapes."""
    if _kernel is None:
        raise RuntimeError("prefill_attention.unavailable() must say \"\" first")
    _, heads, head_dim = q.shape
    rows = seq_lens.shape[0]
    # What the C code trusts (the table's width against the rows' lengths is
    # cpu_kernels.Attention.plan's check, once a step).
    if not (q.stride(2) == 1 and out.is_contiguous() and out.shape == q.shape and block_table.is_contiguous()
            and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
            and block_table.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
            and block_table.shape[0] >= rows and query_start_loc.shape[0] == rows + 1
            and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1):
        raise ValueError("prefill_attention: inputs of another layout than the kernel reads")
    if _kernel(q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
               key_cache.stride(0), key_cache.stride(1), out.data_ptr(), block_table.data_ptr(),
               block_table.shape[1], seq_lens.data_ptr(), query_start_loc.data_ptr(), rows, heads,
               key_cache.shape[1], head_dim, key_cache.shape[2], scale) != 0:
        raise MemoryError("prefill_attention: no host memory for the step's work plan")
