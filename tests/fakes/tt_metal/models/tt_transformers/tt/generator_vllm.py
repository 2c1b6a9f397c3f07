"""Mirrors tt-metal models/tt_transformers/tt/generator_vllm.py: the classes the TT vLLM plugin
registers for text models, with the behaviours ttserve must honour:
- vLLM is imported at module top (the real module imports vllm.model_executor.models.gemma3_mm,
  mistral3, interfaces, vllm.multimodal's MULTIMODAL_REGISTRY and processing): without vLLM no
  class here imports;
- initialize_vllm_model builds ModelArgs per data-parallel submesh, which asserts HF_MODEL and
  supports batch sizes 1, 2, 4, 8, 16, 32 (max_batch_size // tt_data_parallel each);
- get_max_tokens_all_users states the KV budget of the configurations tt-metal sized, else
  ModelCapabilitiesMixin's 131072;
- GptOssForCausalLM asserts `optimizations is None`;
- the vision classes: Gemma3ForConditionalGeneration takes pixel_values per user through
  prefill_forward_text; MllamaForConditionalGeneration and Mistral3ForConditionalGeneration take
  prefill_forward(tokens, images, page_table, kv_cache, prompt_lens, cross_page_table).
"""
from __future__ import annotations

from typing import Any

from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: F401 - imported at the top, as the real module does

from models.common.utility_functions import is_wormhole_b0
from models.tt_transformers.tt.generator import TTNN, Generator
from models.tt_transformers.tt.model_config import ModelArgs

_CAPS = {"supports_prefix_caching": True, "supports_async_decode": True, "supports_sample_on_device": True}


class _TextGenerator(Generator):
    model_capabilities = _CAPS

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: str = "performance") -> Any:
        for _ in range(tt_data_parallel):
            ModelArgs(mesh_device, instruct=True, max_batch_size=max_batch_size // tt_data_parallel,
                      max_seq_len=max_seq_len)
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, optimizations)


class LlamaForCausalLM(_TextGenerator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 **kwargs: Any) -> int:
        if "Llama-3.1-8B" in model_name and num_devices // tt_data_parallel == 1 and is_wormhole_b0():
            return 32_768
        return super().get_max_tokens_all_users(model_name=model_name, num_devices=num_devices,
                                                tt_data_parallel=tt_data_parallel, **kwargs)


class QwenForCausalLM(_TextGenerator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 **kwargs: Any) -> int:
        devices = num_devices // tt_data_parallel
        if "Qwen3-8B" in model_name and devices == 1 and is_wormhole_b0():
            return 32_768
        if "Qwen2.5-14B" in model_name and devices == 2 and is_wormhole_b0():
            return 65_536
        return super().get_max_tokens_all_users(model_name=model_name, num_devices=num_devices,
                                                tt_data_parallel=tt_data_parallel, **kwargs)


class MistralForCausalLM(_TextGenerator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 **kwargs: Any) -> int:
        if "Mistral-7B" in model_name and num_devices // tt_data_parallel == 1 and is_wormhole_b0():
            return 65_536
        return super().get_max_tokens_all_users(model_name=model_name, num_devices=num_devices,
                                                tt_data_parallel=tt_data_parallel, **kwargs)


class GptOssForCausalLM(_TextGenerator):
    model_capabilities = {"supports_prefix_caching": False, "supports_async_decode": True,
                          "supports_sample_on_device": True}

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: str | None = None) -> Any:
        assert optimizations is None, "Custom optimizations are not supported for this model"
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, None)


class Gemma3ForConditionalGeneration(_TextGenerator):
    """Gemma 3 with images: prefill_forward(*args, **kwargs) hands everything to
    prefill_forward_text, whose pixel_values are per user (None: text-only). No rope deltas."""
    model_capabilities = {"supports_prefix_caching": False}

    def prefill_forward(self, *args: Any, **kwargs: Any) -> Any:
        pixel_values = kwargs.pop("pixel_values", None)
        kwargs.pop("image_grid_thw", None)
        TTNN.recorder.add("model.vision_prefill", pixel_values=pixel_values)
        return super().prefill_forward(*args, **kwargs)


class _CrossAttentionVision(_TextGenerator):
    """The encoder-decoder prefill of Mllama and Mistral3: PIL images and a cross-attention page
    table; the plugin's model runner refuses encoder-decoder models."""
    model_capabilities = {"supports_prefix_caching": False}

    def prefill_forward(self, tokens: Any, images: Any, page_table: Any, kv_cache: Any, prompt_lens: Any,
                        cross_page_table: Any) -> Any:
        raise AssertionError("ttserve must refuse this class before it runs")


class MllamaForConditionalGeneration(_CrossAttentionVision):
    pass


class Mistral3ForConditionalGeneration(_CrossAttentionVision):
    pass


class HybridAttentionForCausalLM(Generator):
    """Mirrors tt-metal's HybridAttentionForCausalLM (models/tt_transformers/tt/generator_vllm.py, the
    version stored in the search index as id 54494048887): the base of tt-metal's hybrid-attention
    bridges (Gemma 3, Gemma 4 and GPT-OSS there; only Gemma 4's fake derives from it here).
    - `_HYBRID_KV_CACHE_GROUPS_ENABLED = False`: vLLM's hybrid KV cache groups are off, so one
      full-attention group and the legacy single page_table serve every layer;
    - `get_kv_cache_spec(vllm_config)`: its presence is what makes the plugin build per-layer page
      tables (`page_tables_per_layer`); the real one returns vLLM FullAttentionSpecs keyed
      "model.layers.<i>.self_attn", here (name -> layer type) from the config's layer_types;
    - prefill_forward / decode_forward raise NotImplementedError until a subclass overrides them;
    - allocate_kv_cache_per_layer(per_layer_specs): one (K, V) per (shape, dtype, tensor_idx),
      layers with the same tensor_idx sharing a buffer (allocate_vllm_kv_cache_per_layer)."""
    _HYBRID_KV_CACHE_GROUPS_ENABLED = False

    @classmethod
    def get_kv_cache_spec(cls, vllm_config: Any) -> dict[str, str]:
        hf_config = vllm_config.model_config.hf_config
        text_config = getattr(hf_config, "text_config", hf_config)
        layer_types = getattr(text_config, "layer_types", None)
        if layer_types is None:
            raise ValueError(f"{cls.__name__}.get_kv_cache_spec requires hf_config.text_config.layer_types")
        return {f"model.layers.{i}.self_attn": "full_attention" for i, _ in enumerate(layer_types)}

    def prefill_forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must override prefill_forward to consume "
                                  "`page_tables_per_layer`")

    def decode_forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must override decode_forward to consume "
                                  "`page_tables_per_layer`")

    def allocate_kv_cache_per_layer(self, per_layer_specs: list) -> list:
        TTNN.recorder.add("model.allocate_kv_cache_per_layer", specs=list(per_layer_specs))
        self.block_size = per_layer_specs[0][0][2]
        buffers: dict[int, list] = {}
        return [[buffers.setdefault(tensor_idx, ["k", "v"]) for _, _, tensor_idx in per_layer_specs]]
