"""Mirrors tt-metal models/demos/qwen25_vl/tt/generator_vllm.py: Qwen2_5_VLForConditionalGeneration
as the TT vLLM plugin drives it:
- vLLM is imported at module top (vllm.model_executor.models.qwen2_5_vl, MULTIMODAL_REGISTRY);
- model_capabilities: no prefix caching, async decode, device sampling, max_device_top_k 32;
  `decode_input_update_contract = 1` (decode takes reload_* commands, refuses reset_batch);
- prefill_forward(tokens, page_table, kv_cache, prompt_lens, enable_trace, **kwargs): kwargs
  carry empty_slots, start_pos (all 0), sampling_params (dropped: the real one calls
  prefill_forward_text without them and returns logits) and per-user pixel_values and
  image_grid_thw (fakes/fake_tt_vision.py); returns (logits, rope_deltas);
- decode_forward(*args, **kwargs) pops rope_deltas_all_users (None: unchanged) into the model's
  per-row deltas (update_rope_deltas).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: F401 - imported at the top, as the real module does

from fakes.fake_tt_model import make_model_class
from fakes.fake_tt_vision import check_images

from models.common.model_capabilities import ModelCapabilitiesMixin
from models.tt_transformers.tt.generator import TTNN

IMAGE_TOKEN_ID = 60  # the fake vocabulary is 64 tokens


class Qwen2_5_VLForConditionalGeneration(ModelCapabilitiesMixin, make_model_class(TTNN, decode_contract=1)):
    model_capabilities = {"supports_prefix_caching": False, "supports_async_decode": True,
                          "supports_sample_on_device": True, "max_device_top_k": 32}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rope_deltas: list[int] = []

    def prefill_forward(self, tokens, page_table, kv_cache, prompt_lens, enable_trace, **kwargs: Any):
        empty_slots = kwargs.pop("empty_slots", None)
        start_pos = kwargs.get("start_pos", None)
        deltas = check_images(tokens, prompt_lens, IMAGE_TOKEN_ID, kwargs.get("pixel_values"),
                              kwargs.get("image_grid_thw"), start_pos)
        TTNN.recorder.add("model.vision_prefill", pixel_values=kwargs.get("pixel_values"),
                          image_grid_thw=kwargs.get("image_grid_thw"), rope_deltas=deltas,
                          sampling_params=kwargs.get("sampling_params"))
        logits = super().prefill_forward(tokens, page_table, kv_cache, torch.as_tensor(prompt_lens),
                                         torch.as_tensor(start_pos), enable_trace, None, empty_slots)
        return logits, torch.tensor(deltas)

    def decode_forward(self, *args: Any, **kwargs: Any):
        rope_deltas = kwargs.pop("rope_deltas_all_users", None)
        kwargs.pop("slot_remap", None)
        if rope_deltas is not None:
            self.rope_deltas = list(rope_deltas)
        TTNN.recorder.add("model.rope_deltas", rope_deltas=rope_deltas)
        return super().decode_forward(*args, **kwargs)
