"""The phase scheduler of one lane: admission, prefill chunks, decode batches, preemption and
prefix-cache hits.

Lane-local state only: its own waiting and running queues, block pool and slots, so a lane
coordinator can run several of these side by side. `plan` is the one planner of every step,
synchronous or pipelined (async decode plans a decode before the one in flight returns, counting
its token as in flight: Request.num_in_flight); it is also the only call that changes the queues
while planning. Everything else that asks (`wants_prefill`, `pipelined_rows`, ...) only reads
(a request's block hashes aside: computed once, then kept, Request.full_block_hashes).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import logging

from . import images
from .blocks import BlockPool, PrefixHit
from .client_text import first_line
from .request import FinishReason, Request, RequestStatus, TokenLogprobs
from .speculation import SpecTally, SpeculativeConfig, propose
from .step import DecodeWork, GroupBlocks, PrefillWork, StepKind, StepPlan
from .stop import check_stop

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int              # rows of this lane
    max_num_batched_tokens: int    # prefill tokens per step
    max_model_len: int
    chunked_prefill: bool = True   # the model can prefill a prompt in several chunks
    max_prefill_batch: int = 0     # rows of one prefill step; 0 = max_num_seqs
    max_prefill_len: int = 0       # longest chunk (the largest traced prefill length); 0 = any
    speculative: SpeculativeConfig | None = None  # decode rows carry n-gram drafts (speculation.py)

    def __post_init__(self) -> None:
        if not self.chunked_prefill:
            # Whole prompts only: a budget below max_model_len would leave long prompts waiting
            # forever (a livelock seen in the field).
            assert self.max_num_batched_tokens >= self.max_model_len
            assert not self.max_prefill_len or self.max_prefill_len >= self.max_model_len


class Scheduler:
    """One lane's queues, slots and blocks. The step's kind is chosen by the lane group it belongs
    to (control/lanes.py), which is also how a single lane is stepped: a group of one."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, lane: int = 0) -> None:
        assert not config.chunked_prefill or min(
            config.max_num_batched_tokens, config.max_prefill_len or pool.block_size) >= pool.block_size, \
            "a chunk must hold at least one block, or chunked prefill cannot progress"
        self.config = config
        self.pool = pool
        self.lane = lane
        self.waiting: deque[Request] = deque()
        self.skipped: deque[Request] = deque()  # waiting on something other than KV
        self.running: list[Request] = []        # in admission order; the last is preempted first
        self._free_slots = list(range(config.max_num_seqs))
        self._released: list[str] = []         # device state to drop with the next step
        self.num_preemptions = 0
        self.spec = SpecTally()

    # ---- queue changes -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason, error: str = "", invalid: bool = False,
               stop_token_id: int | None = None) -> None:
        """End a request now (abort, error or stop): blocks and slot are free for the next step."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._evict(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.skipped.remove(request)
        request.finish(reason, error, invalid, stop_token_id)

    def adopt(self, request: Request) -> None:
        """A request another lane gave up (`release`: its worker was lost, drained or failed a
        step) joins the head of the queue and recomputes from prompt + the tokens it has, as a
        preempted request resumes (the client has seen those tokens and sees no others twice)."""
        assert request.status is RequestStatus.WAITING and request.slot is None and not request.block_tables
        self.waiting.appendleft(request)

    def release(self) -> list[Request]:
        """Give up every request this lane holds (its lane group is torn down): rows and blocks
        go back, and each is requeued with nothing on any device, ready for another lane to
        adopt. Returns them, running ones first, each queue in its order."""
        held = [*self.running, *self.waiting, *self.skipped]
        for request in self.running:
            self._evict(request)
            request.requeued()
        self.running, self.waiting, self.skipped = [], deque(), deque()
        return held

    @property
    def num_waiting(self) -> int:
        """Queued requests, including ones waiting aside (a grammar compiling)."""
        return len(self.waiting) + len(self.skipped)

    @property
    def has_work(self) -> bool:
        """Requests to run. Device state to drop (_released) is not work of its own: it rides on
        the next step, as vLLM's finished request ids ride on its next scheduler output; a step
        that only released cost a round trip to the worker at the end of every request served
        alone (1.8 ms on the simulated Galaxy), in the way of the next request's prefill."""
        return bool(self.waiting or self.running or self.skipped)

    # ---- planning ------------------------------------------------------------------------
    def wants_prefill(self) -> bool:
        """Some prefill can run now: a partial prefill, or an admissible head of the queue."""
        if any(r.is_prefilling for r in self.running):
            return True
        head = self._head()
        if head is None or not self._free_slots:
            return False
        return self._admission(head, self.config.max_num_batched_tokens) is not None

    def _head(self) -> Request | None:
        """The request admission would take next: the first ready one, those set aside before
        the queue (they arrived first; `_set_aside` puts them back there)."""
        return next((r for q in (self.skipped, self.waiting) for r in q if r.ready), None)

    def has_decodes(self) -> bool:
        return any(not r.is_prefilling for r in self.running)

    def isolated_candidate(self, kind: StepKind) -> Request | None:
        """The isolated request (Request.isolated: a step that carried it failed) a step of
        `kind` would run on this lane: a partial prefill or the head of the queue, or the
        isolated decoder with the fewest outputs (so that several take turns)."""
        if kind is StepKind.PREFILL:
            partial = next((r for r in self.running if r.is_prefilling and r.isolated), None)
            if partial is not None:
                return partial
            head = self._head()
            return head if head is not None and head.isolated else None
        if kind is StepKind.DECODE:
            return min((r for r in self.running if r.isolated and not r.is_prefilling),
                       key=lambda r: len(r.output_token_ids), default=None)
        return None

    def plan(self, kind: StepKind, carry: StepPlan | None = None,
             payload: images.PayloadBudget | None = None, alone: Request | None = None) -> StepPlan:
        """This lane's slice of a step of the given kind (EMPTY if it has none of that kind).

        `carry` is an earlier attempt at this step that scheduled nothing: its released ids
        (finished and preempted requests) travel with the new plan. `payload`: the image bytes
        the whole step may still carry (shared by the group's lanes; a lane alone by default).
        Isolated requests run only as `alone` (isolated_candidate), which then is the slice's
        only row; when it cannot run now the slice is planned without it.
        """
        plan = StepPlan(lane=self.lane, released_ids=(carry.released_ids if carry else []) + self._released)
        self._released = []
        self._set_aside()
        if kind is StepKind.PREFILL:
            self._fill_prefill(plan, payload or images.PayloadBudget(), alone)
        elif kind is StepKind.DECODE:
            self._fill_decode(plan, alone)
        plan.kind = StepKind.PREFILL if plan.prefill else StepKind.DECODE if plan.decode else StepKind.EMPTY
        self._mask(plan)
        # A request preempted while planning leaves its id in _released.
        plan.released_ids += self._released
        self._released = []
        return plan

    def pipelined_rows(self, previous: StepPlan) -> int | None:
        """How many rows this lane's next decode would run if planned now, while `previous` (its
        slice of a pipelined decode) is still in flight; None when the pipeline must drain first.

        The next decode feeds each request the token `previous` sampled (still on the device) one
        position further. That holds only while nothing else wants the lane (no prefill, no new
        decoder, nobody isolated), no request samples on the host, and blocks are free without
        preempting. Requests the steps in flight certainly end (max_tokens, max_model_len) get no
        row; ones they end by a stop token are dropped when that result arrives (rows go empty:
        the traced shape does not change). Only reads: `plan` then plans the step.
        """
        if self.wants_prefill() or any(r.isolated for r in self.running) or self.config.speculative:
            return None  # (a verify step's accepted tokens decide what the next step feeds)
        decoders = [r for r in self.running if not r.is_prefilling]
        carried = {id(w.request) for w in previous.decode if w.request.status is RequestStatus.RUNNING}
        if carried != {id(r) for r in decoders}:
            return None
        rows = needed = 0
        for request in decoders:
            blocks = self._decode_blocks(request)
            if blocks is None:
                continue
            if request.samples_on_host():
                # Penalties, bad words, logprobs and grammars read every token so far, and
                # min_tokens masks its EOS: no device-resident pipeline.
                return None
            rows, needed = rows + 1, needed + blocks
        return rows if self.pool.can_grow(needed) else None

    @staticmethod
    def _mask(plan: StepPlan) -> None:
        """Each sampling row of a request with a grammar carries the grammar's mask for the
        token it samples (the grammar has consumed every token before it)."""
        for work in (*(w for w in plan.prefill if w.sample), *plan.decode):
            if work.request.grammar is not None:
                work.bitmask = work.request.grammar.bitmask()

    def _set_aside(self) -> None:
        """Requests not ready to run (grammar compiling) wait aside; ready ones return to the
        front of the queue in their arrival order."""
        if self.skipped:
            back = [r for r in self.skipped if r.ready]
            if back:
                self.skipped = deque(r for r in self.skipped if not r.ready)
                self.waiting.extendleft(reversed(back))
        while self.waiting and not self.waiting[0].ready:
            self.skipped.append(self.waiting.popleft())

    def _admission(self, request: Request, budget: int) -> tuple[PrefixHit, int, int] | None:
        """(prefix-cache hit, first chunk end, new blocks per group) to admit `request` now, or None."""
        hit = self.pool.lookup([])
        if self.pool.enable_caching:
            # The last known token is always computed: it yields the logits to sample from.
            hashes = request.full_block_hashes(self.pool.block_size, request.num_tokens - 1)
            hit = self.pool.lookup(hashes)
            if hit.num_blocks < len(hashes) and hashes[hit.num_blocks] in self._prefix_being_computed():
                # A running request (a sibling of `n` > 1, or the same prompt just before) is
                # computing the next blocks now: wait for them to publish and share them.
                return None
            # Resume outside every image (an image is computed whole): a shorter prefix, found
            # again (a sliding group's window at the new resume point may hold other blocks).
            while request.images and (usable := images.usable_hit_blocks(
                    request.images, hit.num_blocks, self.pool.block_size)) < hit.num_blocks:
                hit = self.pool.lookup(hashes[:usable])
        start = hit.num_blocks * self.pool.block_size
        end = self._chunk_end(request, start, budget)
        if end is None:
            return None
        new_blocks = self.pool.blocks_for(end) - hit.num_blocks
        if not self.pool.can_allocate(new_blocks * self.pool.num_groups + self.pool.num_free_among(hit.block_ids)):
            return None
        return hit, end, new_blocks

    def _prefix_being_computed(self) -> set[int]:
        """Hashes of full blocks that running prefills will publish when their chunks land."""
        return {h for r in self.running if r.is_prefilling for h in r.block_hashes[r.num_published_blocks:]}

    def _chunk_end(self, request: Request, start: int, budget: int) -> int | None:
        """Where a prefill chunk starting at `start` ends within `budget`, or None if none fits."""
        limit = min(budget, self.config.max_prefill_len or budget)
        if request.num_tokens - start <= limit:
            return request.num_tokens
        if not self.config.chunked_prefill:
            return None
        # Intermediate chunks end on a block boundary, so every chunk starts block-aligned
        # (device kernels fill whole blocks), and outside every image (images.py).
        end = (start + limit) // self.pool.block_size * self.pool.block_size
        if request.images:
            end = images.chunk_end(request.images, start, end, self.pool.block_size)
        return end if end > start else None

    @staticmethod
    def _images_for(request: Request, end: int) -> list[images.ImageInput]:
        """The images a chunk ending at `end` carries to the worker (each once per device state)."""
        if not request.images:
            return []
        sent = images.unsent(request.images, request.num_sent_images, end)
        request.images_sent(len(sent))
        return sent

    def _fill_prefill(self, plan: StepPlan, payload: images.PayloadBudget, alone: Request | None) -> None:
        budget = self.config.max_num_batched_tokens
        if alone is not None and self._prefill_alone(plan, alone, budget, payload):
            return
        rows = self.config.max_prefill_batch or self.config.max_num_seqs
        preemptions, blocked = self.num_preemptions, False
        for request in list(self.running):  # partial prefills first: they hold blocks already
            if budget <= 0 or rows <= 0:
                return
            if request.status is RequestStatus.RUNNING and request.is_prefilling and not request.isolated:
                scheduled = self._continue_chunk(plan, request, budget, payload)
                blocked |= scheduled == 0
                budget -= scheduled
                rows -= scheduled > 0
        if blocked or self.num_preemptions != preemptions:
            # KV is short: a newcomer would take the blocks just freed for a running prefill
            # (and a victim re-admitted at once would recompute every step). As vLLM's V1
            # scheduler, admit nothing until the running prefills move again.
            return
        while budget > 0 and rows > 0 and self.waiting and self._free_slots:
            request = self.waiting[0]
            if not request.ready:
                self.skipped.append(self.waiting.popleft())
                continue
            if request.isolated:
                break  # it runs in a step of its own: no overtaking it
            admitted = self._admit(plan, request, budget, payload)
            if admitted == 0:
                break  # first come, first served: no overtaking the head of the queue
            budget -= admitted
            rows -= 1

    def _prefill_alone(self, plan: StepPlan, request: Request, budget: int,
                       payload: images.PayloadBudget) -> bool:
        """Plan the isolated `request`'s next prefill chunk as the slice's only row, if it can run."""
        if request.status is RequestStatus.RUNNING:
            return self._continue_chunk(plan, request, budget, payload) > 0
        if not (self.waiting and self.waiting[0] is request and self._free_slots):
            return False
        return self._admit(plan, request, budget, payload) > 0

    def _admit(self, plan: StepPlan, request: Request, budget: int, payload: images.PayloadBudget) -> int:
        """Start the head of the queue with its first chunk within `budget`; the chunk's tokens,
        or 0 when it cannot start now (KV, or its images would pass the step's message)."""
        admission = self._admission(request, budget)
        if admission is None:
            return 0
        hit, end, new_blocks = admission
        if not payload.take(images.unsent(request.images, request.num_sent_images, end)):
            return 0  # its images would pass the step's message: it goes first in a later step
        self.waiting.popleft()
        self._start(request, plan, hit)
        start = request.num_computed_tokens
        # The first chunk sends the hit's blocks too: the worker's tables start empty.
        new_ids = [table + new for table, new in zip(hit.tables, self.pool.grow(request, new_blocks))]
        self._plan_chunk(plan, PrefillWork(request, start, end, new_ids[0], sample=end == request.num_tokens,
                                           images=self._images_for(request, end),
                                           groups=self._groups(request, new_ids)))
        return end - start

    @staticmethod
    def _groups(request: Request, new_ids: list[list[int]]) -> list[GroupBlocks]:
        """A step item's blocks in the KV groups past the first."""
        return [GroupBlocks(ids, skipped) for ids, skipped in zip(new_ids[1:], request.num_skipped_blocks[1:])]

    @staticmethod
    def _plan_chunk(plan: StepPlan, work: PrefillWork) -> None:
        if work.sample:
            work.request.planned()
        plan.prefill.append(work)

    def _start(self, request: Request, plan: StepPlan, hit: PrefixHit) -> None:
        """Move an admitted request to running with its prefix-cache hit in place."""
        if request.num_preemptions == 0 and self.pool.enable_caching:
            self.pool.record_query(max(request.num_tokens - 1, 0) // self.pool.block_size, hit.num_blocks)
        request.started(heapq.heappop(self._free_slots), hit.num_blocks * self.pool.block_size)
        self.pool.assign(request, hit)
        self.running.append(request)
        plan.new_requests.append(request)

    def _continue_chunk(self, plan: StepPlan, request: Request, budget: int,
                        payload: images.PayloadBudget) -> int:
        start = request.num_computed_tokens
        end = self._chunk_end(request, start, budget)
        if end is None:
            return 0
        needed = self.pool.blocks_for(end) - len(request.block_ids)
        # Older requests go first: newer ones are preempted to let this chunk run, so partial
        # prefills that share a full pool cannot wait on each other forever.
        carried = images.unsent(request.images, request.num_sent_images, end)
        if not payload.fits(carried):
            return 0  # a later step carries its images
        if not self._make_room(request, needed, preempt_self=False):
            return 0
        payload.take(carried)
        new_ids = self.pool.grow(request, needed)
        self._plan_chunk(plan, PrefillWork(request, start, end, new_ids[0], sample=end == request.num_tokens,
                                           images=self._images_for(request, end),
                                           groups=self._groups(request, new_ids)))
        return end - start

    def _make_room(self, request: Request, needed: int, preempt_self: bool = True) -> bool:
        """Preempt running requests newer than `request` until `needed` more blocks (in every
        KV group) are free.

        If it is the newest and still does not fit, a decode preempts itself (it must either run
        or give its blocks back); a partial prefill keeps its blocks and waits instead, since
        giving them up would only make it recompute the same chunks.
        """
        while not self.pool.can_grow(needed):
            victim = self.running[-1]
            if victim is request and not preempt_self:
                return False
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _fill_decode(self, plan: StepPlan, alone: Request | None) -> None:
        if alone is not None:
            # Isolated decoders take turns (fewest outputs first); one that cannot run now (it
            # preempted itself for KV) lets the next try.
            turns = sorted((r for r in self.running if r.isolated and r is not alone and not r.is_prefilling),
                           key=lambda r: len(r.output_token_ids))
            for request in (alone, *turns):
                self._decode(plan, [request])
                if plan.decode:
                    return
        self._decode(plan, [r for r in self.running if not r.isolated])

    def _decode(self, plan: StepPlan, requests: list[Request]) -> None:
        for request in requests:
            if request.status is not RequestStatus.RUNNING or request.is_prefilling:
                continue
            drafts = self._drafts(request)
            needed = self._decode_blocks(request, len(drafts))
            if needed is None or (needed and not self._make_room(request, needed)):
                continue
            # With a token in flight the worker feeds the one it sampled (still on the device).
            in_flight = request.num_in_flight
            new_ids = self.pool.grow(request, needed)
            work = DecodeWork(request, None if in_flight else request.output_token_ids[-1],
                              request.num_tokens - 1 + in_flight, new_ids[0], groups=self._groups(request, new_ids),
                              draft_token_ids=drafts)
            request.planned()
            plan.decode.append(work)
        # A victim may have been planned before it was preempted: drop it from this step.
        plan.decode = [w for w in plan.decode if w.request.status is RequestStatus.RUNNING]

    def _decode_blocks(self, request: Request, num_drafts: int = 0) -> int | None:
        """New blocks the request's next decode needs (with `num_drafts` draft positions after
        its own), or None when the steps in flight certainly end it (it gets no row). With none
        in flight check_stop has already ended a request at those limits: the check is skipped
        (this runs for every row of every step)."""
        in_flight = request.num_in_flight
        if in_flight and request.ends_in_flight(self.config.max_model_len):
            return None
        # Its next position is num_tokens - 1 + in_flight: blocks for one more token than that.
        needed = self.pool.blocks_for(request.num_tokens + in_flight + num_drafts) - len(request.block_ids)
        return needed if needed > 0 else 0

    def _drafts(self, request: Request) -> list[int]:
        """The tokens proposed for the positions after its next one (speculation.py), within what
        it may still produce: max_tokens and max_model_len leave room for the token the step
        samples after them. None for a request whose sampling reads more than the logits
        (penalties, bias, bad words, a grammar, min_tokens still masking EOS): its drafts would
        be judged against a distribution the verify step does not compute."""
        config = self.config.speculative
        if config is None or request.num_in_flight or not request.can_speculate:
            return []
        room = min(request.sampling.max_tokens - len(request.output_token_ids),
                   self.config.max_model_len - request.num_tokens) - 1
        return propose(request.all_token_ids, config, min(config.num_speculative_tokens, room))

    def _preempt(self, request: Request) -> None:
        """Back to the head of waiting with nothing on the device; it recomputes on resume
        (from its cached prefix blocks, when they survive)."""
        self.running.remove(request)
        self._evict(request)
        request.preempted()
        self.num_preemptions += 1
        log.info("preempted request %s on lane %d: the KV cache is full (%d blocks); it will "
                 "recompute %d tokens (%d preemptions so far)", request.request_id, self.lane,
                 self.pool.num_blocks, request.num_tokens, self.num_preemptions)
        self.waiting.appendleft(request)

    def _evict(self, request: Request) -> None:
        """Its row and blocks go back; the worker drops its device state with the next step."""
        self.pool.release(request)
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
            self._released.append(request.request_id)
        request.dropped()

    # ---- results -------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[str, int],
               logprobs: dict[str, TokenLogprobs] | None = None,
               refused: dict[str, str] | None = None, accepted: dict[str, int] | None = None,
               draft_logprobs: dict[str, list[TokenLogprobs]] | None = None) -> list[Request]:
        """Apply a step's sampled tokens (and the logprobs of requests that asked for them);
        returns the requests with new tokens or a finish. A request the worker `refused` (its
        items were out of range) ends with the worker's reason; the rest of the step applies. A
        verify row's request gets its `accepted` drafts (with their `draft_logprobs`) before
        its sampled token, each checked against its stop conditions in turn."""
        logprobs = logprobs or {}
        changed: list[Request] = []
        for work in (*plan.prefill, *plan.decode) if refused else ():
            request = work.request
            if request.request_id in refused and request.status is RequestStatus.RUNNING:
                self.finish(request, FinishReason.ERROR, f"the worker refused the request: "
                            f"{refused[request.request_id]}", invalid=True)
                changed.append(request)
        for work in plan.prefill:
            request = work.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.computed(work.end)
            self.pool.advance(request)
            if work.sample:
                self._append(request, sampled[request.request_id], logprobs, changed)
        for work in plan.decode:
            request = work.request
            if request.status is not RequestStatus.RUNNING:
                continue
            if request.isolated:
                request.step_succeeded()
            if work.draft_token_ids:
                self._apply_verified(work, sampled, logprobs, accepted or {}, draft_logprobs or {}, changed)
                continue
            request.computed(work.position + 1)
            self.pool.advance(request)
            self._append(request, sampled[request.request_id], logprobs, changed)
        return changed

    def _apply_verified(self, work: DecodeWork, sampled: dict[str, int], logprobs: dict[str, TokenLogprobs],
                        accepted: dict[str, int], draft_logprobs: dict[str, list[TokenLogprobs]],
                        changed: list[Request]) -> None:
        """A verify row: its accepted drafts, then the token sampled after them. KV is computed
        for the fed token and the accepted drafts; the rejected positions' KV stays in blocks the
        request keeps and is rewritten when those positions are computed again."""
        request = work.request
        rid = request.request_id
        count = min(accepted.get(rid, 0), len(work.draft_token_ids))
        self.spec.record(len(work.draft_token_ids), count)
        lps = draft_logprobs.get(rid, [])
        for i, token in enumerate(work.draft_token_ids[:count]):
            if not self._take_draft(request, token, lps[i] if i < len(lps) else None, changed):
                return  # it ended on this draft (a stop token, max_tokens): the rest is dropped
        self._append(request, sampled[rid], logprobs, changed)
        if request.status is RequestStatus.RUNNING:
            # The hashes of the blocks it publishes read the tokens just appended.
            request.computed(work.position + 1 + count)
            self.pool.advance(request)

    def _take_draft(self, request: Request, token_id: int, token_logprobs: TokenLogprobs | None,
                    changed: list[Request]) -> bool:
        """An accepted draft joins its output; False when that ends it."""
        if request.sampling.logprobs is not None and token_logprobs is None:
            self.finish(request, FinishReason.ERROR, "the worker accepted a draft token without the logprobs the "
                        "request asked for")
            changed.append(request)
            return False
        request.draft_accepted(token_id, token_logprobs if request.sampling.logprobs is not None else None)
        stop = check_stop(request, self.config.max_model_len)
        if stop is None:
            return True
        changed.append(request)
        reason, stop_token_id = stop
        self.finish(request, reason, stop_token_id=stop_token_id)
        return False

    def _append(self, request: Request, token_id: int, logprobs: dict[str, TokenLogprobs],
                changed: list[Request]) -> None:
        changed.append(request)
        token_logprobs = logprobs.get(request.request_id) if request.sampling.logprobs is not None else None
        if request.sampling.logprobs is not None and token_logprobs is None:
            self.finish(request, FinishReason.ERROR, "the worker returned a token without the "
                        "logprobs the request asked for")
            return
        request.sampled(token_id, token_logprobs)
        stop = check_stop(request, self.config.max_model_len)
        if stop is not None:
            reason, stop_token_id = stop
            self.finish(request, reason, stop_token_id=stop_token_id)
        elif request.grammar is not None:
            self._advance_grammar(request, token_id)

    def _advance_grammar(self, request: Request, token_id: int) -> None:
        """Feed the grammar its request's new token; a token it refuses ends the request with an
        error. A complete grammar allows only EOS, so the request ends on that EOS as in vLLM
        (whose frontend hides the token a STOP ends on: ending without one would cut the output's
        last token from the text); tokens after completion (ignore_eos) are not fed, as in vLLM."""
        grammar = request.grammar
        assert grammar is not None
        if not grammar.is_complete and not grammar.accept(token_id):
            self.finish(request, FinishReason.ERROR, f"the request's structured output cannot go on: the worker "
                        f"sampled token {token_id}, which it does not allow ({first_line(grammar.error)})",
                        invalid=True)
