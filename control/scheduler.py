"""The phase scheduler of one lane: admission, prefill chunks, decode batches, preemption.

Lane-local state only: its own waiting and running queues, its own block pool and slots, so a
lane coordinator can run several of these side by side.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from .blocks import BlockPool
from .phase import PhasePolicy
from .request import FinishReason, Request, RequestStatus
from .step import DecodeWork, PrefillWork, StepKind, StepPlan
from .stop import check_stop


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int            # rows of this lane
    max_num_batched_tokens: int  # prefill tokens per step
    max_model_len: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, lane: int = 0,
                 policy: PhasePolicy | None = None) -> None:
        self.config = config
        self.pool = pool
        self.lane = lane
        self.policy = policy or PhasePolicy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # in admission order; the last is preempted first
        self._free_slots = list(range(config.max_num_seqs))
        self._released: list[str] = []     # device state to drop with the next step
        self.num_preemptions = 0

    # ---- queue changes -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason, error: str = "") -> None:
        """End a request now (abort, error or stop): blocks and slot are free for the next step."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._evict(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released)

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(lane=self.lane, released_ids=self._released)
        self._released = []
        has_decodes = any(not r.is_prefilling for r in self.running)
        plan.kind = self.policy.choose(self._wants_prefill(), has_decodes)
        if plan.kind is StepKind.PREFILL:
            self._fill_prefill(plan)
            if not plan.prefill:
                # Liveness: a prefill step that admits nothing (KV pressure) runs as decode, so
                # finishing decodes free the blocks the prefill waits for.
                plan.kind = StepKind.DECODE if has_decodes else StepKind.EMPTY
        if plan.kind is StepKind.DECODE:
            self._fill_decode(plan)
            if not plan.decode:
                plan.kind = StepKind.EMPTY
        # A request preempted while planning this step leaves its id in _released.
        plan.released_ids += self._released
        self._released = []
        return plan

    def _wants_prefill(self) -> bool:
        if any(r.is_prefilling for r in self.running):
            return True
        if not self.waiting or not self._free_slots:
            return False
        head = self.waiting[0]
        first_chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
        return self.pool.can_allocate(self.pool.blocks_for(first_chunk))

    def _fill_prefill(self, plan: StepPlan) -> None:
        budget = self.config.max_num_batched_tokens
        for request in self.running:  # partial prefills first: they hold blocks already
            if budget > 0 and request.is_prefilling:
                budget -= self._plan_chunk(plan, request, budget)
        while budget > 0 and self.waiting and self._free_slots:
            request = self.waiting[0]
            if not self.pool.can_allocate(self.pool.blocks_for(min(request.num_tokens, budget))):
                break  # first come, first served: no overtaking the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.slot = heapq.heappop(self._free_slots)
            self.running.append(request)
            plan.new_requests.append(request)
            request.on_device = True
            budget -= self._plan_chunk(plan, request, budget)

    def _plan_chunk(self, plan: StepPlan, request: Request, budget: int) -> int:
        start = request.num_computed_tokens
        end = min(request.num_tokens, start + budget)
        needed = self.pool.blocks_for(end) - len(request.block_ids)
        if not self.pool.can_allocate(needed):
            return 0
        new_blocks = self.pool.allocate(needed)
        request.block_ids += new_blocks
        plan.prefill.append(PrefillWork(request, start, end, new_blocks, sample=end == request.num_tokens))
        return end - start

    def _fill_decode(self, plan: StepPlan) -> None:
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.is_prefilling:
                continue
            needed = self.pool.blocks_for(request.num_tokens) - len(request.block_ids)
            while not self.pool.can_allocate(needed):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            new_blocks = self.pool.allocate(needed)
            request.block_ids += new_blocks
            plan.decode.append(DecodeWork(request, request.output_token_ids[-1],
                                          request.num_tokens - 1, new_blocks))
        # A victim may have been planned before it was preempted: drop it from this step.
        plan.decode = [w for w in plan.decode if w.request.status is RequestStatus.RUNNING]

    def _preempt(self, request: Request) -> None:
        """Back to the head of waiting with nothing on the device; it recomputes on resume."""
        self.running.remove(request)
        self._evict(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.prefilled = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _evict(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None
        if request.on_device:
            self._released.append(request.request_id)
            request.on_device = False

    # ---- results -------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests with new tokens or a finish."""
        changed: list[Request] = []
        for work in plan.prefill:
            request = work.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = work.end
            if work.sample:
                request.prefilled = True
                self._append(request, sampled[request.request_id], changed)
        for work in plan.decode:
            request = work.request
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = work.position + 1
            self._append(request, sampled[request.request_id], changed)
        return changed

    def _append(self, request: Request, token_id: int, changed: list[Request]) -> None:
        request.output_token_ids.append(token_id)
        changed.append(request)
        stop = check_stop(request, self.config.max_model_len)
        if stop is not None:
            reason, request.stop_token_id = stop
            self.finish(request, reason)
