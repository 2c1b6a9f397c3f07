"""The torch backend's CUDA-graph decode against the same worker with `tt.trace_mode none`, on a GPU.

Two of the worker's runners (worker/runner.py over TorchBackend, as `ttserve worker --device cuda`
builds them: bf16, decode traced as a CUDA graph unless tt.trace_mode is "none") serve the same
model and the same requests, one after the other: a prefill of --rows prompts, then --steps
greedy decode steps. Reported per runner: the median decode step (ms, the runner's own step, the
GPU synchronized by its readback) and the tokens; then the graph's speed-up over eager and how
many of the decoded tokens the two agree on (the static step attends over the whole page table
under a mask, eager over each row's blocks: the same math, other roundings, so a near-tie may
pick another token and the sequences part from there). Each step of both runners also checks
the other's: the first step where they differ is printed.

Without a model folder at hand (a GPU host with no model hub), --random builds SmolLM2-135M's
shape with seeded random weights in a temporary folder; random weights decode near-ties often,
so agreement is a weaker check there than on a trained model.

    python benchmarks/cuda_graph_decode.py [--model smollm2 | --random] [--rows 1 8 32] [--steps 64]
    python benchmarks/cuda_graph_decode.py --quick      # CI: skips without CUDA
Prints JSON: per row count, each runner's median step ms and the graph's speed-up and agreement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# SmolLM2-135M-Instruct's config.json, the fields the reference model reads.
SMOLLM2_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                 "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
                 "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def random_model(folder: Path) -> Path:
    """SmolLM2-135M's shape with seeded random weights (std 0.02, norms 1), as safetensors."""
    from safetensors.torch import save_file

    c = SMOLLM2_SHAPE
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": w(c["vocab_size"], hidden),
             "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(kv, hidden),
                      p + "self_attn.v_proj.weight": w(kv, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
                      p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                      p + "mlp.down_proj.weight": w(hidden, inter),
                      p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                      p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c))
    return folder


def runner(model_path: Path, device: torch.device, tt: dict, rows: int, max_len: int):
    """The worker's runner as worker/config.py builds it for the torch backend."""
    from ttserve.worker.backends.torch.backend import TorchBackend
    from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM
    from ttserve.worker.batch import ServingConfig
    from ttserve.worker.runner import DeviceOptions, ModelRunner

    options = DeviceOptions(tt, backend_traces=device.type == "cuda" or "trace_mode" in tt,
                            traced_kinds=frozenset({"decode"}))
    r = ModelRunner(model_path, TorchLlamaForCausalLM, "LlamaForCausalLM",
                    TorchBackend(device, torch.bfloat16, options.traced), torch.bfloat16, block_size=64,
                    kv_cache_bytes=1 << 30, options=options)
    r.warmup(ServingConfig(num_lanes=1, max_num_seqs=rows, max_model_len=max_len, max_num_batched_tokens=2048),
             lambda *a: None)
    return r


def generate(r, rows: int, prompt_len: int, steps: int) -> tuple[list[list[int]], list[float]]:
    """Prefill `rows` seeded prompts, then `steps` greedy decodes: each row's tokens and each
    decode step's seconds."""
    from ttserve.worker.batch import DecodeItem, NewRequest, PrefillChunk, StepBatch

    g = torch.Generator().manual_seed(1)
    blocks = -(-(prompt_len + steps + 1) // 64)
    news, chunks = [], []
    for i in range(rows):
        rid = f"r{i}"
        news.append(NewRequest(rid, 0, i, 0.0, 1.0, 0, None))
        chunks.append(PrefillChunk(rid, torch.randint(3, 49152, (prompt_len,), generator=g).tolist(), 0,
                                   list(range(i * blocks, (i + 1) * blocks)), True))
    result = r.execute(StepBatch(1, "prefill", new_requests=news, prefill=chunks))
    out = {rid: [t] for rid, t in result.tokens.items()}
    times = []
    for step in range(steps):
        items = [DecodeItem(rid, out[rid][-1], prompt_len + step, []) for rid in out]
        started = time.perf_counter()
        result = r.execute(StepBatch(2 + step, "decode", decode=items))
        times.append(time.perf_counter() - started)
        for rid, t in result.tokens.items():
            out[rid].append(t)
    return [out[f"r{i}"] for i in range(rows)], times


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int | None]:
    """The fraction of decoded tokens equal up to each row's first difference, and the earliest
    step where any row differs (None: none)."""
    same, total, first = 0, 0, None
    for x, y in zip(a, b):
        total += len(x)
        for step, (s, t) in enumerate(zip(x, y)):
            if s != t:
                first = step if first is None else min(first, step)
                break
            same += 1
    return same / total, first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an embedded model name or a prepared folder")
    parser.add_argument("--random", action="store_true", help="SmolLM2-135M's shape with random weights")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: the traced path's static shapes run eagerly (a check)")
    parser.add_argument("--quick", action="store_true", help="CI: 1 and 4 rows, 8 steps, random weights")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps, args.prompt_len, args.random = [1, 4], 8, 32, True
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device here"}))
        return 0
    with tempfile.TemporaryDirectory(prefix="cuda-graph-decode-") as tmp:
        if args.random:
            model_path = random_model(Path(tmp))
        else:
            from ttserve.worker.planning.model_prepare import resolve_model
            model_path = Path(resolve_model(args.model))
        report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "model": "random SmolLM2-135M shape" if args.random else str(model_path), "rows": {}}
        max_len = -(-(args.prompt_len + args.steps + 1) // 64) * 64
        tokens: dict[str, list[list[int]]] = {}
        for rows in args.rows:
            figures = {}
            # On a CPU the traced runner is asked for by tt.trace_mode (its static shapes run eagerly).
            traced = {} if device.type == "cuda" else {"trace_mode": "decode_only"}
            for name, tt in (("graph", traced), ("eager", {"trace_mode": "none"})):
                r = runner(model_path, device, tt, rows, max_len)
                tokens[name], times = generate(r, rows, args.prompt_len, args.steps)
                figures[name] = {"step_ms": round(statistics.median(times[2:] or times) * 1e3, 3),
                                 "traced": r.options.traced("decode")}
                r.close()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            same, first = agreement(tokens["graph"], tokens["eager"])
            figures["graph_speedup"] = round(figures["eager"]["step_ms"] / figures["graph"]["step_ms"], 3)
            figures["tokens_agree"] = round(same, 3)
            figures["first_difference_step"] = first
            report["rows"][rows] = figures
            print(json.dumps({rows: figures}), file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
