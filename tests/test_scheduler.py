"""The single-lane phase scheduler: step kinds, admission, stopping, preemption, accounting, and
the host-sampler options' path through it (logprobs, token history, validation)."""
from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.control import config as control_config
from ttserve.control.admission import AdmissionError, Limits, check_request
from ttserve.control.blocks import BlockPool
from ttserve.control.phase import PhasePolicy, default_streak
from ttserve.control.request import FinishReason, Request, RequestStatus, SamplingParams, TokenLogprobs
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.step import StepKind
from ttserve.control.session import output_of
from ttserve.control.wire import output_to_pb, request_from_pb, step_batch_to_pb
from lane_of_one import LaneOfOne
from ttserve.control.lanes import GroupPlan
from ttserve.v1 import engine_pb2

EOS = 2


def make(rid: str, prompt_len: int, max_tokens: int = 4, **sampling) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), **sampling))


def scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 4,
              budget: int = 32, max_model_len: int = 64, caching: bool = False,
              max_consecutive_prefills: int = 4, **config) -> LaneOfOne:
    return LaneOfOne(Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, **config),
                               BlockPool(num_blocks, block_size, enable_caching=caching)),
                     PhasePolicy(max_consecutive_prefills))


def test_decodes_wait_for_2048_prefill_tokens_worth_of_steps_by_default_and_a_flag_wins():
    """A CPU's 512-token steps run 4 in a row, 1024's 2, a device's 2048 still 2 (never fewer);
    the flag, when given, is the bound whatever the budget, and 0 is refused."""
    assert [default_streak(b) for b in (64, 512, 1024, 2048, 8192)] == [32, 4, 2, 2, 2]
    parser = argparse.ArgumentParser()
    control_config.add_arguments(parser)
    assert control_config.engine_config(parser.parse_args([])).max_consecutive_prefills == 0  # from the budget
    flagged = parser.parse_args(["--max-consecutive-prefill-steps", "1"])
    assert control_config.engine_config(flagged).max_consecutive_prefills == 1
    with pytest.raises(control_config.ConfigError, match="at least 1, got 0"):
        control_config.engine_config(parser.parse_args(["--max-consecutive-prefill-steps", "0"]))


def run_step(s: LaneOfOne, token: int = 7) -> GroupPlan:
    """One step with a worker that samples `token` for every request that samples."""
    plan = s.schedule()
    sampled = {w.request.request_id: token for w in plan.prefill if w.sample}
    sampled |= {w.request.request_id: token for w in plan.decode}
    s.update(plan, sampled, {rid: TokenLogprobs([token], [-1.0], 1) for rid in sampled})
    return plan


def test_prefill_has_priority_then_decode():
    s = scheduler()
    s.add(make("a", 5))
    assert run_step(s).kind is StepKind.PREFILL
    s.add(make("b", 3))
    plan = run_step(s)
    assert plan.kind is StepKind.PREFILL and [w.request.request_id for w in plan.prefill] == ["b"]
    plan = run_step(s)
    assert plan.kind is StepKind.DECODE and len(plan.decode) == 2


def test_no_step_is_mixed_and_empty_when_idle():
    s = scheduler()
    assert s.schedule().kind is StepKind.EMPTY
    s.add(make("a", 5, max_tokens=3))
    kinds = []
    while s.has_work:
        plan = run_step(s)
        assert not (plan.prefill and plan.decode)
        kinds.append(plan.kind)
    assert kinds[:3] == [StepKind.PREFILL, StepKind.DECODE, StepKind.DECODE]


def test_long_prompt_is_prefilled_in_chunks_sampling_only_at_the_end():
    s = scheduler(budget=8)
    r = make("a", 20)
    s.add(r)
    chunks = [run_step(s).prefill[0] for _ in range(3)]
    assert [(c.start, c.end, c.sample) for c in chunks] == [(0, 8, False), (8, 16, False), (16, 20, True)]
    assert r.output_token_ids == [7] and r.num_computed_tokens == 20


def test_max_tokens_finishes_with_length_and_frees_blocks():
    s = scheduler()
    r = make("a", 5, max_tokens=3)
    s.add(r)
    while s.has_work:
        run_step(s)
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 3
    assert s.pool.num_free == s.pool.num_blocks


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back():
    s = scheduler()
    r = make("a", 5, max_tokens=8)
    s.add(r)
    run_step(s, token=EOS)
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == [EOS]
    s = scheduler()
    r = make("b", 5, max_tokens=3, ignore_eos=True)
    s.add(r)
    while s.has_work:
        run_step(s, token=EOS)
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 3
    s = scheduler()
    r = make("c", 5, max_tokens=8, min_tokens=2)
    s.add(r)
    while s.has_work:
        run_step(s, token=EOS)
    assert r.finish_reason is FinishReason.STOP and len(r.output_token_ids) == 2


def test_stop_token_id_is_reported():
    s = scheduler()
    r = make("a", 5, max_tokens=8, stop_token_ids=frozenset({7}))
    s.add(r)
    run_step(s, token=7)
    assert r.finish_reason is FinishReason.STOP and r.stop_token_id == 7


def test_max_model_len_finishes_with_length():
    s = scheduler(max_model_len=8)
    r = make("a", 6, max_tokens=100)
    s.add(r)
    while s.has_work:
        run_step(s)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 8


def test_abort_frees_blocks_and_releases_device_state():
    s = scheduler()
    r = make("a", 5, max_tokens=8)
    s.add(r)
    run_step(s)
    s.finish(r, FinishReason.ABORT)
    assert s.pool.num_free == s.pool.num_blocks
    assert s.schedule().released_ids == ["a"]


def test_abort_during_step_drops_its_result():
    s = scheduler()
    r = make("a", 5, max_tokens=8)
    s.add(r)
    plan = s.schedule()
    s.finish(r, FinishReason.ABORT)
    assert s.update(plan, {"a": 7}) == [] and r.output_token_ids == []


def test_slots_are_stable_and_capacity_bounds_running():
    s = scheduler(max_num_seqs=2)
    reqs = [make(str(i), 3, max_tokens=50) for i in range(3)]
    for r in reqs:
        s.add(r)
    run_step(s)
    assert [r.slot for r in reqs[:2]] == [0, 1] and reqs[2].status is RequestStatus.WAITING
    for _ in range(5):
        assert run_step(s).kind is StepKind.DECODE
    assert [r.slot for r in reqs[:2]] == [0, 1]


def test_kv_pressure_preempts_latest_and_resume_recomputes():
    # 6 blocks of 4 tokens; two requests growing to 16 tokens each cannot both fit.
    s = scheduler(num_blocks=6, block_size=4)
    a, b = make("a", 4, max_tokens=12), make("b", 4, max_tokens=12)
    s.add(a)
    s.add(b)
    while s.has_work:
        run_step(s)
        s.pool.check()
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_token_ids == [7] * 12 and b.output_token_ids == [7] * 12
    assert s.pool.num_free == s.pool.num_blocks


def test_a_finished_requests_release_waits_for_the_next_step_instead_of_making_one():
    s = scheduler()
    r = make("a", 5, max_tokens=2)
    s.add(r)
    while s.has_work:
        run_step(s)
    assert r.is_finished and s.pool.num_free == s.pool.num_blocks  # its blocks are free at once
    assert not s.has_work  # nothing to run: no step only to drop the worker's state
    s.add(make("b", 3))
    plan = s.schedule()
    assert plan.released_ids == ["a"] and [w.request.request_id for w in plan.prefill] == ["b"]


def test_resumed_request_prefills_prompt_and_outputs_then_samples_next():
    s = scheduler()
    r = make("a", 4, max_tokens=10)
    s.add(r)
    run_step(s)
    run_step(s)
    s._preempt(r)
    plan = s.schedule()
    assert plan.released_ids == ["a"]
    work = plan.prefill[0]
    assert (work.start, work.end, work.sample) == (0, 6, True)


def test_decode_steps_interleave_between_chunks_of_a_long_prompt():
    s = scheduler(budget=8, max_consecutive_prefills=2, max_model_len=128, num_blocks=64)
    streaming = make("stream", 3, max_tokens=100)
    s.add(streaming)
    run_step(s)                       # its prefill: it decodes from now on
    s.add(make("long", 60, max_tokens=2))
    kinds = [run_step(s).kind for _ in range(12)]
    assert kinds[:9] == [StepKind.PREFILL, StepKind.PREFILL, StepKind.DECODE] * 3
    assert len(streaming.output_token_ids) >= 5


def test_without_chunking_a_prompt_is_never_split():
    s = scheduler(budget=64, max_model_len=64, chunked_prefill=False)
    a, b = make("a", 40), make("b", 40)
    s.add(a)
    s.add(b)
    first = run_step(s)
    assert [(w.request.request_id, w.start, w.end) for w in first.prefill] == [("a", 0, 40)]
    second = run_step(s)
    assert [(w.request.request_id, w.start, w.end) for w in second.prefill] == [("b", 0, 40)]


def test_no_chunking_with_a_small_budget_is_refused_at_construction():
    # Regression (field livelock): max_num_batched_tokens < prompt < max_model_len, no chunking.
    import pytest
    with pytest.raises(AssertionError):
        SchedulerConfig(4, 16, 64, chunked_prefill=False)


def test_intermediate_chunks_end_on_block_boundaries():
    s = scheduler(budget=10, block_size=4)
    s.add(make("a", 25))
    ends = []
    while not s.running or s.running[0].is_prefilling:
        ends.append(run_step(s).prefill[0].end)
    assert ends == [8, 16, 25]


def test_prefill_batch_follows_the_devices_rows_and_longest_trace():
    s = scheduler(budget=64, max_prefill_batch=2, max_prefill_len=8)
    for i in range(3):
        s.add(make(str(i), 12))
    plan = s.schedule()
    assert [(w.request.request_id, w.end - w.start) for w in plan.prefill] == [("0", 8), ("1", 8)]


def test_prefix_cache_hit_skips_cached_blocks_and_reports_them():
    s = scheduler(caching=True, block_size=4)
    first = make("a", 13, max_tokens=2)
    s.add(first)
    run_step(s)
    first_blocks = list(first.block_ids)
    while s.has_work:
        run_step(s)
    second = make("b", 13, max_tokens=2)
    s.add(second)
    work = s.schedule().prefill[0]
    assert (work.start, work.end) == (12, 13) and second.num_cached_tokens == 12
    assert work.new_block_ids[:3] == first_blocks[:3]
    assert (s.pool.num_queries, s.pool.num_hits) == (6, 3)


def test_identical_prompts_arriving_together_compute_their_prefix_once():
    # n > 1: the siblings wait one step for the first one's blocks, then share them.
    s = scheduler(caching=True, block_size=4, budget=64)
    kids = [make(f"{i}_r", 13, max_tokens=3) for i in range(3)]
    for kid in kids:
        s.add(kid)
    first = run_step(s)
    assert [w.request for w in first.prefill] == [kids[0]]
    second = run_step(s)
    assert [(w.request, w.start) for w in second.prefill] == [(kids[1], 12), (kids[2], 12)]
    assert kids[1].block_ids[:3] == kids[2].block_ids[:3] == kids[0].block_ids[:3]
    while s.has_work:
        run_step(s)
    assert [k.output_token_ids for k in kids] == [[7, 7, 7]] * 3


def test_prefix_hit_always_leaves_the_last_token_to_compute():
    s = scheduler(caching=True, block_size=4)
    s.add(make("a", 12, max_tokens=1))
    while s.has_work:
        run_step(s)
    again = make("b", 12, max_tokens=1)
    s.add(again)
    work = s.schedule().prefill[0]
    assert (work.start, work.end) == (8, 12) and again.num_cached_tokens == 8


def test_salted_requests_do_not_share_blocks():
    s = scheduler(caching=True, block_size=4)
    s.add(make("a", 13, max_tokens=1))
    while s.has_work:
        run_step(s)
    other = Request("b", list(range(10, 23)), SamplingParams(max_tokens=1), cache_salt="tenant-b")
    s.add(other)
    assert s.schedule().prefill[0].start == 0


def test_preempted_request_resumes_from_its_cached_prefix():
    s = scheduler(caching=True, block_size=4, num_blocks=32)
    r = make("a", 9, max_tokens=20)
    s.add(r)
    for _ in range(5):
        run_step(s)
    s._preempt(r)
    work = s.schedule().prefill[0]
    assert work.start == 12 and work.end == r.num_tokens and work.sample


def test_request_waiting_on_its_grammar_sits_aside_without_blocking():
    s = scheduler()
    slow, fast = make("slow", 5), make("fast", 5)
    slow.ready = False
    s.add(slow)
    s.add(fast)
    plan = run_step(s)
    assert [w.request.request_id for w in plan.prefill] == ["fast"] and list(s.skipped) == [slow]
    slow.ready = True
    plan = run_step(s)
    assert [w.request.request_id for w in plan.prefill] == ["slow"] and not s.skipped


def test_abort_while_waiting_aside():
    s = scheduler()
    r = make("a", 5)
    r.ready = False
    s.add(r)
    s.schedule()
    s.finish(r, FinishReason.ABORT)
    assert not s.has_work


def test_forced_prefill_with_zero_tokens_retries_as_decode():
    # Regression (field livelock): a partial prefill wants the next chunk but no block is free
    # while a decode runs; the step must run the decode, which frees blocks as it finishes.
    s = scheduler(num_blocks=4, block_size=4, budget=4, max_model_len=16)
    a = make("a", 4, max_tokens=2)
    s.add(a)
    run_step(s)                      # a: 1 block, decoding
    b = make("b", 12, max_tokens=1)
    s.add(b)
    run_step(s)                      # b: first chunk, 1 block
    run_step(s)                      # b: second chunk, 1 block
    s.pool.allocate(s.pool.num_free)  # the rest of the pool is gone
    plan = s.schedule()
    assert plan.kind is StepKind.DECODE and [w.request for w in plan.decode] == [a]


def test_partial_prefills_sharing_a_full_pool_cannot_deadlock():
    # Two prompts admitted together fill the pool with their first chunks; the older one takes
    # the newer one's blocks (preemption) instead of both waiting forever.
    s = scheduler(num_blocks=4, block_size=4, budget=16, max_model_len=16, max_prefill_len=8)
    a, b = make("a", 15, max_tokens=1), make("b", 15, max_tokens=1)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [w.request for w in first.prefill] == [a, b] and s.pool.num_free == 0
    s.update(first, {})
    second = s.schedule()
    assert [w.request for w in second.prefill] == [a] and b.status is RequestStatus.WAITING
    assert second.released_ids == ["b"]
    s.update(second, {"a": 7})
    while s.has_work:
        run_step(s)
    assert a.is_finished and b.is_finished


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.booleans(), st.booleans(),
                          st.integers(0, 6)), min_size=1, max_size=12),
       st.integers(8, 24), st.integers(1, 4), st.integers(4, 32), st.booleans(), st.integers(1, 3),
       st.sampled_from([0, 4, 8]), st.integers(0, 3), st.data())
def test_invariants_hold_under_random_traffic(specs, num_blocks, max_num_seqs, budget, caching,
                                              bound, max_prefill_len, max_prefill_batch, data):
    """Random arrivals, lengths, shared prefixes, aborts, grammar waits and block budgets: no mixed
    step; exact block accounting at every step; nothing held once all requests end; every
    request finishes; no step without progress; decodes never wait more than `bound` prefills."""
    block_size = 4
    max_model_len = min(num_blocks * block_size, 64)
    s = scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len, caching=caching,
                  max_consecutive_prefills=bound, max_prefill_len=max_prefill_len,
                  max_prefill_batch=max_prefill_batch)
    pending = []
    for i, (prompt_len, max_tokens, abort, compiling, arrive) in enumerate(specs):
        prompt_len = min(prompt_len, max_model_len - 1)
        r = Request(str(i), [10 + (j % 7) for j in range(prompt_len)],  # shared prefixes
                    SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS})))
        r.ready = not compiling
        pending.append((arrive, r, abort))
    reqs = [r for _, r, _ in pending]
    steps, streak = 0, 0
    while pending or s.has_work:
        steps += 1
        assert steps < 5000, "no progress"
        for entry in [e for e in pending if e[0] <= steps]:
            pending.remove(entry)
            s.add(entry[1])
        for r in s.skipped:                      # grammars finish compiling eventually
            r.ready = r.ready or data.draw(st.booleans())
        had_decodes = any(not r.is_prefilling for r in s.running)
        plan = s.schedule()
        assert not (plan.prefill and plan.decode)
        if plan.kind is StepKind.EMPTY:
            assert plan.released_ids or not s.running, "empty step while requests run"
            assert not s.waiting or s.running or s.skipped or not s._free_slots or pending
        # A decoder that preempted itself for a running prefill's KV (the forced decode found
        # nothing to run, LaneGroup.schedule) waits for readmission, not for a decode step.
        still_decoding = any(not r.is_prefilling for r in s.running)
        streak = streak + 1 if plan.kind is StepKind.PREFILL and had_decodes and still_decoding else 0
        assert streak <= bound, "decodes waited more prefill steps than the bound"
        assert plan.num_tokens <= max(budget, max_num_seqs)
        assert all(w.end - w.start <= (max_prefill_len or budget) for w in plan.prefill)
        assert len(plan.prefill) <= (max_prefill_batch or max_num_seqs)
        token = data.draw(st.sampled_from([7, 7, 7, EOS]))
        sampled = {w.request.request_id: token for w in plan.prefill if w.sample}
        sampled |= {w.request.request_id: token for w in plan.decode}
        s.update(plan, sampled)
        for r, spec in zip(reqs, specs):
            if spec[2] and r.status is RequestStatus.RUNNING and r.output_token_ids:
                s.finish(r, FinishReason.ABORT)
        s.pool.check()
        held = {b for r in s.running for b in r.block_ids}
        assert len(held) == s.pool.num_used
    assert all(r.is_finished for r in reqs)
    assert s.pool.num_free == s.pool.num_blocks


# ---- host-sampler options: logprobs, history, validation -------------------------------------
def test_logprobs_ride_with_their_tokens_to_the_output():
    s = scheduler()
    r = make("a", 5, max_tokens=3, logprobs=1)
    s.add(r)
    for token in (7, 8):
        plan = s.schedule()
        s.update(plan, {"a": token}, {"a": TokenLogprobs([token, 3], [-0.5, -0.25], 2)})
    out = output_to_pb(output_of(r))
    assert list(out.new_token_ids) == [7, 8] and [list(lp.token_ids) for lp in out.logprobs] == [[7, 3], [8, 3]]
    assert output_to_pb(output_of(r)) == out  # pure: building it twice loses nothing
    r.mark_sent()
    assert out.logprobs[0].rank == 2 and r.unsent_logprobs == [] and not output_of(r).new_token_ids
    plan = s.schedule()
    s.update(plan, {"a": 9})  # the worker broke the contract: no logprobs for a request that asked
    assert r.finish_reason is FinishReason.ERROR and "logprobs" in r.error and r.output_token_ids == [7, 8]


def test_new_request_carries_host_options_and_its_whole_history_on_resume():
    s = scheduler()
    r = make("a", 4, max_tokens=10, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=2,
             bad_words=((5, 6),), logit_bias=((3, -1.0),), min_p=0.1, allowed_token_ids=(7, 8))
    plain = make("b", 4, max_tokens=10, presence_penalty=0.0)
    s.add(r)
    s.add(plain)
    plan = s.schedule()
    new = {n.request_id: n for n in step_batch_to_pb(1, plan.kind, plan.lanes, 4).new_requests}
    assert list(new["a"].prompt_token_ids) == r.prompt_token_ids and not new["a"].output_token_ids
    d = new["a"].sampling
    assert (d.repetition_penalty, d.frequency_penalty, d.logprobs) == (pytest.approx(1.2), 0.5, 2)
    assert dict(d.logit_bias) == {3: -1.0} and list(d.allowed_token_ids) == [7, 8]
    assert [list(w.token_ids) for w in d.bad_words] == [[5, 6]] and d.min_p == pytest.approx(0.1)
    assert not new["b"].prompt_token_ids and not new["b"].sampling.HasField("logprobs")
    s.update(plan, {"a": 7, "b": 7}, {"a": TokenLogprobs([7, 7, 1], [-1.0, -1.0, -2.0], 1)})
    run_step(s)
    s._preempt(r)
    plan = s.schedule()
    resumed = step_batch_to_pb(2, plan.kind, plan.lanes, 4).new_requests[0]
    assert list(resumed.output_token_ids) == [7, 7] and resumed.num_output_tokens == 2


def test_a_request_needing_the_host_sampler_is_never_pipelined():
    s = scheduler()
    for r in (make("a", 4, max_tokens=10), make("b", 4, max_tokens=10, logprobs=0)):
        s.add(r)
    run_step(s)
    decode = s.schedule()
    assert decode.kind is StepKind.DECODE and s.schedule_ahead(decode) is None
    s.finish(s.running[1], FinishReason.ABORT)
    s.update(decode, {"a": 7})
    assert s.schedule_ahead(s.schedule()) is not None  # the plain request alone pipelines again


def add_pb(**sampling) -> engine_pb2.AddRequest:
    return engine_pb2.AddRequest(request_id="x", prompt_token_ids=[1, 2, 3], eos_token_ids=[EOS],
                                 sampling=engine_pb2.SamplingParams(max_tokens=4, **sampling))


def test_a_priority_is_refused_rather_than_ignored():
    add = add_pb()
    add.priority = -3
    request, unsupported = request_from_pb(add, client_id=1)
    with pytest.raises(AdmissionError, match="priority -3 .*first come, first served"):
        check_request(request, unsupported, Limits(max_model_len=64, vocab_size=64))


@pytest.mark.parametrize("sampling, words", [
    (dict(logprobs=21), "between 0 and 20"),
    (dict(logprobs=-1), "between 0 and 20"),
    (dict(prompt_logprobs=1), "prompt_logprobs: not supported"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=-1), "repetition_penalty must be a finite number greater than zero"),
    (dict(logit_bias={100: 1.0}), "logit_bias has token id 100"),
    (dict(allowed_token_ids=[5, 64]), "allowed_token_ids has token id 64"),
    (dict(bad_words=[engine_pb2.BadWords(token_ids=[5, 99])]), "bad_words has token id 99"),
    # Found by test_e2e_fuzz_session: an out-of-range stop id masked before min_tokens failed the
    # whole worker step (IndexError), not the one request.
    (dict(stop_token_ids=[2519360], min_tokens=2), "stop_token_ids has token id 2519360"),
    (dict(eos_extra=[64]), "eos_token_ids has token id 64"),
])
def test_host_options_out_of_range_are_refused_with_the_rule(sampling, words):
    eos = sampling.pop("eos_extra", [])
    add = add_pb(**sampling)
    add.eos_token_ids.extend(eos)
    request, unsupported = request_from_pb(add, client_id=1)
    with pytest.raises(AdmissionError) as e:
        check_request(request, unsupported, Limits(max_model_len=64, vocab_size=64))
    assert words in str(e.value)


def test_host_options_in_range_are_admitted_and_zero_repetition_penalty_is_off():
    request, unsupported = request_from_pb(add_pb(
        logprobs=20, min_p=1.0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0,
        logit_bias={63: -100.0}, allowed_token_ids=[0, 63], bad_words=[engine_pb2.BadWords(token_ids=[1, 2])]), 1)
    check_request(request, unsupported, Limits(max_model_len=64, vocab_size=64))
    assert request.sampling.repetition_penalty == 1.0 and request.sampling.bad_words == ((1, 2),)
    assert request.sampling.needs_host_sampler
    assert not request_from_pb(add_pb(), 1)[0].sampling.needs_host_sampler


def test_while_a_running_prefill_waits_for_blocks_no_newcomer_takes_them():
    # 10 blocks: P's 36-token prompt fills most of them while D1 decodes. Admitting D2 in the
    # step that had to preempt for P would hand D2 the freed blocks and preempt it again.
    s = scheduler(num_blocks=10, block_size=4, budget=16, max_model_len=40)
    requests = [make("D1", 11, max_tokens=4), make("P", 36, max_tokens=4), make("D2", 7, max_tokens=10)]
    for request in requests:
        s.add(request)
    for _ in range(100):
        if not s.has_work:
            break
        run_step(s)
    assert [(r.finish_reason, len(r.output_token_ids)) for r in requests] == [
        (FinishReason.LENGTH, 4), (FinishReason.LENGTH, 4), (FinishReason.LENGTH, 10)]
    assert s.num_preemptions == 0


def test_a_request_the_worker_refused_ends_with_its_reason_and_the_rest_of_the_step_applies():
    s = scheduler()
    s.add(make("a", 5))
    s.add(make("b", 5))
    plan = s.schedule()
    changed = s.update(plan, {"a": 7}, {}, refused={"b": "block id(s) 99 outside the lane's KV cache (0..63)"})
    a, b = sorted(changed, key=lambda r: r.request_id)
    assert a.output_token_ids == [7] and b.finish_reason is FinishReason.ERROR
    assert b.error == "the worker refused the request: block id(s) 99 outside the lane's KV cache (0..63)"
    assert s.pool.num_used == len(a.block_ids)  # b's blocks are back
