"""Scheduler cost per step, ttserve's lane scheduler beside vLLM's V1 Scheduler, same arrivals.

Each step is the scheduler's whole share of a device step: plan it (`schedule`) and apply the
sampled tokens (`update` / `update_from_output`), with no model. Scenarios:
  - 1 lane, 32 running decodes + 1,000 waiting (the queue must not cost per step);
  - 1 lane, 256 running decodes.
Reports the median of per-round medians in microseconds and the ratio ttserve / vLLM (the goal
is at most 0.5). vLLM is driven as docs/vllm-cpu.md records.

    python benchmarks/scheduler_cost.py [--steps 300] [--rounds 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

BLOCK = 64
NUM_BLOCKS = 8192
PROMPT = 128


def ttserve_steps(running: int, waiting: int, steps: int, wire: bool = False) -> list[float]:
    """With `wire`, each step also builds and serializes the device.proto StepBatch, the rest of
    the control plane's per-step work (vLLM's figure has no counterpart: its engine core and
    model runner share a process)."""
    from ttserve.control.blocks import BlockPool
    from ttserve.control.wire import step_batch_to_pb
    from ttserve.control.request import Request, SamplingParams
    from ttserve.control.lanes import LaneGroup
    from ttserve.control.scheduler import Scheduler, SchedulerConfig

    # The loop production runs: a lane group, here of one lane.
    lane = Scheduler(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=8192, max_model_len=4096),
                     BlockPool(NUM_BLOCKS, BLOCK))
    s = LaneGroup([lane])
    for i in range(running + waiting):
        lane.add(Request(str(i), [5] * PROMPT, SamplingParams(max_tokens=100_000, ignore_eos=True)))
    while any(r.is_prefilling for r in lane.running) or len(lane.running) < running:  # admit everyone
        plan = s.schedule()
        s.update(plan, _sampled(plan))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        plan = s.schedule()
        if wire:
            step_batch_to_pb(1, plan.kind, plan.lanes, running).SerializeToString()
        s.update(plan, _sampled(plan))
        times.append(time.perf_counter() - start)
    return times


def _sampled(plan) -> dict[str, int]:
    """A token for every request the step samples: each decode row and each prefill's last
    chunk. (The admission loop's steps mix decodes in once the first prompts are prefilled.)"""
    return {w.request.request_id: 7 for w in (*plan.decode, *(w for w in plan.prefill if w.sample))}


def vllm_steps(running: int, waiting: int, steps: int) -> list[float]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0")
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1,
                   "num_key_value_heads": 1, "vocab_size": 1000, "max_position_embeddings": 8192}, f)
    model = ModelConfig(model=folder, dtype="float16", seed=42, skip_tokenizer_init=True, max_model_len=4096)
    sched = SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=8192, max_model_len=4096,
                            enable_chunked_prefill=True, is_encoder_decoder=model.is_encoder_decoder)
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=False)
    cache.num_gpu_blocks = NUM_BLOCKS
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    s = Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                  block_size=BLOCK, include_finished_set=False, log_stats=True)
    for i in range(running + waiting):
        s.add_request(Request(request_id=str(i), prompt_token_ids=[5] * PROMPT,
                              sampling_params=SamplingParams(max_tokens=100_000, ignore_eos=True),
                              pooling_params=None, block_hasher=None))

    def step() -> None:
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = s.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([7] if done else [])
        s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                    sampled_token_ids=sampled))

    while len(s.running) < running or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def median_of_medians(run, rounds: int, *args) -> float:
    return statistics.median(statistics.median(run(*args)) for _ in range(rounds)) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="CI: 20 steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 20, 1
    report = {}
    for name, running, waiting in (("32 running + 1000 waiting", 32, 1000), ("256 running", 256, 0)):
        ours = median_of_medians(ttserve_steps, args.rounds, running, waiting, args.steps)
        wired = median_of_medians(ttserve_steps, args.rounds, running, waiting, args.steps, True)
        theirs = median_of_medians(vllm_steps, args.rounds, running, waiting, args.steps)
        report[name] = {"ttserve_us": round(ours, 1), "ttserve_with_step_proto_us": round(wired, 1),
                        "vllm_us": round(theirs, 1), "ratio": round(ours / theirs, 3),
                        "ratio_with_step_proto": round(wired / theirs, 3)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
