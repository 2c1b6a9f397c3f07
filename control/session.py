"""What a client session receives from the engine, as domain objects: one `Admission` per request
it adds, then one `StepOutputs` per step with news for its requests. The engine queues these;
the service edge (control/server.py) converts them with control/wire.py."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .request import FinishReason, Request, TokenLogprobs


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    INVALID_ARGUMENT = "invalid_argument"   # the request itself is wrong (HTTP 400)
    UNAVAILABLE = "unavailable"             # no ready worker, or shutting down (HTTP 503)
    OVERLOADED = "overloaded"               # past the queue's bounds: retry later (HTTP 503, Retry-After)


@dataclass(frozen=True, slots=True)
class Admission:
    request_id: str
    verdict: Verdict
    message: str = ""               # why, when refused


@dataclass(slots=True)
class RequestOutput:
    """A request's delta since its last output, copied when published: the request moves on
    (Request.mark_sent, later steps) while this waits in the session's queue. Not frozen: one is
    built per request per step, and a frozen dataclass's __init__ costs several times more."""
    request_id: str
    new_token_ids: list[int]        # a copy: the request's list grows on
    finish_reason: FinishReason | None
    error: str                      # as the client may read it (no worker addresses)
    invalid: bool                   # an error the request itself caused (HTTP 400)
    worker: int
    lane: int
    num_cached_tokens: int          # on its first output only; 0 after
    stop_token_id: int | None
    logprobs: list[TokenLogprobs]   # one per new token when the request asked, else empty


@dataclass(slots=True)
class StepOutputs:
    step_id: int
    timestamp: float                # time.time() when published
    outputs: tuple[RequestOutput, ...]


SessionMessage = Admission | StepOutputs


def output_of(request: Request, error: str | None = None) -> RequestOutput:
    """The request's delta since it was last marked sent: new tokens copied, unsent logprobs
    handed over, so the caller must `Request.mark_sent` right after (Engine._publish does).
    `error`: its error as the client may read it (default: as the request holds it)."""
    new = request.output_token_ids[request.num_sent_tokens:]
    logprobs: list[TokenLogprobs] = []
    if request.sampling.logprobs is not None:
        assert len(request.unsent_logprobs) == len(new), "one TokenLogprobs per new token"
        # Handed over, not copied: mark_sent starts the request a new list.
        logprobs = request.unsent_logprobs
    return RequestOutput(request.request_id, new, request.finish_reason,
                         request.error if error is None else error, request.invalid, request.worker, request.lane,
                         request.num_cached_tokens if request.num_sent_tokens == 0 else 0,
                         request.stop_token_id, logprobs)
