"""Tensors on the wire (ttserve/tensor_wire.py): bit-for-bit round trips, and malformed
messages named before they reach a model."""
from __future__ import annotations

import pytest
import torch

from ttserve.tensor_wire import TensorError, tensor_from_pb, tensor_problem, tensor_to_pb
from ttserve.v1 import multimodal_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_round_trip_is_bit_for_bit(dtype):
    t = (torch.randn(5, 7) * 100).to(dtype)
    back = tensor_from_pb(tensor_to_pb(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_non_contiguous_and_empty_tensors_travel():
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    assert torch.equal(tensor_from_pb(tensor_to_pb(t)), t)
    assert tensor_from_pb(tensor_to_pb(torch.empty(0, 3))).shape == (0, 3)


def test_malformed_messages_are_named():
    assert "needs 24 bytes, got 3" in tensor_problem(multimodal_pb2.Tensor(dtype="int64", shape=[3], data=b"abc"))
    assert "unknown tensor dtype 'complex64'" in tensor_problem(multimodal_pb2.Tensor(dtype="complex64"))
    with pytest.raises(TensorError, match="needs 8 bytes"):
        tensor_from_pb(multimodal_pb2.Tensor(dtype="float32", shape=[2], data=b"1234"))
    with pytest.raises(TensorError, match="cannot be sent"):
        tensor_to_pb(torch.zeros(2, dtype=torch.complex64))
