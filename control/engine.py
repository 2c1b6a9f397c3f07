"""The control plane's engine: admits requests, places each on a lane of some worker's lane
group, and routes each step's outputs to the client sessions that own the requests."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from ttserve.v1 import engine_pb2

from . import images
from .admission import AdmissionError, Limits, check_request
from .grammar import Grammar, GrammarCompiler, GrammarError
from .metrics import ControlMetrics
from .engine_config import EngineConfig, ServingLimits
from .placement import choose_lane
from .request import FinishReason, Request
from .wire import WorkerDescription, admission_pb, mm_inputs_problem, output_to_pb, request_from_pb
from .worker_group import IncompatibleWorker, WorkerGroup, WorkerLost
from .worker_link import WorkerError

__all__ = ["Engine", "EngineConfig", "IncompatibleWorker"]

log = logging.getLogger(__name__)
# One line per finished request, key=value pairs (logfmt), for log pipelines to parse.
request_log = logging.getLogger("ttserve.requests")


class Engine:
    def __init__(self, config: EngineConfig, metrics: ControlMetrics | None = None) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}
        self._clients: dict[int, asyncio.Queue[engine_pb2.ServerMessage | None]] = {}
        self._next_client_id = 1
        self.metrics = metrics or ControlMetrics()
        self.workers = [WorkerGroup(i, address, config, self.metrics) for i, address in enumerate(config.workers)]
        self.metrics.watch(self)
        self.draining = False
        self.serving: ServingLimits | None = None
        # Grammars compile here, never on the event loop that runs the step loops.
        self.grammars: GrammarCompiler | None = None
        self._compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ttserve-grammar")
        self.fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # Requests of a lost worker waiting for a ready one (in the order they were lost).
        self._migrating: list[Request] = []
        for reason in ("invalid", "unavailable", "draining", "overloaded"):
            self.metrics.refused.labels(reason)  # exported as 0 from the start
        for outcome in ("requeued", "failed_limit", "failed_timeout"):
            self.metrics.migrations.labels(outcome)  # exported as 0 from the start

    @property
    def ready(self) -> bool:
        """Can serve a request now: not draining, and some worker is warm and not stalled."""
        return not self.draining and any(w.ready and not w.stalled for w in self.workers)

    @property
    def not_ready_reason(self) -> str:
        if self.draining:
            return "the control plane is shutting down"
        return "; ".join(f"worker {w.index} at {w.address}: {w.state}" for w in self.workers)

    def _serving_workers(self) -> list[WorkerGroup]:
        """Where new requests go: warm workers that are not stalled. With none, new requests are
        refused at once (HTTP 503) rather than queued behind a step that may never return."""
        return [w for w in self.workers if w.ready and not w.stalled]

    @property
    def limits(self) -> Limits | None:
        s = self.serving
        return Limits(max_model_len=s.max_model_len, vocab_size=s.vocab_size, supports_images=s.supports_images,
                      max_image_blocks=images.max_blocks(s.chunk_limit, s.block_size),
                      block_size=s.block_size) if s else None

    # ---- client sessions -----------------------------------------------------------------
    def open_session(self) -> tuple[int, asyncio.Queue[engine_pb2.ServerMessage | None]]:
        client_id = self._next_client_id
        self._next_client_id += 1
        self._clients[client_id] = asyncio.Queue()
        return client_id, self._clients[client_id]

    def close_session(self, client_id: int) -> None:
        """A client that goes away takes its requests with it."""
        self._clients.pop(client_id, None)
        self.abort([rid for rid, r in self.requests.items() if r.client_id == client_id], client_id)

    def add(self, add: engine_pb2.AddRequest, client_id: int) -> None:
        """Admit or refuse a request; the session always gets exactly one Admission for it."""
        queue = self._clients[client_id]
        limits = self.limits
        ready = self._serving_workers()
        if self.draining:
            self.metrics.refused.labels("draining").inc()
            queue.put_nowait(admission_pb(
                add.request_id, engine_pb2.Admission.VERDICT_UNAVAILABLE,
                "the control plane is shutting down: it finishes the requests it holds and admits "
                "no new ones; retry on another replica"))
            return
        if not ready or limits is None:
            self.metrics.refused.labels("unavailable").inc()
            queue.put_nowait(admission_pb(add.request_id, engine_pb2.Admission.VERDICT_UNAVAILABLE,
                                          f"no worker is ready ({self.not_ready_reason})"))
            return
        queued = len(self._migrating) + sum(load.waiting for w in self.workers for load in w.loads())
        if queued >= self.config.max_num_queued_reqs:
            self.metrics.refused.labels("overloaded").inc()
            queue.put_nowait(admission_pb(add.request_id, engine_pb2.Admission.VERDICT_OVERLOADED,
                                          f"{queued} requests are already waiting (--max-num-queued-reqs "
                                          f"{self.config.max_num_queued_reqs}); retry later"))
            return
        request, unsupported = request_from_pb(add, client_id)
        request.received_time = time.monotonic()
        try:
            if request.request_id in self.requests:
                raise AdmissionError(f"request id {request.request_id!r} is already in use")
            check_request(request, unsupported, limits)
            problem = mm_inputs_problem(add) if add.mm_inputs else None
            if problem:
                raise AdmissionError(f"invalid image inputs: {problem}")
        except AdmissionError as e:
            self.metrics.refused.labels("invalid").inc()
            queue.put_nowait(admission_pb(add.request_id, engine_pb2.Admission.VERDICT_INVALID_ARGUMENT, str(e)))
            return
        placed = choose_lane([c for w in ready for c in w.candidates()], request)
        self.requests[request.request_id] = request
        if request.grammar_spec is not None:
            request.ready = False  # waits aside until its grammar has compiled
            self._compile(request)
        self.workers[placed.worker].admit(request, placed.index)
        queue.put_nowait(admission_pb(add.request_id, engine_pb2.Admission.VERDICT_ACCEPTED))

    def _compile(self, request: Request) -> None:
        """Compile the request's grammar on the pool; when done, the request becomes ready (or
        ends with an error that says why the grammar does not compile)."""
        compiler, spec = self.grammars, request.grammar_spec
        assert compiler is not None and spec is not None
        started = time.monotonic()
        future = asyncio.get_running_loop().run_in_executor(self._compile_pool, compiler.compile, spec)

        def done(f: asyncio.Future[Grammar]) -> None:
            if self.requests.get(request.request_id) is not request:
                return  # aborted or failed while compiling
            worker = self.workers[request.worker]
            error = f.exception() if not f.cancelled() else GrammarError("grammar compilation was cancelled")
            if error is None:
                worker.grammar_compiled(request, f.result())
                log.debug("request %s: %s grammar compiled in %.3f s", request.request_id, spec.kind,
                          time.monotonic() - started)
            else:
                message = str(error) if isinstance(error, GrammarError) else \
                    f"structured output failed to compile: {type(error).__name__}: {error}"
                log.info("request %s: %s", request.request_id, message)
                self._end(request, FinishReason.ERROR, message)
                self._publish(0, [request])

        future.add_done_callback(done)

    def abort(self, request_ids: list[str], client_id: int) -> None:
        """A session's aborts end its requests silently (the client already knows). A session
        aborts only the requests it added: another session's ids are ignored as unknown ids are
        (a warning names them), so one client cannot end another's requests."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.client_id != client_id:
                log.warning("session %d asked to abort request %s, which session %d added; ignored",
                            client_id, request_id, request.client_id)
                continue
            del self.requests[request_id]
            self._end(request, FinishReason.ABORT, "")
            self._finished(request, time.monotonic())

    # ---- workers -------------------------------------------------------------------------
    async def run(self) -> None:
        """Drive every worker; a configuration the workers cannot serve resolves `fatal`."""
        tasks = [asyncio.create_task(self._drive(w)) for w in self.workers]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                error = task.exception()
                if error is not None and not self.fatal.done():
                    # The control plane cannot go on: it exits non-zero for its supervisor.
                    self.fatal.set_result(str(error) if isinstance(error, IncompatibleWorker) else
                                          f"the engine failed: {type(error).__name__}: {error}")
        finally:
            for task in tasks:
                task.cancel()
            self._compile_pool.shutdown(wait=False, cancel_futures=True)

    async def _drive(self, worker: WorkerGroup) -> None:
        """The step loop of one worker, as long as the control plane runs: connect and warm it
        up, check it against the serving limits, then publish each step's result; a worker lost
        fails what it held and is reconnected."""
        while True:
            try:
                warm = await worker.connect()
                worker.start(self._check_limits(warm, warm.num_blocks_per_lane * warm.block_size).max_model_len)
                self._place_migrating()
                async for stepped in worker.steps():
                    self._publish(stepped.step_id, stepped.changed)
            except WorkerError as e:
                worker.not_ready_reason = str(e)
                log.error("%s; reconnecting", e)
                self._migrate(e.requests if isinstance(e, WorkerLost) else worker.release(), str(e))
            except IncompatibleWorker:
                raise
            except Exception as e:  # noqa: BLE001 - a fault in this worker's loop takes only its link
                reason = (f"the control plane's step loop for the worker at {worker.address} failed "
                          f"({type(e).__name__}: {e})")
                log.exception("%s; reconnecting", reason)
                worker.not_ready_reason = reason
                self._migrate(worker.release(), reason)
            finally:
                worker.release()
                await worker.close()
            await asyncio.sleep(self.config.reconnect_interval_s)

    def _check_limits(self, d: WorkerDescription, lane_capacity: int) -> ServingLimits:
        """The first worker fixes the serving limits; later ones must serve the same model and
        hold a max_model_len sequence in one lane."""
        if self.serving is None:
            # --max-model-len -1 fits one request to a lane's whole KV cache (vLLM's meaning).
            max_model_len = max(self.config.max_model_len, 0) or d.max_position_embeddings
            if lane_capacity < max_model_len:
                fitting = self.config.max_model_len == -1  # asked for: no warning
                (log.info if fitting else log.warning)("max_model_len lowered from %d to %d: one lane's KV "
                                                       "cache holds %d tokens", max_model_len, lane_capacity,
                                                       lane_capacity)
                max_model_len = lane_capacity
            chunk_limit = 0
            if d.supports_chunked_prefill:
                chunk_limit = max(self.config.max_num_batched_tokens, d.block_size)
                if d.prefill_buckets:
                    chunk_limit = min(chunk_limit, max(d.prefill_buckets))
            self.serving = ServingLimits(d.architecture, d.vocab_size, max_model_len, d.block_size,
                                         d.supports_images, chunk_limit)
            self.grammars = GrammarCompiler(self.config.tokenizer or d.model_path, d.vocab_size,
                                            d.eos_token_ids)
            return self.serving
        s = self.serving
        if (d.architecture, d.vocab_size) != (s.architecture, s.vocab_size):
            raise IncompatibleWorker(f"the worker at {d.address} serves {d.architecture} (vocabulary "
                               f"{d.vocab_size}) but this control plane serves {s.architecture} "
                               f"(vocabulary {s.vocab_size}): every worker must serve the same model")
        if d.block_size != s.block_size:
            raise IncompatibleWorker(f"the worker at {d.address} uses KV blocks of {d.block_size} tokens but "
                               f"the first worker uses {s.block_size}: start every worker with the same "
                               "--block-size (prefix caching and placement hash whole blocks)")
        if lane_capacity < s.max_model_len:
            raise WorkerError(f"the worker at {d.address} holds {lane_capacity} tokens per lane, "
                              f"below max_model_len {s.max_model_len}: give it more KV memory")
        return s

    # ---- shutdown --------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Admit nothing more; let the requests held finish for up to `timeout_s`, then abort
        the rest with a message that says why, and give the sessions time to deliver it."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.requests:
            log.info("draining: %d request(s) in flight, waiting up to %g s for them "
                     "(--shutdown-timeout)", len(self.requests), timeout_s)
        while self.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.requests:
            message = (f"aborted: the server shut down before this request finished "
                       f"(--shutdown-timeout {timeout_s:g} s)")
            left = list(self.requests.values())
            log.warning("draining: aborting %d request(s) still running after %g s", len(left), timeout_s)
            for request in left:
                self._end(request, FinishReason.ABORT, message)
            self._publish(0, left)
        flush_deadline = loop.time() + 2.0
        while any(not q.empty() for q in self._clients.values()) and loop.time() < flush_deadline:
            await asyncio.sleep(0.02)
        log.info("drained")

    def close_sessions(self) -> None:
        """End every client session's stream cleanly (after everything queued on it)."""
        for queue in self._clients.values():
            queue.put_nowait(None)

    def _publish(self, step_id: int, changed: list[Request]) -> None:
        by_client: dict[int, list[engine_pb2.RequestOutput]] = {}
        mono = time.monotonic()
        for request in changed:
            new = request.record_tokens(mono)
            if new:
                self.metrics.progressed(request, new)
            by_client.setdefault(request.client_id, []).append(output_to_pb(request))
            request.mark_sent()
            if request.is_finished:
                self.requests.pop(request.request_id, None)
                self._finished(request, mono)
        now = time.time()
        for client_id, outputs in by_client.items():
            queue = self._clients.get(client_id)
            if queue is not None:
                queue.put_nowait(engine_pb2.ServerMessage(outputs=engine_pb2.StepOutputs(
                    step_id=step_id, timestamp=now, outputs=outputs)))

    def _finished(self, request: Request, now: float) -> None:
        self.metrics.finished(request, now)
        if not request_log.isEnabledFor(logging.INFO):
            return
        ttft = (f"{request.first_token_time - request.received_time:.3f}"
                if request.first_token_time is not None else "-")
        error = f" error={json.dumps(request.error)}" if request.error else ""
        request_log.info(
            "request_finished id=%s worker=%d lane=%d prompt_tokens=%d generated_tokens=%d "
            "cached_tokens=%d preemptions=%d migrations=%d ttft_s=%s duration_s=%.3f finish_reason=%s%s",
            json.dumps(request.request_id), request.worker, request.lane, request.num_prompt_tokens,
            len(request.output_token_ids), request.num_cached_tokens, request.num_preemptions,
            request.num_migrations, ttft,
            now - request.received_time, request.finish_reason.value if request.finish_reason else "-",
            error)

    # ---- migration -------------------------------------------------------------------------
    def _migrate(self, lost: list[Request], reason: str) -> None:
        """Requests of a lost worker move to a lane of a ready worker (or of this one once it is
        back), where they recompute from prompt + the tokens they have: the client sees a pause,
        not an error. Past --migration-limit they fail with the cause; a request that finds no
        ready worker within --migration-timeout fails too."""
        failed: list[Request] = []
        loop = asyncio.get_running_loop()
        for request in lost:
            if self.requests.get(request.request_id) is not request:
                continue  # ended meanwhile
            if request.num_migrations >= self.config.migration_limit:
                self.metrics.migrations.labels("failed_limit").inc()
                request.finish(FinishReason.ERROR, f"{reason}; the request was not migrated again: it moved "
                               f"{request.num_migrations} time(s) already (--migration-limit "
                               f"{self.config.migration_limit})")
                failed.append(request)
                continue
            request.num_migrations += 1
            self._migrating.append(request)
            loop.call_later(self.config.migration_timeout_s, self._migration_expired, request, reason)
        if self._migrating:
            log.warning("migrating %d request(s) off the lost worker: %s", len(self._migrating), reason)
        self._place_migrating()
        self._publish(0, failed)

    def _place_migrating(self) -> None:
        ready = self._serving_workers()
        if not ready:
            return
        for request in self._migrating:
            placed = choose_lane([c for w in ready for c in w.candidates()], request)
            self.workers[placed.worker].adopt(request, placed.index)
            self.metrics.migrations.labels("requeued").inc()
            log.info("request %s migrated to worker %d lane %d: recomputing %d tokens", request.request_id,
                     placed.worker, placed.index, request.num_tokens)
        self._migrating.clear()

    def _migration_expired(self, request: Request, reason: str) -> None:
        if request not in self._migrating:
            return  # placed, or ended
        self._migrating.remove(request)
        self.metrics.migrations.labels("failed_timeout").inc()
        request.finish(FinishReason.ERROR, f"{reason}; no worker was ready to take the request within "
                       f"--migration-timeout {self.config.migration_timeout_s:g} s")
        self._publish(0, [request])

    def _end(self, request: Request, reason: FinishReason, message: str) -> None:
        """Finish a request the serving side ends (its lane frees its row and blocks)."""
        if request in self._migrating:  # on no lane
            self._migrating.remove(request)
            request.finish(reason, message)
            return
        self.workers[request.worker].end(request, reason, message)
