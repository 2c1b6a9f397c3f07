"""Steady decode on the simulated Galaxy: how close the whole system gets to the device's limit.

A sim worker with the `galaxy-llama-3.3-70b` profile (a traced decode step of 1/72.5 s) under a
control plane with 4 lanes x 8 requests. With every row busy decoding, the device could run
72.5 steps/s; whatever the control plane, gRPC and the runner add between steps shows up as
achieved steps/s below that. Reported: achieved / limit with host sampling, and with device
sampling without and with async decode overlap (goal: >= 0.98 with overlap).

    python benchmarks/sim_decode.py [--seconds 10] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from control_stack import control_stack
from ttserve.worker.backends.sim.model import PROFILES

PROFILE = "galaxy-llama-3.3-70b"


def measure(model: str, seconds: float, tt: str, control_flags: tuple[str, ...] = ()) -> dict:
    worker = ["--backend", "sim", "--sim-profile", PROFILE, "--model", model, "--additional-config", tt]
    control = ["--data-parallel-size", "4", "--max-num-seqs", "8", *control_flags]
    with control_stack([worker], control) as client:
        ids = {f"r{i}" for i in range(32)}
        for i in range(32):
            client.add(f"r{i}", [1, 2, 3, 4 + i], 4000, ignore_eos=True)
        # Every request has finished its prefill once its first token is out: from then on every
        # row decodes, and the window counts decode steps only.
        prefilled: set[str] = set()
        deadline = time.monotonic() + 120
        while prefilled != ids:
            if time.monotonic() > deadline:
                raise SystemExit(f"{len(ids - prefilled)} of 32 requests had no first token after 120 s")
            message = client.next(timeout=max(deadline - time.monotonic(), 0.1))
            prefilled.update(out.request_id for out in message.outputs.outputs if out.new_token_ids)
        before = client.server_info().workers[0].num_steps
        time.sleep(seconds)
        steps = client.server_info().workers[0].num_steps - before
    limit = 1 / PROFILES[PROFILE].decode_step_s
    return {"steps_per_s": round(steps / seconds, 2), "limit_steps_per_s": round(limit, 2),
            "ratio_to_limit": round(steps / seconds / limit, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="CI: 1 second per mode")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 1.0
    device = '{"tt": {"sample_on_device_mode": "all"}}'
    report = {
        "host sampling (no overlap possible)": measure(args.model, args.seconds, '{"tt": {}}'),
        "device sampling, no async overlap": measure(args.model, args.seconds, device, ("--no-async-scheduling",)),
        "device sampling, async overlap": measure(args.model, args.seconds, device),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
