"""ttserve's bfloat16 GEMM for a CPU with AVX512-BF16 and no AMX (bf16_gemm.c), the weight packed
once at load.

Why: a decode step reads every weight once, and with a few rows that read is the whole cost.
oneDNN's bf16 GEMM (vLLM CPU's handler) read SmolLM2's weights at 17-19 GB/s on the 2-core EPYC
(Zen 4) with 1 to 8 rows; this kernel, whose packed tiles are one stream and whose accumulators
hold outputs, at 25-27 GB/s. SmolLM2's GEMMs in layer order (benchmarks/gemm.py), oneDNN ->
ttserve: 1 row 14.5 -> 9.9 ms, 8 rows 14.3 -> 10.1, 32 rows 29.1 -> 26.1 (both near the cores'
arithmetic peak from here on), 512 rows 367 -> 364, 2048 rows 1595 -> 1600. A gated MLP's gate and
up projections are one GEMM whose epilogue applies the activation and the product.

Where: a Linear or gated MLP whose weight is bfloat16 on a CPU with AVX512-BF16 and an even
number of inputs. Not on AMX CPUs: there oneDNN's AMX tiles compute a prefill several times
faster than VDPBF16PS can, and its decode GEMMs already read the weights at the host's copy
bandwidth (~21 GB/s, linear.py's figure from the 2-core Xeon), so oneDNN keeps every GEMM rather
than the worker holding the weights twice. TTSERVE_GEMM=onednn turns the kernel off;
TTSERVE_GEMM=ttserve uses it on AMX CPUs too. A row's bits never depend on the other rows of its
GEMM (bf16_gemm.c), so batch invariance needs no sliced GEMMs here.

Built and loaded by native_build.py; without it, `unavailable()` says why and oneDNN serves.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Literal

import torch

from . import native_build

SOURCE = Path(__file__).with_name("bf16_gemm.c")
SWITCH = "TTSERVE_GEMM"  # onednn: never this kernel; ttserve: also on AMX CPUs
TILE = 32  # outputs per packed tile (bf16_gemm.c TILE_N)
Activation = Literal["silu", "gelu_tanh"]
_EPILOGUES = {None: 0, "silu": 1, "gelu_tanh": 2}
_I, _P = ctypes.c_int64, ctypes.c_void_p

NO_AVX512_BF16 = "this CPU has no AVX512-BF16 (the kernel's only path)"

_kernel: ctypes._CFuncPtr | None = None
_why: str | None = None  # None: not tried; "": loaded; else why not


def _load() -> str:
    """Builds and loads the kernel once per process; "" when it can run here, else why not."""
    global _kernel, _why
    if _why is not None:
        return _why
    if not torch.cpu._is_avx512_bf16_supported():  # no compile where it could only refuse
        _why = NO_AVX512_BF16
        return _why
    library = native_build.load(SOURCE)
    if isinstance(library, str):
        _why = library
    elif library.ttserve_bf16_gemm_vector_bits() != 512:
        _why = NO_AVX512_BF16
    elif library.ttserve_bf16_gemm_tile() != TILE:
        _why = f"{SOURCE.name} packs tiles of {library.ttserve_bf16_gemm_tile()} outputs, this module {TILE}"
    else:
        _kernel = native_build.void_function(library, "ttserve_bf16_gemm", [_P, _I, _P, _P, _P, _I, _I, _I, _I,
                                                                            ctypes.c_int])
        _why = ""
    return _why


def kernel_unavailable() -> str:
    """Why the kernel cannot run on this host at all; "" when it can (whether the models use it
    is `unavailable()`)."""
    return _load()


def unavailable(weight: torch.Tensor) -> str:
    """Why the models' GEMMs of this [out, in] weight do not use the kernel here; "" when they do."""
    switch = os.environ.get(SWITCH, "").lower()
    if switch not in ("", "onednn", "ttserve"):
        raise ValueError(f"{SWITCH}={os.environ[SWITCH]!r}: onednn (never ttserve's GEMM) or ttserve (also on AMX "
                         "CPUs), or unset")
    if switch == "onednn":
        return f"{SWITCH}=onednn"
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return f"it computes bfloat16 on a CPU, not {weight.dtype} on {weight.device.type}"
    if weight.shape[1] % 2:
        return f"an odd number of inputs ({weight.shape[1]}): it multiplies input pairs"
    if switch != "ttserve" and torch.cpu._is_amx_tile_supported():
        return f"an AMX CPU, where oneDNN's AMX GEMMs serve ({SWITCH}=ttserve overrides)"
    return _load()


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 32), in / 2, 32, 2], zero-padded to whole tiles (bf16_gemm.c)."""
    out, width = weight.shape
    tiles = -(-out // TILE)
    padded = weight
    if out % TILE:  # only then a second copy (an LM head's is large)
        padded = torch.zeros(tiles * TILE, width, dtype=weight.dtype)
        padded[:out] = weight
    return padded.reshape(tiles, TILE, width // 2, 2).transpose(1, 2).contiguous()


class GEMM:
    """y = x W^T (+ b) for x [..., in] bfloat16, W [out, in]; or, made by `gated`, a gated MLP's
    act(x Wg^T) * (x Wu^T). unavailable(weight) must have said ""."""

    __slots__ = ("packed", "bias", "out_features", "in_features", "is_gated")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if _kernel is None:
            raise RuntimeError("bf16_gemm.unavailable() must say \"\" first")
        if not (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.shape[1] % 2 == 0 and (bias is None or bias.shape == weight.shape[:1])):
            raise ValueError(f"ttserve's GEMM takes a bfloat16 CPU weight [out, in] with an even width and a "
                             f"bias [out], not {weight.dtype} {tuple(weight.shape)} on {weight.device.type}"
                             + ("" if bias is None else f" with a bias {tuple(bias.shape)}"))
        self.out_features, self.in_features = weight.shape
        self.packed = _packed(weight)
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self.is_gated = False

    @classmethod
    def gated(cls, gate: torch.Tensor, up: torch.Tensor) -> "GEMM":
        """One GEMM of a gated MLP's [inter, hidden] gate and up weights (inter a multiple of 16),
        giving act(gate) * up (act a call's choice, silu unless named): its tiles are 16 gate
        outputs, then the same 16 up outputs."""
        inter, hidden = gate.shape
        if inter % (TILE // 2) or up.shape != gate.shape:
            raise ValueError(f"a gated GEMM needs gate and up of one shape, outputs a multiple of {TILE // 2}")
        halves = torch.stack([gate.view(-1, TILE // 2, hidden), up.view(-1, TILE // 2, hidden)], dim=1)
        gemm = cls(halves.reshape(2 * inter, hidden))
        gemm.out_features, gemm.is_gated = inter, True
        return gemm

    def __call__(self, x: torch.Tensor, activation: Activation = "silu") -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1 or x.dtype != torch.bfloat16:
            x2 = x2.contiguous().to(torch.bfloat16)
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.bfloat16)
        if rows:
            _kernel(x2.data_ptr(), x2.stride(0), self.packed.data_ptr(),
                    None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), self.out_features,
                    rows, self.packed.shape[0] * TILE if self.is_gated else self.out_features, self.in_features,
                    _EPILOGUES[activation if self.is_gated else None])
        return y.view(*lead, self.out_features)
