"""Mirrors tt-metal models/tt_transformers/tt/generator.py: `SamplingParams` and `Generator`, the
base of every tt_transformers class. Imports no vLLM (as the real one). The generator behaviour
(traces, device-resident decode inputs, paged KV, resume-offset flooring, the 32-candidate
sampler) is the recording fake's (tests/fakes/fake_tt_model.py), on this module's `TTNN`."""
from __future__ import annotations

from fakes.fake_tt_generator import SamplingParams  # noqa: F401 - the real module defines it here
from fakes.fake_tt_model import make_model_class
from fakes.fake_ttnn import FakeTtnn

from models.common.model_capabilities import ModelCapabilitiesMixin

TTNN = FakeTtnn()  # the ttnn these classes run on; TtnnBackend(..., ttnn=TTNN) records with them


class Generator(ModelCapabilitiesMixin, make_model_class(TTNN)):
    model_capabilities = {"supports_prefix_caching": True}
