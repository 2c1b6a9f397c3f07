"""The worker's share of a request's trace (--otlp-traces-endpoint): a `ttserve.worker.step`
span for each step whose items carry a traceparent (the control plane's detailed traces:
device.proto PrefillChunk/DecodeItem.traceparent), from the batch's arrival to its result's
send. A step serves many requests: the span is a child of the first traced item's request span
and links to the others'. Untraced steps (tracing off, or no item traced) cost one test."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ttserve.tracing import Tracer
from ttserve.v1 import device_pb2

from .batch import StepResult


@dataclass(slots=True)
class _Traced:
    parents: list[str]
    received_ns: int
    rows: int
    tokens: int


class StepTracing:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._pending: dict[int, _Traced] = {}  # step id -> its trace, until its result is sent

    def received(self, pb: device_pb2.StepBatch) -> None:
        """A batch arrived (before it runs): remembers its traced items' parents."""
        if not self.tracer.enabled:
            return
        parents = [item.traceparent for item in (*pb.prefill, *pb.decode) if item.traceparent]
        if parents:
            tokens = sum(len(c.token_ids) for c in pb.prefill) + sum(1 + len(d.draft_token_ids) for d in pb.decode)
            self._pending[pb.step_id] = _Traced(parents, time.time_ns(), len(pb.prefill) + len(pb.decode), tokens)

    def sent(self, result: StepResult) -> None:
        """The step's result went out: its span, if it was traced."""
        if not self._pending:
            return
        traced = self._pending.pop(result.step_id, None)
        if traced is None:
            return
        self.tracer.record("ttserve.worker.step", traced.parents[0], traced.received_ns, time.time_ns(),
                           {"ttserve.step.id": result.step_id, "ttserve.step.kind": result.kind,
                            "ttserve.step.rows": traced.rows, "ttserve.step.tokens": traced.tokens,
                            "ttserve.step.model_s": result.model_s, "ttserve.step.traced": result.traced,
                            "ttserve.step.sampled_on": "device" if result.sampled_on_device else "host"},
                           links=traced.parents[1:])

    def dropped(self) -> None:
        """The device state was dropped (a failed step, a new stream, whose step ids start
        again at 1): nothing pending will get a result."""
        self._pending.clear()
