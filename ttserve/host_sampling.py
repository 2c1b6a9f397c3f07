"""What the control plane and the worker must agree on about sampling: which options only the
host sampler applies — a batch holding one is sampled on the host and never pipelined — and the
logprobs of one sampled token. Both sides' option types (control's SamplingParams, the worker's
HostSampling) answer through these functions, so the rule cannot drift between them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class HostOptions(Protocol):
    """The options only the host sampler applies (vLLM's SamplingParams semantics)."""
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Any
    allowed_token_ids: Any
    bad_words: Any
    logprobs: int | None        # top-k logprobs per sampled token; None = none


def has_penalties(options: HostOptions) -> bool:
    return bool(options.presence_penalty or options.frequency_penalty
                or options.repetition_penalty != 1.0)


def needs_host_sampler(options: HostOptions) -> bool:
    """Some option the device sampler cannot express is set (min_tokens aside: it lapses)."""
    return bool(has_penalties(options) or options.min_p or options.logit_bias
                or options.allowed_token_ids or options.bad_words or options.logprobs is not None)


def draft_problem(options: HostOptions) -> str | None:
    """Why a request's draft tokens cannot be verified (speculative decoding), None when they
    can: a verify step judges a draft by the row's distribution from the logits alone, so an
    option that reads the token history (penalties, bad words) or reshapes the logits beyond
    temperature, top-k, top-p and min-p (bias, allowed ids) rules drafts out; min-p and logprobs
    do not. The control plane proposes none then; the worker refuses any that arrive."""
    if has_penalties(options):
        return "penalties (they read the token history, which the drafts extend)"
    if options.bad_words:
        return "bad words (they read the token history, which the drafts extend)"
    if options.logit_bias or options.allowed_token_ids:
        return "logit_bias or allowed_token_ids"
    return None


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token: the sampled token first, then the top-k, most likely
    first; `rank` is the sampled token's (1 = most likely)."""
    token_ids: list[int]
    logprobs: list[float]
    rank: int
