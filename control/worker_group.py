"""One device worker and the lane group it executes: connect, check the topology, warm up, step,
and after a failure give back what it held and reconnect."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from .blocks import BlockPool
from .engine_config import EngineConfig
from .lanes import GroupPlan, LaneGroup
from .metrics import ControlMetrics
from .phase import PhasePolicy, default_streak
from .placement import Candidate
from .request import FinishReason, Request
from .request_trace import RequestTracing
from .scheduler import Scheduler
from .serving_plan import ServingPlan, WarmupPlan, plan_warmup
from .speculation import SpecTally
from .step import StepKind
from .wire import StepOutcome, WorkerDescription
from .worker_link import StepFailed, WorkerError, WorkerLink
from ttserve.tracing import Tracer

log = logging.getLogger(__name__)


# Steps failed in a row after which a worker is lost rather than its requests isolated: a poison
# request fails twice (in its batch, then alone) and its batch-mates then pass; a third failure in
# a row says the device itself fails.
STEP_FAILURES_LOST = 3


class WorkerLost(WorkerError):
    """The link to a worker ended while it served; the requests it held go back to the engine."""

    def __init__(self, reason: str, requests: list[Request]) -> None:
        super().__init__(reason)
        self.requests = requests


class WorkerDraining(WorkerLost):
    """The worker is shutting down and said so: the requests it held go back to the engine, to
    move to other workers without spending their --migration-limit."""


@dataclass(slots=True)
class LaneTotals:
    """Counts that outlive a lane group (it is rebuilt on every reconnect), so the exported
    counters stay monotonic."""
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    spec: SpecTally = field(default_factory=SpecTally)

    def add(self, group: LaneGroup) -> "LaneTotals":
        for lane in group.lanes:
            self.prefix_query_tokens += lane.pool.num_queries * lane.pool.block_size
            self.prefix_hit_tokens += lane.pool.num_hits * lane.pool.block_size
            self.preemptions += lane.num_preemptions
            self.spec.add(lane.spec)
        return self


@dataclass(frozen=True, slots=True)
class Warm:
    """A worker warm and holding its step stream: how it describes itself now (its KV capacity
    known), and what it was warmed up for (serving_plan.plan_warmup)."""
    description: WorkerDescription
    asked: WarmupPlan


@dataclass(slots=True)
class Stepped:
    """One step's result, on its way up to the engine: the requests with news (new tokens or a
    finish), already applied to their lanes."""
    step_id: int
    changed: list[Request]


@dataclass(slots=True)
class StepFailure:
    """A step failed inside the model, on its way up to the engine. The worker dropped its device
    state and serves on; the lane group has started anew. `requests`: every request it held (to
    place again); `failed`: those the failed step, or a step in flight with it, carried;
    `error`: the model's exception as the worker gave it (no address: it reaches clients)."""
    reason: str
    error: str
    requests: list[Request]
    failed: list[Request]
    alone: bool   # the failed steps carried one request, `failed`'s only one


@dataclass(slots=True)
class InFlight:
    """A step sent and not answered yet. The control side's whole pipeline state is a deque of
    these (at most two: a pipelined decode and the one planned ahead of it) plus each request's
    Request.num_in_flight."""
    plan: GroupPlan | None   # None: an empty flush, which returns the pipelined step before it
    pipelined: bool          # the worker may keep this decode running ahead of its result
    sent: float              # time.monotonic() when sent


@dataclass(slots=True)
class LaneLoad:
    """A lane's queues and KV blocks, as metrics and server info report them."""
    lane: int
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int

    @property
    def kv_usage(self) -> float:
        return self.blocks_used / self.blocks_total


class WorkerGroup:
    """One worker's life, driven by the engine: `connect` (describe, plan the warmup, warm up)
    returns the warm worker; once the engine has made its serving plan (serving_plan.py),
    `start` builds the lane group; `steps` yields each step's result; `release` tears the
    group down and returns the requests it held. Nothing here calls up into the engine."""

    def __init__(self, index: int, address: str, config: EngineConfig,
                 metrics: ControlMetrics | None = None, name: str = "",
                 tracing: RequestTracing | None = None) -> None:
        self.index = index            # the engine's id for it, never reused
        self.name = name or address   # the `worker` label of its metrics
        self.address = address
        self.config = config
        self.metrics = metrics or ControlMetrics()
        self.tracing = tracing or RequestTracing(Tracer.off())
        self._tracing_failed = False
        self.metrics.stalls.labels(self.name)  # exported as 0 from the start, for alert rules
        self.lane_group: LaneGroup | None = None
        self.description: WorkerDescription | None = None
        self.not_ready_reason = f"connecting to the worker at {address}"
        self.num_steps = 0
        self.connected = False        # Describe answered and the link is open
        self.warmup_progress = 0.0    # 0-1, as the worker last reported it
        self.stalled_since: float | None = None  # when the unanswered wait began, once stalled
        self.draining = False         # it said it shuts down; cleared when it describes itself serving
        # It serves another live control plane, for which this one is a standby (set by the
        # engine on WorkerHeldElsewhere; cleared once this one holds its step stream).
        self.standby = False
        self._retired = LaneTotals()  # counts of lane groups torn down by reconnects
        self._wake = asyncio.Event()
        self._link: WorkerLink | None = None
        self.plan: ServingPlan | None = None  # what it serves with (serving_plan.py), set by start
        self._failures_in_a_row = 0   # steps failed since the last that returned a result

    @property
    def ready(self) -> bool:
        return self.lane_group is not None

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    @property
    def serving(self) -> bool:
        """New requests may be placed here: not once the worker said it shuts down, even while
        the steps in flight come back."""
        noticed = self._link is not None and self._link.drain_notice.is_set()
        return self.ready and not self.stalled and not self.draining and not noticed

    @property
    def state(self) -> str:
        if self.stalled_since is not None:
            return (f"stalled: no step result for {time.monotonic() - self.stalled_since:.0f} s; its "
                    f"requests moved, and it is taken back once it answers ({self.not_ready_reason})")
        if self.draining:
            return f"draining: it is shutting down, its requests move to the other workers ({self.not_ready_reason})"
        return "serving" if self.ready else self.not_ready_reason

    def totals(self) -> LaneTotals:
        totals = replace(self._retired, spec=self._retired.spec.copy())  # the lanes' add onto a copy
        return totals.add(self.lane_group) if self.lane_group is not None else totals

    def wake(self) -> None:
        self._wake.set()

    # ---- what the engine reads and asks of the lanes -------------------------------------------
    def candidates(self) -> list[Candidate]:
        """This worker's lanes as placement sees them (empty until it serves)."""
        lanes = self.lane_group.lanes if self.lane_group is not None else []
        return [Candidate(self.index, i, lane) for i, lane in enumerate(lanes)]

    def admit(self, request: Request, lane: int) -> None:
        assert self.lane_group is not None
        request.placed(self.index, lane)
        self.lane_group.lanes[lane].add(request)
        self.wake()

    def adopt(self, request: Request, lane: int) -> None:
        """Take over a request another lane group gave up (Scheduler.adopt)."""
        assert self.lane_group is not None
        request.placed(self.index, lane)
        self.lane_group.lanes[lane].adopt(request)
        self.wake()

    def end(self, request: Request, reason: FinishReason, message: str, invalid: bool = False) -> None:
        """Finish `request` now (its lane frees its row and blocks with the next step)."""
        if self.lane_group is not None:
            self.lane_group.lanes[request.lane].finish(request, reason, message, invalid)
        else:
            request.finish(reason, message, invalid)
        self.wake()

    def loads(self) -> list[LaneLoad]:
        lanes = self.lane_group.lanes if self.lane_group is not None else []
        return [LaneLoad(lane.lane, len(lane.running), lane.num_waiting, lane.pool.num_used, lane.pool.num_blocks)
                for lane in lanes]

    # ---- the worker's life ----------------------------------------------------------------------
    async def connect(self, num_workers: int = 1) -> Warm:
        """Describe (retried until the worker answers and is not shutting down), plan its warmup
        with `num_workers` in the set (serving_plan.plan_warmup) and warm it up. Raises
        serving_plan.IncompatibleWorker or WorkerError."""
        self._link = link = WorkerLink(self.address, self.config.tls)
        while True:
            try:
                described = await link.describe()
                self.connected = True
                if not described.draining:
                    break
                self.not_ready_reason = f"the worker at {self.address} is shutting down"
                log.debug("waiting for worker %s: it is shutting down", self.name)
            except WorkerError as e:
                self.not_ready_reason = str(e)
                log.info("waiting for worker %s: %s", self.name, e)
            await asyncio.sleep(self.config.reconnect_interval_s)
        self.draining = False
        self._failures_in_a_row = 0
        asked = plan_warmup(self.config, described, num_workers)
        for note in asked.notes:
            log.log(note.level, "%s", note.text)
        self.not_ready_reason = f"worker at {link.address} is warming up"
        warm = None
        async for progress in link.warmup(asked.num_lanes, asked.max_num_seqs, asked.max_model_len,
                                          asked.max_num_batched_tokens, self.config.warmup_timeout_s):
            self.warmup_progress = progress.fraction
            warm = progress.description
        assert warm is not None  # the link raises unless the worker reported done
        # The step stream before the worker counts as back: a worker may still hold the stream
        # of a control plane that vanished (until keepalive ends it, worker/server.py).
        self.not_ready_reason = f"worker at {link.address} is warm; waiting for it to take the step stream"
        await link.open()
        self.standby = False
        if self.stalled_since is not None:
            log.warning("worker %s at %s is back %.0f s after it stalled", self.name, self.address,
                        time.monotonic() - self.stalled_since)
            self.stalled_since = None
        return Warm(warm, asked)

    def start(self, warm: WorkerDescription, plan: ServingPlan) -> None:
        """Serve the warm worker with its plan (serving_plan.plan_serving): its notes are logged
        and the lane group is built."""
        for note in plan.notes:
            log.log(note.level, "%s", note.text)
        self.description, self.plan = warm, plan
        self.lane_group = self._build_group(warm, plan)

    def release(self) -> list[Request]:
        """Tear the lane group down (the link too); returns the requests it held."""
        held = self.lane_group.release() if self.lane_group is not None else []
        if self.lane_group is not None:
            self._retired.add(self.lane_group)
        self.lane_group = None
        self.connected = False
        self.warmup_progress = 0.0
        return held  # a stall outlives the link: it ends when the worker warms up again (connect)

    async def close(self) -> None:
        if self._link is not None:
            link, self._link = self._link, None
            await link.close()

    def _build_group(self, warm: WorkerDescription, plan: ServingPlan) -> LaneGroup:
        config = plan.scheduler
        # The group's policy chooses every step's mode (LaneGroup.schedule), one per step for all lanes.
        lanes = [Scheduler(config, BlockPool(warm.num_blocks_per_lane, warm.block_size, plan.prefix_caching,
                                             warm.kv_windows), lane=i)
                 for i in range(plan.num_lanes)]
        streak = self.config.max_consecutive_prefills or default_streak(config.max_num_batched_tokens)
        log.info("lane group %s: worker %s [%s, %s] runs %d lane(s) x %d seqs %s; %d blocks x %d "
                 "tokens per lane%s; max_model_len %d, max_num_batched_tokens %d, at most %d prefill steps "
                 "in a row while decodes wait, chunked prefill %s, prefix caching %s, prefill lengths %s, "
                 "async decode %s", self.name, warm.address, warm.backend,
                 warm.device, plan.num_lanes, config.max_num_seqs,
                 "in one process" if warm.single_execute_lanes else "(independent group)",
                 warm.num_blocks_per_lane, warm.block_size, _kv_groups_text(warm.kv_windows),
                 config.max_model_len, config.max_num_batched_tokens, streak,
                 "on" if config.chunked_prefill else "off", "on" if plan.prefix_caching else "off",
                 warm.prefill_buckets or "any", "on" if plan.async_decode else "off")
        return LaneGroup(lanes, PhasePolicy(streak))

    async def steps(self) -> AsyncIterator[Stepped]:
        """Plan, send, apply, and yield each step's result. With async decode, a stable decode
        batch keeps two steps in flight: step N+1 is planned and sent before N's result arrives,
        feeding N's tokens from the device; anything else drains the pipeline (an empty flush)
        and steps one at a time. A link that ends raises WorkerLost with the requests held; a
        worker that says it shuts down gets no new step, returns those in flight, and then
        raises WorkerDraining with the requests held."""
        group, link, serving = self.lane_group, self._link, self.plan
        assert group is not None and link is not None and serving is not None
        ended = asyncio.ensure_future(link.ended())
        in_flight: deque[InFlight] = deque()
        try:
            while True:
                if not in_flight:
                    if link.drain_notice.is_set():
                        self.draining = True
                        break
                    plan = group.schedule() if group.has_work else None
                    if plan is None or not plan.has_work:
                        # Nothing can run: only arrivals, aborts, grammars finishing or the
                        # worker's drain notice change that.
                        await self._idle(ended, link.drain_notice)
                        continue
                    # A batch the host samples comes back at once: asking for a pipeline would
                    # only cost an empty flush step.
                    pipelined = (serving.async_decode and plan.kind is StepKind.DECODE
                                 and not plan.samples_on_host)
                    await self._send(link, plan, pipelined, in_flight)
                newest = in_flight[-1]
                if newest.pipelined and len(in_flight) == 1:
                    # A draining worker gets the empty flush that returns its pipelined step.
                    assert newest.plan is not None
                    follow = group.schedule_ahead(newest.plan) if not link.drain_notice.is_set() else None
                    if follow is None:
                        reason = "worker_draining" if link.drain_notice.is_set() else self._drain_reason(group)
                        self.metrics.drains.labels(self.name, reason).inc()
                    await self._send(link, follow, follow is not None, in_flight)
                try:
                    outcome = await self._receive(link)
                except StepFailed as e:
                    self._failures_in_a_row += 1
                    if self._failures_in_a_row >= STEP_FAILURES_LOST:
                        # Isolation blames requests; steps that fail whatever they carry mean
                        # a broken device: lost, its requests move to other workers.
                        raise WorkerError(f"worker {self.name} at {self.address} failed {self._failures_in_a_row} "
                                          f"steps in a row, the last: {e.error}; its device is taken as "
                                          "broken") from e
                    yield await self._step_failed(link, e, in_flight)
                    group = self.lane_group
                    assert group is not None
                    continue
                self._failures_in_a_row = 0
                done = in_flight.popleft()
                plan = done.plan
                if plan is not None:
                    self.num_steps += 1
                    landed = time.monotonic()
                    self.metrics.step(self.name, plan.kind, outcome.traced, outcome.sampled_on_device,
                                      outcome.total_s, landed - done.sent)
                    if self.tracing.enabled:
                        self._traced(plan, done.sent, landed)
                    yield Stepped(outcome.step_id, group.update(plan, outcome.sampled, outcome.logprobs,
                                                                outcome.refused, outcome.accepted,
                                                                outcome.draft_logprobs))
        except WorkerError as e:
            if link.drain_notice.is_set():  # it said it shuts down: a planned end, whatever broke after
                raise WorkerDraining(f"worker {self.name} at {self.address} is shutting down ({e})",
                                     self.release()) from e
            raise WorkerLost(str(e), self.release()) from e
        finally:
            ended.cancel()
        raise WorkerDraining(f"worker {self.name} at {self.address} is shutting down", self.release())

    def _traced(self, plan: GroupPlan, sent: float, landed: float) -> None:
        """The step's spans; a fault in tracing must not end this worker's step loop."""
        try:
            for lane_plan in plan.lanes:
                self.tracing.stepped(self.name, lane_plan, sent, landed)
        except Exception:  # noqa: BLE001 - telemetry, never the request's fault
            if not self._tracing_failed:
                log.exception("recording a step's trace spans failed; tracing goes on, this is logged once")
            self._tracing_failed = True

    async def _step_failed(self, link: WorkerLink, failure: StepFailed,
                           in_flight: deque[InFlight]) -> StepFailure:
        """The worker dropped its device state after `failure`: the results of the other steps
        in flight are taken and not applied, and the lane group starts anew on the same stream."""
        # With a pipelined decode the fault may surface in the next step's launch: every step in
        # flight is suspect.
        failed = {id(w.request): w.request for step in in_flight if step.plan is not None
                  for w in (*step.plan.prefill, *step.plan.decode)}
        in_flight.popleft()
        while in_flight:
            in_flight.popleft()
            try:
                await self._receive(link)
            except StepFailed:
                pass
        self.metrics.step_failures.labels(self.name).inc()
        assert self.lane_group is not None and self.description is not None and self.plan is not None
        held = self.lane_group.release()
        self._retired.add(self.lane_group)
        self.lane_group = self._build_group(self.description, self.plan)
        return StepFailure(str(failure), failure.error, held, list(failed.values()), alone=len(failed) == 1)

    async def _send(self, link: WorkerLink, plan: GroupPlan | None, pipelined: bool,
                    in_flight: deque[InFlight]) -> None:
        now = time.monotonic()
        for work in plan.prefill if plan is not None else ():
            work.request.record_scheduled(now)
        await link.send(plan, self.lane_group.max_num_seqs, pipelined)
        in_flight.append(InFlight(plan, pipelined, now))

    async def _receive(self, link: WorkerLink) -> StepOutcome:
        """The next result. A worker that holds a step for --stall-timeout is stalled (logged,
        exported) and lost: its requests migrate rather than wait on a device that may never
        answer, and the worker is taken back once it warms up again. Its step runs on there to
        its end; nothing it returns is applied, so no token is lost or doubled."""
        receive = asyncio.ensure_future(link.receive())
        waiting_since = time.monotonic()
        try:
            done, _ = await asyncio.wait({receive}, timeout=self.config.stall_timeout_s)
        finally:
            receive.cancel()
        if not done:
            self.stalled_since = waiting_since
            self.metrics.stalls.labels(self.name).inc()
            lanes = self.lane_group.lanes if self.lane_group is not None else []
            held = sum(len(lane.running) + lane.num_waiting for lane in lanes)
            log.error("worker %s at %s stalled: no step result for %.0f s with %d request(s) on it "
                      "(see --stall-timeout)", self.name, self.address, self.config.stall_timeout_s, held)
            raise WorkerError(f"worker at {self.address} stalled: no step result for "
                              f"{self.config.stall_timeout_s:g} s (--stall-timeout)")
        return receive.result()

    @staticmethod
    def _drain_reason(group: LaneGroup) -> str:
        if any(lane.wants_prefill() for lane in group.lanes):
            return "prefill"
        if any(r.samples_on_host() for lane in group.lanes for r in lane.running):
            return "host_sampler"
        return "batch_changed"

    async def _idle(self, ended: asyncio.Future[str], drain_notice: asyncio.Event) -> None:
        """Wait for an arrival, an abort or the worker's drain notice; a worker lost meanwhile
        raises WorkerError."""
        self._wake.clear()
        woken = asyncio.ensure_future(self._wake.wait())
        noticed = asyncio.ensure_future(drain_notice.wait())
        await asyncio.wait({woken, noticed, ended}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        noticed.cancel()
        if ended.done() and not drain_notice.is_set():
            raise WorkerError(ended.result())


def _kv_groups_text(windows: tuple[int, ...]) -> str:
    """How a hybrid model's KV groups share the blocks ("" for a model of one group)."""
    if len(windows) == 1:
        return ""
    sliding = [w for w in windows if w]
    return (f" shared by {len(windows)} KV groups ({len(windows) - len(sliding)} full attention, "
            f"{len(sliding)} sliding window of {', '.join(map(str, sorted(set(sliding))))} tokens)")
