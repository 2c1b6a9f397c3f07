"""What ttserve's own attention kernels (decode_attention.c, prefill_attention.c) can read of vLLM
CPU's paged KV cache, where vLLM's cpu_attn_reshape_and_cache writes it: per (block, KV head) the
keys transposed, [head_dim][block_size], then the values, [block_size][head_dim] (the layout of
vLLM's "vec" and "vec16" kernels; its AMX kernel packs blocks otherwise). Each kernel states its
own limits; they load, and their refusals read, alike."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import native_build

LAYOUTS = ("vec", "vec16")  # vLLM's kernel ISAs whose cache layout the C code reads


def unreadable(dtype: torch.dtype, kernel_isa: str) -> str:
    """Why a cache of this dtype, laid out for vLLM's `kernel_isa` kernel, cannot be read; "" when it can."""
    if dtype != torch.bfloat16:
        return f"it computes bfloat16 only, not {dtype}"
    if kernel_isa not in LAYOUTS:
        return f"it reads the cache layout of vLLM's {'/'.join(LAYOUTS)} kernels, not {kernel_isa}'s"
    return ""


def shape_refusal(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, max_group: int,
                  max_block: int, max_head_dim: int, block_multiple: int) -> str:
    """Why a kernel of these limits cannot take these heads and blocks; "" when it can."""
    if num_heads % num_kv_heads or num_heads // num_kv_heads > max_group:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (at most {max_group} per KV head)"
    if head_dim % 16 or head_dim > max_head_dim:
        return f"head_dim {head_dim} (multiples of 16 up to {max_head_dim})"
    if block_size % block_multiple or block_size > max_block:
        return f"block size {block_size} (multiples of {block_multiple} up to {max_block})"
    return ""


Limits = tuple[int, int, int]  # most query heads per KV head, block size, head_dim


def load_kernel(source: Path, off_switch: str, has_path: str, lacking: str,
                limits: str) -> tuple[ctypes.CDLL, Limits] | str:
    """An attention kernel's library, built once (native_build.load), and the limits its C
    function `limits` states; or why it cannot serve here: `off_switch`=vllm, the build, or its
    C function `has_path` returning 0 on this CPU (`lacking` says what is missing)."""
    library = native_build.switched_off(off_switch, "vllm") or native_build.load(source)
    if isinstance(library, str):
        return library
    if not getattr(library, has_path)():
        return lacking
    values = [ctypes.c_int64() for _ in range(3)]
    getattr(library, limits)(*[ctypes.byref(v) for v in values])
    return library, (values[0].value, values[1].value, values[2].value)
