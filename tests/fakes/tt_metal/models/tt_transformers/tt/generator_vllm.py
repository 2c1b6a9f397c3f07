"""Mirrors tt-metal models/tt_transformers/tt/generator_vllm.py, the version that adds
HybridAttentionForCausalLM (stored in the search index as id 54494048887; the stored text names no
commit): the classes the TT vLLM plugin (@ e3fc849, platform.py) registers for text and vision
models, with the behaviours ttserve must honour:
- vLLM is imported at module top (the real module imports vllm.model_executor.models.gemma3_mm,
  mistral3, interfaces, vllm.multimodal's MULTIMODAL_REGISTRY and processing): without vLLM no
  class here imports;
- initialize_vllm_model builds ModelArgs per data-parallel submesh, which asserts HF_MODEL and
  supports batch sizes 1, 2, 4, 8, 16, 32 (max_batch_size // tt_data_parallel each);
- LlamaForCausalLM.initialize_vllm_model raises ValueError, before any model args or weights, when
  hf_config._name_or_path contains "3.1-8B" or "3.2-11B", the mesh holds one device
  (mesh_device.get_num_devices() == 1, the whole mesh) and is_wormhole_b0(), for a max_seq_len
  above 32768 (the same check is in the older version @ 0015d62b);
- get_max_tokens_all_users states the KV budget of the configurations tt-metal sized, else
  ModelCapabilitiesMixin's 131072;
- model_capabilities: the text classes {prefix caching, async decode, device sampling};
- GptOssForCausalLM and Gemma3ForConditionalGeneration subclass HybridAttentionForCausalLM with
  `_HYBRID_KV_CACHE_GROUPS_ENABLED = False` (get_kv_cache_spec, allocate_kv_cache_per_layer
  inherited); their prefill/decode take `page_tables_per_layer` and, with the groups off, ignore
  it and run the legacy single page table through Generator's prefill_forward_text /
  decode_forward; both declare {no prefix caching, async decode, device sampling}; GPT-OSS asserts
  `optimizations is None`;
- Gemma3ForConditionalGeneration.prefill_forward hands every keyword on to prefill_forward_text,
  pixel_values and image_grid_thw per user included (recorded here as "model.vision_prefill");
  its get_max_tokens_all_users gives gemma-3-4b 65536 on one or two Wormhole devices per copy;
- MllamaForConditionalGeneration: prefill_forward(tokens, images, page_table, kv_cache,
  prompt_lens, cross_page_table) (encoder-decoder); {no prefix caching, async decode, no device
  sampling}; asserts `optimizations is None`;
- Mistral3ForConditionalGeneration is decoder-only here (the older version had Mllama's
  cross-attention signature): prefill_forward(*args, **kwargs) reads kwargs["tokens"],
  kwargs["prompt_lens"], page_table and kv_cache, and its images only from kwargs["images"]
  (objects with pixel_values and image_sizes); the pixel_values / image_grid_thw the plugin sends
  are never read (recorded as "model.mistral3_prefill": what it took, what it dropped). It
  declares {no prefix caching, device sampling}, asserts `optimizations is None` and always
  builds for 128K tokens.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: F401 - imported at the top, as the real module does

from models.common.utility_functions import is_wormhole_b0
from models.tt_transformers.tt.generator import TTNN, Generator
from models.tt_transformers.tt.model_config import ModelArgs

_CAPS = {"supports_prefix_caching": True, "supports_async_decode": True, "supports_sample_on_device": True}
_HYBRID_CAPS = {"supports_prefix_caching": False, "supports_async_decode": True, "supports_sample_on_device": True}
_N150_LLAMA_MAX_PROMPT_LEN = 32768


def _model_args_per_submesh(mesh_device: Any, max_batch_size: int, max_seq_len: int, tt_data_parallel: int) -> None:
    """What building the model args of each data-parallel submesh refuses (ModelArgs)."""
    for _ in range(tt_data_parallel):
        ModelArgs(mesh_device, instruct=True, max_batch_size=max_batch_size // tt_data_parallel,
                  max_seq_len=max_seq_len)


class _TextGenerator(Generator):
    model_capabilities = _CAPS

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: str = "performance") -> Any:
        _model_args_per_submesh(mesh_device, max_batch_size, max_seq_len, tt_data_parallel)
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, optimizations)


class HybridAttentionForCausalLM(Generator):
    """Mirrors tt-metal's HybridAttentionForCausalLM (this file's version, index id 54494048887):
    the base of tt-metal's hybrid-attention bridges (Gemma 3, GPT-OSS here; Gemma 4 in its own
    module).
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

    def _generator_prefill(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        """With the groups off: Generator's prefill on the legacy page table."""
        assert not self._HYBRID_KV_CACHE_GROUPS_ENABLED, "the per-layer page-table path is not mirrored"
        return Generator.prefill_forward(self, *args, **kwargs)

    def _generator_decode(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        """With the groups off: Generator.decode_forward, skipping this class's placeholder."""
        assert not self._HYBRID_KV_CACHE_GROUPS_ENABLED, "the per-layer page-table path is not mirrored"
        return Generator.decode_forward(self, *args, **kwargs)


class LlamaForCausalLM(_TextGenerator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 **kwargs: Any) -> int:
        if "Llama-3.1-8B" in model_name and num_devices // tt_data_parallel == 1 and is_wormhole_b0():
            return 32_768
        return super().get_max_tokens_all_users(model_name=model_name, num_devices=num_devices,
                                                tt_data_parallel=tt_data_parallel, **kwargs)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: str = "performance") -> Any:
        name = hf_config._name_or_path
        if (("3.1-8B" in name or "3.2-11B" in name) and mesh_device.get_num_devices() == 1 and is_wormhole_b0()
                and max_seq_len > _N150_LLAMA_MAX_PROMPT_LEN):
            raise ValueError(f"TT-LLama8B and TT-Llama11B do not support max_model_len greater than "
                             f"{_N150_LLAMA_MAX_PROMPT_LEN} on N150 (received {max_seq_len}). Set --max_model_len "
                             f"to {_N150_LLAMA_MAX_PROMPT_LEN} or lower in vLLM.")
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, optimizations)


class QwenForCausalLM(_TextGenerator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 **kwargs: Any) -> int:
        devices = num_devices // tt_data_parallel
        if "Qwen3-8B" in model_name and devices == 1 and is_wormhole_b0():
            return 32_768
        if ("DeepSeek-R1-Distill-Qwen-14B" in model_name or "Qwen2.5-14B" in model_name) and devices == 2 \
                and is_wormhole_b0():
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


class GptOssForCausalLM(HybridAttentionForCausalLM):
    model_capabilities = _HYBRID_CAPS

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: str | None = None) -> Any:
        assert optimizations is None, "Custom optimizations are not supported for this model"
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, None)

    def prefill_forward(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        return self._generator_prefill(*args, page_tables_per_layer=page_tables_per_layer, **kwargs)

    def decode_forward(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        return self._generator_decode(*args, page_tables_per_layer=page_tables_per_layer, **kwargs)


class Gemma3ForConditionalGeneration(HybridAttentionForCausalLM):
    """Gemma 3 with images: prefill_forward(*args, page_tables_per_layer=None, **kwargs) hands
    everything to prefill_forward_text, pixel_values and image_grid_thw per user (None: text-only)
    included. No rope deltas."""
    model_capabilities = _HYBRID_CAPS

    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 **kwargs: Any) -> int:
        if "gemma-3-4b" in model_name.lower() and num_devices // tt_data_parallel in (1, 2) and is_wormhole_b0():
            return 65_536
        return super().get_max_tokens_all_users(model_name=model_name, num_devices=num_devices,
                                                tt_data_parallel=tt_data_parallel, **kwargs)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int = 131072,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: str = "performance") -> Any:
        _model_args_per_submesh(mesh_device, max_batch_size, max_seq_len, tt_data_parallel)
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, optimizations)

    def prefill_forward(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        pixel_values = kwargs.pop("pixel_values", None)
        image_grid_thw = kwargs.pop("image_grid_thw", None)
        TTNN.recorder.add("model.vision_prefill", pixel_values=pixel_values, image_grid_thw=image_grid_thw)
        return self._generator_prefill(*args, page_tables_per_layer=page_tables_per_layer, **kwargs)

    def decode_forward(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        return self._generator_decode(*args, page_tables_per_layer=page_tables_per_layer, **kwargs)


class MllamaForConditionalGeneration(Generator):
    """The encoder-decoder prefill of Mllama: PIL images and a cross-attention page table; the
    plugin's model runner refuses encoder-decoder models."""
    model_capabilities = {"supports_prefix_caching": False, "supports_async_decode": True,
                          "supports_sample_on_device": False}

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, optimizations: str | None = None) -> Any:
        assert optimizations is None, "Custom optimizations are not supported for this model"
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len,
                                             tt_data_parallel=tt_data_parallel, optimizations=None)

    def prefill_forward(self, tokens: Any, images: Any, page_table: Any, kv_cache: Any, prompt_lens: Any,
                        cross_page_table: Any) -> Any:
        raise AssertionError("ttserve must refuse this class before it runs")


class Mistral3ForConditionalGeneration(Generator):
    """Decoder-only: images come only from kwargs["images"]; pixel_values are never read."""
    model_capabilities = {"supports_prefix_caching": False, "supports_sample_on_device": True}

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int = 131072,
                              tt_data_parallel: int = 1, optimizations: str | None = None) -> Any:
        assert optimizations is None, "Custom optimizations are not supported for this model"
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, 1024 * 128,
                                             tt_data_parallel=tt_data_parallel, optimizations=None)

    def prefill_forward(self, *args: Any, **kwargs: Any) -> Any:
        tokens, prompt_lens = kwargs["tokens"], kwargs["prompt_lens"]
        data = kwargs.get("images", None)
        pixel_values = [im.pixel_values for im in data if hasattr(im, "pixel_values")] if data else None
        TTNN.recorder.add("model.mistral3_prefill", pixel_values=pixel_values or None,
                          dropped=sorted(k for k in ("pixel_values", "image_grid_thw") if k in kwargs))
        users = tokens.shape[0]
        return Generator.prefill_forward(self, tokens, kwargs.get("page_table"), kwargs.get("kv_cache"),
                                         torch.as_tensor(prompt_lens), torch.zeros(users, dtype=torch.long),
                                         True, None, range(users))
