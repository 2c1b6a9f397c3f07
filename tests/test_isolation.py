"""Isolation after a step fails inside the model: a request that ran in a failed step is the only
row of its steps until one of its decode steps succeeds; after a second failure it stays alone to
its end. Every lane group schedule keeps that invariant and still finishes everything."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.control.lanes import GroupPlan
from ttserve.control.request import Request, RequestStatus
from ttserve.control.step import StepKind

from test_lanes import EOS, group, make, place

from ttserve.control.lanes import LaneGroup


def rows(plan: GroupPlan) -> list[Request]:
    return [w.request for lane in plan.lanes for w in (*lane.prefill, *lane.decode)]


def checked_step(g: LaneGroup) -> list[Request]:
    """One step (every row samples token 7), after checking that an isolated row is alone."""
    plan = g.schedule()
    batch = rows(plan)
    if any(r.isolated for r in batch):
        assert len(batch) == 1, f"an isolated request shared its step: {[r.request_id for r in batch]}"
    step_plan(g, plan)
    return batch



def step_plan(g: LaneGroup, plan: GroupPlan, token: int = 7) -> None:
    sampled = {w.request.request_id: token for lane in plan.lanes for w in lane.prefill if w.sample}
    sampled |= {w.request.request_id: token for lane in plan.lanes for w in lane.decode}
    g.update(plan, sampled)


def test_a_request_fails_only_alone_and_after_an_earlier_failure():
    r = make("r", 3)
    assert not r.step_failed(alone=False)   # a batch-mate, maybe
    assert r.isolated
    assert r.step_failed(alone=True)        # failed again, alone: it is the culprit
    q = make("q", 3)
    assert not q.step_failed(alone=True)    # once alone: a fault of the device is possible
    assert q.step_failed(alone=True)


def test_isolated_requests_run_one_a_step_then_rejoin_the_batch():
    g = group(num_lanes=2, max_num_seqs=3, budget=64)
    mates = [make(str(i), 5, max_tokens=6) for i in range(4)]
    for r in mates:
        place(g, r)
        r.step_failed(alone=False)          # all four were in the step that failed
    seen_alone: set[str] = set()
    while g.has_work:
        batch = checked_step(g)
        if len(batch) == 1:
            seen_alone.add(batch[0].request_id)
    assert seen_alone == {r.request_id for r in mates}
    assert all(r.is_finished and len(r.output_token_ids) == 6 and not r.isolated for r in mates)


def test_after_two_failures_a_request_stays_isolated_to_its_end():
    g = group(num_lanes=1, max_num_seqs=4, budget=64)
    twice, other = make("twice", 4, max_tokens=5), make("other", 4, max_tokens=5)
    for r in (twice, other):
        place(g, r)
    twice.step_failed(alone=False)
    twice.step_failed(alone=False)
    while g.has_work:
        checked_step(g)
    assert twice.isolated and twice.is_finished and other.is_finished


def test_an_isolated_request_does_not_block_the_decodes_it_waits_behind():
    """KV holds only the running requests: the isolated newcomer waits at the head while they
    decode to their end, then runs alone (no deadlock between isolation and admission)."""
    g = group(num_lanes=1, num_blocks=4, block_size=4, max_num_seqs=2, budget=16)
    running = make("running", 7, max_tokens=8)
    place(g, running)
    checked_step(g)                         # prefilled; it decodes from now on
    late = make("late", 6, max_tokens=3)
    late.step_failed(alone=False)
    place(g, late)
    steps = 0
    while g.has_work:
        steps += 1
        assert steps < 100, "no progress"
        checked_step(g)
    assert running.is_finished and late.is_finished


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.integers(0, 8)),
                min_size=1, max_size=12),
       st.integers(1, 3), st.integers(6, 16), st.integers(1, 3), st.booleans(), st.data())
def test_isolation_holds_and_everything_finishes_under_random_traffic(specs, num_lanes, num_blocks,
                                                                       max_num_seqs, caching, data):
    g = group(num_lanes, num_blocks, 4, max_num_seqs, budget=12, caching=caching)
    max_model_len = g.lanes[0].config.max_model_len
    pending = []
    for i, (prompt, tokens, failures, arrive) in enumerate(specs):
        r = make(str(i), min(prompt, max_model_len - 1), tokens, first=10 + i % 3)
        for _ in range(failures):
            r.step_failed(alone=False)
        pending.append((arrive, r))
    everyone = [r for _, r in pending]
    steps = 0
    while pending or g.has_work:
        steps += 1
        assert steps < 3000, "no progress"
        for entry in [e for e in pending if e[0] <= steps]:
            pending.remove(entry)
            place(g, entry[1])
        plan = g.schedule()
        batch = rows(plan)
        if any(r.isolated for r in batch):
            assert len(batch) == 1, "an isolated request shared its step"
        if plan.kind is StepKind.EMPTY:
            assert not any(lane.running for lane in g.lanes), "empty step while requests run"
        step_plan(g, plan, data.draw(st.sampled_from([7, 7, 7, EOS])))
        for lane in g.lanes:
            lane.pool.check()
    assert all(r.status is RequestStatus.FINISHED for r in everyone)
    # Twice failed: isolated to the end; never failed: never isolated. (Once failed, it rejoins
    # after a decode of its own, which a request finished by prefills alone never had.)
    assert all(r.isolated for r in everyone if r.num_failed_steps >= 2)
    assert not any(r.isolated for r in everyone if r.num_failed_steps == 0)


def test_a_request_isolated_to_its_end_alternates_with_the_others_batch():
    """Twice failed, it decodes alone to its end; the other lanes' requests still decode every
    other step instead of waiting for it to finish."""
    g = group(num_lanes=2, max_num_seqs=3, budget=64)
    twice = make("twice", 4, max_tokens=12)
    others = [make(f"o{i}", 4, max_tokens=12) for i in range(4)]
    for r in (twice, *others):
        place(g, r)
    twice.step_failed(alone=False)
    twice.step_failed(alone=False)
    while not all(r.prefilled for r in (twice, *others)):
        checked_step(g)
    progress = []
    for _ in range(8):
        batch = checked_step(g)
        progress.append(batch == [twice])
    assert progress.count(True) == 4 and progress.count(False) == 4, progress
