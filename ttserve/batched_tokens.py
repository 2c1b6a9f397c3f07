"""The prefill token budget per step when --max-num-batched-tokens is not given: the control plane
plans with it (control/serving_plan.py) and the worker's preflight sizes its KV plan by it, so
both read it here."""
from __future__ import annotations

# Prefill tokens per step unless --max-num-batched-tokens says. A CPU prefills SmolLM2 at ~0.6 ms a
# token on 2 cores, and a step's tokens get their first token together when it ends: the finer
# the steps, the sooner a burst's middle request hears back. At 1024, 32 prompts of 128 tokens
# arriving together (benchmarks/vs_vllm.py's c=32 load) got their first tokens sooner than at 2048
# (TTFT p50 1413/1413 -> 1303/1277 ms, output 358/352 -> 371/369 tok/s, 2-core EPYC). At 512 with
# decodes waiting for at most 2 steps, c=32's output fell in five of seven served A/B rounds; with
# decodes waiting for as many prefill tokens as before (4 steps of 512, control/phase.py), three
# alternating rounds on the 2-core EPYC gave TTFT p50 at c=8 706/664/681 -> 452/427/458 ms and at
# c=32 1583/1766/1405 -> 1384/1544/1452 ms, output at c=8 278/311/289 -> 291/301/298 and at c=32
# 367/388/387 -> 398/389/386 tok/s (a 512-row GEMM is no slower a row than a 1024-row one:
# benchmarks/gemm.py). Devices keep 2048.
CPU_BATCHED_TOKENS, DEVICE_BATCHED_TOKENS = 512, 2048


def default_batched_tokens(backend: str, device: str) -> int:
    """The prefill token budget per step for a worker of `backend` on `device` (its Describe)."""
    return CPU_BATCHED_TOKENS if backend == "torch" and device.split(":")[0] == "cpu" else DEVICE_BATCHED_TOKENS
