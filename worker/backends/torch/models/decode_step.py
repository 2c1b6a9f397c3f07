"""A decode step's decoder layers in one C call (decode_step.c), for a Llama-family model whose
GEMMs are ttserve's (bf16_gemm.py) and whose decode attention is ttserve's (decode_attention.py).

Why: at one row, a decode step's GEMMs read the weights in ~9-10 ms on the 2-core EPYC, and the
step took ~13.4-15.7 ms: the rest was ~10 operator calls per layer (300 a step), each a Python
frame, a dispatcher hop or a ctypes conversion costing 5-20 us around a kernel of a few us. Here
the layers are one call; the embedding, the first norm, the LM head and sampling stay in torch.

Where: llama.py decides once per KV cache (`DecodeStep.build` says why not, and the per-operator
path serves): bfloat16, every GEMM ttserve's, a gated silu MLP, no q/k norms, no sliding window,
ttserve's decode attention on this cache, RoPE from the model's neox table. Per step: a decode
step (one token a row) of one lane. TTSERVE_DECODE_STEP=layers turns it off (an A/B switch).
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from . import bf16_gemm, native_build

SOURCE = Path(__file__).with_name("decode_step.c")
OFF_SWITCH = "TTSERVE_DECODE_STEP"  # layers: the per-operator path
_I, _P = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I,
             ctypes.c_float, ctypes.c_float]

_PAGING_ARGTYPES = [_I, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P]

_kernel: ctypes._CFuncPtr | None = None
_paging: ctypes._CFuncPtr | None = None
_fields = 0
_why: str | None = None  # None: not tried; "": loaded; else why not


def _load() -> str:
    """Builds and loads decode_step.c once per process; "" when it serves, else why not."""
    global _kernel, _paging, _fields, _why
    if _why is not None:
        return _why
    # The GEMM it calls needs AVX512-BF16: checked before any compile.
    library = (native_build.switched_off(OFF_SWITCH, "layers") or bf16_gemm.kernel_unavailable()
               or native_build.load(SOURCE))
    if isinstance(library, str):
        _why = library
        return _why
    _kernel = native_build.void_function(library, "ttserve_decode_step", _ARGTYPES)
    _paging = library.ttserve_decode_paging
    _paging.argtypes, _paging.restype = _PAGING_ARGTYPES, ctypes.c_int64
    _fields, _why = library.ttserve_decode_step_fields(), ""
    return _why


class LivePaging(NamedTuple):
    """A decode batch's live rows (position >= 0, in row order) and what decode_step.c reads for
    them (DecodeStep.__call__'s positions, slots, block_table, seq_lens)."""
    rows: torch.Tensor          # [n] int64: each live row's index in the batch
    tokens: torch.Tensor        # [n] int64
    positions: torch.Tensor     # [n] int64
    slots: torch.Tensor         # [n] int64
    block_table: torch.Tensor   # [n, blocks] int32
    seq_lens: torch.Tensor      # [n] int32: the context after this step


def live_paging(tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, block_size: int,
                cache_blocks: int, max_seq_len: int) -> LivePaging | None:
    """decode_step.c's ttserve_decode_paging over a whole decode batch: tokens [rows, 1] and
    positions [rows] int64 (-1: an empty row), page_table [rows, width] int32, on the CPU. None
    when the inputs are of another kind or a row's paging is refused (a position past
    max_seq_len, a block outside the cache): the caller's general path serves them, and says
    which row is wrong. One call where llama.py's general plan makes ~25 (decode_step.c says why)."""
    if positions.dim() != 1 or not positions.shape[0]:
        return None
    rows = positions.shape[0]
    if (_paging is None or tokens.dtype != torch.int64 or positions.dtype != torch.int64
            or page_table.dtype != torch.int32 or tokens.device.type != "cpu" or positions.device.type != "cpu"
            or page_table.device.type != "cpu" or tuple(tokens.shape) not in ((rows, 1), (rows,))
            or page_table.dim() != 2 or page_table.shape[0] < rows or page_table.stride(1) != 1):
        return None
    tokens, positions = tokens.reshape(-1).contiguous(), positions.contiguous()
    width = page_table.shape[1]
    if page_table.stride(0) != width:
        page_table = page_table.contiguous()
    longs = torch.empty(5, rows, dtype=torch.int64)  # live, tokens, positions, slots, the table's width
    ints = torch.empty(rows * (width + 1), dtype=torch.int32)  # seq_lens, then the block table
    n = _paging(rows, tokens.data_ptr(), positions.data_ptr(), page_table.data_ptr(), width, block_size,
                cache_blocks, max_seq_len, longs[0].data_ptr(), longs[1].data_ptr(), longs[2].data_ptr(),
                longs[3].data_ptr(), ints.data_ptr(), ints[rows:].data_ptr(), longs[4].data_ptr())
    if n <= 0:
        return None
    blocks = int(longs[4, 0])
    return LivePaging(longs[0, :n], longs[1, :n], longs[2, :n], longs[3, :n],
                      ints[rows:rows + n * blocks].view(n, blocks), ints[:n])


class DecodeStep:
    """One model's decoder layers over one lane's KV cache, as decode_step.c reads them: a table
    of the packed weights', norms' and cache views' addresses, made once (the tensors are the
    model's and the cache's, alive as long as they are)."""

    __slots__ = ("table", "num_heads", "kv_heads", "head_dim", "hidden", "intermediate", "gate_up_width",
                 "block_size", "block_stride", "head_stride", "eps", "cos_sin", "keep")

    def __init__(self, layers: Sequence, caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 final_norm: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int,
                 eps: float) -> None:
        """layers: llama.py's _Layer list (build() checked them); caches: the lane's [K, V] per
        layer, vLLM CPU's views [blocks, kv_heads, block_size, head_dim]."""
        norms = [layer.input_norm for layer in layers[1:]] + [final_norm]
        rows = []
        for layer, next_norm, (keys, values) in zip(layers, norms, caches):
            qkv, o, gate_up, down = layer.qkv.weight, layer.o.weight, layer.mlp.gate_up, layer.mlp.down.weight
            rows.append([qkv.packed.data_ptr(), 0 if qkv.bias is None else qkv.bias.data_ptr(),
                         o.packed.data_ptr(), 0 if o.bias is None else o.bias.data_ptr(),
                         gate_up.packed.data_ptr(), down.packed.data_ptr(),
                         layer.post_norm.data_ptr(), next_norm.data_ptr(), keys.data_ptr(), values.data_ptr()])
        self.table = torch.tensor(rows, dtype=torch.int64)
        assert self.table.shape[1] == _fields, f"decode_step.c reads {_fields} fields a layer"
        first_keys = caches[0][0]
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.hidden = layers[0].qkv.weight.in_features
        self.intermediate = layers[0].mlp.gate_up.out_features
        self.gate_up_width = layers[0].mlp.gate_up.packed.shape[0] * bf16_gemm.TILE
        self.block_size = first_keys.shape[2]
        self.block_stride, self.head_stride = first_keys.stride(0), first_keys.stride(1)
        self.eps = eps
        self.cos_sin = cos_sin.contiguous()
        # Every tensor whose address the table holds, kept alive with it.
        self.keep = (layers, caches, final_norm)

    @staticmethod
    def build(layers: Sequence, caches: Sequence[tuple[torch.Tensor, torch.Tensor]], final_norm: torch.Tensor,
              cos_sin: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int, eps: float,
              sliding_window: int | None, own_decode_attention: bool) -> DecodeStep | str:
        """The step for these layers and this lane's cache, or why decode_step.c cannot run them."""
        why = _load()
        if why:
            return why
        if not own_decode_attention:
            return "ttserve's decode attention does not serve this cache"
        if sliding_window is not None:
            return "sliding-window attention (decode_step.c attends to the whole context)"
        if cos_sin.dtype != torch.bfloat16 or final_norm.dtype != torch.bfloat16:
            return f"it computes bfloat16, not {cos_sin.dtype}"
        for layer in layers:
            if layer.q_norm is not None or layer.k_norm is not None:
                return "q/k norms before RoPE (Qwen3)"
            if not (layer.qkv.kind == layer.o.kind == layer.mlp.down.kind == "ttserve"
                    and layer.mlp.gate_up is not None and getattr(layer.mlp.gate_up, "is_gated", False)):
                return "a GEMM that is not ttserve's (bf16_gemm.py), or an MLP without its gated GEMM"
        if len(caches) != len(layers) or any(k.stride() != caches[0][0].stride() or v.stride() != k.stride()
                                             or k.stride(3) != 1 for k, v in caches):
            return "a KV cache whose layers' views differ in layout"
        if layers[0].qkv.weight.in_features % 8:
            return "a hidden size that is not a multiple of 8 (the norms' vectors)"
        return DecodeStep(layers, caches, final_norm, cos_sin, num_heads, kv_heads, head_dim, eps)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Runs every layer, in place: h [rows, hidden] layer 0's normed input -> the final norm's
        output; residual [rows, hidden] the embeddings -> the residual stream. positions, slots
        [rows] int64; block_table [rows, width] and seq_lens [rows] int32, contiguous (one lane's
        cpu_kernels.Attention plan: seq_lens counts this step's token)."""
        rows = h.shape[0]
        # What the C code trusts (it writes through these addresses), about a microsecond a step.
        if not (h.is_contiguous() and residual.is_contiguous() and h.shape == residual.shape == (rows, self.hidden)
                and h.dtype == residual.dtype == torch.bfloat16 and len(positions) == len(slots) == rows
                and positions.dtype == slots.dtype == torch.int64 and block_table.dtype == seq_lens.dtype == torch.int32
                and block_table.is_contiguous() and seq_lens.is_contiguous() and len(seq_lens) == block_table.shape[0]
                == rows):
            raise ValueError("decode_step: inputs of another layout than decode_step.c reads")
        q_width = self.num_heads * self.head_dim
        qkv_width = q_width + 2 * self.kv_heads * self.head_dim
        scratch = torch.empty(rows * (qkv_width + q_width + self.hidden + self.intermediate), dtype=torch.bfloat16)
        positions, slots = positions.contiguous(), slots.contiguous()
        _kernel(self.table.data_ptr(), self.table.shape[0], h.data_ptr(), residual.data_ptr(), scratch.data_ptr(),
                rows, self.hidden, self.num_heads, self.kv_heads, self.head_dim, self.intermediate,
                self.gate_up_width, positions.data_ptr(), slots.data_ptr(), block_table.data_ptr(),
                block_table.shape[1], seq_lens.data_ptr(), self.cos_sin.data_ptr(), self.block_size,
                self.block_stride, self.head_stride, self.eps, 1.0 / self.head_dim ** 0.5)

