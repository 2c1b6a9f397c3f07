"""The serving plan (control/serving_plan.py): every rule that turns the control plane's flags and
a worker's description into lanes, max_model_len, the batched-token budget, the chunk limit,
prefix caching and async decode, and every refusal of a worker this configuration cannot serve."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from ttserve.control.engine_config import EngineConfig
from ttserve.control.serving_plan import IncompatibleWorker, ServingPlan, plan_serving, plan_warmup
from ttserve.control.wire import WorkerDescription

MAX_POSITIONS = 4096


def config(**kw) -> EngineConfig:
    return EngineConfig(workers=(), **kw)


def cold(**kw) -> WorkerDescription:
    """A worker as Describe reports it before warmup: no KV capacity, no block size yet."""
    base = dict(address="w:1", backend="torch", device="cpu", model_path="/m", architecture="X",
                vocab_size=100, max_position_embeddings=MAX_POSITIONS, eos_token_ids=[2],
                supports_chunked_prefill=True, supports_prefix_caching=True, single_execute_lanes=True)
    return WorkerDescription(**(base | kw))


def warm(d: WorkerDescription, tokens_per_lane: int = 8192, block_size: int = 64, **kw) -> WorkerDescription:
    """The same worker warm: its KV capacity and prefill shape known."""
    return replace(d, num_blocks_per_lane=tokens_per_lane // block_size, block_size=block_size,
                   max_prefill_batch_size=kw.pop("max_prefill_batch_size", 8), **kw)


def plan(c: EngineConfig, d: WorkerDescription | None = None, fixed: ServingPlan | None = None,
         num_workers: int = 1, **warm_kw) -> ServingPlan:
    """Both moments, as the engine runs them: the warmup asked for, then the plan once warm."""
    d = d or cold()
    return plan_serving(c, warm(d, **warm_kw), plan_warmup(c, d, num_workers), fixed)


def texts(p) -> list[tuple[int, str]]:
    return [(n.level, n.text) for n in p.notes]


# ---- max_model_len ----------------------------------------------------------------------------
def test_the_default_asks_warmup_for_the_models_limit_and_lowers_it_to_a_lanes_kv_with_a_warning():
    assert plan_warmup(config(), cold(), 1).max_model_len == MAX_POSITIONS
    p = plan(config(), tokens_per_lane=2048)
    assert p.max_model_len == p.scheduler.max_model_len == 2048
    assert texts(p) == [(logging.WARNING, "max_model_len lowered from 4096 to 2048: one lane's KV cache "
                                          "holds 2048 tokens")]


def test_a_lane_that_holds_the_models_limit_keeps_it_and_says_nothing():
    p = plan(config(), tokens_per_lane=8192)
    assert p.max_model_len == MAX_POSITIONS and p.notes == ()


def test_max_model_len_minus_1_fits_a_lanes_kv_and_only_informs():
    c = config(max_model_len=-1)
    assert plan_warmup(c, cold(), 1).max_model_len == MAX_POSITIONS  # warmup is asked for the model's limit
    p = plan(c, tokens_per_lane=1024)
    assert p.max_model_len == 1024
    assert texts(p) == [(logging.INFO, "max_model_len lowered from 4096 to 1024: one lane's KV cache holds "
                                       "1024 tokens")]


def test_an_explicit_max_model_len_is_asked_for_and_still_lowered_to_a_lanes_kv():
    c = config(max_model_len=3000)
    assert plan_warmup(c, cold(), 1).max_model_len == 3000
    assert plan(c, tokens_per_lane=8192).max_model_len == 3000
    lowered = plan(c, tokens_per_lane=1024)
    assert lowered.max_model_len == 1024 and lowered.notes[0].level == logging.WARNING


def test_a_max_model_len_beyond_max_position_embeddings_is_refused_before_warmup():
    with pytest.raises(IncompatibleWorker) as refused:
        plan_warmup(config(max_model_len=MAX_POSITIONS + 1), cold(), 1)
    assert str(refused.value) == ("--max-model-len 4097 exceeds the model's limit of 4096 tokens "
                                  "(max_position_embeddings of /m)")


# ---- the batched-token budget and the chunk limit --------------------------------------------------
def test_a_model_that_cannot_chunk_prefills_raises_the_budget_to_max_model_len():
    d = cold(supports_chunked_prefill=False)
    asked = plan_warmup(config(max_num_batched_tokens=512), d, 1)
    assert asked.max_num_batched_tokens == MAX_POSITIONS
    assert texts(asked) == [(logging.WARNING, "the model cannot chunk prefills: raising max_num_batched_tokens "
                                              "from 512 to max_model_len 4096")]
    p = plan(config(max_num_batched_tokens=512), d)
    assert p.max_num_batched_tokens == MAX_POSITIONS and not p.scheduler.chunked_prefill
    assert p.chunk_limit == 0  # whole prompts


def test_a_model_that_cannot_chunk_keeps_a_budget_already_large_enough():
    asked = plan_warmup(config(max_num_batched_tokens=8192), cold(supports_chunked_prefill=False), 1)
    assert asked.max_num_batched_tokens == 8192 and asked.notes == ()


def test_a_chunk_holds_at_least_one_block():
    p = plan(config(max_num_batched_tokens=16), block_size=64)
    assert p.max_num_batched_tokens == 64 and p.chunk_limit == 64
    assert texts(p) == [(logging.WARNING, "max_num_batched_tokens raised from 16 to the block size 64: a "
                                          "prefill chunk holds at least one block")]
    assert plan_warmup(config(max_num_batched_tokens=16), cold(), 1).max_num_batched_tokens == 16  # block unknown cold


def test_without_the_flag_a_cpu_worker_prefills_512_tokens_a_step_and_a_device_2048():
    """The budget's default follows the worker's device (ttserve/batched_tokens.py); a flag wins."""
    assert plan_warmup(config(), cold(backend="torch", device="cpu"), 1).max_num_batched_tokens == 512
    assert plan_warmup(config(), cold(backend="torch", device="cuda:0"), 1).max_num_batched_tokens == 2048
    assert plan_warmup(config(), cold(backend="ttnn", device="mesh T3K (1, 8)"), 1).max_num_batched_tokens == 2048
    assert plan_warmup(config(), cold(backend="sim", device="sim t3k"), 1).max_num_batched_tokens == 2048
    assert plan_warmup(config(max_num_batched_tokens=4096), cold(), 1).max_num_batched_tokens == 4096


def test_the_chunk_limit_is_the_budget_capped_by_the_longest_traced_prefill():
    p = plan(config(max_num_batched_tokens=2048))
    assert p.chunk_limit == 2048 and p.scheduler.max_prefill_len == 0
    traced = plan(config(max_num_batched_tokens=2048), prefill_buckets=[128, 1024])
    assert traced.chunk_limit == 1024 and traced.scheduler.max_prefill_len == 1024
    assert traced.max_num_batched_tokens == 2048


def test_the_scheduler_config_carries_the_rows_and_the_prefill_shape():
    p = plan(config(max_num_seqs=4), max_prefill_batch_size=1)
    assert (p.scheduler.max_num_seqs, p.scheduler.max_prefill_batch) == (4, 1)
    assert plan_warmup(config(max_num_seqs=4), cold(), 1).max_num_seqs == 4


# ---- prefix caching and async decode -----------------------------------------------------------------
def test_prefix_caching_is_on_when_asked_and_supported():
    assert plan(config(enable_prefix_caching=True)).prefix_caching
    assert not plan(config()).prefix_caching


def test_prefix_caching_a_model_does_not_support_is_turned_off_with_a_warning():
    p = plan(config(enable_prefix_caching=True), cold(supports_prefix_caching=False))
    assert not p.prefix_caching
    assert texts(p) == [(logging.WARNING, "--enable-prefix-caching: X on the worker at w:1 does not support "
                                          "prefix caching; serving without it")]


@pytest.mark.parametrize("flag, supported, on", [
    (None, True, True), (None, False, False), (True, True, True), (False, True, False), (False, False, False)])
def test_async_decode_follows_the_worker_unless_turned_off(flag, supported, on):
    p = plan(config(async_scheduling=flag), async_decode=supported)
    assert p.async_decode is on and p.notes == ()


def test_async_scheduling_forced_on_a_worker_that_cannot_pipeline_is_turned_off_with_a_warning():
    p = plan(config(async_scheduling=True), async_decode=False)
    assert not p.async_decode
    assert texts(p) == [(logging.WARNING, "--async-scheduling: the worker at w:1 cannot pipeline decode steps "
                                          "(X does not support async decode, or decode samples on the host); "
                                          "turned off")]


# ---- lanes: data parallelism ----------------------------------------------------------------------
def test_single_execute_models_run_every_lane_in_one_group():
    assert plan_warmup(config(data_parallel_size=4), cold(), 1).num_lanes == 4
    assert plan(config(data_parallel_size=4)).num_lanes == 4


def test_independent_group_models_need_one_worker_per_lane():
    with pytest.raises(IncompatibleWorker) as refused:
        plan_warmup(config(data_parallel_size=2), cold(single_execute_lanes=False), 1)
    assert str(refused.value) == ("--data-parallel-size 2: X on the worker at w:1 runs lanes as independent "
                                  "groups; start one worker per lane (each on its own submesh with "
                                  "TT_VISIBLE_DEVICES) and pass each with --worker")
    assert plan_warmup(config(), cold(single_execute_lanes=False), 3).num_lanes == 1


def test_mrope_models_run_in_lane_mode():
    """The plugin refuses request-specific RoPE with lane DP; ttserve keeps rope deltas by row."""
    assert plan_warmup(config(data_parallel_size=2), cold(mrope=True), 1).num_lanes == 2


def test_a_mixture_of_experts_model_over_several_independent_workers_is_refused():
    moe = cold(single_execute_lanes=False, mixture_of_experts=True)
    with pytest.raises(IncompatibleWorker) as refused:
        plan_warmup(config(), moe, 2)
    assert str(refused.value) == ("X is a mixture-of-experts model: data parallelism over independent groups "
                                  "(2 workers) is refused")
    assert plan_warmup(config(), moe, 1).num_lanes == 1
    assert plan_warmup(config(data_parallel_size=4), replace(moe, single_execute_lanes=True), 2).num_lanes == 4


# ---- later workers match the first -------------------------------------------------------------------
def test_a_later_worker_serves_with_the_first_workers_max_model_len():
    first = plan(config(), tokens_per_lane=2048)
    later = plan(config(), fixed=first, tokens_per_lane=8192, async_decode=True)
    assert later.max_model_len == 2048 and later.notes == () and later.async_decode


@pytest.mark.parametrize("later, warm_kw, refusal", [
    (cold(architecture="Y", vocab_size=200, address="w:2"), {},
     "the worker at w:2 serves Y (vocabulary 200) but this control plane serves X (vocabulary 100): every "
     "worker must serve the same model"),
    (cold(address="w:2"), {"block_size": 32},
     "the worker at w:2 uses KV blocks of 32 tokens but the first worker uses 64: start every worker with the "
     "same --block-size (prefix caching and placement hash whole blocks)"),
    (cold(address="w:2"), {"tokens_per_lane": 1024},
     "the worker at w:2 holds 1024 tokens per lane, below max_model_len 4096: give it more KV memory"),
], ids=["another model", "another block size", "a lane below max_model_len"])
def test_a_later_worker_that_does_not_match_the_first_is_refused(later, warm_kw, refusal):
    first = plan(config())
    with pytest.raises(IncompatibleWorker) as refused:
        plan(config(), later, fixed=first, **warm_kw)
    assert str(refused.value) == refusal


def test_planning_is_pure(caplog):
    caplog.set_level(logging.DEBUG)
    c, d = config(enable_prefix_caching=True, async_scheduling=True), cold(supports_prefix_caching=False)
    assert plan(c, d, tokens_per_lane=1024) == plan(c, d, tokens_per_lane=1024)
    assert caplog.records == []  # the notes are the caller's to log
