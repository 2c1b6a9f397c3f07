"""Which kind of step runs next: the phase policy.

A traced device program replays one fixed shape, so a step is prefill-only, decode-only or empty,
never mixed. Prefill goes first whenever something can be admitted (new requests reach the
running batch sooner and decode batches stay full), but at most `max_consecutive_prefills`
prefill steps run in a row while decodes wait, so a burst of long prompts cannot starve the
requests that are streaming: between chunks of a long prompt, decode steps keep them going.
The default of 2 comes from benchmarks/phase_policy.py: against an unbounded policy it cuts the
worst decode stall during a burst of long prompts ~15x for ~5% more time to first token.
"""
from __future__ import annotations

from .step import StepKind


class PhasePolicy:
    def __init__(self, max_consecutive_prefills: int = 2) -> None:
        assert max_consecutive_prefills >= 1
        self.max_consecutive_prefills = max_consecutive_prefills
        self._streak = 0  # prefill steps in a row while decodes were waiting

    def choose(self, wants_prefill: bool, has_decodes: bool) -> StepKind:
        if wants_prefill and (not has_decodes or self._streak < self.max_consecutive_prefills):
            return StepKind.PREFILL
        if has_decodes:
            return StepKind.DECODE
        return StepKind.EMPTY

    def record(self, kind: StepKind, had_decodes: bool) -> None:
        """The kind of step that actually ran (a prefill with nothing admitted runs as decode)."""
        if kind is StepKind.DECODE:
            self._streak = 0
        elif kind is StepKind.PREFILL and had_decodes:
            self._streak += 1
