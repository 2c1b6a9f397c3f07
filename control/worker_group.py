"""One device worker and the lane group it executes: connect, check the topology, warm up, step,
and after a failure give back what it held and reconnect."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from .blocks import BlockPool
from .lanes import GroupPlan, LaneGroup
from .metrics import ControlMetrics
from .phase import PhasePolicy
from .request import Request
from .scheduler import Scheduler, SchedulerConfig
from .step import StepKind
from .wire import StepOutcome, WorkerDescription
from .worker_link import WorkerError, WorkerLink

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A configuration the workers cannot serve; the control plane exits with this message."""


@dataclass(slots=True, frozen=True)
class EngineConfig:
    workers: tuple[str, ...]
    max_num_seqs: int = 32            # per lane
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0            # 0 = the model's own limit, capped by KV capacity
    data_parallel_size: int = 1       # lanes per worker
    enable_prefix_caching: bool = False
    max_consecutive_prefills: int = 2
    async_scheduling: bool | None = None  # None: whenever the worker supports async decode
    reconnect_interval_s: float = 1.0
    tokenizer: str = ""               # for grammars; "" = the first worker's model folder
    stall_timeout_s: float = 60.0     # a step in flight this long without a result: stalled


@dataclass(slots=True)
class ServingLimits:
    """What every group must honour, fixed by the first worker that comes up."""
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int   # one for all: prefix hashes, placement and ModelInfo assume it


@dataclass(slots=True)
class LaneTotals:
    """Counts that outlive a lane group (it is rebuilt on every reconnect), so the exported
    counters stay monotonic."""
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0

    def add(self, group: LaneGroup) -> "LaneTotals":
        for lane in group.lanes:
            self.prefix_query_tokens += lane.pool.num_queries * lane.pool.block_size
            self.prefix_hit_tokens += lane.pool.num_hits * lane.pool.block_size
            self.preemptions += lane.num_preemptions
        return self


Publish = Callable[[int, list[Request]], None]       # step id, requests with news
Fail = Callable[[list[Request], str], None]          # requests lost with a worker, why


class WorkerGroup:
    def __init__(self, index: int, address: str, config: EngineConfig, publish: Publish,
                 fail: Fail, metrics: ControlMetrics | None = None) -> None:
        self.index = index
        self.address = address
        self.config = config
        self._publish = publish
        self._fail = fail
        self.metrics = metrics or ControlMetrics()
        self.metrics.stalls.labels(str(index))  # exported as 0 from the start, for alert rules
        self.group: LaneGroup | None = None
        self.description: WorkerDescription | None = None
        self.not_ready_reason = f"connecting to the worker at {address}"
        self.num_steps = 0
        self.async_decode = False
        self.connected = False        # Describe answered and the link is open
        self.warmup_progress = 0.0    # 0-1, as the worker last reported it
        self.stalled_since: float | None = None  # when the unanswered wait began, once stalled
        self._retired = LaneTotals()  # counts of lane groups torn down by reconnects
        self._wake = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.group is not None

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    @property
    def state(self) -> str:
        if self.stalled_since is not None:
            return (f"stalled: a step has been in flight for "
                    f"{time.monotonic() - self.stalled_since:.0f} s")
        return "serving" if self.ready else self.not_ready_reason

    def totals(self) -> LaneTotals:
        totals = replace(self._retired)
        return totals.add(self.group) if self.group is not None else totals

    def wake(self) -> None:
        self._wake.set()

    async def run(self, limits: Callable[[WorkerDescription, int], ServingLimits]) -> None:
        """Serve until cancelled. `limits(description, lane capacity)` fixes or checks the
        serving limits against this worker (raising StartupError or WorkerError)."""
        while True:
            link = WorkerLink(self.address)
            try:
                await self._connect(link, limits)
                await self._step_loop(link)
            except WorkerError as e:
                self.not_ready_reason = str(e)
                log.error("%s; reconnecting", e)
                self._give_back(str(e))
            finally:
                if self.group is not None:
                    self._retired.add(self.group)
                self.group = None
                self.connected = False
                self.stalled_since = None
                self.warmup_progress = 0.0
                await link.close()
            await asyncio.sleep(self.config.reconnect_interval_s)

    def _give_back(self, reason: str) -> None:
        if self.group is None:
            return
        lost = [r for lane in self.group.lanes for r in (*lane.running, *lane.waiting, *lane.skipped)]
        self._fail(lost, reason)

    async def _connect(self, link: WorkerLink, limits: Callable[[WorkerDescription, int], ServingLimits]) -> None:
        while True:
            try:
                described = await link.describe()
                self.connected = True
                break
            except WorkerError as e:
                self.not_ready_reason = str(e)
                log.info("waiting for worker: %s", e)
                await asyncio.sleep(self.config.reconnect_interval_s)
        num_lanes = self._lanes_for(described)
        max_model_len = max(self.config.max_model_len, 0) or described.max_position_embeddings
        if max_model_len > described.max_position_embeddings:
            raise StartupError(
                f"--max-model-len {max_model_len} exceeds the model's limit of "
                f"{described.max_position_embeddings} tokens (max_position_embeddings of "
                f"{described.model_path})")
        batched = self.config.max_num_batched_tokens
        if not described.supports_chunked_prefill and batched < max_model_len:
            log.warning("the model cannot chunk prefills: raising max_num_batched_tokens from "
                        "%d to max_model_len %d", batched, max_model_len)
            batched = max_model_len
        self.not_ready_reason = f"worker at {link.address} is warming up"
        warm = await link.warmup(num_lanes, self.config.max_num_seqs, max_model_len, batched,
                                 self._warmup_progressed)
        serving = limits(warm, warm.num_blocks_per_lane * warm.block_size)
        await link.open()
        self.description = warm
        self.async_decode = warm.async_decode and self.config.async_scheduling is not False
        if self.config.async_scheduling and not warm.async_decode:
            log.warning("--async-scheduling: the worker at %s cannot pipeline decode steps (%s does "
                        "not support async decode, or decode samples on the host); turned off",
                        warm.address, warm.architecture)
        self.group = self._build_group(warm, num_lanes, serving.max_model_len, batched)

    def _warmup_progressed(self, completed: int, total: int) -> None:
        self.warmup_progress = completed / total if total else 0.0

    def _lanes_for(self, d: WorkerDescription) -> int:
        """The topology rules, checked before the worker touches its device."""
        dp = self.config.data_parallel_size
        if d.single_execute_lanes:
            if d.mrope and dp > 1:
                raise StartupError(f"{d.architecture} uses request-specific RoPE (mRoPE), which lane "
                                   f"mode cannot serve: --data-parallel-size {dp} must be 1")
            return dp
        if dp != 1:
            raise StartupError(
                f"--data-parallel-size {dp}: {d.architecture} on the worker at {d.address} runs lanes "
                "as independent groups; start one worker per lane (each on its own submesh with "
                "TT_VISIBLE_DEVICES) and pass each with --worker")
        if d.mixture_of_experts and len(self.config.workers) > 1:
            raise StartupError(f"{d.architecture} is a mixture-of-experts model: data parallelism over "
                               f"independent groups ({len(self.config.workers)} workers) is refused")
        return 1

    def _build_group(self, warm: WorkerDescription, num_lanes: int, max_model_len: int,
                     batched: int) -> LaneGroup:
        c = self.config
        caching = c.enable_prefix_caching
        if caching and not warm.supports_prefix_caching:
            log.warning("--enable-prefix-caching: %s on the worker at %s does not support prefix "
                        "caching; serving without it", warm.architecture, warm.address)
            caching = False
        if warm.supports_chunked_prefill and batched < warm.block_size:
            log.warning("max_num_batched_tokens raised from %d to the block size %d: a prefill "
                        "chunk holds at least one block", batched, warm.block_size)
            batched = warm.block_size
        config = SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=batched, max_model_len=max_model_len,
            chunked_prefill=warm.supports_chunked_prefill, max_prefill_batch=warm.max_prefill_batch_size,
            max_prefill_len=max(warm.prefill_buckets, default=0))
        # The group's policy chooses every step's mode (LaneGroup.schedule), one per step for all lanes.
        lanes = [Scheduler(config, BlockPool(warm.num_blocks_per_lane, warm.block_size, caching), lane=i)
                 for i in range(num_lanes)]
        log.info("lane group %d: worker %s [%s, %s] runs %d lane(s) x %d seqs %s; %d blocks x %d "
                 "tokens per lane; max_model_len %d, max_num_batched_tokens %d, chunked prefill %s, "
                 "prefix caching %s, prefill lengths %s, async decode %s", self.index, warm.address, warm.backend,
                 warm.device, num_lanes, c.max_num_seqs,
                 "as one program (single-execute)" if warm.single_execute_lanes else "(independent group)",
                 warm.num_blocks_per_lane, warm.block_size, max_model_len, batched,
                 "on" if config.chunked_prefill else "off", "on" if caching else "off",
                 warm.prefill_buckets or "any", "on" if self.async_decode else "off")
        return LaneGroup(lanes, PhasePolicy(c.max_consecutive_prefills))

    async def _step_loop(self, link: WorkerLink) -> None:
        """Plan, send, apply. With async decode, a stable decode batch keeps two steps in
        flight: step N+1 is planned and sent before N's result arrives, feeding N's tokens from
        the device; anything else drains the pipeline (an empty flush) and steps one at a time."""
        group = self.group
        assert group is not None
        ended = asyncio.ensure_future(link.ended())
        # (plan or None for a flush, pipelined, time sent)
        in_flight: deque[tuple[GroupPlan | None, bool, float]] = deque()
        try:
            while True:
                if not in_flight:
                    plan = group.schedule() if group.has_work else None
                    if plan is None or not plan.has_work:
                        # Nothing can run: only arrivals, aborts or grammars finishing change that.
                        await self._idle(ended)
                        continue
                    # A batch the host samples comes back at once: asking for a pipeline would
                    # only cost an empty flush step.
                    pipelined = (self.async_decode and plan.kind is StepKind.DECODE
                                 and not plan.samples_on_host)
                    await self._send(link, plan, pipelined, in_flight)
                newest, pipelined, _ = in_flight[-1]
                if pipelined and len(in_flight) == 1:
                    follow = group.followup(newest)
                    if follow is None:
                        self.metrics.drains.labels(str(self.index), self._drain_reason(group)).inc()
                    await self._send(link, follow, follow is not None, in_flight)
                outcome = await self._receive(link)
                plan, _, sent = in_flight.popleft()
                if plan is not None:
                    self.num_steps += 1
                    self.metrics.step(self.index, plan.kind, outcome.traced, outcome.sampled_on_device,
                                      outcome.total_s, time.monotonic() - sent)
                    self._publish(outcome.step_id, group.update(plan, outcome.sampled, outcome.logprobs))
        finally:
            ended.cancel()

    async def _send(self, link: WorkerLink, plan: GroupPlan | None, pipelined: bool,
                    in_flight: deque[tuple[GroupPlan | None, bool, float]]) -> None:
        now = time.monotonic()
        if plan is not None:
            self.metrics.scheduled(plan, now)
        await link.send(plan, self.group.max_num_seqs, pipelined)
        in_flight.append((plan, pipelined, now))

    async def _receive(self, link: WorkerLink) -> StepOutcome:
        """The next result. A worker that holds a step for --stall-timeout is reported stalled
        (logged, exported) and waited for: a long first compile or a wedged device look alike
        from here, and only the operator can tell which."""
        receive = asyncio.ensure_future(link.receive())
        waiting_since = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({receive}, timeout=self.config.stall_timeout_s)
                if done:
                    break
                if self.stalled_since is None:
                    self.stalled_since = waiting_since
                    self.metrics.stalls.labels(str(self.index)).inc()
                    lanes = self.group.lanes if self.group is not None else []
                    log.error("worker %s at %s stalled: no step result for %.0f s with %d request(s) "
                              "on it (see --stall-timeout)", self.index, self.address,
                              self.config.stall_timeout_s, sum(len(lane.running) for lane in lanes))
        finally:
            receive.cancel()
        outcome = receive.result()
        if self.stalled_since is not None:
            log.warning("worker %s at %s recovered after a %.0f s stall", self.index, self.address,
                        time.monotonic() - self.stalled_since)
            self.stalled_since = None
        return outcome

    @staticmethod
    def _drain_reason(group: LaneGroup) -> str:
        if any(lane.wants_prefill() for lane in group.lanes):
            return "prefill"
        if any(r.needs_host_sampler or r.sampling.min_tokens > len(r.output_token_ids)
               for lane in group.lanes for r in lane.running):
            return "host_sampler"
        return "batch_changed"

    async def _idle(self, ended: asyncio.Future[str]) -> None:
        """Wait for an arrival or abort; a worker lost meanwhile raises WorkerError."""
        self._wake.clear()
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({woken, ended}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if ended.done():
            raise WorkerError(ended.result())
