"""The control plane's engine: admits requests, runs the step loop against a worker, and routes
each step's outputs to the client sessions that own the requests."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ttserve.v1 import engine_pb2

from .admission import AdmissionError, Limits, check_request
from .blocks import BlockPool
from .phase import PhasePolicy
from .request import FinishReason, Request
from .scheduler import Scheduler, SchedulerConfig
from .step import StepKind
from .wire import WorkerDescription, admission_pb, output_to_pb, request_from_pb
from .worker_link import WorkerError, WorkerLink

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A configuration the worker cannot serve; the control plane exits with this message."""


@dataclass(slots=True, frozen=True)
class EngineConfig:
    worker_address: str
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0            # 0 = the model's own limit, capped by KV capacity
    enable_prefix_caching: bool = False
    max_consecutive_prefills: int = 2
    reconnect_interval_s: float = 1.0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}
        self._clients: dict[int, asyncio.Queue[engine_pb2.ServerMessage]] = {}
        self._next_client_id = 1
        self._wake = asyncio.Event()
        self._link: WorkerLink | None = None
        self.worker: WorkerDescription | None = None
        self.scheduler: Scheduler | None = None
        self.limits: Limits | None = None
        self.not_ready_reason = f"connecting to the worker at {config.worker_address}"
        self.fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.num_steps = 0

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    # ---- client sessions -----------------------------------------------------------------
    def open_session(self) -> tuple[int, asyncio.Queue[engine_pb2.ServerMessage]]:
        client_id = self._next_client_id
        self._next_client_id += 1
        self._clients[client_id] = asyncio.Queue()
        return client_id, self._clients[client_id]

    def close_session(self, client_id: int) -> None:
        """A client that goes away takes its requests with it."""
        self._clients.pop(client_id, None)
        self.abort([rid for rid, r in self.requests.items() if r.client_id == client_id])

    def add(self, add: engine_pb2.AddRequest, client_id: int) -> None:
        """Admit or refuse a request; the session always gets exactly one Admission for it."""
        queue = self._clients[client_id]
        if self.scheduler is None or self.limits is None:
            queue.put_nowait(admission_pb(add.request_id, engine_pb2.Admission.VERDICT_UNAVAILABLE,
                                          f"no worker is ready ({self.not_ready_reason})"))
            return
        request, unsupported = request_from_pb(add, client_id)
        try:
            if request.request_id in self.requests:
                raise AdmissionError(f"request id {request.request_id!r} is already in use")
            check_request(request, unsupported, self.limits)
        except AdmissionError as e:
            queue.put_nowait(admission_pb(add.request_id, engine_pb2.Admission.VERDICT_INVALID_ARGUMENT, str(e)))
            return
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        queue.put_nowait(admission_pb(add.request_id, engine_pb2.Admission.VERDICT_ACCEPTED))
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        """Client aborts end silently (the client already knows); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None and self.scheduler is not None:
                self.scheduler.finish(request, FinishReason.ABORT)
        self._wake.set()

    # ---- worker lifecycle ----------------------------------------------------------------
    async def run(self) -> None:
        """Connect, warm up and step; after a worker failure, fail what was in flight and
        reconnect. Configuration errors resolve `fatal` instead."""
        while True:
            self._link = WorkerLink(self.config.worker_address)
            try:
                await self._connect(self._link)
                await self._step_loop(self._link)
            except WorkerError as e:
                self._fail_all(str(e))
                self.not_ready_reason = str(e)
                log.error("%s; reconnecting", e)
            except StartupError as e:
                if not self.fatal.done():
                    self.fatal.set_result(str(e))
                return
            finally:
                self.scheduler = None
                await self._link.close()
            await asyncio.sleep(self.config.reconnect_interval_s)

    async def _connect(self, link: WorkerLink) -> None:
        while True:
            try:
                described = await link.describe()
                break
            except WorkerError as e:
                self.not_ready_reason = str(e)
                log.info("waiting for worker: %s", e)
                await asyncio.sleep(self.config.reconnect_interval_s)
        max_model_len = self.config.max_model_len or described.max_position_embeddings
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
        warm = await link.warmup(1, self.config.max_num_seqs, max_model_len, batched)
        capacity = warm.num_blocks_per_lane * warm.block_size
        if capacity < max_model_len:
            log.warning("max_model_len lowered from %d to %d: one lane's KV cache holds %d tokens",
                        max_model_len, capacity, capacity)
            max_model_len = capacity
        await link.open()
        self.worker = warm
        self.limits = Limits(max_model_len=max_model_len, vocab_size=warm.vocab_size)
        self.scheduler = build_scheduler(warm, self.config, max_model_len, batched)

    async def _step_loop(self, link: WorkerLink) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        ended = asyncio.ensure_future(link.ended())
        try:
            while True:
                if not scheduler.has_work:
                    await self._idle(ended)
                    continue
                plan = scheduler.schedule()
                if plan.kind is StepKind.EMPTY and not plan.released_ids:
                    # Work exists but none can run: only arrivals or aborts change that.
                    await self._idle(ended)
                    continue
                outcome = await link.step(plan, self.config.max_num_seqs)
                self.num_steps += 1
                self._publish(outcome.step_id, scheduler.update(plan, outcome.sampled))
        finally:
            ended.cancel()

    async def _idle(self, ended: asyncio.Future[str]) -> None:
        """Wait for an arrival or abort; a worker lost meanwhile raises WorkerError."""
        self._wake.clear()
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({woken, ended}, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if ended.done():
            raise WorkerError(ended.result())

    def _publish(self, step_id: int, changed: list[Request]) -> None:
        by_client: dict[int, list[engine_pb2.RequestOutput]] = {}
        for request in changed:
            by_client.setdefault(request.client_id, []).append(output_to_pb(request))
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        now = time.time()
        for client_id, outputs in by_client.items():
            queue = self._clients.get(client_id)
            if queue is not None:
                queue.put_nowait(engine_pb2.ServerMessage(outputs=engine_pb2.StepOutputs(
                    step_id=step_id, timestamp=now, outputs=outputs)))

    def _fail_all(self, message: str) -> None:
        failed = list(self.requests.values())
        self.requests.clear()
        for request in failed:
            if self.scheduler is not None:
                self.scheduler.finish(request, FinishReason.ERROR, message)
            else:
                request.finish_reason, request.error = FinishReason.ERROR, message
        self._publish(0, failed)


def build_scheduler(warm: WorkerDescription, config: EngineConfig, max_model_len: int,
                    batched: int) -> Scheduler:
    """The lane scheduler for what the warmed-up worker reports it can do."""
    caching = config.enable_prefix_caching
    if caching and not warm.supports_prefix_caching:
        log.warning("--enable-prefix-caching: %s on this worker does not support prefix caching; "
                    "serving without it", warm.architecture)
        caching = False
    block_size = warm.block_size
    if warm.supports_chunked_prefill and batched < block_size:
        log.warning("max_num_batched_tokens raised from %d to the block size %d: a prefill chunk "
                    "holds at least one block", batched, block_size)
        batched = block_size
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=batched,
        max_model_len=max_model_len, chunked_prefill=warm.supports_chunked_prefill,
        max_prefill_batch=warm.max_prefill_batch_size,
        max_prefill_len=max(warm.prefill_buckets, default=0))
    log.info("serving %s (%s) on worker %s [%s, %s]: 1 lane x %d seqs, %d blocks x %d tokens, "
             "max_model_len %d, max_num_batched_tokens %d, chunked prefill %s, prefix caching %s, "
             "prefill lengths %s", warm.model_path, warm.architecture, warm.address, warm.backend,
             warm.device, config.max_num_seqs, warm.num_blocks_per_lane, block_size, max_model_len,
             batched, "on" if scheduler_config.chunked_prefill else "off", "on" if caching else "off",
             warm.prefill_buckets or "any")
    return Scheduler(scheduler_config, BlockPool(warm.num_blocks_per_lane, block_size, caching),
                     policy=PhasePolicy(config.max_consecutive_prefills))
