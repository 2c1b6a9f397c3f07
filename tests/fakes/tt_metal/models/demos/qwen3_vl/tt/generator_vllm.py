"""Mirrors tt-metal models/demos/qwen3_vl/tt/generator_vllm.py @ 1d1ec002 (with its base,
models/demos/qwen3_vl/tt/generator.py @ 5f866a08): Qwen3VLForConditionalGeneration, as
models/demos/qwen25_vl's class (fakes/fake_tt_vision.py), with the differences of the real files:
- enable_trace is forced off in prefill;
- decode takes no update contract and no `reset_batch`: generator_vllm's decode_forward(*args,
  **kwargs) pops rope_deltas_all_users and hands the rest to the qwen3_vl Generator's
  decode_forward(tokens, start_pos, page_table, kv_cache, enable_trace, read_from_device,
  sampling_params), so a `reset_batch` (which its **kwargs seems to accept) raises TypeError
  there, as it does here (the fake's base is built without reset_batch);
- a batch's images are read only when its first user has some ("we currently do not support mixed
  inputs of text-only users and text-image users"): a mixed batch is an error here, where the real
  class would crash on a None user or drop the other users' images;
- empty_slots is ignored: the generator prefills batch index i as user i of its one model.
The real class declares no model_capabilities (its Generator has no ModelCapabilitiesMixin); the
fake's {"supports_prefix_caching": False} reads the same to ttserve (a missing key is False), and
its mixin's get_max_tokens_all_users gives the fallback budget the real one falls back to.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: F401 - imported at the top, as the real module does

from fakes.fake_tt_model import make_model_class
from fakes.fake_tt_vision import check_images

from models.common.model_capabilities import ModelCapabilitiesMixin
from models.tt_transformers.tt.generator import TTNN

IMAGE_TOKEN_ID = 60


class Qwen3VLForConditionalGeneration(ModelCapabilitiesMixin, make_model_class(TTNN, takes_reset_batch=False)):
    model_capabilities = {"supports_prefix_caching": False}

    def prefill_forward(self, tokens, page_table, kv_cache, prompt_lens, enable_trace, **kwargs: Any):
        pixel_values = kwargs.get("pixel_values") or []
        has_images = [pv is not None for pv in pixel_values]
        assert len(set(has_images)) <= 1, "mixed inputs of text-only users and text-image users are not supported"
        start_pos = kwargs.get("start_pos", None)
        deltas = check_images(tokens, prompt_lens, IMAGE_TOKEN_ID, pixel_values, kwargs.get("image_grid_thw"),
                              start_pos)
        TTNN.recorder.add("model.vision_prefill", pixel_values=pixel_values,
                          image_grid_thw=kwargs.get("image_grid_thw"), rope_deltas=deltas,
                          sampling_params=kwargs.get("sampling_params"))
        logits = super().prefill_forward(tokens, page_table, kv_cache, torch.as_tensor(prompt_lens),
                                         torch.as_tensor(start_pos), False, None, range(tokens.shape[0]))
        return logits, torch.tensor(deltas)

    def decode_forward(self, *args: Any, **kwargs: Any):
        rope_deltas = kwargs.pop("rope_deltas_all_users", None)
        TTNN.recorder.add("model.rope_deltas", rope_deltas=rope_deltas)
        return super().decode_forward(*args, **kwargs)
