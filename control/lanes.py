"""A lane group: the lanes one device program executes together, stepped as one. This is the one
scheduling loop: a worker with a single lane is a group of one.

Each lane is a Scheduler with its own queues, slots and block pool (lane-local block ids). Every
step the group picks one shared mode: if any lane can prefill, all lanes run prefill and idle
lanes contribute empty slices; otherwise all run decode. The lanes' slices merge into one step
batch (row = lane * max_num_seqs + slot, stable while a request runs) and the results split back
per lane by request id, all in this process.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import images
from .phase import PhasePolicy
from .request import Request, TokenLogprobs
from .scheduler import Scheduler
from .step import DecodeWork, PrefillWork, StepKind, StepPlan


@dataclass(slots=True)
class GroupPlan:
    """One step of a lane group. Invariant: every lane slice is of `kind` or EMPTY."""
    kind: StepKind
    lanes: list[StepPlan]

    @property
    def has_work(self) -> bool:
        return self.kind is not StepKind.EMPTY or any(p.released_ids for p in self.lanes)

    @property
    def prefill(self) -> list[PrefillWork]:
        return [w for lane in self.lanes for w in lane.prefill]

    @property
    def decode(self) -> list[DecodeWork]:
        return [w for lane in self.lanes for w in lane.decode]

    @property
    def released_ids(self) -> list[str]:
        return [rid for lane in self.lanes for rid in lane.released_ids]

    @property
    def num_tokens(self) -> int:
        return sum(lane.num_tokens for lane in self.lanes)

    @property
    def samples_on_host(self) -> bool:
        """Some decode row samples on the host (Request.planned_on_host): asked right after
        planning, before anything applies to its requests."""
        return any(w.request.planned_on_host() for lane in self.lanes for w in lane.decode)


class LaneGroup:
    def __init__(self, lanes: list[Scheduler], policy: PhasePolicy | None = None) -> None:
        assert lanes and len({lane.config.max_num_seqs for lane in lanes}) == 1
        self.lanes = lanes
        self.policy = policy or PhasePolicy()
        self._isolated_decoded = False  # the last decode step ran an isolated request

    @property
    def max_num_seqs(self) -> int:
        return self.lanes[0].config.max_num_seqs

    @property
    def has_work(self) -> bool:
        return any(lane.has_work for lane in self.lanes)

    def schedule(self) -> GroupPlan:
        has_decodes = any(lane.has_decodes() for lane in self.lanes)
        wants_prefill = any(lane.wants_prefill() for lane in self.lanes)
        kind = self.policy.choose(wants_prefill, has_decodes)
        plans = self._plan_lanes(kind)
        if kind is StepKind.PREFILL and not any(p.prefill for p in plans) and has_decodes:
            # Liveness: a forced prefill that merged to zero tokens (KV pressure) runs as decode
            # for the whole group, carrying the ids finished or preempted by the attempt.
            plans = self._plan_lanes(StepKind.DECODE, plans)
            kind = StepKind.DECODE
        elif kind is StepKind.DECODE and not any(p.decode for p in plans) and any(
                lane.wants_prefill() for lane in self.lanes):
            # Likewise a forced decode whose only decoder gave its blocks back (it preempted
            # itself for a running prefill's KV): the prefills run instead of an empty step.
            plans = self._plan_lanes(StepKind.PREFILL, plans)
            kind = StepKind.PREFILL
        if not any(p.prefill or p.decode for p in plans):
            kind = StepKind.EMPTY
        self.policy.record(kind, has_decodes)
        return GroupPlan(kind, plans)

    def _plan_lanes(self, kind: StepKind, carry: list[StepPlan] | None = None) -> list[StepPlan]:
        """Every lane's slice of one step. A request that runs isolated (a step that carried it
        failed) is the step's only row: its lane plans first and, when its slice carries it, the
        other lanes plan nothing; otherwise every lane plans without its isolated requests.
        Isolated decoders take turns, fewest outputs first, and alternate with the batch of the
        others: a request isolated to its end never stops them."""
        payload = images.PayloadBudget()  # one gRPC message for the whole group's step
        carry = carry or [None] * len(self.lanes)
        picks = [(i, r) for i, lane in enumerate(self.lanes) if (r := lane.isolated_candidate(kind)) is not None]
        if kind is StepKind.DECODE and picks and self._isolated_decoded and any(
                not r.isolated and not r.is_prefilling for lane in self.lanes for r in lane.running):
            # The others' turn; if none of them can run now (KV), the isolated one's after all,
            # carrying what the attempt released.
            carry = [lane.plan(kind, c, payload) for lane, c in zip(self.lanes, carry)]
            if any(p.decode for p in carry):
                self._isolated_decoded = False
                return carry
            picks = [(i, r) for i, lane in enumerate(self.lanes)
                     if (r := lane.isolated_candidate(kind)) is not None]
        if not picks:
            return [lane.plan(kind, c, payload) for lane, c in zip(self.lanes, carry)]
        if kind is StepKind.DECODE:
            picks.sort(key=lambda p: len(p[1].output_token_ids))
        plans: dict[int, StepPlan] = {}
        ran = False
        for i, alone in picks:
            # A pick that cannot run now (KV) leaves its lane's slice to the others' rows, or,
            # with none, lets the next pick try.
            plans[i] = plan = self.lanes[i].plan(kind, carry[i], payload, alone)
            # Another isolated decoder of the lane may have taken the turn `alone` could not.
            ran = any(w.request.isolated for w in (*plan.prefill, *plan.decode))
            if ran or plan.prefill or plan.decode:
                break
        if kind is StepKind.DECODE:
            self._isolated_decoded = ran
        return [plans[i] if i in plans else lane.plan(StepKind.EMPTY if ran else kind, c, payload)
                for i, (lane, c) in enumerate(zip(self.lanes, carry))]

    def schedule_ahead(self, in_flight: GroupPlan) -> GroupPlan | None:
        """The next decode step, planned while `in_flight` (a pipelined decode) has not returned
        (async decode), by the same planner as every step; None when some lane needs the
        pipeline drained first (Scheduler.pipelined_rows) or no row would run."""
        if in_flight.kind is not StepKind.DECODE:
            return None
        rows = [lane.pipelined_rows(p) for lane, p in zip(self.lanes, in_flight.lanes)]
        if None in rows or not sum(rows):
            return None
        plans = [lane.plan(StepKind.DECODE) for lane in self.lanes]
        assert [len(p.decode) for p in plans] == rows, "pipelined_rows and plan disagree"
        self.policy.record(StepKind.DECODE, True)
        return GroupPlan(StepKind.DECODE, plans)

    def release(self) -> list[Request]:
        """Tear the group down: every lane gives up what it holds (Scheduler.release)."""
        return [r for lane in self.lanes for r in lane.release()]

    def update(self, plan: GroupPlan, sampled: dict[str, int],
               logprobs: dict[str, TokenLogprobs] | None = None,
               refused: dict[str, str] | None = None, accepted: dict[str, int] | None = None,
               draft_logprobs: dict[str, list[TokenLogprobs]] | None = None) -> list[Request]:
        changed: list[Request] = []
        for lane, lane_plan in zip(self.lanes, plan.lanes):
            changed += lane.update(lane_plan, sampled, logprobs, refused, accepted, draft_logprobs)
        return changed
