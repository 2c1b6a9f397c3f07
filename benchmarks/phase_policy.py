"""How many prefill steps may run in a row while decodes wait: the trade measured.

Drives the real lane scheduler against a device-time model (no model arithmetic): prefill step
= 10 ms + 0.45 ms per token, decode step = 30 ms, close to Llama 3.1 8B on an n300 (67 ms TTFT
at 128 tokens, 33.5 tokens/s/user at batch 32). 16 requests stream long outputs; at t = 1 s a
burst of 8 prompts of 2,048 tokens arrives (chunked at 512 tokens a step). Reported per bound:
the worst and 99th-percentile inter-token gap of the streaming requests, and the burst's mean
time to first token, each as a ratio to the unbounded policy (prefill always first).

    python benchmarks/phase_policy.py [--quick]
"""
from __future__ import annotations

import json
import argparse
import statistics
import sys

from ttserve.control.blocks import BlockPool
from ttserve.control.phase import PhasePolicy
from ttserve.control.request import Request, SamplingParams
from ttserve.control.lanes import LaneGroup
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.step import StepKind

PREFILL_FIXED_S, PREFILL_PER_TOKEN_S, DECODE_S = 0.010, 0.00045, 0.030


def simulate(bound: int) -> dict:
    # The loop production runs: a lane group (here of one lane) whose policy picks each step.
    s = LaneGroup([Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=8192),
                             BlockPool(4096, 64))], PhasePolicy(bound))
    lane = s.lanes[0]
    streaming = [Request(f"s{i}", [5] * 64, SamplingParams(max_tokens=10_000, ignore_eos=True)) for i in range(16)]
    burst = [Request(f"b{i}", [6] * 2048, SamplingParams(max_tokens=32, ignore_eos=True)) for i in range(8)]
    for r in streaming:
        lane.add(r)
    now, arrived, last_token, gaps, first_token = 0.0, False, {}, [], {}
    done_at = None
    while done_at is None or now < done_at + 0.5:  # until the burst is in, plus some decode
        if done_at is None and len(first_token) == len(burst):
            done_at = now
        if not arrived and now >= 1.0:
            arrived = True
            for r in burst:
                lane.add(r)
        plan = s.schedule()
        if plan.kind is StepKind.PREFILL:
            now += PREFILL_FIXED_S + PREFILL_PER_TOKEN_S * plan.num_tokens
        elif plan.kind is StepKind.DECODE:
            now += DECODE_S
        sampled = {w.request.request_id: 7 for w in plan.prefill if w.sample}
        sampled |= {w.request.request_id: 7 for w in plan.decode}
        for r in s.update(plan, sampled):
            if r.request_id.startswith("s"):
                if arrived and r.request_id in last_token:
                    gaps.append(now - last_token[r.request_id])
                last_token[r.request_id] = now
            elif r.request_id not in first_token:
                first_token[r.request_id] = now - 1.0
    gaps.sort()
    return {"worst_itl_s": gaps[-1], "p99_itl_s": gaps[int(0.99 * (len(gaps) - 1))],
            "burst_ttft_s": statistics.mean(first_token.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI: bounds 1 and 4 only")
    args = parser.parse_args()
    unbounded = simulate(1_000_000)
    report = {}
    for bound in (1, 4) if args.quick else (1, 2, 4, 8, 16):
        r = simulate(bound)
        report[bound] = {"worst_itl_ratio": round(r["worst_itl_s"] / unbounded["worst_itl_s"], 3),
                         "p99_itl_ratio": round(r["p99_itl_s"] / unbounded["p99_itl_s"], 3),
                         "burst_ttft_ratio": round(r["burst_ttft_s"] / unbounded["burst_ttft_s"], 3),
                         "worst_itl_ms": round(1000 * r["worst_itl_s"]),
                         "burst_ttft_ms": round(1000 * r["burst_ttft_s"])}
    report["unbounded"] = {"worst_itl_ms": round(1000 * unbounded["worst_itl_s"]),
                           "burst_ttft_ms": round(1000 * unbounded["burst_ttft_s"])}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
