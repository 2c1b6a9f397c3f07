"""vLLM's engine-core transport replaced by a gRPC client of the ttserve control plane.

`GrpcEngineCoreClient` is what `AsyncLLM` talks to instead of vLLM's ZMQ client of a local
EngineCore process: one `Engine.Session` stream carries AddRequest/AbortRequests out and
Admission/StepOutputs back. `GatewayLLM` is vLLM's `AsyncLLM` built on that client; everything
else of vLLM's frontend (renderer, InputProcessor, OutputProcessor, the log-stats logger) is
unchanged; vLLM's Prometheus stat logger is replaced by one that records nothing.

Invariants:
- Every request handed to `add_request_async` gets exactly one verdict: it returns once the
  control plane accepted it, or raises (400 RequestRefused / 503 ControlPlaneUnavailable or
  GatewayShuttingDown) after removing it from vLLM's OutputProcessor. vLLM itself only cleans up
  after n>1 fan-out failures.
- `get_output_async` never raises: a raise kills AsyncLLM for good. A lost control plane instead
  ends every in-flight request with finish reason ERROR and the client reconnects with backoff;
  `resources.engine_dead` stays False.
- Outputs are timestamped with the gateway's monotonic clock on receipt.
- Once the gateway drains (`drain.draining`), nothing more is admitted: check_admission and
  add_request_async refuse with GatewayShuttingDown (503). See drain.py for the shutdown sequence.
- With API keys, every AddRequest names its key (rate_limits.CURRENT_KEY, set by the key
  middleware) as its `tenant`, and the key is charged for the request's tokens: its prompt once
  the control plane accepted it, its generated tokens as they arrive (rate_limits.py has the rule).
- A request the control plane fails with a message has it recorded in the client's
  `failure_reasons` until vLLM's serving layer asks for it (generation_errors.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from ttserve.gateway import vllm_compat

vllm_compat.prepare()

from vllm.config import VllmConfig  # noqa: E402
from vllm.tasks import SupportedTask  # noqa: E402
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, FinishReason  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.core_client import EngineCoreClient  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor  # noqa: E402
from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: E402

from ttserve.gateway import convert, http_tracing  # noqa: E402
from ttserve.gateway import vllm_patches  # noqa: E402
from ttserve.gateway.drain import Drain  # noqa: E402
from ttserve.gateway.errors import (ControlPlaneOverloaded, ControlPlaneUnavailable, GatewayShuttingDown,  # noqa: E402
                                    RequestRefused, record_refusal)
from ttserve.gateway.generation_errors import FailureReasons  # noqa: E402
from ttserve.gateway.metrics import CONNECTED, RESUMPTIONS, SESSIONS_LOST  # noqa: E402
from ttserve.gateway.rate_limits import KeyAccount, current_key  # noqa: E402
from ttserve.gateway.control_channel import ControlPlane, ControlPlanes  # noqa: E402
from ttserve.protocol import CALL_METADATA  # noqa: E402
from ttserve.tls import PLAINTEXT, Tls  # noqa: E402
from ttserve.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

log = logging.getLogger("ttserve.gateway.engine_client")
# How long a request waits for the control plane's verdict (it answers without waiting on workers).
ADMISSION_TIMEOUT_S = 30.0
# How long each control plane may take to answer GetServerInfo or GetModelInfo when the gateway
# chooses one (a hung one is passed over after it).
ASK_TIMEOUT_S = 2.0
# With several control planes listed: how often the session's one is compared with the others,
# and how many polls in a row it must be not ready while another is ready before the gateway
# moves its requests there.
FAILOVER_POLL_S = 2.0
FAILOVER_STRIKES = 2
# How soon a resumption turned away (the control plane is back but no worker is ready yet) is sent again.
RESUME_RETRY_S = 0.5

Verdict = engine_pb2.Admission


@dataclass(slots=True)
class _Track(convert.RequestTrack):
    """A request's track, with the account of the API key that sent it (None without keys), and
    what resuming it on a control plane takes: its AddRequest, the tokens streamed so far, and
    how many times it has resumed."""
    account: KeyAccount | None = field(default=None)
    add: engine_pb2.AddRequest | None = field(default=None)
    streamed: list[int] = field(default_factory=list)
    resumptions: int = 0


@dataclass
class _Resources:
    """The part of vLLM's BackgroundResources that AsyncLLM reads."""
    engine_dead: bool = False


class _Session:
    """One Engine.Session call; messages are queued and written by gRPC in order."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._outbox: asyncio.Queue[engine_pb2.ClientMessage | None] = asyncio.Queue()
        self.call = stub.Session(self._messages(), metadata=CALL_METADATA)

    def send(self, message: engine_pb2.ClientMessage) -> None:
        self._outbox.put_nowait(message)

    def close(self) -> None:
        self._outbox.put_nowait(None)
        self.call.cancel()

    async def _messages(self) -> AsyncIterator[engine_pb2.ClientMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message


class GrpcEngineCoreClient(EngineCoreClient):
    """An EngineCoreClient whose engine core is a ttserve control plane reached over gRPC.

    Create it inside the running event loop; it connects (and reconnects) in the background.
    """

    def __init__(self, targets: str | tuple[str, ...], *, backoff_s: tuple[float, float] = (0.1, 2.0),
                 tls: Tls = PLAINTEXT, model: engine_pb2.ModelInfo | None = None, resume_limit: int = 3,
                 resume_timeout_s: float = 120.0) -> None:
        """`targets`: the control planes, in order of preference (control_channel.ControlPlanes).
        `model`: the model the gateway serves, as the first control plane described it; one
        that serves another is not used. `resume_limit`, `resume_timeout_s`: how many times a
        request in flight when the session breaks is re-added as a resumption, and how long it
        waits for a ready control plane."""
        self.planes = ControlPlanes((targets,) if isinstance(targets, str) else targets, tls)
        self._model = model
        self.resume_limit, self.resume_timeout_s = resume_limit, resume_timeout_s
        self.resources = _Resources()
        self.engine_ranks_managed = [0]
        # Set by GatewayLLM from vLLM's structured_outputs_config: how the control plane
        # compiles grammars (to_add_request's defaults until then).
        self.grammar_options: dict[str, bool] = {}
        # The OutputProcessor of the AsyncLLM this client serves (attach_output_processor).
        self._output_processor: OutputProcessor | None = None
        # The control plane's message for each request it failed, until vLLM's serving layer
        # asks (through GatewayLLM.failure_reasons; vllm_patches.report_failure_reasons).
        self.failure_reasons = FailureReasons()
        # The gateway's drain state; GatewayLLM shares its own here.
        self.drain = Drain()
        self._backoff_s = backoff_s
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()
        self._tracks: dict[str, _Track] = {}  # sent and not finished
        self._verdicts: dict[str, asyncio.Future[engine_pb2.Admission]] = {}  # awaiting Admission
        # Requests of a lost session waiting to resume, with the deadline past which they fail;
        # their tracks stay in _tracks, so their outputs go on where they stopped.
        self._resuming: dict[str, float] = {}
        self._awaiting_verdict: set[str] = set()  # of those, sent on this session, no verdict yet
        self._resume_retry: asyncio.TimerHandle | None = None
        # Control planes found serving another model, with why (_serves_our_model).
        self._other_model: dict[str, str] = {}
        self._session: _Session | None = None
        self._plane: ControlPlane | None = None  # the session's control plane, while there is one
        self._last_error = "not connected yet"
        self._ever_connected = False
        self._runner = asyncio.create_task(self._run(), name="ttserve-control-session")

    # ---- connection ----------------------------------------------------------------------
    def attach_output_processor(self, output_processor: OutputProcessor) -> None:
        """The OutputProcessor of the AsyncLLM this client serves, from which a request refused
        or cancelled before admission is removed (vLLM removes none for n=1). AsyncLLM builds it
        in its constructor, after this client exists; GatewayLLM hands it over, once."""
        assert self._output_processor is None, "the client already serves an AsyncLLM"
        self._output_processor = output_processor

    def _drop(self, request_id: str) -> None:
        if self._output_processor is not None:
            self._output_processor.abort_requests([request_id], internal=True)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this client (and the gateway's requests) run on."""
        return self._loop

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def target(self) -> str:
        """The address of the session's control plane; without a session, the first listed."""
        return (self._plane or self.planes.planes[0]).target

    @property
    def unreachable_message(self) -> str:
        """For the operator (logs, /ready): it names the control plane's address."""
        if len(self.planes.planes) == 1:
            return self._other_model.get(self.target) or \
                f"control plane at {self.target} is unreachable ({self._last_error})"
        return f"none of {self.planes.describe()} is ready ({self._last_error})"

    # What an HTTP client is told instead: internal addresses are the operator's.
    UNREACHABLE_FOR_CLIENTS = "the control plane is unreachable; retry later"
    # What a client whose request was in flight hears when the session breaks (no address: the
    # operator's log names it).
    LOST_FOR_CLIENTS = ("the gateway lost its session with the control plane while this request was in "
                        "flight; the request was not completed, retry it")

    async def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.connected

    async def get_server_info(self, timeout: float) -> engine_pb2.ServerInfo:
        """The ServerInfo of the session's control plane (else the first listed) now, by a call
        of its own, not on the session."""
        plane = self._plane or self.planes.planes[0]
        return await plane.stub.GetServerInfo(engine_pb2.ServerInfoRequest(), metadata=CALL_METADATA,
                                              timeout=timeout)

    async def _run(self) -> None:
        delay = self._backoff_s[0]
        while True:
            try:
                answers = await self.planes.ask(timeout=ASK_TIMEOUT_S)
                for answer in answers:
                    if answer.refused and answer.why not in self._last_error:
                        log.error("%s", answer.why)
                chosen = ControlPlanes.choose([a for a in answers if a.plane.target not in self._other_model])
                if chosen is None:
                    reason = "; ".join(self._other_model.get(a.plane.target) or a.describe(named=len(answers) > 1)
                                       for a in answers)
                elif await self._serves_our_model(chosen.plane):
                    reason = (await self._serve_session(chosen.plane, chosen.info)
                              or f"the control plane at {chosen.plane.target} ended the session")
                else:
                    continue  # chosen again without it
            except asyncio.CancelledError:
                self._disconnected("the gateway is shutting down", shutting_down=True)
                raise
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            except Exception as e:  # keep reconnecting whatever broke; never kill AsyncLLM
                log.exception("control plane session failed")
                reason = f"{type(e).__name__}: {e}"
            if self._disconnected(reason):
                delay = self._backoff_s[0]
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff_s[1])

    async def _serves_our_model(self, plane: ControlPlane) -> bool:
        """False, for good (until the gateway restarts), for a control plane that serves another
        model than the one this gateway's frontend was built for: its tokenizer, limits and
        resumed tokens would not fit. Raises grpc.aio.AioRpcError if it does not answer."""
        if self._model is None:
            return True
        info = await plane.stub.GetModelInfo(engine_pb2.ModelInfoRequest(), metadata=CALL_METADATA,
                                             timeout=ASK_TIMEOUT_S)
        want = (self._model.architecture, self._model.vocab_size, self._model.max_model_len)
        if (info.architecture, info.vocab_size, info.max_model_len) == want:
            return True
        why = (f"serves {info.architecture} (vocabulary {info.vocab_size}, max_model_len {info.max_model_len}) "
               f"from {info.model_path}, and this gateway serves {want[0]} (vocabulary {want[1]}, max_model_len "
               f"{want[2]}) from {self._model.model_path}")
        self._other_model[plane.target] = f"{plane.target} is not used: it {why}"
        log.error("not using the control plane at %s: it %s", plane.target, why)
        return False

    async def _failover_wanted(self, plane: ControlPlane) -> str:
        """Resolves, with the reason, once the session's control plane has been not ready (or
        unreachable) for FAILOVER_STRIKES polls in a row while another listed one is ready: a
        worker restart may have given the workers to a standby, or this one may be frozen."""
        strikes = 0
        while True:
            await asyncio.sleep(FAILOVER_POLL_S)
            answers = await self.planes.ask(timeout=ASK_TIMEOUT_S)
            mine = next(a for a in answers if a.plane is plane)
            other = next((a for a in answers if a.ready and a.plane is not plane
                          and a.plane.target not in self._other_model), None)
            strikes = strikes + 1 if other is not None and not mine.ready else 0
            if strikes >= FAILOVER_STRIKES:
                assert other is not None
                return (f"the control plane at {plane.target} is {mine.describe(named=False)} and the one at "
                        f"{other.plane.target} is ready")

    async def _serve_session(self, plane: ControlPlane, info: engine_pb2.ServerInfo) -> str | None:
        """Serve a session with `plane` until it ends (None) or, with several listed, until the
        gateway leaves it for a ready one (the reason)."""
        self._session = session = _Session(plane.stub)
        self._plane = plane
        CONNECTED.set(1)
        log.info("%s the control plane at %s%s", "reconnected to" if self._ever_connected
                 else "connected to", plane.target,
                 "" if info.ready else " (not ready: requests get 503 until it is)")
        self._ever_connected = True
        if self._resuming:
            self._schedule_resumptions(0.0)
        if len(self.planes.planes) == 1:
            async for message in session.call:
                self._on_message(message)
            return None
        failover = asyncio.ensure_future(self._failover_wanted(plane))
        try:
            while True:
                read = asyncio.ensure_future(session.call.read())
                await asyncio.wait({read, failover}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    log.warning("leaving the session: %s", failover.result())
                    return failover.result()
                if (message := read.result()) is grpc.aio.EOF:
                    return None
                self._on_message(message)
        finally:
            failover.cancel()

    def _on_message(self, message: engine_pb2.ServerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "outputs":
            self._on_step(message.outputs)
        elif kind == "admission":
            self._on_admission(message.admission)

    def _disconnected(self, reason: str, shutting_down: bool = False) -> bool:
        """Fail everything in flight on the lost session; returns whether one was lost."""
        self._last_error = reason
        session, self._session = self._session, None
        target = self.target
        self._plane = None
        self._awaiting_verdict.clear()
        if shutting_down:
            self._end_resumptions()
        if session is None:
            return False
        session.close()
        CONNECTED.set(0)
        for future in self._verdicts.values():
            if not future.done():
                future.set_exception(ControlPlaneUnavailable(self.UNREACHABLE_FOR_CLIENTS))
        pending = set(self._verdicts)  # not admitted yet: their clients get a 503 to retry
        self._verdicts.clear()
        lost = [rid for rid in self._tracks]
        if not shutting_down:
            now = time.monotonic()
            for rid in lost:
                track = self._tracks[rid]
                if rid not in pending and track.add is not None and track.resumptions < self.resume_limit \
                        and self.resume_timeout_s > 0 and rid not in self._resuming:
                    track.resumptions += 1
                    self._resuming[rid] = now + self.resume_timeout_s
            lost = [rid for rid in lost if rid not in self._resuming]
            for rid in lost:  # the client's error says what happened instead of vLLM's bare 500
                self.failure_reasons.record(rid, self.LOST_FOR_CLIENTS)
            if self._resuming:
                self._schedule_resumptions(min(self._resuming.values()) - now)
        ended = [convert.finished_output(rid, FinishReason.ERROR, self._tracks.pop(rid).trace_headers)
                 for rid in lost]
        if ended:
            self._outputs.put_nowait(EngineCoreOutputs(outputs=ended, timestamp=time.monotonic()))
        if shutting_down:
            log.info("closed the session with the control plane at %s (%d request(s) in flight)",
                     target, len(lost))
        else:
            SESSIONS_LOST.inc()
            log.warning("lost the control plane at %s (%s): %d in-flight request(s) failed, %d wait to "
                        "resume; reconnecting", target, reason, len(lost), len(self._resuming))
        return True

    # ---- inbound -------------------------------------------------------------------------
    def _on_admission(self, admission: engine_pb2.Admission) -> None:
        future = self._verdicts.pop(admission.request_id, None)
        if future is None and admission.request_id in self._tracks:
            self._on_resumed(admission)
            return
        if future is None:
            log.debug("admission for unknown request %s ignored", admission.request_id)
            return
        if admission.verdict != Verdict.VERDICT_ACCEPTED:
            self._tracks.pop(admission.request_id, None)
        elif (track := self._tracks.get(admission.request_id)) is not None and track.account is not None:
            track.account.count_tokens(track.num_prompt_tokens, "prompt")
        if not future.done():
            future.set_result(admission)

    def _on_step(self, step: engine_pb2.StepOutputs) -> None:
        outputs = []
        for out in step.outputs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue  # aborted here, or not ours
            if track.account is not None:
                track.account.count_tokens(len(out.new_token_ids), "generation")
            track.streamed += out.new_token_ids
            output = convert.to_engine_core_output(out, track)
            if output is None:
                continue
            if output.finish_reason is not None:
                del self._tracks[out.request_id]
                if output.finish_reason == FinishReason.ERROR:
                    log.warning("request %s failed in the control plane: %s", out.request_id,
                                out.error or "no message")
                    if out.error:
                        self.failure_reasons.record(out.request_id, out.error, out.invalid_request)
                elif output.finish_reason == FinishReason.ABORT and out.error:
                    # The control plane ended it (e.g. it shut down); the client sees finish
                    # reason "abort" (the OpenAI API has no field for the message).
                    log.info("request %s aborted by the control plane: %s", out.request_id,
                             out.error)
            outputs.append(output)
        if outputs:
            self._outputs.put_nowait(EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic()))

    # ---- resumption ----------------------------------------------------------------------
    def _schedule_resumptions(self, delay_s: float) -> None:
        if self._resume_retry is not None:
            self._resume_retry.cancel()
        self._resume_retry = self._loop.call_later(delay_s, self._send_resumptions)

    def _send_resumptions(self) -> None:
        """Re-add each waiting request on the current session as a resumption (engine.proto
        Resumption: the tokens its client has); fail those past their deadline. Runs when a
        session starts, after a resumption was turned away as unavailable, and at the deadline."""
        self._resume_retry = None
        now = time.monotonic()
        expired = [rid for rid, deadline in self._resuming.items() if deadline <= now]
        for rid in expired:
            self._fail_resumption(rid, f"{self.LOST_FOR_CLIENTS} (no control plane was ready within "
                                       f"{self.resume_timeout_s:g} s)")
        session = self._session
        sent = 0
        for rid in [rid for rid in self._resuming if rid not in self._awaiting_verdict] if session else []:
            track = self._tracks.get(rid)
            if track is None or track.add is None:  # its client went away meanwhile
                del self._resuming[rid]
                continue
            add = engine_pb2.AddRequest()
            add.CopyFrom(track.add)
            add.resumption.output_token_ids[:] = track.streamed
            session.send(engine_pb2.ClientMessage(add=add))
            self._awaiting_verdict.add(rid)
            sent += 1
        if sent:
            log.info("resuming %d request(s) on the control plane at %s", sent, self.target)
        if self._resuming:  # the deadline holds while a verdict is awaited too
            self._schedule_resumptions(min(self._resuming.values()) - now)

    def _on_resumed(self, admission: engine_pb2.Admission) -> None:
        """The verdict on a resumption: admitted, turned away for now (no worker ready yet:
        retried within its deadline), or refused (the request fails with the reason)."""
        rid = admission.request_id
        self._awaiting_verdict.discard(rid)
        if rid not in self._resuming:
            return
        if admission.verdict == Verdict.VERDICT_ACCEPTED:
            del self._resuming[rid]
            RESUMPTIONS.labels("resumed").inc()
            return
        retry = admission.verdict in (Verdict.VERDICT_UNAVAILABLE, Verdict.VERDICT_OVERLOADED)
        if retry and time.monotonic() < self._resuming[rid]:
            self._schedule_resumptions(RESUME_RETRY_S)
            return
        self._fail_resumption(rid, f"{self.LOST_FOR_CLIENTS} (the control plane refused to resume it: "
                                   f"{admission.message or 'no reason given'})")

    def _fail_resumption(self, rid: str, message: str) -> None:
        del self._resuming[rid]
        if rid in self._awaiting_verdict and self._session is not None:  # admitted later, it would run for nobody
            self._session.send(engine_pb2.ClientMessage(abort=engine_pb2.AbortRequests(request_ids=[rid])))
        self._awaiting_verdict.discard(rid)
        if (track := self._tracks.pop(rid, None)) is None:
            return
        RESUMPTIONS.labels("failed").inc()
        log.warning("request %s: %s", rid, message)
        self.failure_reasons.record(rid, message)
        self._outputs.put_nowait(EngineCoreOutputs(
            outputs=[convert.finished_output(rid, FinishReason.ERROR, track.trace_headers)],
            timestamp=time.monotonic()))

    def _end_resumptions(self) -> None:
        """The gateway shuts down: no request waits to resume any more."""
        if self._resume_retry is not None:
            self._resume_retry.cancel()
            self._resume_retry = None
        for rid in list(self._resuming):
            self._fail_resumption(rid, "the gateway shut down while this request waited for its control plane")

    # ---- EngineCoreClient ----------------------------------------------------------------
    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    async def get_supported_tasks_async(self) -> tuple[SupportedTask, ...]:
        return ("generate",)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        request_id = request.request_id
        http_tracing.note_request(request)  # its ids on its HTTP span (traced only)
        if self.drain.draining:  # passed check_admission before the drain began
            raise self._refused(request_id, GatewayShuttingDown())
        reason = convert.unsupported_by_protocol(request)
        if reason is not None:
            raise self._refused(request_id, RequestRefused(reason))
        session = self._session
        if session is None:
            raise self._refused(request_id, ControlPlaneUnavailable(self.UNREACHABLE_FOR_CLIENTS))
        try:
            message = engine_pb2.ClientMessage(add=convert.to_add_request(request, **self.grammar_options))
        except (ValueError, TypeError) as e:  # a value engine.proto's field cannot hold
            raise self._refused(request_id, RequestRefused(f"the request cannot be sent to the control "
                                                           f"plane: {e}")) from None
        account = current_key()  # the API key that sent it (set by ApiKeyMiddleware)
        message.add.tenant = account.name if account is not None else ""
        reason = convert.too_large(message.add)
        if reason is not None:
            raise self._refused(request_id, RequestRefused(reason))
        future: asyncio.Future[engine_pb2.Admission] = self._loop.create_future()
        self._verdicts[request_id] = future
        track = self._tracks[request_id] = _Track.of(request)
        track.account = account
        if self.resume_limit > 0:  # held for its life only where it may resume
            track.add = message.add
        session.send(message)
        try:
            # The control plane answers at once (admission never waits on a device): no verdict
            # within the bound means it is wedged, and the client gets a 503 saying so.
            admission = await asyncio.wait_for(future, ADMISSION_TIMEOUT_S)
        except (asyncio.CancelledError, TimeoutError) as e:  # the HTTP client went away, or no verdict
            self._verdicts.pop(request_id, None)
            self._resuming.pop(request_id, None)  # the verdict came, then the session broke
            if self._tracks.pop(request_id, None) is not None and session is self._session:
                session.send(engine_pb2.ClientMessage(
                    abort=engine_pb2.AbortRequests(request_ids=[request_id])))
            if isinstance(e, TimeoutError):
                raise self._refused(request_id, ControlPlaneUnavailable(
                    f"the control plane did not answer the request's admission "
                    f"within {ADMISSION_TIMEOUT_S:g} s")) from None
            self._drop(request_id)
            raise
        except ControlPlaneUnavailable as e:
            raise self._refused(request_id, e) from None
        if admission.verdict == Verdict.VERDICT_ACCEPTED:
            return
        if admission.verdict == Verdict.VERDICT_INVALID_ARGUMENT:
            raise self._refused(request_id, RequestRefused(
                admission.message or "the control plane refused the request as invalid"))
        if admission.verdict == Verdict.VERDICT_OVERLOADED:
            raise self._refused(request_id, ControlPlaneOverloaded(
                admission.message or "the control plane has too many requests waiting; retry later"))
        raise self._refused(request_id, ControlPlaneUnavailable(
            admission.message or "the control plane cannot take requests now"))

    def _refused(self, request_id: str, error: Exception) -> Exception:
        self._drop(request_id)
        record_refusal(error)
        return error

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        for request_id in request_ids:
            self._tracks.pop(request_id, None)
            self._resuming.pop(request_id, None)
        # With no session there is nothing to abort: a closed session aborts all its requests.
        if self._session is not None:
            self._session.send(engine_pb2.ClientMessage(
                abort=engine_pb2.AbortRequests(request_ids=request_ids)))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop reconnecting and close the channel; callable from any thread."""
        loop = self._loop

        def close() -> None:
            self._runner.cancel()
            loop.create_task(self.planes.close())

        try:
            in_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            in_loop = False
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            if in_loop:
                close()
            else:
                loop.call_soon_threadsafe(close)

    async def reset_mm_cache_async(self) -> None:
        return None

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False,
                                       reset_connector: bool = False) -> bool:
        return False

    async def reset_encoder_cache_async(self) -> None:
        return None

    async def is_sleeping_async(self) -> bool:
        return False

    def dp_engines_running(self) -> bool:
        return False


class _NoPrometheusStatLogger(PrometheusStatLogger):
    """Records nothing. vLLM's StatLoggerManager adds its own PrometheusStatLogger unless it is
    given one, and that one records the vllm:* metrics on every step, which the gateway never
    exports (metrics.py). The log-stats lines come from LoggingStatLogger, which stays."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        pass  # no metrics created

    def record(self, *args, **kwargs) -> None:
        pass

    def record_sleep_state(self, *args, **kwargs) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass


class GatewayLLM(AsyncLLM):
    """vLLM's AsyncLLM with its engine core replaced by a GrpcEngineCoreClient.

    AsyncLLM builds its engine core through `EngineCoreClient.make_async_mp_client` (its only
    contact with the engine); that factory returns the given client for the duration of the
    constructor (vllm_patches.use_engine_core_client). Construct inside the running event loop.
    """

    def __init__(self, vllm_config: VllmConfig, core_client: GrpcEngineCoreClient, *,
                 log_stats: bool = True, log_requests: bool = False) -> None:
        grammar = vllm_config.structured_outputs_config
        core_client.grammar_options = dict(
            disable_any_whitespace=grammar.disable_any_whitespace,
            disable_additional_properties=grammar.disable_additional_properties)
        with vllm_patches.use_engine_core_client(core_client):
            # Without log_stats there is no stat logger at all; a stat logger given then would
            # turn stats on.
            super().__init__(vllm_config, executor_class=None, log_stats=log_stats,  # type: ignore[arg-type]
                             log_requests=log_requests,
                             stat_loggers=[_NoPrometheusStatLogger] if log_stats else None)
        self.core_client = core_client
        self.drain = core_client.drain
        core_client.attach_output_processor(self.output_processor)
        if self.output_processor.tracing_enabled and not self.log_stats:
            # vLLM's `llm_request` span (OutputProcessor.do_tracing) asserts the request's stats
            # and the step's IterationStats, which exist only with log stats: it would raise in
            # AsyncLLM's output loop, which then fails every request for good. The gateway's and
            # the control plane's spans do not need it.
            self.output_processor.tracing_enabled = False
            log.warning("--disable-log-stats: vLLM's llm_request span is not recorded (it needs the "
                        "request stats); the gateway's HTTP spans and the control plane's are")

    @property
    def failure_reasons(self) -> FailureReasons:
        """Where vLLM's serving layer, which holds this as its engine client, finds the control
        plane's reason for a failed request (vllm_patches.report_failure_reasons)."""
        return self.core_client.failure_reasons

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine side; callable from any thread.

        vLLM's serve_http calls it on SIGTERM/SIGINT from an executor thread with `timeout` =
        --shutdown-timeout, while uvicorn keeps serving: the gateway then drains first (see
        drain.py) and returns once nothing is in flight. With `timeout` None (start-up failures,
        interpreter exit), or on the event loop's own thread, which must not block, it stops at
        once; whatever is still in flight is then failed by the closing session.
        """
        if getattr(self, "_shut_down", False):
            return  # AsyncLLM.__del__ repeats it at interpreter exit, when modules are torn down
        self._shut_down = True
        if timeout is not None:
            self._drain_from_thread(timeout)
        super().shutdown(timeout)

    def _drain_from_thread(self, timeout: float) -> None:
        loop = self.core_client.loop
        try:
            if asyncio.get_running_loop() is loop:
                self.drain.begin()
                return
        except RuntimeError:
            pass  # no loop in this thread: the expected case
        try:
            asyncio.run_coroutine_threadsafe(self.drain.run(self, timeout), loop).result()
        except RuntimeError:
            log.warning("cannot drain: the event loop has stopped")
        except Exception:
            log.exception("draining failed; stopping at once")

    # ---- Drainable ----------------------------------------------------------------------
    def num_in_flight(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    async def abort_in_flight(self) -> int:
        # Internal ids (n>1 children included): the OutputProcessor gives each a final output
        # with finish reason abort, which ends its stream, and the control plane drops them.
        request_ids = list(self.output_processor.request_states)
        if request_ids:
            await self.abort(request_ids, internal=True)
        return len(request_ids)

    # ---- admission and health -----------------------------------------------------------
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        # Runs before a streamed response starts (vLLM's _preflight), so the 503 for an
        # unreachable control plane or a draining gateway is a real HTTP status, not an error
        # inside a 200 stream. vLLM runs it again just before it registers the request; a
        # refusal there reaches RefusalStatusMiddleware through record_refusal.
        error: Exception | None = None
        if self.drain.draining:
            error = GatewayShuttingDown()
        elif not self.core_client.connected:
            error = ControlPlaneUnavailable(self.core_client.UNREACHABLE_FOR_CLIENTS)
        if error is not None:
            record_refusal(error, n)
            raise error
        super().check_admission(n, request_id)

    async def check_health(self) -> None:
        await super().check_health()
        # Liveness only: a lost control plane shows on /ready (restarting the gateway would not
        # bring it back); a draining gateway is on its way out.
        if self.drain.draining:
            raise GatewayShuttingDown("the gateway is shutting down")
