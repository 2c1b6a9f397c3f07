"""ttserve's bf16 GEMM (bf16_gemm.py) against vLLM CPU's oneDNN matmul handler, over a model's own
weight shapes at decode and prefill row counts, on the worker's cores.

Each pass multiplies `rows` rows through every layer's q/k/v, o, gate+up (ttserve: one gated GEMM
with silu; oneDNN: two GEMMs, silu and the product, as linear.SwiGLU runs them) and down
projections and the LM head, in layer order (each layer's own weights, as a step reads them);
passes alternate between the kernels and the best of --repeats counts. Prints per row count both
kernels' ms, the weight bytes read per second (what bounds a decode step) and the arithmetic
rate (what bounds a prefill), and oneDNN / ttserve (above 1: ttserve is faster).

    python benchmarks/gemm.py [--model smollm2] [--rows 1 8 32 128 512 2048] [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from weight_bound import weight_shapes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an embedded model name or a prepared folder")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="CI: 2 layers, rows 1 and 64, 2 passes")
    args = parser.parse_args()
    from ttserve.worker.backends.torch.models import bf16_gemm, cpu_kernels
    from ttserve.worker.planning.model_prepare import resolve_model

    config = json.loads((Path(resolve_model(args.model)) / "config.json").read_text())
    if args.quick:
        config, args.rows, args.repeats = {**config, "num_hidden_layers": 2}, [1, 64], 2
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    probe = torch.zeros(64, 64, dtype=torch.bfloat16)
    why = bf16_gemm.kernel_unavailable() or cpu_kernels.gemm_unavailable(probe)
    if why:
        print(json.dumps({"skipped": why}))
        return 0
    g = torch.Generator().manual_seed(0)

    def weight(out: int, width: int) -> torch.Tensor:
        return (torch.randn(out, width, generator=g) / width ** 0.5).to(torch.bfloat16)

    shapes = weight_shapes(config)  # per layer q/k/v, o, gate, up, down; then the LM head
    ours, theirs, weight_bytes = [], [], 0
    for layer in range(config["num_hidden_layers"]):
        qkv, o, gate, up, down = (weight(*shape) for shape in shapes[5 * layer:5 * layer + 5])
        ours.append([bf16_gemm.GEMM(qkv), bf16_gemm.GEMM(o), bf16_gemm.GEMM.gated(gate, up), bf16_gemm.GEMM(down)])
        theirs.append([cpu_kernels.MatMul(w, None) for w in (qkv, o, gate, up, down)])
        weight_bytes += 2 * sum(w.numel() for w in (qkv, o, gate, up, down))
    head = weight(*shapes[-1])
    hidden, attended_width = head.shape[1], ours[0][1].in_features
    ours_head, theirs_head = bf16_gemm.GEMM(head), cpu_kernels.MatMul(head, None)
    weight_bytes += 2 * head.numel()

    def run_ours(x: torch.Tensor, attended: torch.Tensor) -> None:
        for qkv, o, gate_up, down in ours:
            qkv(x)
            o(attended)
            down(gate_up(x))
        ours_head(x)

    def run_theirs(x: torch.Tensor, attended: torch.Tensor) -> None:
        for qkv, o, gate, up, down in theirs:
            qkv(x)
            o(attended)
            down(F.silu(gate(x), inplace=True).mul_(up(x)))
        theirs_head(x)

    results = {}
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
            attended = torch.randn(rows, attended_width, generator=g).to(torch.bfloat16)
            best = {"ttserve": float("inf"), "onednn": float("inf")}
            for _ in range(args.repeats):
                for name, run in (("ttserve", run_ours), ("onednn", run_theirs)):
                    start = time.perf_counter()
                    run(x, attended)
                    best[name] = min(best[name], time.perf_counter() - start)
            results[rows] = {
                **{f"{name}_ms": round(s * 1e3, 2) for name, s in best.items()},
                **{f"{name}_gb_per_s": round(weight_bytes / s / 1e9, 1) for name, s in best.items()},
                # 2 flops and 2 bytes per weight: a row's flops are the weight bytes
                **{f"{name}_gflop_per_s": round(weight_bytes * rows / s / 1e9, 1) for name, s in best.items()},
                "onednn_over_ttserve": round(best["onednn"] / best["ttserve"], 2)}
            print(f"rows {rows}: {json.dumps(results[rows])}", flush=True)
    print(json.dumps({"weight_bytes": weight_bytes, "threads": torch.get_num_threads(), "rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
