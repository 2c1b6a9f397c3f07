"""Structured-output specs the gateway refuses before vLLM validates them.

vLLM validates a request's structured output with llguidance on the gateway's event loop
(vllm/sampling_params.py calls vllm/v1/structured_output/backend_guidance.py's
`validate_guidance_grammar`, vLLM 0.32). A `choice` list of 100k options took it 4.4 s, every
other client of the gateway waiting meanwhile, and llguidance follows at most 2000 alternatives
anyway (longer lists compile, then fail mid-generation; 65k panic its compiler). So
`refuse_oversized_choice` runs first (gateway/vllm_patches.py, `bound_choice_validation`) and
such a list is a 400 at once; the control plane refuses the same at admission for its other
clients (control/grammar.py MAX_CHOICES).

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

from typing import Any

MAX_CHOICES = 2000  # llguidance's alternatives per row: control/grammar.py MAX_CHOICES


def choice_problem(structured_outputs: Any) -> str | None:
    choices = getattr(structured_outputs, "choice", None)
    if isinstance(choices, list) and len(choices) > MAX_CHOICES:
        return (f"structured output choice has {len(choices)} options, more than the {MAX_CHOICES} "
                "this server's grammar engine can follow")
    return None


def refuse_oversized_choice(sampling_params: Any) -> None:
    """Raise VLLMValidationError (HTTP 400) for a choice list past MAX_CHOICES; `sampling_params`
    is vLLM's SamplingParams."""
    problem = choice_problem(getattr(sampling_params, "structured_outputs", None))
    if problem:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(problem, parameter="structured_outputs.choice")
