"""The control plane's engine: admits requests, places each on a lane of some worker's lane
group, and routes each step's outputs to the client sessions that own the requests."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from . import images
from .admission import AdmissionError, Limits, check_request
from .grammar import Grammar, GrammarCompiler, GrammarError
from .metrics import ControlMetrics
from .engine_config import EngineConfig
from .placement import choose_lane
from .request import FinishReason, Request
from .request_trace import RequestTracing
from .serving_plan import IncompatibleWorker, ServingPlan, plan_serving
from .session import Admission, RequestOutput, SessionMessage, StepOutputs, Verdict, output_of
from .client_text import first_line, for_client
from .queue_bounds import Ledger
from .worker_group import StepFailure, Warm, WorkerDraining, WorkerGroup, WorkerLost
from .worker_link import WorkerError, WorkerHeldElsewhere
from .worker_set import WorkerSpec
from ttserve.tracing import Tracer, trace_id_of

__all__ = ["Engine", "EngineConfig", "IncompatibleWorker"]

log = logging.getLogger(__name__)
# A worker refused as incompatible is asked again this often: its operator may restart it with
# the right flags, and it must not flood the log meanwhile.
REFUSED_RETRY_S = 30.0
# One line per finished request, key=value pairs (logfmt), for log pipelines to parse.
request_log = logging.getLogger("ttserve.requests")


class Engine:
    def __init__(self, config: EngineConfig, metrics: ControlMetrics | None = None,
                 tracing: RequestTracing | None = None) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}
        self.tracing = tracing or RequestTracing(Tracer.off())
        self._clients: dict[int, asyncio.Queue[SessionMessage | None]] = {}
        self._next_client_id = 1
        self.metrics = metrics or ControlMetrics()
        # By id, in the order they joined; an id is never reused, so a request's `worker` never
        # names a later worker. --workers-file adds and removes workers at run time (set_workers).
        self.workers: dict[int, WorkerGroup] = {}
        self._drivers: dict[int, asyncio.Task] = {}
        self.worker_names: dict[int, str] = {}  # every id ever given: a finished request names its last
        self._worker_addresses: dict[str, str] = {}  # every address ever served -> its name (client_text)
        self._next_worker_id = 0
        self._running = False
        for spec in config.workers:
            self._add_worker(spec)
        self.metrics.watch(self)
        self.draining = False
        # The first warm worker's plan: the limits every worker and request must honour.
        self.serving: ServingPlan | None = None
        # Grammars compile here, never on the event loop that runs the step loops.
        self.grammars: GrammarCompiler | None = None
        self._compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ttserve-grammar")
        self.fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # Requests of a lost worker waiting for a ready one (in the order they were lost); those
        # of a drained or removed worker are handed off, which spends no --migration-limit.
        self._migrating: list[Request] = []
        self._ledger = Ledger()  # what the live requests hold, by tenant (queue_bounds.py)
        self._handed_off: set[str] = set()
        # Each migrating request's --migration-timeout, cancelled when it is placed or ends: a
        # request that moves again waits its full time again.
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        for reason in ("invalid", "unavailable", "draining", "overloaded"):
            self.metrics.refused.labels(reason)  # exported as 0 from the start
        for outcome in ("requeued", "handed_off", "failed_limit", "failed_timeout"):
            self.metrics.migrations.labels(outcome)  # exported as 0 from the start
        for outcome in ("isolated", "failed"):
            self.metrics.isolations.labels(outcome)

    @property
    def ready(self) -> bool:
        """Can serve a request now: not draining, and some worker is warm and not stalled."""
        return not self.draining and bool(self._serving_workers())

    @property
    def not_ready_reason(self) -> str:
        if self.draining:
            return "the control plane is shutting down"
        if not self.workers:
            return "no worker is configured (--worker, --workers-file)"
        return "; ".join(f"worker {w.name} at {w.address}: {w.state}" for w in self.workers.values())

    def _serving_workers(self) -> list[WorkerGroup]:
        """Where new requests go: warm workers that are not stalled. With none, new requests are
        refused at once (HTTP 503) rather than queued behind a step that may never return. A
        draining worker takes nothing new."""
        return [w for w in self.workers.values() if w.serving]

    @property
    def limits(self) -> Limits | None:
        s = self.serving
        return Limits(max_model_len=s.max_model_len, vocab_size=s.vocab_size, supports_images=s.supports_images,
                      max_image_blocks=images.max_blocks(s.chunk_limit, s.block_size),
                      block_size=s.block_size) if s else None

    # ---- client sessions -----------------------------------------------------------------
    def open_session(self) -> tuple[int, asyncio.Queue[SessionMessage | None]]:
        client_id = self._next_client_id
        self._next_client_id += 1
        self._clients[client_id] = asyncio.Queue()
        return client_id, self._clients[client_id]

    def close_session(self, client_id: int) -> None:
        """A client that goes away takes its requests with it."""
        self._clients.pop(client_id, None)
        self.abort([rid for rid, r in self.requests.items() if r.client_id == client_id], client_id)

    def turned_away(self, request_id: str, tenant: str, wire_size: int, client_id: int) -> bool:
        """Refuse an arrival the control plane cannot take now, whatever it asks: it is shutting
        down, no worker is ready, or the queue's bounds are reached (queue_bounds.py). True when
        refused (its session has the Admission). The service edge asks before converting the
        request, so a refusal under overload costs no conversion, then calls `admit`."""
        queue = self._clients[client_id]
        if self.draining:
            self.metrics.refused.labels("draining").inc()
            queue.put_nowait(Admission(
                request_id, Verdict.UNAVAILABLE,
                "the control plane is shutting down: it finishes the requests it holds and admits "
                "no new ones; retry on another replica"))
            return True
        ready = self._serving_workers()
        if not ready or self.serving is None:
            self.metrics.refused.labels("unavailable").inc()
            queue.put_nowait(Admission(request_id, Verdict.UNAVAILABLE,
                                       self._for_client(f"no worker is ready ({self.not_ready_reason})")))
            return True
        loads = [load for w in ready for load in w.loads()]
        rows = len(loads) * self.config.max_num_seqs
        # Requests that take a free row at the next step are not queued.
        waiting = max(len(self._migrating) + sum(load.waiting for load in loads)
                      - (rows - sum(load.running for load in loads)), 0)
        overloaded = self._ledger.refusal(self.config.queue, waiting, rows, tenant, wire_size)
        if overloaded:
            self.metrics.refused.labels("overloaded").inc()
            queue.put_nowait(Admission(request_id, Verdict.OVERLOADED, overloaded))
            return True
        return False

    def add(self, request: Request, unsupported: Sequence[str] = (), image_problem: str | None = None) -> None:
        """Admit or refuse a request (as wire.request_from_pb made it: its session in `client_id`,
        its wire size in `held_bytes`); the session always gets exactly one Admission for it.
        `unsupported`: options it sets that this release does not apply; `image_problem`: why its
        image tensors are malformed (wire.mm_inputs_problem)."""
        if not self.turned_away(request.request_id, request.tenant, request.held_bytes, request.client_id):
            self.admit(request, unsupported, image_problem)

    def admit(self, request: Request, unsupported: Sequence[str] = (), image_problem: str | None = None) -> None:
        """`add` for an arrival `turned_away` has just let through (nothing ran between): its own
        checks, then a lane. The service edge calls the two apart, converting in between."""
        queue = self._clients[request.client_id]
        limits = self.limits
        assert limits is not None
        ready = self._serving_workers()
        request.record_received(time.monotonic())
        self.tracing.arrived(request)
        try:
            if request.request_id in self.requests:
                raise AdmissionError(f"request id {request.request_id!r} is already in use")
            check_request(request, list(unsupported), limits)
            if image_problem:
                raise AdmissionError(f"invalid image inputs: {image_problem}")
        except AdmissionError as e:
            self.tracing.verdict(request, None, str(e))
            self.metrics.refused.labels("invalid").inc()
            if request.output_token_ids:
                self.metrics.resumptions.labels("invalid").inc()
            queue.put_nowait(Admission(request.request_id, Verdict.INVALID_ARGUMENT, str(e)))
            return
        if request.output_token_ids:
            self.metrics.resumptions.labels("admitted").inc()
        placed = choose_lane([c for w in ready for c in w.candidates()], request)
        self.requests[request.request_id] = request
        self._ledger.add(request)
        if request.grammar_spec is not None:
            request.await_grammar()
            self._compile(request)
        self.workers[placed.worker].admit(request, placed.index)
        self.tracing.verdict(request, self.workers[placed.worker].name)
        queue.put_nowait(Admission(request.request_id, Verdict.ACCEPTED))

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
            error = f.exception() if not f.cancelled() else GrammarError("grammar compilation was cancelled")
            grammar = f.result() if error is None else None
            if grammar is not None and (refused := _refused_by(grammar, request.output_token_ids)):
                error = GrammarError(refused)
            if error is None:
                request.grammar_ready(grammar)  # a migrating one carries it to its next lane
                if request not in self._migrating:
                    self.workers[request.worker].wake()
                log.debug("request %s: %s grammar compiled in %.3f s", request.request_id, spec.kind,
                          time.monotonic() - started)
            else:
                message = str(error) if isinstance(error, GrammarError) else \
                    f"structured output failed to compile: {type(error).__name__}: {first_line(str(error))}"
                log.info("request %s: %s", request.request_id, message)
                self._end(request, FinishReason.ERROR, message, invalid=True)
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
            self._ledger.remove(request)
            self._end(request, FinishReason.ABORT, "")
            self._finished(request, time.monotonic())

    # ---- workers -------------------------------------------------------------------------
    async def run(self) -> None:
        """Drive every worker, those that join later too, until cancelled; a fault the control
        plane cannot serve past resolves `fatal`."""
        self._running = True
        for worker in self.workers.values():
            self._start_driver(worker)
        try:
            await asyncio.Event().wait()
        finally:
            for task in self._drivers.values():
                task.cancel()
            self._compile_pool.shutdown(wait=False, cancel_futures=True)

    def set_workers(self, specs: tuple[WorkerSpec, ...]) -> None:
        """Serve exactly these workers: new names join, absent names are removed (their requests
        handed off), a name whose address changed is removed and joins again."""
        wanted = {spec.name: spec for spec in specs}
        for worker in list(self.workers.values()):
            spec = wanted.get(worker.name)
            if spec is None or spec.address != worker.address:
                self._remove_worker(worker)
        present = {worker.name for worker in self.workers.values()}
        for spec in specs:
            if spec.name not in present:
                log.info("worker %s at %s joins", spec.name, spec.address)
                self._add_worker(spec)

    def _add_worker(self, spec: WorkerSpec) -> WorkerGroup:
        worker = WorkerGroup(self._next_worker_id, spec.address, self.config, self.metrics, name=spec.name,
                             tracing=self.tracing)
        self._next_worker_id += 1
        self.workers[worker.index] = worker
        self.worker_names[worker.index] = worker.name
        self._worker_addresses[worker.address] = worker.name
        if self._running:
            self._start_driver(worker)
        return worker

    def _remove_worker(self, worker: WorkerGroup) -> None:
        held = worker.release()
        del self.workers[worker.index]
        task = self._drivers.pop(worker.index, None)
        if task is not None:
            task.cancel()  # its `finally` closes the link
        log.warning("worker %s at %s removed (no longer in --workers-file); %d request(s) move to the "
                    "other workers", worker.name, worker.address, len(held))
        self._migrate(held, f"worker {worker.name} at {worker.address} was removed", handed_off=True)

    def _start_driver(self, worker: WorkerGroup) -> None:
        task = asyncio.create_task(self._drive(worker), name=f"ttserve-worker-{worker.name}")
        self._drivers[worker.index] = task

        def ended(t: asyncio.Task) -> None:
            if t.cancelled() or self.fatal.done():
                return
            error = t.exception()
            if error is not None:
                # The control plane cannot go on: it exits non-zero for its supervisor.
                self.fatal.set_result(str(error) if isinstance(error, IncompatibleWorker) else
                                      f"the engine failed: {type(error).__name__}: {error}")

        task.add_done_callback(ended)

    async def _drive(self, worker: WorkerGroup) -> None:
        """The step loop of one worker, as long as it is in the set: connect and warm it up,
        check it against the serving limits, then publish each step's result; a worker lost
        hands back what it held (to migrate) and is reconnected. An incompatible worker is
        refused alone and asked again later while another worker serves; with none serving the
        configuration serves nothing, and IncompatibleWorker ends the control plane."""
        while True:
            retry_s = self.config.reconnect_interval_s
            try:
                warm = await worker.connect(len(self.workers))
                worker.start(warm.description, self._plan(warm))
                self._place_migrating()
                async for stepped in worker.steps():
                    if isinstance(stepped, StepFailure):
                        self._isolate(stepped)
                    else:
                        self._publish(stepped.step_id, stepped.changed)
            except WorkerDraining as e:
                worker.not_ready_reason = str(e)
                log.warning("%s; %d request(s) move to the other workers", e, len(e.requests))
                self._migrate(e.requests, str(e), handed_off=True)
            except WorkerHeldElsewhere as e:
                if not worker.standby:
                    log.info("standby for worker %s: %s; asking again until it is free", worker.name, e)
                worker.standby = True
                worker.not_ready_reason = f"standby: {e}"
            except WorkerError as e:
                worker.not_ready_reason = str(e)
                log.error("%s; reconnecting", e)
                self._migrate(e.requests if isinstance(e, WorkerLost) else worker.release(), str(e))
            except IncompatibleWorker as e:
                if not any(w.serving for w in self.workers.values() if w is not worker):
                    raise  # nothing else serves: the configuration cannot serve at all
                worker.not_ready_reason = f"refused: {e}"
                log.error("worker %s at %s refused (the others serve on): %s; asked again in %.0f s",
                          worker.name, worker.address, e, REFUSED_RETRY_S)
                self._migrate(worker.release(), str(e))
                retry_s = REFUSED_RETRY_S
            except Exception as e:  # noqa: BLE001 - a fault in this worker's loop takes only its link
                reason = (f"the control plane's step loop for the worker at {worker.address} failed "
                          f"({type(e).__name__}: {e})")
                log.exception("%s; reconnecting", reason)
                worker.not_ready_reason = reason
                # Requests a step had finished before the fault are on no lane any more: their
                # clients get their last output now, or would wait for it forever.
                self._publish(0, [r for r in self.requests.values() if r.is_finished])
                self._migrate(worker.release(), reason)
            finally:
                worker.release()
                await worker.close()
            await asyncio.sleep(retry_s)

    def _plan(self, warm: Warm) -> ServingPlan:
        """The warm worker's serving plan (serving_plan.plan_serving). The first worker's fixes
        the serving limits; later ones must serve the same model and hold a max_model_len
        sequence in one lane, or raise IncompatibleWorker."""
        plan = plan_serving(self.config, warm.description, warm.asked, self.serving)
        if self.serving is None:
            d = warm.description
            self.serving = plan
            self.grammars = GrammarCompiler(self.config.tokenizer or d.model_path, d.vocab_size, d.eos_token_ids)
        return plan

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
        """Queue each changed request's delta for its session, taken now (output_of): the
        request is marked sent at once and moves on while the copy waits to be sent."""
        by_client: dict[int, list[RequestOutput]] = {}
        mono = time.monotonic()
        for request in changed:
            new = request.record_tokens(mono)
            if new:
                self.metrics.progressed(request, new, self.worker_names[request.worker])
            out = output_of(request, self._for_client(request.error) if request.error else None)
            by_client.setdefault(request.client_id, []).append(out)
            request.mark_sent()
            if request.is_finished:
                if self.requests.pop(request.request_id, None) is request:
                    self._ledger.remove(request)
                self._finished(request, mono)
        now = time.time()
        for client_id, outputs in by_client.items():
            queue = self._clients.get(client_id)
            if queue is not None:
                queue.put_nowait(StepOutputs(step_id, now, tuple(outputs)))

    def _for_client(self, text: str) -> str:
        """A reason as a client may read it: workers by name, no addresses (client_text.py)."""
        return for_client(text, self._worker_addresses)

    def _finished(self, request: Request, now: float) -> None:
        self.metrics.finished(request, now)
        # Its own trace, or when this control plane does not trace, the one it arrived in.
        trace_id = (self.tracing.finished(request, self.worker_names[request.worker], now)
                    or trace_id_of(request.trace_headers.get("traceparent")))
        if not request_log.isEnabledFor(logging.INFO):
            return
        ttft = (f"{request.first_token_time - request.received_time:.3f}"
                if request.first_token_time is not None else "-")
        error = f" error={json.dumps(request.error)}" if request.error else ""
        traced = f" trace_id={trace_id}" if trace_id else ""
        request_log.info(
            "request_finished id=%s worker=%s lane=%d prompt_tokens=%d generated_tokens=%d "
            "cached_tokens=%d preemptions=%d migrations=%d ttft_s=%s duration_s=%.3f finish_reason=%s%s%s",
            json.dumps(request.request_id), json.dumps(self.worker_names[request.worker]), request.lane, request.num_prompt_tokens,
            len(request.output_token_ids), request.num_cached_tokens, request.num_preemptions,
            request.num_migrations, ttft,
            now - request.received_time, request.finish_reason.value if request.finish_reason else "-",
            traced, error)

    # ---- migration -------------------------------------------------------------------------
    def _isolate(self, failure: StepFailure) -> None:
        """A step failed inside the model. The worker is sound and serves on, and the fault may be
        one request's (inputs that make the model raise), so nobody spends --migration-limit: the
        failed step's requests run isolated, each in steps of its own, and one that fails a step
        alone after an earlier failure is failed with the model's error. Every other request the
        worker held is placed again (as a drain hands off) and recomputes: its client sees the
        tokens of an uninterrupted run."""
        failed = [r for r in failure.failed if self.requests.get(r.request_id) is r]
        culprits = [r for r in failed if r.step_failed(failure.alone)]
        log.error("%s; %d request(s) of the step run isolated, %d failed alone", failure.reason,
                  len(failed) - len(culprits), len(culprits))
        for request in culprits:
            request.finish(FinishReason.ERROR, f"the model failed on this request: {request.num_failed_steps} "
                           f"steps that carried it failed, the last with it alone ({first_line(failure.error)}); "
                           "it is not retried", invalid=True)
        self.metrics.isolations.labels("failed").inc(len(culprits))
        self.metrics.isolations.labels("isolated").inc(len(failed) - len(culprits))
        self._migrate([r for r in failure.requests if r not in culprits], failure.reason, handed_off=True)
        self._publish(0, culprits)

    def _migrate(self, lost: list[Request], reason: str, handed_off: bool = False) -> None:
        """Requests of a lost worker move to a lane of a ready worker (or of this one once it is
        back), where they recompute from prompt + the tokens they have: the client sees a pause,
        not an error. Past --migration-limit they fail with the cause; a request that finds no
        ready worker within --migration-timeout fails too. Requests `handed_off` by a worker that
        drains or is removed move the same way, but spend none of their --migration-limit: the
        move was planned, not a fault of theirs."""
        failed: list[Request] = []
        loop = asyncio.get_running_loop()
        for request in lost:
            if self.requests.get(request.request_id) is not request:
                continue  # ended meanwhile
            if not handed_off and request.num_migrations >= self.config.migration_limit:
                self.metrics.migrations.labels("failed_limit").inc()
                request.finish(FinishReason.ERROR, f"{reason}; the request was not migrated again: it moved "
                               f"{request.num_migrations} time(s) already (--migration-limit "
                               f"{self.config.migration_limit})")
                failed.append(request)
                continue
            if handed_off:
                self._handed_off.add(request.request_id)
            else:
                request.migrated()
            if self.tracing.enabled:
                self.tracing.migrating(request, self.worker_names.get(request.worker, str(request.worker)), reason,
                                       time.monotonic())
            self._migrating.append(request)
            self._expiry[request.request_id] = loop.call_later(self.config.migration_timeout_s,
                                                               self._migration_expired, request, reason)
        if self._migrating:
            log.warning("migrating %d request(s) off the worker: %s", len(self._migrating), reason)
        self._place_migrating()
        self._publish(0, failed)

    def _place_migrating(self) -> None:
        ready = self._serving_workers()
        if not ready:
            return
        for request in self._migrating:
            placed = choose_lane([c for w in ready for c in w.candidates()], request)
            self.workers[placed.worker].adopt(request, placed.index)
            outcome = "handed_off" if request.request_id in self._handed_off else "requeued"
            self._stop_migrating(request)
            self.metrics.migrations.labels(outcome).inc()
            self.tracing.placed(request, self.workers[placed.worker].name, outcome == "handed_off", time.monotonic())
            log.info("request %s moved to worker %s lane %d: recomputing %d tokens", request.request_id,
                     self.workers[placed.worker].name, placed.index, request.num_tokens)
        self._migrating.clear()

    def _migration_expired(self, request: Request, reason: str) -> None:
        if request not in self._migrating:
            return  # placed, or ended
        self._migrating.remove(request)
        self._stop_migrating(request)
        self.metrics.migrations.labels("failed_timeout").inc()
        request.finish(FinishReason.ERROR, f"{reason}; no worker was ready to take the request within "
                       f"--migration-timeout {self.config.migration_timeout_s:g} s")
        self._publish(0, [request])

    def _stop_migrating(self, request: Request) -> None:
        """`request` left the migrating list (placed, expired or ended): forget its move."""
        self._handed_off.discard(request.request_id)
        expiry = self._expiry.pop(request.request_id, None)
        if expiry is not None:
            expiry.cancel()

    def _end(self, request: Request, reason: FinishReason, message: str, invalid: bool = False) -> None:
        """Finish a request the serving side ends (its lane frees its row and blocks)."""
        if request in self._migrating:  # on no lane
            self._migrating.remove(request)
            self._stop_migrating(request)
            request.finish(reason, message, invalid)
            return
        self.workers[request.worker].end(request, reason, message, invalid)


def _refused_by(grammar: Grammar, tokens: list[int]) -> str | None:
    """Feed a resumed request's output so far to its fresh grammar (its invariant: it has
    consumed exactly the output); why one is refused, or None."""
    for position, token in enumerate(tokens, start=1):
        if grammar.is_complete:  # what follows (EOS under ignore_eos) is not fed, as in Scheduler._advance_grammar
            break
        if not grammar.accept(token):
            return f"resumed output token {position} (id {token}) does not match the structured output ({first_line(grammar.error)})"
    return None
