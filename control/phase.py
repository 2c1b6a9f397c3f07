"""Which kind of step runs next: the phase policy.

A traced device program replays one fixed shape, so a step is prefill-only, decode-only or empty,
never mixed. Prefill goes first whenever something can be admitted (new requests reach the
running batch sooner and decode batches stay full), but at most `max_consecutive_prefills`
prefill steps run in a row while decodes wait, so a burst of long prompts cannot starve the
requests that are streaming: between chunks of a long prompt, decode steps keep them going.
The default bounds the wait in prefill tokens, whatever the step's budget (`default_streak`):
2,048 tokens, 4 steps of a CPU's 512 (ttserve/batched_tokens.py; 2 steps of 1,024 before), at
least 2 steps (a device's 2,048-token steps: 2, as before). benchmarks/phase_policy.py's burst of
long prompts in 512-token steps on an n300-like device, against an unbounded policy: 2 steps cut
the worst decode stall 15x for 5.5% more time to first token, 4 steps 7.8x for 2.4% more.
"""
from __future__ import annotations

from .step import StepKind

# Prefill tokens decodes wait for at most, by default.
PREFILL_TOKENS_WHILE_DECODES_WAIT = 2048


def default_streak(max_num_batched_tokens: int) -> int:
    """max_consecutive_prefills when --max-consecutive-prefill-steps is not given: as many steps
    of this budget as PREFILL_TOKENS_WHILE_DECODES_WAIT, and at least 2."""
    return max(2, PREFILL_TOKENS_WHILE_DECODES_WAIT // max(max_num_batched_tokens, 1))


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
