"""ttserve's own paged decode attention for bfloat16 on a CPU (decode_attention.c), built on the
host that runs it.

Why: at 8 rows and more, a decode step's attention reads every row's whole context from a cache
that the layer's weights have just evicted, and vLLM CPU's kernel reads that cold cache at ~5 GB/s
per thread (one block after another), a third of what the memory system serves. On the 2-core
EPYC, SmolLM2's heads, 30 layers, vLLM's kernel -> ttserve's (each with vLLM's KV write, as the
operator path runs it; benchmarks/decode_attention.py): 32 rows x 200 tokens 565 -> 326 us a
layer, 32 x 1000 2447 -> 1055, 8 x 200 134 -> 88, 8 x 1000 730 -> 338. Attention was 38% of a
32-row SmolLM2 step. What made the difference, each measured alone (32 x 160 and 32 x 1000, the
kernel only, cold): requesting the next block into L2 rather than L1 (prefetcht1; the L1's miss
buffers drop or stall a burst of 256 requests) and spreading the requests over the block's work,
1.3-1.5x; the query-key products as bfloat16 pairs (VDPBF16PS) instead of converting every key to
float32, 1.1-1.25x.

Where: the model decides once, at allocate_kv_cache, whether its decode steps may use it
(`unavailable()`: this host, the dtype, the shapes, the cache layout); cpu_kernels.Attention.plan
decides per step whether a step fills the threads (its docstring). The keys and values are vLLM's
cache, written by vLLM's cpu_attn_reshape_and_cache.

Built and loaded by native_build.py (the host's C compiler, ttserve's cache, torch's OpenMP).
Without a compiler, a writable cache, an AVX-512 CPU or torch on that one OpenMP runtime,
`unavailable()` says why and vLLM's kernel serves every step. TTSERVE_DECODE_ATTENTION=vllm
turns it off (an A/B switch for benchmarks).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import native_build, vllm_cache_layout


SOURCE = Path(__file__).with_name("decode_attention.c")
OFF_SWITCH = "TTSERVE_DECODE_ATTENTION"
_I, _P = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float]

_kernel: ctypes._CFuncPtr | None = None
_limits: vllm_cache_layout.Limits = (0, 0, 0)
_why: str | None = None  # None: not tried; "": loaded; else why not


def _load() -> str:
    """Builds and loads the kernel once per process; "" when it serves, else why not."""
    global _kernel, _limits, _why
    if _why is not None:
        return _why
    loaded = vllm_cache_layout.load_kernel(SOURCE, OFF_SWITCH, "ttserve_decode_attention_vector_bits",
                                           "this CPU has no AVX-512 (the kernel's only vector path)",
                                           "ttserve_decode_attention_limits")
    if isinstance(loaded, str):
        _why = loaded
        return _why
    library, _limits = loaded
    _kernel = native_build.void_function(library, "ttserve_decode_attention", _ARGTYPES)
    _why = ""
    return _why


def unavailable(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                kernel_isa: str) -> str:
    """Why the kernel cannot run this attention, on a cache vLLM's `kernel_isa` kernel lays out,
    here; "" when it can."""
    why = vllm_cache_layout.unreadable(dtype, kernel_isa) or _load()
    return why or vllm_cache_layout.shape_refusal(num_heads, num_kv_heads, head_dim, block_size, *_limits,
                                                  block_multiple=16)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> None:
    """out[r] = softmax(q[r] K_r^T * scale) V_r over row r's seq_lens[r] keys, through its
    block_table row: q [rows, heads, head_dim] (last dim contiguous), out contiguous, the caches
    vLLM CPU's [blocks, kv_heads, block_size, head_dim] views; block_table and seq_lens
    contiguous int32. unavailable() must have said "" for these shapes."""
    if _kernel is None:
        raise RuntimeError("decode_attention.unavailable() must say \"\" first")
    rows, heads, head_dim = q.shape
    # What the C code trusts, about a microsecond a call. (The table's width against the rows'
    # lengths is cpu_kernels.Attention.plan's check, once a step.)
    if not (q.stride(2) == 1 and out.is_contiguous() and out.shape == q.shape and block_table.is_contiguous()
            and seq_lens.is_contiguous() and block_table.dtype == seq_lens.dtype == torch.int32
            and block_table.shape[0] >= rows and seq_lens.shape[0] >= rows
            and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1):
        raise ValueError("decode_attention: inputs of another layout than the kernel reads")
    _kernel(q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            key_cache.stride(0), key_cache.stride(1), out.data_ptr(), block_table.data_ptr(),
            block_table.shape[1], seq_lens.data_ptr(), rows, heads, key_cache.shape[1], head_dim,
            key_cache.shape[2], scale)
