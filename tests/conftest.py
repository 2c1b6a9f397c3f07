from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The prepared SmolLM2-135M-Instruct folder (converted once, then reused)."""
    from ttserve.worker.model_prepare import prepare
    return prepare("smollm2")
