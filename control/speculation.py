"""Speculative decoding's proposals: n-gram prompt lookup (vLLM's `--speculative-config` method
"ngram"), made here in the control plane from a request's own tokens, no draft model.

A decode row then carries the proposed tokens (DecodeWork.draft_token_ids) and the worker
verifies them in the same forward (device.proto DecodeItem.draft_token_ids): each accepted draft
is a token the step produced for the price of one decode, which is bound by reading the weights.

The proposal (vLLM v1's NgramProposer, vllm/v1/spec_decode/ngram_proposer.py): the longest
n-gram, prompt_lookup_min <= n <= prompt_lookup_max, that ends the request's tokens and occurred
before; of its earlier occurrences the first; the up to k tokens that followed it.
"""
from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram",)
# vLLM's defaults for ngram when neither bound is given (SpeculativeConfig.__post_init__).
DEFAULT_LOOKUP = 5


class SpeculativeConfigError(ValueError):
    """A --speculative-config the control plane cannot serve; the message says what is allowed."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int     # k: drafts per decode row at most
    prompt_lookup_min: int
    prompt_lookup_max: int

    def describe(self) -> str:
        return (f"ngram, {self.num_speculative_tokens} draft tokens, n-grams of "
                f"{self.prompt_lookup_min}-{self.prompt_lookup_max}")


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """--speculative-config as vLLM spells it (a JSON object); "" is off."""
    if not text:
        return None
    try:
        fields: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpeculativeConfigError(f"--speculative-config must be a JSON object ({e.msg}), e.g. "
                                     '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(fields, dict):
        raise SpeculativeConfigError("--speculative-config must be a JSON object")
    method = fields.get("method", "ngram" if "model" not in fields else None)
    if method not in METHODS:
        raise SpeculativeConfigError(
            f"--speculative-config method {method!r} is not supported: ttserve proposes with 'ngram' (prompt "
            "lookup, no draft model); draft models, EAGLE and MTP heads are not served")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise SpeculativeConfigError(f"--speculative-config: {', '.join(unknown)} not supported with method "
                                     f"ngram (supported: {', '.join(sorted(known))})")
    k = fields.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SpeculativeConfigError("--speculative-config needs num_speculative_tokens, a positive integer")
    low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SpeculativeConfigError(f"--speculative-config {name} must be a positive integer, got {value!r}")
    # vLLM: both unset -> 5 and 5; one set -> the other equals it.
    low, high = (low or high or DEFAULT_LOOKUP), (high or low or DEFAULT_LOOKUP)
    if low > high:
        raise SpeculativeConfigError(f"--speculative-config prompt_lookup_min={low} must be <= "
                                     f"prompt_lookup_max={high}")
    return SpeculativeConfig(k, low, high)


def propose(tokens: list[int], config: SpeculativeConfig, k: int) -> list[int]:
    """Up to `k` tokens that followed the first earlier occurrence of the longest n-gram ending
    `tokens` (n within the config's bounds); [] when none occurred.

    Runs for every decode row of every step: the search is bytes.find over the tokens as 32-bit
    words (C speed), not a Python loop over positions."""
    total = len(tokens)
    if k < 1 or total <= config.prompt_lookup_min:
        return []
    words = array("I", tokens).tobytes()
    # A match must be followed by a token: search every occurrence in tokens[:-1].
    haystack = memoryview(words)[:-4].tobytes()
    for n in range(min(config.prompt_lookup_max, total - 1), config.prompt_lookup_min - 1, -1):
        needle = words[-4 * n:]
        at = haystack.find(needle)
        while at != -1 and at % 4:  # a match across word boundaries is not a token match
            at = haystack.find(needle, at + 1)
        if at != -1:
            start = at // 4 + n
            return tokens[start:start + k]
    return []


@dataclass(slots=True)
class SpecTally:
    """What a lane's verify rows proposed and had accepted (vLLM's spec_decode metrics)."""
    drafts: int = 0                 # rows that carried at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: accepted as the (i+1)-th draft

    def record(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def copy(self) -> SpecTally:
        return SpecTally(self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_per_position))

    def add(self, other: SpecTally) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        for i, n in enumerate(other.accepted_per_position):
            if i == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += n
