"""The paged KV cache's storage, and how attention writes and reads it block by block.

Storage: one tensor per lane, [num_tensors, num_blocks, block_size, 2, num_kv_heads, head_dim]:
token-major inside a block, K and V of a token side by side. A tensor is one layer's, or, with
hybrid KV cache groups (allocate's `tensor_of_layer`), the buffer several layers share, each
indexing disjoint blocks of it through its group's page table. The contract's view of it,
kv_cache[lane][layer] = [K, V] each [num_blocks, num_kv_heads, block_size, head_dim], is a
strided view of the layer's tensor (the same memory, tt-metal's shape), so callers and tests that
index K or V by (block, head, offset) see exactly what attention wrote.

Why this layout: a row's keys are the blocks its page table names, in order. Gathering them with
one index_select over a layer's [num_blocks, block_size, 2, kv_heads, head_dim] storage gives
[rows, blocks * block_size, 2, kv_heads, head_dim] contiguous, and K and V are strided views of
that ([rows, kv_heads, tokens, head_dim] after a transpose) that SDPA reads directly. With the
head-major layout, every layer paid a gather per tensor plus a permuted copy of what it gathered.
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

KVCache = list[list[list[torch.Tensor]]]  # [lane][layer] -> [K, V]


def allocate(lanes: int, layers: int, blocks: int, kv_heads: int, block_size: int, head_dim: int,
             dtype: torch.dtype, device: torch.device, tensor_of_layer: Sequence[int] | None = None) -> KVCache:
    """Zeroed storage per lane and the contract's [K, V] views of each layer: of tensor
    tensor_of_layer[layer] (layers naming one tensor view the same memory; tensors
    0..max(tensor_of_layer)), or each layer its own when None."""
    tensor_of = list(range(layers)) if tensor_of_layer is None else [int(t) for t in tensor_of_layer]
    if len(tensor_of) != layers or min(tensor_of, default=0) < 0:
        raise ValueError(f"tensor_of_layer {tensor_of} must name a tensor >= 0 for each of {layers} layers")
    cache: KVCache = []
    shape = (max(tensor_of, default=-1) + 1, blocks, block_size, 2, kv_heads, head_dim)
    for _ in range(lanes):
        storage = zeroed_host(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        cache.append([[storage[tensor, :, :, kind].transpose(1, 2) for kind in (0, 1)]
                      for tensor in tensor_of])
    return cache


def zeroed_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host memory the OS hands out zeroed (an anonymous mapping), made resident page by page as
    blocks are first written. torch.zeros would write every byte of the budget at start-up
    (1.6 s for 1 GiB on a 2-core host) and keep it resident before any request needs it. Zeroed
    matters: attention reads the unwritten tail of a row's last block (masked, but 0 x NaN is
    NaN), so it must hold finite values."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # The storage keeps the mapping alive (frombuffer's storage holds a reference to the buffer).
    flat = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape))
    # A tensor of its own over that storage, not a view of `flat`: the layers' K/V views must
    # have the 6-d storage as their _base (see _layer_storage).
    return torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)


def write_then_gather(cache_k: torch.Tensor, cache_v: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, table: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes token i's K and V [n, kv_heads, head_dim] into block blk[i] at offset off[i], then
    returns K and V [rows, kv_heads, nb * block_size, head_dim] of the blocks table [rows, nb]
    names: only those (the table is as wide as the longest row of the step needs).

    A cache from `allocate` is read with one index_select per layer; K and V tensors made
    elsewhere (copies a caller took, say) still work, through the head-major gather."""
    storage = _layer_storage(cache_k, cache_v)
    rows, nb = table.shape
    if storage is None:
        cache_k[blk, :, off] = k.to(cache_k.dtype)
        cache_v[blk, :, off] = v.to(cache_v.dtype)
        return _gather_head_major(cache_k, table), _gather_head_major(cache_v, table)
    _, block_size, _, kv_heads, head_dim = storage.shape
    storage[blk, off] = torch.stack((k, v), dim=1).to(storage.dtype)
    got = storage.index_select(0, table.reshape(-1)).view(rows, nb * block_size, 2, kv_heads, head_dim)
    return got[:, :, 0].transpose(1, 2), got[:, :, 1].transpose(1, 2)


def _layer_storage(cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor | None:
    """The [num_blocks, block_size, 2, kv_heads, head_dim] storage a layer's K and V view, when
    they are `allocate`'s views: the tensor their offset in the 6-d storage falls in (the one
    the layer shares with its tensor's other layers)."""
    base = cache_k._base
    if (base is None or base is not cache_v._base or base.dim() != 6
            or cache_v.data_ptr() - cache_k.data_ptr() != base.stride(3) * base.element_size()):
        return None
    tensor = (cache_k.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())
    return base[tensor]


def _gather_head_major(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[blocks, kv_heads, block_size, head_dim] by table [n, nb] -> [n, kv_heads, nb*bs, head_dim]."""
    n, nb = table.shape
    _, heads, block_size, head_dim = cache.shape
    return cache[table].permute(0, 2, 1, 3, 4).reshape(n, heads, nb * block_size, head_dim)
