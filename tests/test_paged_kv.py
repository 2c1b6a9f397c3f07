"""The paged KV storage (worker/backends/torch/models/paged_kv.py): the contract's views, the fast path, and
that it reads exactly what the head-major layout would."""
from __future__ import annotations

import pytest
import torch

from ttserve.worker.backends.torch.models import paged_kv

LANES, LAYERS, BLOCKS, KV_HEADS, BLOCK, HEAD_DIM = 2, 3, 6, 2, 4, 8


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def cache(request):
    return paged_kv.allocate(LANES, LAYERS, BLOCKS, KV_HEADS, BLOCK, HEAD_DIM, request.param, torch.device("cpu"))


def test_allocate_gives_zeroed_views_of_the_contract_shape_over_one_storage_per_lane(cache):
    for lane in cache:
        assert len(lane) == LAYERS
        for k, v in lane:
            assert k.shape == v.shape == (BLOCKS, KV_HEADS, BLOCK, HEAD_DIM)
            assert not k.any() and not v.any()
            # The fast path (one index_select per layer) is the one these caches take.
            assert paged_kv._layer_storage(k, v) is not None
    assert cache[0][0][0]._base is not cache[1][0][0]._base


def test_write_then_gather_equals_the_head_major_copy_of_the_same_cache(cache):
    g = torch.Generator().manual_seed(0)
    dtype = cache[0][0][0].dtype
    # Tokens at (block, offset); row 0 owns blocks [4, 1], row 1 owns [2, 5].
    blk, off = torch.tensor([4, 4, 1, 2, 5]), torch.tensor([0, 3, 2, 1, 0])
    k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    table = torch.tensor([[4, 1], [2, 5]])
    copies = [t.clone() for t in cache[1][2]]  # plain tensors: the head-major path
    keys, values = paged_kv.write_then_gather(*cache[1][2], blk, off, k, v, table)
    ref_keys, ref_values = paged_kv.write_then_gather(*copies, blk, off, k, v, table)
    assert keys.shape == (2, KV_HEADS, 2 * BLOCK, HEAD_DIM)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    # Through the contract's view, each token sits at [block, head, offset].
    for i in range(5):
        assert torch.equal(cache[1][2][0][blk[i], :, off[i]], k[i])
        assert torch.equal(cache[1][2][1][blk[i], :, off[i]], v[i])
    # Row 1's gathered keys are its blocks in table order: block 2 then block 5.
    assert torch.equal(keys[1, :, BLOCK + 0], k[4]) and torch.equal(keys[1, :, 1], k[3])
    # Nothing else in the lane or in the other lane changed.
    assert not cache[0][2][0].any() and not cache[1][1][0].any()
