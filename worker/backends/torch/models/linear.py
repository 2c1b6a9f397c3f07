"""A linear layer whose weight is kept in the layout the device's GEMM reads fastest.

On a CPU in 16 bits, the weight goes to vLLM CPU's oneDNN matmul handler
(`cpu_kernels.MatMul`), as vLLM's own linear layers do; without vLLM's op library, bfloat16 falls
back to torch's mkldnn packed linear (the packing inductor's CPU freezing pass uses). Both beat
F.linear, which reorders a plain [out, in] weight for oneDNN on every call: a decode GEMM (a few
rows) is bound by reading the weight, and on a 2-core Xeon with AMX, SmolLM2's MLP weights went
from ~13 to ~21 GB/s (the host's copy bandwidth) packed once at load.
float32 keeps plain F.linear: it must stay bit-for-bit the textbook computation the transformers
oracle is compared with.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from . import cpu_kernels

Kind = Literal["onednn", "packed", "plain"]  # cpu_kernels.MatMul, mkldnn's packed linear, F.linear


def _kind(weight: torch.Tensor) -> Kind:
    if not cpu_kernels.gemm_unavailable(weight):
        return "onednn"
    if (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "packed"
    return "plain"


class Linear:
    """y = x W^T + b for x [..., in]; W given as [out, in] (the checkpoint's layout)."""

    __slots__ = ("weight", "bias", "kind", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.kind = _kind(weight)
        # onednn: the handler holds its own copy; packed: an opaque mkldnn tensor that only
        # _linear_pointwise reads.
        if self.kind == "onednn":
            self.weight = cpu_kernels.MatMul(weight, bias)
        elif self.kind == "packed":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return self.weight(x)
        if self.kind == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class SwiGLU:
    """Llama's MLP, down(silu(gate(x)) * up(x)), from the checkpoint's [inter, hidden] gate and up
    and [hidden, inter] down weights.

    onednn: gate and up as two GEMMs (contiguous outputs, so silu and the product run in place
    on the gate's): measured faster than one stacked GEMM and a strided split up to 512 rows.
    packed: silu rides the gate GEMM as a oneDNN post-op and the product the up GEMM as a binary
    post-op, so the [tokens, inter] activations are written once instead of three times.
    plain: one GEMM of gate and up stacked, then silu and the product: the textbook float32
    computation."""

    __slots__ = ("kind", "gate", "up", "gate_up", "down")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.kind = _kind(gate)
        self.down = Linear(down)
        if self.kind == "plain":
            self.gate_up = Linear(torch.cat([gate, up]))
        else:
            self.gate, self.up = Linear(gate), Linear(up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return self.down(F.silu(self.gate(x), inplace=True).mul_(self.up(x)))
        if self.kind == "packed":
            g = torch.ops.mkldnn._linear_pointwise(x, self.gate.weight, None, "swish", [], "")
            return self.down(torch.ops.mkldnn._linear_pointwise.binary(x, g, self.up.weight, None, "mul"))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
