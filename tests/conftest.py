from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The prepared SmolLM2-135M-Instruct folder (converted once, then reused)."""
    from ttserve.worker.model_prepare import prepare
    return prepare("smollm2")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """transformers' SmolLM2 as the oracle, loaded once per session: (tokenizer, model) in float32
    with eager attention (plain softmax(QK^T)V, the textbook computation the reference model and
    the served outputs are compared with). Tests must not change the model's state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return tokenizer, model
