"""Model registry: a checkpoint's declared architecture selects the model class.

Entries match the architecture (e.g. LlamaForCausalLM), never a model's name, so one entry covers
every release of a family.
"""
from __future__ import annotations


class UnknownArchitecture(ValueError):
    """No registered model class serves this checkpoint."""


def reference_models() -> dict[str, type]:
    from .models import REFERENCE_ARCHITECTURES
    return dict(REFERENCE_ARCHITECTURES)


def resolve(architectures: list[str], registry: dict[str, type]) -> tuple[str, type]:
    """The first declared architecture with an entry, and its class."""
    for arch in architectures:
        if arch in registry:
            return arch, registry[arch]
    raise UnknownArchitecture(
        f"no model is registered for architecture {', '.join(architectures) or '(none declared)'}; "
        f"registered: {', '.join(sorted(registry))}")
