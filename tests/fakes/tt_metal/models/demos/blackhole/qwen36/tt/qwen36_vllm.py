"""Mirrors tt-metal models/demos/blackhole/qwen36/tt/qwen36_vllm.py @ 01c8afed5a09a5fdd7c3ddbe0167f81b9607feb3
(index id 54492196086) `Qwen36ForCausalLM`, the class vllm-tt-plugin @ e3fc849 registers for
TTQwen3_5ForConditionalGeneration (TT_QWEN35_TEXT_VER=qwen36_blackhole, platform.py:678-692): Qwen 3.5 /
3.6, Gated DeltaNet (recurrent + conv state per slot) and a few paged full-attention layers (8 of 32
on the 9B). What ttserve depends on:
- vLLM is imported at module top (interfaces.SupportsMultiModal, qwen3_5's processor classes,
  MULTIMODAL_REGISTRY);
- model_capabilities: no prefix caching, no async decode (it corrupts the DeltaNet scan), device
  sampling (decode only: prefill returns logits whatever it is asked);
- get_max_tokens_all_users: QWEN36_MAX_TOKENS_ALL_USERS when set, else max_model_len x max_num_seqs;
- initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, tt_data_parallel=1,
  optimizations=None, **kwargs): the weights folder is MODEL_WEIGHTS_DIR, else HF_MODEL, else
  hf_config._name_or_path (create_tt_model then writes it to HF_MODEL); ONE model on the whole mesh
  with the whole max_batch_size: tt_data_parallel and optimizations are accepted and never read;
- allocate_kv_cache(kv_cache_shape, dtype, num_layers): the paged KV of the full-attention layers
  only (num_layers is not read) plus the per-slot DeltaNet state for max_batch_size slots;
- prefill_forward(tokens, page_table, kv_cache, prompt_lens, **kwargs) returns (logits, zero
  rope_deltas): on one device (or max_batch_size 1) it prefills prompt_lens[0] of the first row
  only, into the single-sequence state; on a multi-device mesh with max_batch_size > 1 every row
  into its decode slot (empty_slots), text only (AssertionError for real pixel_values);
  start_pos is not read (no prefix caching, no chunked prefill);
- decode_forward(*args, **kwargs): a batched multi-device model reindexes its per-slot DeltaNet
  state by `slot_remap` before Generator.decode_forward (the plugin's condense moves).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: F401 - imported at the top, as the real module does

from models.demos.blackhole.qwen36.tt.common import create_tt_model
from models.tt_transformers.tt.generator import TTNN, Generator


def _has_visual(kwargs: dict, key: str) -> bool:
    value = kwargs.get(key)
    return value is not None and len(value) > 0 and value[0] is not None


class Qwen36ForCausalLM(Generator):
    model_capabilities = {
        "supports_prefix_caching": False,
        "supports_async_decode": False,
        "supports_sample_on_device": True,
    }

    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                                 **kwargs: Any) -> int:
        override = os.environ.get("QWEN36_MAX_TOKENS_ALL_USERS")
        if override:
            return int(override)
        if max_model_len is not None:
            return int(max_model_len) * int(max_num_seqs or 1)
        return super().get_max_tokens_all_users(model_name=model_name, num_devices=num_devices,
                                                tt_data_parallel=tt_data_parallel, max_num_seqs=max_num_seqs,
                                                **kwargs)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, optimizations: Any = None, **kwargs: Any) -> Any:
        name_or_path = (os.environ.get("MODEL_WEIGHTS_DIR") or os.environ.get("HF_MODEL")
                        or getattr(hf_config, "_name_or_path", None))
        create_tt_model(mesh_device, max_batch_size=max_batch_size, max_seq_len=max_seq_len, hf_model=name_or_path)
        model = super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len,
                                              tt_data_parallel=tt_data_parallel, optimizations=optimizations)
        model.num_devices = mesh_device.get_num_devices()
        text_config = getattr(hf_config, "text_config", hf_config)
        # Qwen36ModelArgs.attention_type_list: the config's layer_types, else the 9B's pattern.
        layer_types = getattr(text_config, "layer_types", None) or (["linear_attention"] * 3 + ["full_attention"]) * 8
        model.num_attention_layers = sum(lt == "full_attention" for lt in layer_types)
        return model

    @property
    def batched(self) -> bool:
        return self.num_devices > 1 and self.max_batch_size > 1

    def allocate_kv_cache(self, kv_cache_shape: tuple, dtype: Any, num_layers: int) -> list:
        TTNN.recorder.add("model.qwen36_allocate_kv_caches", kv_cache_shape=kv_cache_shape,
                          attention_layers=self.num_attention_layers, batch_size=self.max_batch_size)
        self.block_size = kv_cache_shape[2]
        return [[f"k{i}", f"v{i}"] for i in range(self.num_attention_layers)]

    def prefill_forward(self, tokens: torch.Tensor, page_table: Any, kv_cache: Any, prompt_lens: Any,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        prompt_lens = torch.as_tensor(prompt_lens)
        rows = tokens.shape[0]
        if self.batched:
            assert not _has_visual(kwargs, "pixel_values") and not _has_visual(kwargs, "pixel_values_videos"), (
                "batched (max_num_seqs>1) serving is text-only; multimodal is single-sequence "
                "(max_concurrency=1). Run the model at max_num_seqs=1 for image/video requests.")
            slots = list(kwargs.get("empty_slots") or range(rows))
        else:
            rows, slots = 1, [0]   # prefill_dispatch: prompt_lens[0] of the first row, one DeltaNet state
        TTNN.recorder.add("model.qwen36_prefill", slots=slots, prompt_lens=prompt_lens[:rows].tolist())
        logits = Generator.prefill_forward(self, tokens[:rows], page_table=page_table[:rows], kv_cache=kv_cache,
                                           prompt_lens=prompt_lens[:rows],
                                           start_pos=torch.zeros(rows, dtype=torch.long),
                                           enable_trace=kwargs.get("enable_trace", False), empty_slots=slots)
        return logits, torch.zeros(rows, dtype=torch.long)

    def decode_forward(self, *args: Any, **kwargs: Any) -> Any:
        slot_remap = kwargs.pop("slot_remap", None)
        if self.batched and slot_remap is not None:
            TTNN.recorder.add("model.qwen36_remap_gdn_slots", slot_remap=slot_remap)
        kwargs.pop("rope_deltas_all_users", None)  # taken by tt-metal's Generator.decode_forward, not read here
        return Generator.decode_forward(self, *args, **kwargs)

    def warmup_model_prefill(self, kv_cache: Any, enable_trace: bool, *args: Any, **kwargs: Any) -> None:
        if not enable_trace or self.already_warmed_up_prefill:
            return
        self.already_warmed_up_prefill = True
        TTNN.recorder.add("model.warmup_model_prefill", kv_cache=kv_cache, enable_trace=enable_trace,
                          can_sample_on_device=kwargs.get("can_sample_on_device"))

    def warmup_model_decode(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("non_greedy_decoding_on_device", None)
        return super().warmup_model_decode(*args, **kwargs)
