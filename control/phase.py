"""Which kind of step runs next: the phase policy.

A traced device program replays one fixed shape, so a step is prefill-only, decode-only or empty,
never mixed. Prefill goes first whenever something can be admitted (new requests reach the
running batch sooner, and decode batches stay full).
"""
from __future__ import annotations

from .step import StepKind


class PhasePolicy:
    def choose(self, wants_prefill: bool, has_decodes: bool) -> StepKind:
        if wants_prefill:
            return StepKind.PREFILL
        if has_decodes:
            return StepKind.DECODE
        return StepKind.EMPTY
