"""Dense tensors on the wire (multimodal.proto `Tensor`): torch <-> protobuf, bit for bit.

Shared by the gateway (which sends its processor's outputs) and the worker (which hands them to
the model). The control plane forwards the messages without reading them, so it never imports
torch; this module imports it only when called.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ttserve.v1 import multimodal_pb2

if TYPE_CHECKING:
    import torch

# The dtypes a processor's outputs come in; anything else is refused by name.
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "uint8", "bool")


class TensorError(ValueError):
    """A tensor message that does not describe a tensor (unknown dtype, wrong byte count)."""


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

    if message.dtype not in DTYPES:
        raise TensorError(f"unknown tensor dtype {message.dtype!r} (supported: {', '.join(DTYPES)})")
    dtype = getattr(torch, message.dtype)
    shape = tuple(int(d) for d in message.shape)
    count = 1
    for d in shape:
        count *= d
    size = torch.empty((), dtype=dtype).element_size()
    if len(message.data) != count * size:
        raise TensorError(f"a {message.dtype} tensor of shape {list(shape)} needs {count * size} bytes, "
                          f"got {len(message.data)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable copy (frombuffer over the message's immutable bytes would warn).
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)
