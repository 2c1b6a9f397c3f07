"""The prefill token budget per step when --max-num-batched-tokens is not given: the control plane
plans with it (control/serving_plan.py) and the worker's preflight sizes its KV plan by it, so
both read it here."""
from __future__ import annotations

# Prefill tokens per step unless --max-num-batched-tokens says: a CPU prefills SmolLM2 at ~0.66 ms a
# token on 2 cores, so a step of 2048 holds every decode and every later prompt for ~1.4 s. At 1024,
# 32 prompts of 128 tokens arriving together (benchmarks/vs_vllm.py's c=32 load) got their first
# tokens sooner, TTFT p50 1413/1413 -> 1303/1277 ms, and output 358/352 -> 371/369 tok/s (2-core
# EPYC, two rounds). At 512, c=8's TTFT p50 fell ~25% more (in process, splitting 1024 tokens in two
# steps costs ~1%), but c=32's output fell in five of seven served A/B rounds (8-12% where the
# machine was steady) and rose 8-11% in two: not settled, so 1024 stays. Devices keep 2048.
CPU_BATCHED_TOKENS, DEVICE_BATCHED_TOKENS = 1024, 2048


def default_batched_tokens(backend: str, device: str) -> int:
    """The prefill token budget per step for a worker of `backend` on `device` (its Describe)."""
    return CPU_BATCHED_TOKENS if backend == "torch" and device.split(":")[0] == "cpu" else DEVICE_BATCHED_TOKENS
