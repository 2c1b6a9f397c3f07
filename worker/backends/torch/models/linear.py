"""A linear layer whose weight is kept in the layout the device's GEMM reads fastest.

On a CPU with AVX512-BF16 and no AMX, a bfloat16 weight is packed for ttserve's own GEMM
(bf16_gemm.py: a decode step's weights read 1.4-1.5x as fast as oneDNN reads them there, prefill
alike, a gated MLP's activation in its epilogue). Otherwise, on a CPU in 16 bits, the weight goes to
vLLM CPU's oneDNN matmul handler
(`cpu_kernels.MatMul`), as vLLM's own linear layers do; without vLLM's op library, bfloat16 falls
back to torch's mkldnn packed linear (the packing inductor's CPU freezing pass uses). Both beat
F.linear, which reorders a plain [out, in] weight for oneDNN on every call: a decode GEMM (a few
rows) is bound by reading the weight, and on a 2-core Xeon with AMX, SmolLM2's MLP weights went
from ~13 to ~21 GB/s (the host's copy bandwidth) packed once at load.
float32 keeps plain F.linear: it must stay bit-for-bit the textbook computation the transformers
oracle is compared with.

Batch invariance (`batch_invariant`, the worker's --batch-invariant): ttserve's GEMM sums each
row in one order at any row count, so it is invariant as it is. oneDNN picks its kernel by
the row count, and for a reduction longer than ~1024 inputs the kernels of few and of many rows
sum in different orders (measured on the 2-core Xeon: SmolLM2's down projection, 1536 inputs,
gave other bf16 bits for 1-15 rows than for 16 or more). A row's result then depends on how many
rows share its step, so speculative decoding's verify step (1 + k rows per request) and batching
flip near-ties of greedy decoding. Sliced into reductions of at most SPLIT_K inputs, every
slice's kernels agree at any row count, and the slices' partial products are added in a fixed
order: each row's bits are its own. `rows_invariant` checks it on this host at load.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from . import bf16_gemm, cpu_kernels

# bf16_gemm.GEMM, cpu_kernels.MatMul, mkldnn's packed linear, F.linear
Kind = Literal["ttserve", "onednn", "packed", "plain"]

# The widest reduction one oneDNN GEMM computes in batch-invariant mode: measured invariant from 1
# to 2048 rows up to 1024 inputs, not at 1088 (576 outputs, bf16, AMX Xeon).
SPLIT_K = 1024


class BatchInvarianceError(ValueError):
    """The GEMMs cannot give each row bits independent of the batch here."""


def _kind(weight: torch.Tensor) -> Kind:
    if not bf16_gemm.unavailable(weight):
        return "ttserve"
    if not cpu_kernels.gemm_unavailable(weight):
        return "onednn"
    if (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "packed"
    return "plain"


class Linear:
    """y = x W^T + b for x [..., in]; W given as [out, in] (the checkpoint's layout)."""

    __slots__ = ("weight", "bias", "kind", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 batch_invariant: bool = False) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.kind = _kind(weight)
        if batch_invariant and self.kind not in ("ttserve", "onednn"):
            raise BatchInvarianceError(
                f"batch invariance needs ttserve's GEMM or vLLM CPU's oneDNN matmul for every weight: "
                f"{bf16_gemm.unavailable(weight)}; {cpu_kernels.gemm_unavailable(weight) or 'unavailable'}")
        # ttserve, onednn: a packed copy of their own; packed: an opaque mkldnn tensor that only
        # _linear_pointwise reads.
        if self.kind == "ttserve":
            self.weight = bf16_gemm.GEMM(weight, bias)
        elif batch_invariant and weight.shape[1] > SPLIT_K:
            self.weight = SplitMatMul(weight, bias)
        elif self.kind == "onednn":
            self.weight = cpu_kernels.MatMul(weight, bias)
        elif self.kind == "packed":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in ("ttserve", "onednn"):
            return self.weight(x)
        if self.kind == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class SplitMatMul:
    """y = x W^T (+ b) as sum_s x[:, s] W[:, s]^T over slices s of at most SPLIT_K inputs, added
    left to right in the activations' dtype: every slice's GEMM gives a row the same bits at any
    row count (module docstring)."""

    __slots__ = ("parts", "bounds", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        width = weight.shape[1]
        count = -(-width // SPLIT_K)
        step = -(-width // count)  # equal slices: 1536 -> 2 x 768
        self.bounds = [(lo, min(lo + step, width)) for lo in range(0, width, step)]
        self.parts = [cpu_kernels.MatMul(weight[:, lo:hi].contiguous(), bias if lo == 0 else None)
                      for lo, hi in self.bounds]
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (lo, hi), *rest = self.bounds
        out = self.parts[0](x[..., lo:hi].contiguous())
        for part, (lo, hi) in zip(self.parts[1:], rest):
            out += part(x[..., lo:hi].contiguous())
        return out


def rows_invariant(linear: "Linear | SplitMatMul | bf16_gemm.GEMM", in_features: int, dtype: torch.dtype,
                   rows: int = 33) -> bool:
    """Whether each of `rows` random rows gets the same bits alone as in one GEMM of all of
    them (and of 2, and of 17): what batch invariance needs of this weight's kernels here."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    alone = torch.cat([linear(x[r:r + 1]) for r in range(rows)])
    return all(torch.equal(linear(x[:m]), alone[:m]) for m in (2, 17, rows))


class SwiGLU:
    """Llama's MLP, down(silu(gate(x)) * up(x)), from the checkpoint's [inter, hidden] gate and up
    and [hidden, inter] down weights (Gemma's the same with gelu_tanh: `gated`).

    ttserve: gate and up as one GEMM whose epilogue gives act(gate) * up (bf16_gemm.GEMM.gated;
    intermediate sizes that are not a multiple of 16 take the onednn form on ttserve's GEMMs).
    onednn: gate and up as two GEMMs (contiguous outputs, so silu and the product run in place
    on the gate's): measured faster than one stacked GEMM and a strided split up to 512 rows.
    packed: silu rides the gate GEMM as a oneDNN post-op and the product the up GEMM as a binary
    post-op, so the [tokens, inter] activations are written once instead of three times.
    plain: one GEMM of gate and up stacked, then silu and the product: the textbook float32
    computation."""

    __slots__ = ("kind", "gate", "up", "gate_up", "down")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 batch_invariant: bool = False) -> None:
        self.kind = _kind(gate)
        self.down = Linear(down, batch_invariant=batch_invariant)
        self.gate = self.up = self.gate_up = None
        if self.kind == "ttserve" and gate.shape[0] % (bf16_gemm.TILE // 2) == 0:
            self.gate_up = bf16_gemm.GEMM.gated(gate, up)
        elif self.kind == "plain":
            self.gate_up = Linear(torch.cat([gate, up]), batch_invariant=batch_invariant)
        else:
            self.gate = Linear(gate, batch_invariant=batch_invariant)
            self.up = Linear(up, batch_invariant=batch_invariant)

    def gated(self, x: torch.Tensor, activation: bf16_gemm.Activation = "silu") -> torch.Tensor:
        """act(x Wg^T) * (x Wu^T): the MLP before its down projection."""
        if self.kind == "ttserve" and self.gate_up is not None:
            return self.gate_up(x, activation)
        if self.kind == "packed" and activation == "silu":
            g = torch.ops.mkldnn._linear_pointwise(x, self.gate.weight, None, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, g, self.up.weight, None, "mul")
        if self.kind == "plain":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return _ACTIVATIONS[activation](gate) * up
        gate = self.gate(x)  # its own output: silu runs in place on it
        gate = F.silu(gate, inplace=True) if activation == "silu" else _ACTIVATIONS[activation](gate)
        return gate.mul_(self.up(x))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gated(x))


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
