"""--vllm-metric-names: the control plane's /metrics also serves vLLM's names and labels, so that
vLLM's own Grafana dashboard and scrapers read ttserve unchanged (control/vllm_metric_names.py).

End to end: a real stack (gateway, control plane, SmolLM2 worker) with the flag takes a streamed
chat and a plain completion through the openai client; every series vLLM's published dashboard
queries is then on the control plane's /metrics under vLLM's name with vLLM's labels, valued as
the ttserve_ series it comes from. A control plane without the flag serves no vllm: series."""
from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from stack import Stack, get, start_stack, wait_until
from ttserve.control.blocks import BlockPool
from ttserve.control.engine_config import EngineConfig
from ttserve.control.lanes import LaneGroup
from ttserve.control.metrics import ControlMetrics
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.speculation import SpeculativeConfig
from ttserve.control.vllm_metric_names import VllmMetricNames
from ttserve.control.worker_group import WorkerGroup
from ttserve.control.worker_set import WorkerSpec
from ttserve.up import split_flags

pytestmark = pytest.mark.e2e

# Every series vLLM's published Grafana dashboard queries, as its PromQL names them: the
# dashboard examples/observability/prometheus_grafana/grafana.json of vllm-project/vllm at commit
# 4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (the same panels as its earlier home,
# examples/online_serving/prometheus_grafana/grafana.json, at 004f771f3a6b49597546b05c7d83686d1e121fa0).
# Each query selects {model_name="$model_name"}, the variable label_values(model_name) fills.
DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
# vLLM's histograms and the ttserve_ histogram each is served from, bucket for bucket.
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttserve_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "ttserve_inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds": "ttserve_request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "ttserve_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "ttserve_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "ttserve_request_prefill_time_seconds",
    "vllm:request_decode_time_seconds": "ttserve_request_decode_time_seconds",
    "vllm:request_prompt_tokens": "ttserve_request_prompt_tokens",
    "vllm:request_generation_tokens": "ttserve_request_generation_tokens",
    "vllm:request_max_num_generation_tokens": "ttserve_request_generation_tokens",  # n = 1 (docs/metrics.md)
}
# vLLM's counters and gauges and the ttserve_ series each sums over workers and lanes.
SUMMED = {
    "vllm:prompt_tokens_total": "ttserve_prompt_tokens_total",
    "vllm:generation_tokens_total": "ttserve_generation_tokens_total",
    "vllm:prefix_cache_queries_total": "ttserve_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "ttserve_prefix_cache_hits_total",
    "vllm:num_preemptions_total": "ttserve_num_preemptions_total",
    "vllm:num_requests_running": "ttserve_num_requests_running",
    "vllm:num_requests_waiting": "ttserve_num_requests_waiting",
}


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, smollm2):
    named = start_stack(tmp_path_factory.mktemp("vllm-names"), str(smollm2), control_flags=("--vllm-metric-names",))
    try:
        plain = start_stack(tmp_path_factory.mktemp("plain"), str(smollm2), gateway=False)
    except BaseException:
        named.stop()
        raise
    yield named, plain
    plain.stop()
    named.stop()


def scrape(stack: Stack) -> list[Sample]:
    status, text = get(f"{stack.control_metrics_url}/metrics")
    assert status == 200
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_every_series_the_dashboard_queries_is_served_under_vllms_name_and_labels(stacks):
    named, _ = stacks
    client = openai.OpenAI(base_url=f"{named.http_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    usage = []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage.append(chunks[-1].usage)
    completion = client.completions.create(model=model, prompt="The three primary colours are", max_tokens=6,
                                           temperature=0)
    assert completion.choices[0].finish_reason == "length"
    usage.append(completion.usage)
    wait_until(lambda: total(scrape(named), "vllm:e2e_request_latency_seconds_count") == 2, 10,
               "both requests in the vLLM-named metrics", named)
    samples = scrape(named)

    for name in DASHBOARD:
        found = [s for s in samples if s.name == name]
        assert found, f"{name} is not served"
        extra = {"_bucket": {"le"}}.get(name[name.rfind("_"):], set()) | (
            {"finished_reason"} if name == "vllm:request_success_total" else set())
        for s in found:
            assert set(s.labels) == {"model_name", "engine"} | extra, s
            # The name the gateway serves the model under, the dashboard's $model_name.
            assert (s.labels["model_name"], s.labels["engine"]) == (model, "0"), s

    # The values are the ttserve_ ones: summed over workers and lanes, bucket for bucket.
    for vllm_name, ours in SUMMED.items():
        assert total(samples, vllm_name) == total(samples, ours), vllm_name
    assert total(samples, "vllm:generation_tokens_total") == sum(u.completion_tokens for u in usage) > 0
    assert total(samples, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usage) > 0
    for vllm_name, ours in HISTOGRAMS.items():
        for suffix in ("_sum", "_count"):
            assert total(samples, vllm_name + suffix) == total(samples, ours + suffix), vllm_name + suffix
        ours_buckets = {s.labels["le"]: s.value for s in samples if s.name == ours + "_bucket"}
        assert {s.labels["le"]: s.value for s in samples if s.name == vllm_name + "_bucket"} == ours_buckets
    assert total(samples, "vllm:request_prompt_tokens_count") == 2
    for reason in ("stop", "length", "abort", "error"):
        assert (total(samples, "vllm:request_success_total", finished_reason=reason)
                == total(samples, "ttserve_request_success_total", finished_reason=reason)), reason
    assert total(samples, "vllm:request_success_total", finished_reason="length") >= 1
    # One lane: the pool's usage is the lane's.
    assert total(samples, "vllm:kv_cache_usage_perc") == total(samples, "ttserve_kv_cache_usage_perc")
    # Speculative counters exist, as in vLLM, only with --speculative-config.
    assert not [s for s in samples if s.name.startswith("vllm:spec_decode")]


def test_without_the_flag_no_vllm_series_is_served(stacks):
    _, plain = stacks
    status, text = get(f"{plain.control_metrics_url}/metrics")
    assert status == 200 and "ttserve_num_requests_running" in text
    assert "vllm:" not in text


def test_up_gives_the_flag_to_the_control_plane_and_the_served_name_to_it_and_the_gateway():
    _, shares = split_flags(["--vllm-metric-names", "--served-model-name", "smol", "other"])
    assert "--vllm-metric-names" in shares["control"]
    assert "--vllm-metric-names" not in shares["gateway"] + shares["worker"]
    for service in ("control", "gateway"):
        at = shares[service].index("--served-model-name")
        assert shares[service][at + 1:at + 3] == ["smol", "other"]


# ---- the collector's arithmetic, without a stack -----------------------------------------------
def lane_group(queries: int, hits: int, preemptions: int) -> LaneGroup:
    scheduler = Scheduler(SchedulerConfig(2, 16, 64), BlockPool(16, 4, enable_caching=True))
    scheduler.pool.record_query(queries, hits)
    scheduler.num_preemptions = preemptions
    return LaneGroup([scheduler])


def served(collector: VllmMetricNames) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What `collector` serves, as a scrape parses it: (name, sorted labels) -> value."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_removed_worker_keeps_counting_and_positions_follow_the_speculative_config():
    config = EngineConfig(workers=(WorkerSpec("a", "a:1"),), speculative=SpeculativeConfig(3, 1, 2))
    metrics = ControlMetrics()
    workers = {}
    for index, (queries, hits, preemptions) in enumerate(((5, 2, 1), (3, 3, 0))):
        workers[index] = WorkerGroup(index, f"w:{index}", config, metrics, name=f"w{index}")
        workers[index].lane_group = lane_group(queries, hits, preemptions)
    workers[0].lane_group.lanes[0].spec.record(proposed=2, accepted=1)
    collector = VllmMetricNames(SimpleNamespace(workers=workers, metrics=metrics, config=config), "smol")
    labels = (("engine", "0"), ("model_name", "smol"))
    before = served(collector)
    assert before["vllm:prefix_cache_queries_total", labels] == (5 + 3) * 4   # tokens = blocks x block size
    assert before["vllm:prefix_cache_hits_total", labels] == (2 + 3) * 4
    assert before["vllm:num_preemptions_total", labels] == 1
    assert [before["vllm:spec_decode_num_accepted_tokens_per_pos_total", (*labels, ("position", str(p)))]
            for p in range(3)] == [1, 0, 0]
    del workers[0]   # dropped from --workers-file: its counts stay in the sums
    after = served(collector)
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:spec_decode_num_drafts_total"):
        assert after[name, labels] == before[name, labels], name


def test_the_model_name_is_the_ready_workers_folder_until_then_nothing_is_served():
    config = EngineConfig(workers=(WorkerSpec("a", "a:1"),))
    metrics = ControlMetrics()
    worker = WorkerGroup(0, "a:1", config, metrics)
    collector = VllmMetricNames(SimpleNamespace(workers={0: worker}, metrics=metrics, config=config))
    assert served(collector) == {}   # no worker has described its model yet
    worker.description = SimpleNamespace(model_path="/models/SmolLM2-135M-Instruct/")
    worker.lane_group = lane_group(0, 0, 0)
    names = {labels for _, labels in served(collector)}
    assert {pair for labels in names for pair in labels if pair[0] == "model_name"} == {
        ("model_name", "SmolLM2-135M-Instruct")}
