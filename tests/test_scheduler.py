"""The single-lane phase scheduler: step kinds, admission, stopping, preemption, accounting."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.control.blocks import BlockPool
from ttserve.control.request import FinishReason, Request, RequestStatus, SamplingParams
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.step import StepKind, StepPlan

EOS = 2


def make(rid: str, prompt_len: int, max_tokens: int = 4, **sampling) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), **sampling))


def scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 4,
              budget: int = 32, max_model_len: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), BlockPool(num_blocks, block_size))


def run_step(s: Scheduler, token: int = 7) -> StepPlan:
    """One step with a worker that samples `token` for every request that samples."""
    plan = s.schedule()
    sampled = {w.request.request_id: token for w in plan.prefill if w.sample}
    sampled |= {w.request.request_id: token for w in plan.decode}
    s.update(plan, sampled)
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


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.booleans()), min_size=1, max_size=12),
       st.integers(6, 24), st.integers(1, 4), st.integers(4, 32), st.data())
def test_invariants_hold_under_random_traffic(specs, num_blocks, max_num_seqs, budget, data):
    """No mixed step, exact block accounting after every step, every request finishes, nothing
    leaks, and no step passes without progress while work remains."""
    block_size = 4
    max_model_len = min(num_blocks * block_size, 64)
    s = scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len)
    reqs = []
    for i, (prompt_len, max_tokens, _) in enumerate(specs):
        prompt_len = min(prompt_len, max_model_len - 1)
        reqs.append(make(str(i), prompt_len, max_tokens))
        s.add(reqs[-1])
    steps = 0
    while s.has_work:
        steps += 1
        assert steps < 5000, "no progress"
        plan = s.schedule()
        assert not (plan.prefill and plan.decode)
        assert plan.kind is not StepKind.EMPTY or plan.released_ids or not (s.waiting or s.running)
        assert plan.num_tokens <= max(budget, max_num_seqs)
        token = data.draw(st.sampled_from([7, 7, 7, EOS]))
        sampled = {w.request.request_id: token for w in plan.prefill if w.sample}
        sampled |= {w.request.request_id: token for w in plan.decode}
        s.update(plan, sampled)
        # Abort some requests mid-flight.
        for r, (_, _, abort) in zip(reqs, specs):
            if abort and r.status is RequestStatus.RUNNING and r.output_token_ids:
                s.finish(r, FinishReason.ABORT)
        s.pool.check()
        used = sum(len(r.block_ids) for r in s.running)
        assert used == s.pool.num_used
    assert all(r.is_finished for r in reqs)
    assert s.pool.num_free == s.pool.num_blocks
