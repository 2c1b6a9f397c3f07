"""Dense tensors on the wire (multimodal.proto `Tensor`): torch <-> protobuf, bit for bit.

Shared by the gateway (which sends its processor's outputs) and the worker (which hands them to
the model). The control plane checks their shapes and sizes at admission (tensor_problem, no
torch) and forwards them untouched; this module imports torch only when called.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ttserve.v1 import multimodal_pb2

if TYPE_CHECKING:
    import torch

# The dtypes a processor's outputs come in, with their element sizes; anything else is refused.
ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
                 "uint8": 1, "bool": 1}
DTYPES = tuple(ELEMENT_SIZES)


class TensorError(ValueError):
    """A tensor message that does not describe a tensor (unknown dtype, wrong byte count)."""


def tensor_problem(message: multimodal_pb2.Tensor) -> str | None:
    """Why `message` is not a tensor (checked without torch, so the control plane can refuse a
    malformed request at admission instead of failing a worker's step), or None."""
    size = ELEMENT_SIZES.get(message.dtype)
    if size is None:
        return f"unknown tensor dtype {message.dtype!r} (supported: {', '.join(DTYPES)})"
    count = 1
    for d in message.shape:
        count *= d
    if len(message.data) != count * size:
        return (f"a {message.dtype} tensor of shape {list(message.shape)} needs {count * size} bytes, "
                f"got {len(message.data)}")
    return None


def tensor_to_pb(tensor: torch.Tensor) -> multimodal_pb2.Tensor:
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TensorError(f"tensors of dtype {name} cannot be sent (supported: {', '.join(DTYPES)})")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if sys.byteorder != "little":
        raise TensorError("big-endian hosts are not supported")
    # Bytes through a same-size integer view: numpy has no bfloat16.
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return multimodal_pb2.Tensor(dtype=name, shape=list(tensor.shape), data=raw.numpy().tobytes())


def tensor_from_pb(message: multimodal_pb2.Tensor) -> torch.Tensor:
    import torch

    problem = tensor_problem(message)
    if problem:
        raise TensorError(problem)
    dtype = getattr(torch, message.dtype)
    shape = tuple(int(d) for d in message.shape)
    if not message.data:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable copy (frombuffer over the message's immutable bytes would warn).
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)
