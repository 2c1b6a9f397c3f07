"""ttserve's decode attention kernel (worker/backends/torch/models/decode_attention.c) against vLLM
CPU's (`cpu_attention_with_kv_cache`), both on vLLM's KV cache layout, in the same process.

Two measures, each alternating the kernels and reporting medians:
  - kernel: one decode step's attention over 30 layers, each layer's cache its own tensor (as a
    model's: when layer i reads its cache, the other layers' weights and caches have passed
    through since, so it is cold), SmolLM2-135M's heads (9 query / 3 KV, head_dim 64) and blocks
    of 64; us per layer, and the KV bytes per second that makes;
  - step: SmolLM2-135M's whole bf16 decode step (decode_forward) with the one kernel or the other,
    on the same model and cache.
Ratios are vLLM's time / ttserve's (above 1: ttserve's kernel is faster).

    python benchmarks/decode_attention.py [--rows 8 32] [--context 200 1000] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM, cpu_kernels, decode_attention
from ttserve.worker.planning.model_prepare import resolve_model

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 64, 30
BF16 = torch.bfloat16


def kernel_figures(rows: int, context: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    per_row = -(-context // BLOCK)
    blocks = rows * per_row + 1
    caches = []
    for _ in range(LAYERS):
        (k, v), = cpu_kernels.allocate(1, 1, blocks, KV_HEADS, BLOCK, HEAD_DIM, BF16)[0]
        k.copy_(torch.randn(k.shape, generator=generator).to(BF16))
        v.copy_(torch.randn(v.shape, generator=generator).to(BF16))
        caches.append((k, v))
    table = torch.randperm(blocks - 1, generator=generator)[:rows * per_row].reshape(rows, per_row)
    lens = torch.full((rows,), context)
    slots = table[:, -1] * BLOCK + (context - 1) % BLOCK
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).to(BF16)
    k_new = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=generator).to(BF16)
    out = torch.empty(rows, HEADS, HEAD_DIM, dtype=BF16)
    isa = cpu_kernels.isa(BF16, BLOCK, HEAD_DIM)
    plans = {name: cpu_kernels.Attention.plan(0, rows, slots, torch.ones(rows, dtype=torch.long), lens, table,
                                              HEADS, KV_HEADS, HEAD_DIM, BLOCK, BF16, isa, own_decode=name == "ttserve")
             for name in ("vllm", "ttserve")}
    assert plans["ttserve"].metadata is None and plans["vllm"].metadata is not None

    def step(plan: cpu_kernels.Attention) -> None:
        for k, v in caches:
            plan(q, k_new, k_new, k, v, out)

    times: dict[str, list[float]] = {name: [] for name in plans}
    for name, plan in plans.items():
        step(plan)  # warm
    for _ in range(repeats):
        for name, plan in plans.items():
            started = time.perf_counter()
            step(plan)
            times[name].append((time.perf_counter() - started) / LAYERS)
    kv_bytes = rows * context * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16, one layer
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return {"rows": rows, "context": context, "us_per_layer": {k: round(v, 1) for k, v in us.items()},
            "kv_gb_per_s": {k: round(kv_bytes / v / 1e3, 1) for k, v in us.items()},
            "kernel_ratio": round(us["vllm"] / us["ttserve"], 3)}


def step_figures(model: TorchLlamaForCausalLM, rows: int, context: int, repeats: int) -> dict:
    per_row = -(-(context + 1) // BLOCK)
    kv = model.allocate_kv_cache((rows * per_row, KV_HEADS, BLOCK, HEAD_DIM), BF16, LAYERS)
    assert model.own_decode_attention
    table = torch.arange(rows * per_row).reshape(rows, per_row)
    tokens = torch.randint(0, 49152, (rows, 1), generator=torch.Generator().manual_seed(0))
    positions = torch.full((rows,), context)
    times: dict[str, list[float]] = {"vllm": [], "ttserve": []}
    for _ in range(repeats):
        for name in times:
            model.own_decode_attention = name == "ttserve"  # the model's verdict, set here per run
            model.decode_forward(tokens, positions, table, kv)
            started = time.perf_counter()
            model.decode_forward(tokens, positions, table, kv)
            times[name].append(time.perf_counter() - started)
    model.own_decode_attention = True
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"rows": rows, "context": context, "step_ms": {k: round(v, 2) for k, v in ms.items()},
            "step_ratio": round(ms["vllm"] / ms["ttserve"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="CI: 8 rows x 100 tokens, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.context, args.repeats = [8], [100], 3
    why = decode_attention.unavailable(BF16, HEADS, KV_HEADS, HEAD_DIM, BLOCK, cpu_kernels.isa(BF16, BLOCK, HEAD_DIM))
    if why or cpu_kernels.unavailable(torch.device("cpu"), BF16, BLOCK, HEAD_DIM, None):
        print(json.dumps({"skipped": why or "vLLM CPU's kernels do not load here"}))
        return 0
    if min(args.rows) * KV_HEADS < 2 * torch.get_num_threads():
        parser.error(f"--rows below {math.ceil(2 * torch.get_num_threads() / KV_HEADS)} run vLLM's kernel anyway")
    model_path = resolve_model("smollm2")
    config = json.loads((model_path / "config.json").read_text())
    model = TorchLlamaForCausalLM.initialize_vllm_model(config, "cpu", max(args.rows), 4096,
                                                        model_path=str(model_path), dtype=BF16)
    report = {"threads": torch.get_num_threads(), "kernel": [], "step": []}
    for rows in args.rows:
        for context in args.context:
            report["kernel"].append(kernel_figures(rows, context, args.repeats))
            report["step"].append(step_figures(model, rows, context, args.repeats))
            print(json.dumps(report["kernel"][-1]), json.dumps(report["step"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
