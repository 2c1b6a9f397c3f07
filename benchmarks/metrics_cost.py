"""What the control plane's request metrics cost per decode step, against the rest of what a step's
results cost it: building each request's RequestOutput for its client (`output_of`, then the
session's `output_to_pb`).

Every step, each running request gains one token, and the engine both publishes it and counts it
(TTFT, inter-token latency, token counters). Measured in one run, per step of N running requests:
  - baseline: output_of and output_to_pb for every request (work the control plane does anyway);
  - ttserve:  Request.record_tokens and ControlMetrics.progressed for every request (the arrival
              recorded on the request, then TokenHistogram and plain tallies);
  - naive:    the same observations through prometheus_client's Histogram and labelled Counter;
  - tracing_off: what request tracing adds per request with --otlp-traces-endpoint unset (the step
              batch's `request.trace` test, control/wire.py; the worker group's `tracing.enabled`);
  - tracing_on: the same with tracing on and detailed worker traces: each decode item asks its
              request's trace whether this step carries it (request_trace.py), spans recorded
              by the OpenTelemetry SDK (no exporter: the export runs off the step loop).
Reports microseconds per step, the ratios of each to the baseline, and tracing off's cost per
request net of the harness's own loop (an empty work function).

    python benchmarks/metrics_cost.py [--running 256] [--steps 300] [--rounds 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from ttserve.control.metrics import ITL_BUCKETS, ControlMetrics
from ttserve.control.request_trace import RequestTracing
from ttserve.tracing import Tracer
from ttserve.control.request import Request, SamplingParams
from ttserve.control.session import output_of
from ttserve.control.wire import output_to_pb


def requests(n: int) -> list[Request]:
    out = [Request(str(i), [5] * 128, SamplingParams(max_tokens=1 << 30), received_time=0.0)
           for i in range(n)]
    for r in out:
        r.output_token_ids.append(7)
    return out


def per_step(running: int, steps: int, work: Callable[[Request, float], None]) -> float:
    """Median microseconds of one step's work over `running` requests."""
    batch = requests(running)
    for r in batch:
        work(r, 0.05)  # first token: the rare path, out of the measurement
    times = []
    for step in range(steps):
        for r in batch:
            r.output_token_ids.append(7)
        now = 0.1 + step * 0.02
        start = time.perf_counter()
        for r in batch:
            work(r, now)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def publish(request: Request, now: float) -> None:
    request.num_sent_tokens = len(request.output_token_ids) - 1
    output_to_pb(output_of(request))


def ttserve_metrics() -> Callable[[Request, float], None]:
    """What Engine._publish does per request with news: record the arrival, count it."""
    metrics = ControlMetrics()

    def work(request: Request, now: float) -> None:
        new = request.record_tokens(now)
        if new:
            metrics.progressed(request, new, "0")

    return work


def tracing_off() -> Callable[[Request, float], None]:
    """Control/wire.py's per-item test with tracing off, and the per-step hook's."""
    tracing = RequestTracing(Tracer.off())

    def work(request: Request, now: float) -> None:
        if request.trace is not None:
            request.trace.decode_parent()
        if tracing.enabled:
            raise AssertionError("tracing is off")

    return work


def tracing_on() -> Callable[[Request, float], None]:
    from opentelemetry.sdk.trace import TracerProvider

    tracing = RequestTracing(Tracer(TracerProvider(), "control"), worker_steps=True)

    def work(request: Request, now: float) -> None:
        if request.trace is None:
            request.trace_headers = {}
            request.received_time = now
            tracing.arrived(request)
        if request.trace is not None:
            request.trace.decode_parent()

    return work


def naive_metrics() -> Callable[[Request, float], None]:
    registry = CollectorRegistry()
    itl = Histogram("naive_itl_seconds", "ITL.", buckets=ITL_BUCKETS, registry=registry)
    tokens = Counter("naive_generation_tokens", "Tokens.", ["worker"], registry=registry)
    last: dict[str, float] = {}

    def work(request: Request, now: float) -> None:
        if request.request_id in last:
            itl.observe(now - last[request.request_id])
        last[request.request_id] = now
        tokens.labels(str(request.worker)).inc()

    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="CI: 32 running, 20 steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.running, args.steps, args.rounds = 32, 20, 1
    # "loop": calling an empty work function per request, the harness's own share of every arm.
    arms = {"baseline": lambda: publish, "ttserve": ttserve_metrics, "naive": naive_metrics,
            "tracing_off": tracing_off, "tracing_on": tracing_on, "loop": lambda: lambda request, now: None}
    rounds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, make in arms.items():
            rounds[name].append(per_step(args.running, args.steps, make()))
    us = {k: statistics.median(v) for k, v in rounds.items()}
    print(json.dumps({"running": args.running, "us_per_step": {k: round(v, 1) for k, v in us.items()},
                      **{f"{name}_over_baseline": round(us[name] / us["baseline"], 3) for name in arms
                         if name not in ("baseline", "loop")},
                      # What tracing off adds beyond the harness's loop, per request and step.
                      "tracing_off_ns_per_request": round((us["tracing_off"] - us["loop"]) * 1e3 / args.running, 1)}))


if __name__ == "__main__":
    main()
