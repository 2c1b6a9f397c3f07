"""A linear layer whose weight is kept in the layout the device's GEMM reads fastest.

On a CPU in bfloat16, torch's F.linear reorders a plain [out, in] weight for oneDNN on every
call, and a decode GEMM (a few rows) is bound by reading the weight: measured on a 2-core Xeon
with AMX, SmolLM2's MLP weights went from ~13 to ~21 GB/s (the host's copy bandwidth) when
packed once at load with mkldnn's reorder, the packing inductor's CPU freezing pass uses.
float32 and float16 keep plain F.linear: packing measured no faster there, and float32 must stay
bit-for-bit the textbook computation the transformers oracle is compared with.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _packs(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x W^T + b for x [..., in]; W given as [out, in] (the checkpoint's layout)."""

    __slots__ = ("weight", "bias", "packed", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = _packs(weight)
        # Packed, the weight is an opaque mkldnn tensor: only _linear_pointwise reads it.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class SwiGLU:
    """Llama's MLP, down(silu(gate(x)) * up(x)), from the checkpoint's [inter, hidden] gate and up
    and [hidden, inter] down weights.

    Packed (CPU, bf16): silu rides the gate GEMM as a oneDNN post-op and the product the up GEMM
    as a binary post-op, so the [tokens, inter] activations are written once instead of three
    times (silu, multiply): ~12% of a 1,024-token prefill on a 2-core Xeon. Otherwise one GEMM of
    gate and up stacked, then silu and the product: the textbook float32 computation."""

    __slots__ = ("packed", "gate", "up", "gate_up", "down")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.packed = _packs(gate)
        self.down = Linear(down)
        if self.packed:
            self.gate, self.up = Linear(gate), Linear(up)
        else:
            self.gate_up = Linear(torch.cat([gate, up]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            g = torch.ops.mkldnn._linear_pointwise(x, self.gate.weight, None, "swish", [], "")
            return self.down(torch.ops.mkldnn._linear_pointwise.binary(x, g, self.up.weight, None, "mul"))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
