"""A request's trace in the control plane (--otlp-traces-endpoint): one `ttserve.request` span
from arrival to finish, a child of the span that sent it (the gateway's HTTP span, from
AddRequest.trace_headers), with children for what happened to it here:

  admission   arrival to the verdict (refused ones end here, with the reason as the error)
  queue       arrival to its first step (again after a preemption: `preempted` ... next step)
  prefill     each prefill chunk, sent to landed: its positions, worker, lane
  decode      first token to last: tokens and decode steps, one span, not one per token
  migration   off a lost (or drained) worker until placed on another, or failed
  preempted   its lane's KV ran out, until its recompute's first step

With --collect-detailed-traces worker (or all), each prefill chunk and one decode step in
DECODE_STEP_SAMPLE carry the request span's traceparent to the worker (device.proto), which
records that step as its child: a sample, since a span per token would cost more than the step.

Times are taken where they already are (the request's monotonic events, a step's send time)
and recorded as wall clock. Untraced (tracing off): `Request.trace` is None and every hook
returns at its first test.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ttserve.tracing import Span, Tracer, wall_ns

if TYPE_CHECKING:
    from .request import Request
    from .step import StepPlan

# One decode step in this many per request carries its trace to the worker (detailed traces).
DECODE_STEP_SAMPLE = 16


@dataclass(slots=True)
class RequestTrace:
    """A traced request's span and what its later spans need (owned by its Request)."""
    span: Span
    worker_steps: bool                      # --collect-detailed-traces worker: steps carry it
    decode_steps: int = 0                   # decode steps sent (the worker's sample counts them)
    decode_steps_landed: int = 0
    waiting_since: float | None = None      # monotonic: requeued (preempted) at, until its next step
    moving_since: float | None = None       # monotonic: migration started at
    moving_from: str = ""
    queue_recorded: bool = False

    @property
    def trace_id(self) -> str:
        return self.span.trace_id

    def prefill_parent(self) -> str:
        """The traceparent a prefill chunk carries to the worker ("" unless worker steps are traced)."""
        return self.span.traceparent if self.worker_steps else ""

    def decode_parent(self) -> str:
        """As prefill_parent, for the first decode step and one in DECODE_STEP_SAMPLE after it."""
        self.decode_steps += 1
        if self.worker_steps and self.decode_steps % DECODE_STEP_SAMPLE == 1:
            return self.span.traceparent
        return ""

    def preempted(self, now: float) -> None:
        self.waiting_since = now


class RequestTracing:
    """The control plane's request traces: called by the engine (arrival, verdict, migration,
    finish) and by each worker group (its steps landing)."""

    def __init__(self, tracer: Tracer, worker_steps: bool = False) -> None:
        self.tracer = tracer
        self.enabled = tracer.enabled
        self.worker_steps = worker_steps and tracer.enabled

    def arrived(self, request: Request) -> None:
        """Starts its span (at its recorded arrival). A request without trace headers (a gRPC
        client that sends none) starts a trace of its own."""
        if not self.enabled:
            return
        span = self.tracer.start("ttserve.request", request.trace_headers or None, kind="server",
                                 start_ns=wall_ns(request.received_time),
                                 attributes={"gen_ai.request.id": request.request_id,
                                             "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
                                             "gen_ai.request.max_tokens": request.sampling.max_tokens,
                                             "ttserve.resumed_tokens": len(request.output_token_ids) or None})
        request.traced(RequestTrace(span, self.worker_steps))

    def verdict(self, request: Request, worker: str | None, reason: str = "") -> None:
        """The admission span: placed on `worker` (its name), or refused for `reason` (None
        worker), which ends the request's trace here."""
        trace = request.trace
        if trace is None:
            return
        accepted = worker is not None
        self.tracer.record("admission", trace.span, wall_ns(request.received_time), time.time_ns(),
                           {"ttserve.verdict": "accepted" if accepted else "invalid_argument",
                            "ttserve.worker": worker, "ttserve.lane": request.lane if accepted else None})
        if not accepted:
            trace.span.end(error=reason)
            request.untraced()

    def stepped(self, worker: str, plan: StepPlan, sent: float, landed: float) -> None:
        """A step of `plan` sent at `sent` landed at `landed` (monotonic): its prefill chunks'
        spans, and each traced request's first step after waiting (queue, preemption)."""
        if not self.enabled:
            return
        start_ns, end_ns = wall_ns(sent), wall_ns(landed)
        for work in plan.prefill:
            trace = work.request.trace
            if trace is None:
                continue
            self._waited(work.request, trace, sent)
            self.tracer.record("prefill", trace.span, start_ns, end_ns,
                               {"ttserve.worker": worker, "ttserve.lane": plan.lane,
                                "ttserve.chunk.start": work.start, "ttserve.chunk.end": work.end,
                                "ttserve.chunk.tokens": work.end - work.start, "ttserve.chunk.samples": work.sample})
        for work in plan.decode:
            trace = work.request.trace
            if trace is not None:
                trace.decode_steps_landed += 1

    def _waited(self, request: Request, trace: RequestTrace, sent: float) -> None:
        if request.scheduled_time is not None and not trace.queue_recorded:
            trace.queue_recorded = True
            self.tracer.record("queue", trace.span, wall_ns(request.received_time), wall_ns(request.scheduled_time))
        if trace.waiting_since is not None:
            self.tracer.record("preempted", trace.span, wall_ns(trace.waiting_since), wall_ns(sent),
                               {"ttserve.recompute_tokens": request.num_tokens})
            trace.waiting_since = None

    def _requeue_ends(self, request: Request, trace: RequestTrace, now: float) -> None:
        """A preemption still waiting for its recompute ends at `now` (it migrates or finishes)."""
        if trace.waiting_since is not None:
            self.tracer.record("preempted", trace.span, wall_ns(trace.waiting_since), wall_ns(now),
                               {"ttserve.recompute_tokens": request.num_tokens, "ttserve.recomputed": False})
            trace.waiting_since = None

    def migrating(self, request: Request, worker: str, reason: str, now: float) -> None:
        trace = request.trace
        if trace is not None:
            self._requeue_ends(request, trace, now)
        if trace is not None and trace.moving_since is None:
            trace.moving_since, trace.moving_from = now, worker
            trace.span.event("migration.started", {"ttserve.reason": reason, "ttserve.from_worker": worker},
                             at_ns=wall_ns(now))

    def placed(self, request: Request, worker: str, handed_off: bool, now: float) -> None:
        trace = request.trace
        if trace is None or trace.moving_since is None:
            return
        self.tracer.record("migration", trace.span, wall_ns(trace.moving_since), wall_ns(now),
                           {"ttserve.from_worker": trace.moving_from, "ttserve.to_worker": worker,
                            "ttserve.lane": request.lane, "ttserve.handed_off": handed_off,
                            "ttserve.recompute_tokens": request.num_tokens})
        trace.moving_since = None

    def finished(self, request: Request, worker: str, now: float) -> str | None:
        """Ends its span (and a migration or preemption still open); returns its trace id."""
        trace = request.trace
        if trace is None:
            return None
        end_ns = wall_ns(now)
        self._requeue_ends(request, trace, now)
        if trace.moving_since is not None:
            self.tracer.record("migration", trace.span, wall_ns(trace.moving_since), end_ns,
                               {"ttserve.from_worker": trace.moving_from, "ttserve.placed": False})
        if request.scheduled_time is not None and not trace.queue_recorded:
            self.tracer.record("queue", trace.span, wall_ns(request.received_time), wall_ns(request.scheduled_time))
        generated = len(request.output_token_ids) - request.num_resumed_tokens
        if request.first_token_time is not None and request.last_token_time is not None and generated > 1:
            self.tracer.record("decode", trace.span, wall_ns(request.first_token_time), wall_ns(request.last_token_time),
                               {"gen_ai.usage.completion_tokens": generated,
                                "ttserve.decode_steps": trace.decode_steps_landed})
        reason = request.finish_reason.value if request.finish_reason is not None else None
        trace.span.set({"gen_ai.usage.completion_tokens": generated,
                        "gen_ai.response.finish_reasons": [reason] if reason else None,
                        "ttserve.worker": worker, "ttserve.lane": request.lane,
                        "ttserve.cached_tokens": request.num_cached_tokens,
                        "ttserve.preemptions": request.num_preemptions, "ttserve.migrations": request.num_migrations,
                        "gen_ai.latency.time_to_first_token":
                            request.first_token_time - request.received_time
                            if request.first_token_time is not None else None})
        trace.span.end(end_ns, error=request.error or None)
        request.untraced()
        return trace.trace_id
