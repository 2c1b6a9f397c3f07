"""A stand-in for tt-metal's `models.tt_transformers.tt.generator` module: its SamplingParams.

The fields are those of tt-metal's SamplingParams (one value or one list entry per row);
`seed` takes None for a row without one, as the TT vLLM plugin sends it.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

MODULE = "models.tt_transformers.tt.generator"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float | list[float]
    top_k: int | list[int]
    top_p: float | list[float]
    presence_penalty: float | list[float] = 0.0
    frequency_penalty: float | list[float] = 0.0
    repetition_penalty: float | list[float] = 1.0
    seed: int | list[int | None] | None = None
    enable_log_probs: bool | list[bool] = False


def install(monkeypatch: Any) -> None:
    """Makes `from models.tt_transformers.tt.generator import SamplingParams` find this module
    (and its parent packages) for the length of a test."""
    parts = MODULE.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = types.ModuleType(name)
        if depth < len(parts):
            module.__path__ = []
        else:
            module.SamplingParams = SamplingParams
        monkeypatch.setitem(sys.modules, name, module)
