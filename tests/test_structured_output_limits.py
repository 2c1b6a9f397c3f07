"""The gateway's bound on structured-output choices, ahead of vLLM's validation
(gateway/structured_output_limits.py), and the control plane's at admission (control/grammar.py)."""
from __future__ import annotations

import inspect
import json
import time
from types import SimpleNamespace

import pytest

from ttserve.control.grammar import MAX_CHOICES, GrammarSpec
from ttserve.gateway import structured_output_limits


def test_vllm_looks_its_validation_up_where_the_bound_is_installed():
    """vLLM imports validate_guidance_grammar from backend_guidance inside the validating method:
    replacing the module's attribute reaches it. Fails if vLLM binds it some other way."""
    from vllm import sampling_params

    source = inspect.getsource(sampling_params)
    assert "from vllm.v1.structured_output.backend_guidance import" in source
    assert "validate_guidance_grammar(" in source


def test_a_choice_list_past_the_bound_is_refused_at_once_and_others_are_validated():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output import backend_guidance

    from ttserve.gateway import vllm_patches
    vllm_patches.bound_choice_validation()
    vllm_patches.bound_choice_validation()  # idempotent
    started = time.monotonic()
    with pytest.raises(VLLMValidationError, match="100000 options, more than the 2000"):
        backend_guidance.validate_guidance_grammar(
            SimpleNamespace(structured_outputs=SimpleNamespace(choice=[f"c{i}" for i in range(100_000)])))
    assert time.monotonic() - started < 1
    assert structured_output_limits.MAX_CHOICES == MAX_CHOICES
    # Within the bound the original validation runs (a spec without structured output passes).
    backend_guidance.validate_guidance_grammar(SimpleNamespace(structured_outputs=None))


def test_the_control_plane_refuses_the_same_at_admission():
    spec = GrammarSpec("choice", json.dumps([f"c{i}" for i in range(MAX_CHOICES + 1)]))
    assert "2001 options, more than the 2000" in spec.problem()
    assert GrammarSpec("choice", json.dumps(["a", "b"])).problem() is None
    assert GrammarSpec("regex", "a+").problem() is None
