"""The `--dtype` flag as vLLM names it, and the rule `auto` follows.

auto:
* CUDA: bfloat16 where the GPU computes in it natively (Ampere and later), else float16.
* CPU: bfloat16 where the CPU has native bf16 instructions (x86 `avx512_bf16` or `amx_bf16`,
  Arm `bf16`): its GEMMs then read half the bytes of float32, and decode on a CPU is bound by
  memory bandwidth. Elsewhere float32: emulated bf16 or fp16 arithmetic is slower than float32.

The checkpoint's own dtype does not decide: SmolLM2 is prepared in float32, and serving it in
float32 on a bf16-capable CPU would forgo 1.5-2x. `float32` stays available and is exact
against transformers in float32; the 16-bit dtypes are checked against transformers run in
the same dtype (tests/test_reference_model.py).
"""
from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a dtype is resolved: `ttserve up` parses flags without it
    import torch

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")

# /proc/cpuinfo flags that mean the CPU multiplies bf16 natively.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this host's CPU advertises bf16 arithmetic (Linux; False where it cannot tell)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.machine() == "arm64" and platform.system() == "Darwin"  # Apple M2+
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and _NATIVE_BF16_FLAGS & set(value.split()):
            return True
    return False


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The torch dtype of weights, activations and KV for `--dtype name` on `device`, and why."""
    import torch

    if name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {name!r} is not one of {', '.join(DTYPE_CHOICES)}")
    if name != "auto":
        return getattr(torch, name), "requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU computes in bf16"
        return torch.float16, "auto: the GPU lacks bf16"
    if cpu_has_native_bf16():
        return torch.bfloat16, "auto: the CPU has native bf16 (avx512_bf16/amx_bf16/bf16)"
    return torch.float32, "auto: the CPU has no native bf16"
