"""ttserve's prefill attention kernel (worker/backends/torch/models/prefill_attention.c) against vLLM
CPU's (`cpu_attention_with_kv_cache`), both on vLLM's KV cache layout, in the same process.

Two measures, alternating the kernels and reporting medians:
  - kernel: one prefill step's attention over 30 layers (each layer's cache its own tensor, so
    it is cold when read, as in a model), SmolLM2-135M's heads (9 query / 3 KV, head_dim 64),
    blocks of 64, with vLLM's KV write as the model runs it; ms per step, and GFLOP/s of the
    causal products;
  - step: SmolLM2-135M's whole bf16 prefill step (prefill_forward) with the one kernel or the
    other, on the same model and cache.
Shapes are ROWSxCHUNK@CONTEXT: ROWS rows each computing its last CHUNK tokens of CONTEXT (a chunk
over a cached prefix when CHUNK < CONTEXT). Ratios are vLLM's time / ttserve's (above 1: ttserve's
kernel is faster).

    python benchmarks/prefill_attention.py [--shapes 4x128@128 1x512@2048] [--quick]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import torch

from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM, cpu_kernels, prefill_attention
from ttserve.worker.planning.model_prepare import resolve_model

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 64, 30
BF16 = torch.bfloat16
DEFAULT_SHAPES = ["4x128@128", "8x128@128", "1x512@512", "1x512@2048", "1x512@4096"]


def parse_shape(text: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)@(\d+)", text)
    if not match or int(match[2]) > int(match[3]) or 0 in map(int, match.groups()):
        raise argparse.ArgumentTypeError(f"{text!r}: ROWSxCHUNK@CONTEXT, 1 <= CHUNK <= CONTEXT")
    return int(match[1]), int(match[2]), int(match[3])


def _table(rows: int, context: int) -> torch.Tensor:
    per_row = -(-context // BLOCK)
    return torch.arange(rows * per_row).reshape(rows, per_row)


def kernel_figures(rows: int, chunk: int, context: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    table = _table(rows, context)
    caches = []
    for _ in range(LAYERS):
        (k, v), = cpu_kernels.allocate(1, 1, table.numel() + 1, KV_HEADS, BLOCK, HEAD_DIM, BF16)[0]
        k.copy_(torch.randn(k.shape, generator=generator).to(BF16))
        v.copy_(torch.randn(v.shape, generator=generator).to(BF16))
        caches.append((k, v))
    positions = torch.arange(context - chunk, context)
    slots = (table.gather(1, (positions // BLOCK).expand(rows, -1)) * BLOCK + positions % BLOCK).flatten()
    tokens = rows * chunk
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(BF16)
    k_new = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(BF16)
    out = torch.empty(tokens, HEADS, HEAD_DIM, dtype=BF16)
    isa = cpu_kernels.isa(BF16, BLOCK, HEAD_DIM)
    plans = {name: cpu_kernels.Attention.plan(0, tokens, slots, torch.full((rows,), chunk), torch.full((rows,), context),
                                              table, HEADS, KV_HEADS, HEAD_DIM, BLOCK, BF16, isa,
                                              own_prefill=name == "ttserve")
             for name in ("vllm", "ttserve")}
    assert plans["ttserve"].kernel == "prefill" and plans["vllm"].kernel == "vllm"
    times: dict[str, list[float]] = {name: [] for name in plans}
    for plan in plans.values():
        for k, v in caches:  # warm
            plan(q, k_new, k_new, k, v, out)
    for _ in range(repeats):
        for name, plan in plans.items():
            started = time.perf_counter()
            for k, v in caches:
                plan(q, k_new, k_new, k, v, out)
            times[name].append(time.perf_counter() - started)
    flops = 4 * HEADS * HEAD_DIM * rows * sum(context - chunk + i + 1 for i in range(chunk)) * LAYERS
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"shape": f"{rows}x{chunk}@{context}", "ms_per_step": {k: round(v, 2) for k, v in ms.items()},
            "gflop_per_s": {k: round(flops / v / 1e6) for k, v in ms.items()},
            "kernel_ratio": round(ms["vllm"] / ms["ttserve"], 3)}


def step_figures(model: TorchLlamaForCausalLM, rows: int, chunk: int, context: int, repeats: int) -> dict:
    table = _table(rows, context)
    kv = model.allocate_kv_cache((table.numel(), KV_HEADS, BLOCK, HEAD_DIM), BF16, LAYERS)
    assert model.own_prefill_attention
    tokens = torch.randint(0, 49152, (rows, context), generator=torch.Generator().manual_seed(0))
    start, end = [context - chunk] * rows, [context] * rows
    times: dict[str, list[float]] = {"vllm": [], "ttserve": []}
    for _ in range(repeats):
        for name in times:
            model.own_prefill_attention = name == "ttserve"  # the model's verdict, set here per run
            started = time.perf_counter()
            model.prefill_forward(tokens, table, kv, end, start_pos=start)
            times[name].append(time.perf_counter() - started)
    model.own_prefill_attention = True
    ms = {name: statistics.median(t[1:] if len(t) > 1 else t) * 1e3 for name, t in times.items()}
    return {"shape": f"{rows}x{chunk}@{context}", "step_ms": {k: round(v, 1) for k, v in ms.items()},
            "step_ratio": round(ms["vllm"] / ms["ttserve"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in DEFAULT_SHAPES])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="CI: 2x64@128, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.repeats = [parse_shape("2x64@128")], 3
    why = prefill_attention.unavailable(BF16, HEADS, KV_HEADS, HEAD_DIM, BLOCK, cpu_kernels.isa(BF16, BLOCK, HEAD_DIM))
    if why or cpu_kernels.unavailable(torch.device("cpu"), BF16, BLOCK, HEAD_DIM, None):
        print(json.dumps({"skipped": why or "vLLM CPU's kernels do not load here"}))
        return 0
    model_path = resolve_model("smollm2")
    config = json.loads((model_path / "config.json").read_text())
    model = TorchLlamaForCausalLM.initialize_vllm_model(config, "cpu", max(r for r, _, _ in args.shapes),
                                                        max(c for _, _, c in args.shapes) + 1,
                                                        model_path=str(model_path), dtype=BF16)
    report = {"threads": torch.get_num_threads(), "kernel": [], "step": []}
    for rows, chunk, context in args.shapes:
        if not prefill_attention.fills_threads([chunk] * rows, [context] * rows, HEADS, KV_HEADS,
                                               torch.get_num_threads()):
            parser.error(f"{rows}x{chunk}@{context} cannot keep ttserve's kernel's threads busy on "
                         f"{torch.get_num_threads()} threads (vLLM's serves it)")
        report["kernel"].append(kernel_figures(rows, chunk, context, args.repeats))
        report["step"].append(step_figures(model, rows, chunk, context, args.repeats))
        print(json.dumps(report["kernel"][-1]), json.dumps(report["step"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
