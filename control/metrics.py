"""The control plane's Prometheus metrics (catalog: docs/metrics.md).

Events (a token, a finished request, a step) are recorded as they happen; state (queues, KV
usage, worker up/ready/stalled) is read from the engine at scrape time, so a gauge can never
drift from the truth. Everything runs on the engine's event loop, scrapes included, so no state
is read while a step mutates it.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .request import Request
from .step import StepKind

if TYPE_CHECKING:
    from .engine import Engine

# vLLM's buckets, so dashboards built for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0)


class TokenHistogram:
    """A histogram cheap enough to observe once per generated token: no lock (everything runs on
    the engine's event loop) and no label lookup. prometheus_client's Histogram costs about 2 µs
    an observation, which at 256 running requests would double the control plane's cost per
    step (benchmarks/scheduler_cost.py)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation, self.buckets = name, documentation, buckets
        self.counts = [0] * (len(buckets) + 1)   # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def family(self) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts):
            running += count
            cumulative.append((bound, running))
        return HistogramMetricFamily(self.name, self.documentation, buckets=cumulative,
                                     sum_value=self.sum)

    def collect(self) -> list[HistogramMetricFamily]:
        """As prometheus_client's Histogram.collect, so either reads the same (vllm_metric_names.py)."""
        return [self.family()]


class ControlMetrics:
    def __init__(self, vllm_metric_names: bool = False, served_model_name: str = "") -> None:
        """`vllm_metric_names`: also serve vLLM's names (--vllm-metric-names, vllm_metric_names.py),
        their model_name label `served_model_name` ("": the model folder's name)."""
        self.vllm_metric_names, self.served_model_name = vllm_metric_names, served_model_name
        self.registry = r = CollectorRegistry()
        # Per-token events: plain tallies and TokenHistograms, exported by _EngineState.
        # By worker name: a worker removed and added again under its name counts on.
        self.prompt_tokens: Tally[str] = Tally()
        self.generation_tokens: Tally[str] = Tally()
        self.itl = TokenHistogram("ttserve_inter_token_latency_seconds",
                                  "Time between successive tokens.", ITL_BUCKETS)
        self.request_success = Counter(
            "ttserve_request_success", "Finished requests by finish reason.", ["finished_reason"],
            registry=r)
        self.refused = Counter(
            "ttserve_requests_refused", "Requests refused at admission, by reason.", ["reason"],
            registry=r)
        self.ttft = Histogram("ttserve_time_to_first_token_seconds",
                              "Arrival at the control plane to the first token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("ttserve_request_time_per_output_token_seconds",
                              "Decode time divided by (generated tokens - 1), per request.",
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ttserve_e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("ttserve_request_queue_time_seconds",
                                    "Arrival to first sent to a worker.", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.prefill_time = Histogram("ttserve_request_prefill_time_seconds",
                                      "First sent to a worker to the first token.",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("ttserve_request_decode_time_seconds",
                                     "First token to last token.", buckets=LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("ttserve_request_prompt_tokens",
                                               "Prompt tokens per finished request.",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("ttserve_request_generation_tokens",
                                                   "Generated tokens per finished request.",
                                                   buckets=TOKEN_BUCKETS, registry=r)
        self.step_duration = Histogram(
            "ttserve_step_duration_seconds", "A step's time on the worker, batch received to result.",
            ["worker", "kind"], buckets=STEP_BUCKETS, registry=r)
        self.step_rtt = Histogram(
            "ttserve_step_rtt_seconds",
            "A step's gRPC round trip from the control plane, sent to result received.",
            ["worker", "kind"], buckets=STEP_BUCKETS, registry=r)
        self.steps = Counter("ttserve_steps", "Steps run, traced (a replayed trace) or eager.",
                             ["worker", "kind", "execution"], registry=r)
        self.sampling = Counter("ttserve_sampling_batches",
                                "Non-empty steps sampled on the device or on the host.",
                                ["worker", "path"], registry=r)
        self.drains = Counter("ttserve_async_drains", "Async-decode pipeline drains, by reason.",
                              ["worker", "reason"], registry=r)
        self.migrations = Counter("ttserve_request_migrations",
                                  "Requests of a lost worker, by outcome: requeued (on another lane, or "
                                  "the worker once back), handed_off (off a worker that drained, was "
                                  "removed or failed a step inside the model), failed_limit (--migration-limit reached), "
                                  "failed_timeout (no worker ready within --migration-timeout).",
                                  ["outcome"], registry=r)
        self.resumptions = Counter("ttserve_request_resumptions",
                                   "Resumed requests (engine.proto Resumption: output another control plane "
                                   "produced) past the queue's bounds, by outcome: admitted, invalid.",
                                   ["outcome"], registry=r)
        self.stalls = Counter("ttserve_worker_stalls", "Times a worker was found stalled.",
                              ["worker"], registry=r)
        self.step_failures = Counter("ttserve_step_failures",
                                     "Steps that failed inside the model (the worker reported an error).",
                                     ["worker"], registry=r)
        self.isolations = Counter("ttserve_request_isolations",
                                  "Requests of a failed step, by outcome: isolated (it runs in steps of "
                                  "its own until one succeeds), failed (it failed a step alone after an "
                                  "earlier failure: the request itself makes the model fail).",
                                  ["outcome"], registry=r)

    def watch(self, engine: Engine) -> None:
        """Export the engine's live state (queues, KV, workers) at scrape time."""
        self.registry.register(_EngineState(engine))
        if self.vllm_metric_names:
            # Imported only here: without the flag the module is never loaded.
            from .vllm_metric_names import VllmMetricNames
            self.registry.register(VllmMetricNames(engine, self.served_model_name))

    # ---- events ------------------------------------------------------------------------------
    def step(self, w: str, kind: StepKind, traced: bool, sampled_on_device: bool,
             worker_s: float, rtt_s: float) -> None:
        self.steps.labels(w, kind.value, "traced" if traced else "eager").inc()
        self.step_duration.labels(w, kind.value).observe(worker_s)
        self.step_rtt.labels(w, kind.value).observe(rtt_s)
        if kind is not StepKind.EMPTY:
            self.sampling.labels(w, "device" if sampled_on_device else "host").inc()

    def progressed(self, request: Request, new: int, worker: str) -> None:
        """Count the `new` tokens that reached `request` together (Request.record_tokens) on the
        worker named `worker`."""
        if request.previous_token_time is None:  # the first arrival: TTFT
            self.ttft.observe(request.first_token_time - request.received_time)
            if request.scheduled_time is not None:
                self.queue_time.observe(request.scheduled_time - request.received_time)
                self.prefill_time.observe(request.first_token_time - request.scheduled_time)
            self.prompt_tokens[worker] += request.num_prompt_tokens
            after_first = new - 1
        else:
            after_first = new
        if after_first > 0 and request.previous_token_time is not None:
            # Tokens that arrive together (a pipelined pair) share the interval evenly.
            self.itl.observe((request.last_token_time - request.previous_token_time) / after_first, after_first)
        self.generation_tokens[worker] += new

    def finished(self, request: Request, now: float) -> None:
        assert request.finish_reason is not None
        self.request_success.labels(request.finish_reason.value).inc()
        self.e2e.observe(now - request.received_time)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        generated = len(request.output_token_ids) - request.num_resumed_tokens  # its time here
        self.request_generation_tokens.observe(generated)
        if request.first_token_time is not None and request.last_token_time is not None:
            decode_s = request.last_token_time - request.first_token_time
            self.decode_time.observe(decode_s)
            if generated > 1:
                self.tpot.observe(decode_s / (generated - 1))


class _EngineState(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        engine = self.engine
        metrics = engine.metrics
        prompt = CounterMetricFamily("ttserve_prompt_tokens",
                                     "Prompt tokens of requests that produced their first token.",
                                     labels=["worker"])
        generation = CounterMetricFamily("ttserve_generation_tokens", "Generated tokens.",
                                         labels=["worker"])
        for w in sorted({*metrics.prompt_tokens, *metrics.generation_tokens,
                         *(g.name for g in engine.workers.values())}):
            prompt.add_metric([w], metrics.prompt_tokens[w])
            generation.add_metric([w], metrics.generation_tokens[w])
        yield from (prompt, generation, metrics.itl.family())
        running = GaugeMetricFamily("ttserve_num_requests_running",
                                    "Requests holding a device row.", labels=["worker", "lane"])
        waiting = GaugeMetricFamily("ttserve_num_requests_waiting",
                                    "Requests queued, including ones waiting aside for a grammar.",
                                    labels=["worker", "lane"])
        kv = GaugeMetricFamily("ttserve_kv_cache_usage_perc",
                               "Fraction of the lane's KV blocks in use (0-1).", labels=["worker", "lane"])
        queries = CounterMetricFamily("ttserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", labels=["worker"])
        hits = CounterMetricFamily("ttserve_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", labels=["worker"])
        preemptions = CounterMetricFamily("ttserve_num_preemptions",
                                          "Requests preempted (to be recomputed).", labels=["worker"])
        drafts = CounterMetricFamily("ttserve_spec_decode_num_drafts",
                                     "Decode rows that carried speculative draft tokens.", labels=["worker"])
        draft_tokens = CounterMetricFamily("ttserve_spec_decode_num_draft_tokens",
                                           "Speculative draft tokens proposed.", labels=["worker"])
        accepted = CounterMetricFamily("ttserve_spec_decode_num_accepted_tokens",
                                       "Speculative draft tokens the model accepted.", labels=["worker"])
        per_position = CounterMetricFamily("ttserve_spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each position of a row's drafts (0: the "
                                           "first).", labels=["worker", "position"])
        up = GaugeMetricFamily("ttserve_worker_up",
                               "1 while the control plane holds a connection to the worker.",
                               labels=["worker"])
        ready = GaugeMetricFamily("ttserve_worker_ready",
                                  "1 while the worker is warmed up and its lane group serves.",
                                  labels=["worker"])
        stalled = GaugeMetricFamily("ttserve_worker_stalled",
                                    "1 from a step held past --stall-timeout (its requests moved) "
                                    "until the worker warms up again.", labels=["worker"])
        standby = GaugeMetricFamily("ttserve_worker_standby",
                                    "1 while the worker serves another control plane, for which this one "
                                    "is a standby.", labels=["worker"])
        warmup = GaugeMetricFamily("ttserve_worker_warmup_progress",
                                   "Warmup progress of the worker, 0-1.", labels=["worker"])
        for g in engine.workers.values():
            w = g.name
            for load in g.loads():
                labels = [w, str(load.lane)]
                running.add_metric(labels, load.running)
                waiting.add_metric(labels, load.waiting)
                kv.add_metric(labels, load.kv_usage)
            totals = g.totals()
            queries.add_metric([w], totals.prefix_query_tokens)
            hits.add_metric([w], totals.prefix_hit_tokens)
            preemptions.add_metric([w], totals.preemptions)
            drafts.add_metric([w], totals.spec.drafts)
            draft_tokens.add_metric([w], totals.spec.draft_tokens)
            accepted.add_metric([w], totals.spec.accepted_tokens)
            for position, count in enumerate(totals.spec.accepted_per_position):
                per_position.add_metric([w, str(position)], count)
            up.add_metric([w], float(g.connected))
            ready.add_metric([w], float(g.ready))
            stalled.add_metric([w], float(g.stalled))
            standby.add_metric([w], float(g.standby))
            warmup.add_metric([w], g.warmup_progress)
        draining = GaugeMetricFamily("ttserve_draining",
                                     "1 once SIGTERM arrived: admits nothing, finishes what it holds.",
                                     value=float(engine.draining))
        yield from (running, waiting, kv, queries, hits, preemptions, drafts, draft_tokens, accepted, per_position,
                    up, ready, stalled, standby, warmup, draining)
