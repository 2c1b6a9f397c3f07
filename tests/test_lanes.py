"""Lane groups and placement: one shared mode per step, empty slices for idle lanes, stable
rows, exact per-lane accounting, liveness, least-loaded placement that never moves a request."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.control.blocks import BlockPool
from ttserve.control.lanes import LaneGroup
from ttserve.control.phase import PhasePolicy
from ttserve.control.placement import Candidate, choose_lane
from ttserve.control.request import FinishReason, Request, RequestStatus, SamplingParams, TokenLogprobs
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.step import StepKind
from ttserve.control.wire import step_batch_to_pb

EOS = 2


def make(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 10) -> Request:
    return Request(rid, [first + (j % 5) for j in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS})))


def group(num_lanes: int = 4, num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 2,
          budget: int = 16, caching: bool = False, bound: int = 2) -> LaneGroup:
    config = SchedulerConfig(max_num_seqs, budget, min(num_blocks * block_size, 64))
    return LaneGroup([Scheduler(config, BlockPool(num_blocks, block_size, caching), lane=i)
                      for i in range(num_lanes)], PhasePolicy(bound))


def place(g: LaneGroup, request: Request) -> Scheduler:
    lane = choose_lane([Candidate(0, i, lane) for i, lane in enumerate(g.lanes)], request).lane
    request.placed(0, lane.lane)
    lane.add(request)
    return lane


def step(g: LaneGroup, token: int = 7):
    plan = g.schedule()
    sampled = {w.request.request_id: token for p in plan.lanes for w in p.prefill if w.sample}
    sampled |= {w.request.request_id: token for p in plan.lanes for w in p.decode}
    g.update(plan, sampled)
    return plan


def test_prefill_in_one_lane_makes_every_lane_prefill_with_empty_slices():
    g = group()
    place(g, make("a", 3, max_tokens=10))
    step(g)                                  # a prefilled on lane 0; it decodes from now on
    assert step(g).kind is StepKind.DECODE
    r = make("b", 3)
    assert place(g, r) is g.lanes[1]
    plan = step(g)
    assert plan.kind is StepKind.PREFILL
    assert [p.kind for p in plan.lanes] == [StepKind.EMPTY, StepKind.PREFILL, StepKind.EMPTY, StepKind.EMPTY]


def test_merged_batch_rows_are_lane_times_capacity_plus_slot():
    g = group(max_num_seqs=2)
    for i in range(6):
        place(g, make(str(i), 3))
    plan = g.schedule()
    batch = step_batch_to_pb(1, plan.kind, plan.lanes, g.max_num_seqs)
    rows = {n.request_id: (n.lane, n.row) for n in batch.new_requests}
    assert rows == {"0": (0, 0), "1": (1, 2), "2": (2, 4), "3": (3, 6), "4": (0, 1), "5": (1, 3)}


def test_placement_prefers_least_loaded_weighting_waiting_and_ties_to_lowest():
    lanes = [Scheduler(SchedulerConfig(4, 16, 64), BlockPool(16, 4), lane=i) for i in range(3)]
    cands = [Candidate(0, i, lane) for i, lane in enumerate(lanes)]
    assert choose_lane(cands, make("x", 3)).lane is lanes[0]
    lanes[0].running.extend([make("r1", 3), make("r2", 3), make("r3", 3)])  # score 3
    lanes[1].waiting.append(make("w", 3))                                  # score 4
    assert choose_lane(cands, make("y", 3)).lane is lanes[2]
    lanes[2].running.extend([make("r4", 3), make("r5", 3), make("r6", 3), make("r7", 3)])  # 4
    assert choose_lane(cands, make("z", 3)).lane is lanes[0]


def test_placement_prefers_a_lane_holding_the_prefix_among_near_equal_loads():
    g = group(num_lanes=2, caching=True, block_size=4)
    first = make("a", 13, max_tokens=1)
    g.lanes[1].add(first)                    # lane 1 computes and caches the prefix
    while g.has_work:
        step(g)
    g.lanes[1].running.append(make("busy", 3))  # lane 1 is now slightly busier
    assert place(g, make("b", 13)) is g.lanes[1]
    assert place(g, make("c", 3, first=40)) is g.lanes[0]  # no shared prefix: least loaded


def test_forced_prefill_that_merges_to_zero_tokens_runs_the_whole_group_as_decode():
    g = group(num_lanes=2, num_blocks=4, block_size=4, budget=4)
    a = make("a", 4, max_tokens=3)
    g.lanes[0].add(a)
    step(g)                                  # a decodes on lane 0
    b = make("b", 12, max_tokens=1)
    g.lanes[1].add(b)
    step(g)                                  # b's first chunk on lane 1
    g.lanes[1].pool.allocate(g.lanes[1].pool.num_free)  # lane 1's pool is exhausted
    plan = g.schedule()
    assert plan.kind is StepKind.DECODE
    assert [p.kind for p in plan.lanes] == [StepKind.DECODE, StepKind.EMPTY]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.booleans(), st.integers(0, 8)),
                min_size=1, max_size=16),
       st.integers(1, 4), st.integers(6, 16), st.integers(1, 3), st.booleans(), st.data())
def test_group_invariants_under_random_traffic(specs, num_lanes, num_blocks, max_num_seqs, caching, data):
    g = group(num_lanes, num_blocks, 4, max_num_seqs, budget=12, caching=caching)
    max_model_len = g.lanes[0].config.max_model_len
    pending = [(arrive, make(str(i), min(p, max_model_len - 1), t, first=10 + i % 3), abort)
               for i, (p, t, abort, arrive) in enumerate(specs)]
    everyone = [r for _, r, _ in pending]
    slots: dict[str, int] = {}
    steps = 0
    while pending or g.has_work:
        steps += 1
        assert steps < 3000, "no progress"
        for entry in [e for e in pending if e[0] <= steps]:
            pending.remove(entry)
            lane = place(g, entry[1])
            assert entry[1].lane == lane.lane
        plan = g.schedule()
        for lane_plan in plan.lanes:
            assert lane_plan.kind in (plan.kind, StepKind.EMPTY), "lanes in different modes"
            assert not (lane_plan.prefill and lane_plan.decode)
        if plan.kind is StepKind.EMPTY:
            assert not any(lane.running for lane in g.lanes), "empty step while requests run"
        for lane, lane_plan in zip(g.lanes, plan.lanes):
            for w in lane_plan.prefill + lane_plan.decode:
                assert w.request.lane == lane.lane, "a request moved lanes"
        token = data.draw(st.sampled_from([7, 7, 7, EOS]))
        sampled = {w.request.request_id: token for p in plan.lanes for w in p.prefill if w.sample}
        sampled |= {w.request.request_id: token for p in plan.lanes for w in p.decode}
        g.update(plan, sampled)
        for lane in g.lanes:
            lane.pool.check()
            assert len({b for r in lane.running for b in r.block_ids}) == lane.pool.num_used
            for r in lane.running:   # rows stable while running
                assert slots.setdefault(r.request_id + str(r.num_preemptions), r.slot) == r.slot
        for r, spec in zip(everyone, specs):
            if spec[2] and r.status is RequestStatus.RUNNING and r.output_token_ids:
                g.lanes[r.lane].finish(r, FinishReason.ABORT)
    assert all(r.is_finished for r in everyone)
    assert all(lane.pool.num_free == lane.pool.num_blocks for lane in g.lanes)


# ---- async decode: two steps in flight ---------------------------------------------------------
from collections import deque  # noqa: E402


class FakeDevice:
    """Tokens as a pure function of the fed token and its position; a decode item without a
    token feeds the one this device sampled for the request in its previous step."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def run(self, plan) -> dict[str, int]:
        out = {}
        for lane_plan in plan.lanes:
            for w in lane_plan.prefill:
                if w.sample:
                    out[w.request.request_id] = (w.request.all_token_ids[w.end - 1] * 7 + w.end) % 50 + 2
            for w in lane_plan.decode:
                fed = self.last[w.request.request_id] if w.token_id is None else w.token_id
                out[w.request.request_id] = (fed * 7 + w.position + 1) % 50 + 2
        self.last.update(out)
        return out


def drive(g: LaneGroup, requests: list[Request], pipelined: bool) -> tuple[dict, int]:
    for i, r in enumerate(requests):
        g.lanes[i % len(g.lanes)].add(r)
    device, in_flight, drains = FakeDevice(), deque(), 0
    for _ in range(5000):
        if not in_flight:
            if not g.has_work:
                break
            plan = g.schedule()
            in_flight.append((plan, device.run(plan)))
        if pipelined and in_flight[-1][0] is not None and in_flight[-1][0].kind is StepKind.DECODE \
                and len(in_flight) == 1:
            follow = g.schedule_ahead(in_flight[-1][0])
            drains += follow is None
            assert follow is None or not any(w.request.sampling.needs_host_sampler
                                             for p in follow.lanes for w in p.decode)
            in_flight.append((follow, device.run(follow) if follow else {}))
        plan, sampled = in_flight.popleft()
        if plan is not None:
            g.update(plan, sampled, {rid: TokenLogprobs([t], [-1.0], 1) for rid, t in sampled.items()})
        for lane in g.lanes:
            lane.pool.check()
    assert not g.has_work
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in requests}, drains


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 15), st.integers(0, 3), st.booleans()),
                min_size=1, max_size=8),
       st.integers(1, 3), st.integers(10, 24))
def test_pipelined_decode_gives_exactly_the_unpipelined_outputs(specs, num_lanes, num_blocks):
    def requests():
        # Some requests need the host sampler (logprobs): their batches drain the pipeline.
        return [Request(str(i), [10 + (j * 3) % 40 for j in range(p)],
                        SamplingParams(max_tokens=t, eos_token_ids=frozenset({EOS}), min_tokens=m,
                                       logprobs=0 if host else None))
                for i, (p, t, m, host) in enumerate(specs)]
    sync, _ = drive(group(num_lanes, num_blocks, 4, 2, budget=16), requests(), pipelined=False)
    piped, _ = drive(group(num_lanes, num_blocks, 4, 2, budget=16), requests(), pipelined=True)
    assert piped == sync


def test_a_stable_batch_stays_pipelined_until_it_changes():
    g = group(num_lanes=2, num_blocks=32)
    reqs = [Request(str(i), [11, 12, 13], SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(4)]
    _, drains = drive(g, reqs, pipelined=True)
    assert drains <= 2  # after the prefills, one stable batch decodes to the end


def test_asking_whether_a_lane_can_prefill_or_pipeline_changes_nothing():
    """Only `plan` changes a lane's queues: the questions the group asks before planning (and
    before planning a pipelined step ahead) leave them as they were, whatever they answer."""
    g = group(num_lanes=1)
    lane = g.lanes[0]
    decoding, compiling, ready = make("a", 3, max_tokens=10), make("b", 3), make("c", 3)
    lane.add(decoding)
    step(g)
    compiling.await_grammar()  # waits aside once a plan sees it
    lane.add(compiling)
    lane.add(ready)
    decode = g.schedule()
    snapshot = (list(lane.waiting), list(lane.skipped), list(lane.running), decoding.num_in_flight)
    assert lane.wants_prefill() and lane.pipelined_rows(decode.lanes[0]) is None
    assert lane.isolated_candidate(StepKind.PREFILL) is None
    assert (list(lane.waiting), list(lane.skipped), list(lane.running), decoding.num_in_flight) == snapshot


def test_a_pipelined_decode_is_planned_by_the_same_planner_one_position_further():
    g = group(num_lanes=2)
    reqs = [make(str(i), 3, max_tokens=10) for i in range(3)]
    for r in reqs:
        place(g, r)
    step(g)
    first = g.schedule()
    ahead = g.schedule_ahead(first)
    assert ahead is not None and ahead.kind is StepKind.DECODE
    by_id = {w.request.request_id: w for w in first.decode}
    for w in ahead.decode:
        assert w.token_id is None and w.position == by_id[w.request.request_id].position + 1
    assert all(r.num_in_flight == 2 for r in reqs)
    g.update(first, {r.request_id: 7 for r in reqs})
    g.update(ahead, {r.request_id: 8 for r in reqs})
    assert all(r.output_token_ids[-2:] == [7, 8] and r.num_in_flight == 0 for r in reqs)
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in reqs)
