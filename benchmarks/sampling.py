"""The worker's sampler (worker/sampling.py `sample`) against vLLM CPU's (TopKTopPSampler on the CPU:
top-k/top-p filtering, then its fused Gumbel-max kernel), on the same logits in this process.

Logits are [rows, vocab] float32 over SmolLM2's vocabulary, each row Zipf-like (the k-th most
likely token's logit -1.1 ln k, plus noise, in a random order: the nucleus at top_p 0.9 holds a
few hundred tokens, as a small model's does at temperature 1). Per row count and setting
(temperature 1; temperature 0.7 with top_p 0.9; temperature 0.7 with top_k 50) each sampler runs
--repeats times, alternating; prints the medians in ms and vLLM / ttserve (above 1: ttserve is
faster). vLLM's side includes its temperature division, as its Sampler divides before it.

    python benchmarks/sampling.py [--rows 1 8 32] [--repeats 30] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 49_152
SETTINGS = {"temperature_1": (1.0, 0, 1.0), "top_p_0.9": (0.7, 0, 0.9), "top_k_50": (0.7, 50, 1.0)}


def zipf_logits(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.1 * ranks.log()
    logits = base + 0.3 * torch.randn(rows, vocab, generator=generator)
    order = torch.argsort(torch.rand(rows, vocab, generator=generator), dim=-1)
    return logits.gather(1, order)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="CI: rows 1 and 4, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = [1, 4], 3
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    from ttserve.worker.backends.torch.models import cpu_kernels
    from ttserve.worker.sampling import SamplingBatch, sample

    if cpu_kernels.gemm_unavailable(torch.zeros(64, 64, dtype=torch.bfloat16)):  # loads vLLM's op library
        print(json.dumps({"skipped": "vLLM CPU's op library is not loadable here"}))
        return 0
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    theirs = TopKTopPSampler()
    generator = torch.Generator().manual_seed(0)
    results: dict[str, dict] = {}
    for rows in args.rows:
        logits = zipf_logits(rows, VOCAB, generator)
        for name, (temperature, top_k, top_p) in SETTINGS.items():
            batch = SamplingBatch([temperature] * rows, [top_k] * rows, [top_p] * rows)
            k = torch.full((rows,), top_k, dtype=torch.long) if top_k else None
            p = torch.full((rows,), top_p) if top_p < 1 else None
            times: dict[str, list[float]] = {"ttserve": [], "vllm": []}
            for _ in range(args.repeats + 2):  # the first two warm both up
                start = time.perf_counter()
                sample(logits, batch)
                times["ttserve"].append(time.perf_counter() - start)
                mine = logits.clone()  # vLLM filters in place
                start = time.perf_counter()
                theirs.forward_cpu(mine.div_(temperature) if temperature != 1 else mine, {}, k, p)
                times["vllm"].append(time.perf_counter() - start)
            ms = {who: statistics.median(t[2:]) * 1e3 for who, t in times.items()}
            results[f"{name} rows={rows}"] = {"ttserve_ms": round(ms["ttserve"], 3), "vllm_ms": round(ms["vllm"], 3),
                                              "vllm_over_ttserve": round(ms["vllm"] / ms["ttserve"], 2)}
            print(f"{name} rows={rows}: {json.dumps(results[f'{name} rows={rows}'])}", flush=True)
    print(json.dumps({"vocab": VOCAB, "threads": torch.get_num_threads(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
