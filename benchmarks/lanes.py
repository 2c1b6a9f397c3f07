"""The same workload on four topologies: 1 lane, a 4-lane group in one worker, 2 workers (with
torch's default threads, and with one thread each).

Each topology gets the same total capacity (16 rows) and the same 16 greedy requests of 64
tokens, driven token-level through the control plane (no gateway). Reported: output tokens/s,
device steps per worker, and the ratio of tokens/s to the 1-lane run measured in this command.
On a CPU the workers share the cores, so this shows the system's overheads and step counts,
not device scaling; `--num-threads` shows what splitting the cores between workers recovers.

    python benchmarks/lanes.py [--model smollm2] [--max-tokens 64] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from control_stack import control_stack

TOPOLOGIES = {
    "1 lane x 16": dict(workers=1, control=["--max-num-seqs", "16"]),
    "4-lane group x 4": dict(workers=1, control=["--data-parallel-size", "4", "--max-num-seqs", "4"]),
    "2 workers x 8": dict(workers=2, control=["--max-num-seqs", "8"]),
    "2 workers x 8, 1 thread each": dict(workers=2, control=["--max-num-seqs", "8"],
                                         worker=["--num-threads", "1"]),
}


def _measure(model: str, workers: int, control: list[str], max_tokens: int,
             worker_flags: list[str]) -> dict:
    worker = ["--model", model, "--kv-cache-memory-bytes", str(512 << 20), *worker_flags]
    with control_stack([worker] * workers, control) as client:
        client.add("warm", [1, 2, 3], 2)
        client.collect({"warm"})
        before = [w.num_steps for w in client.server_info().workers]
        start = time.perf_counter()
        for i in range(16):
            client.add(f"r{i}", [1, 504, 3458, 282, 100 + i], max_tokens, ignore_eos=True)
        results = client.collect({f"r{i}" for i in range(16)})
        wall = time.perf_counter() - start
        steps = [w.num_steps - b for w, b in zip(client.server_info().workers, before)]
    return {"output_tokens_per_s": sum(len(r.token_ids) for r in results.values()) / wall,
            "steps_per_worker": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="CI: 8 output tokens per request")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens = 8
    report = {name: _measure(args.model, t["workers"], t["control"], args.max_tokens, t.get("worker", []))
              for name, t in TOPOLOGIES.items()}
    base = report["1 lane x 16"]["output_tokens_per_s"]
    for entry in report.values():
        entry["ratio_vs_1_lane"] = round(entry["output_tokens_per_s"] / base, 3)
        entry["output_tokens_per_s"] = round(entry["output_tokens_per_s"], 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
