"""Mirrors tt-metal models/demos/gemma4/tt/generator_vllm.py @ 00b97ff1158e06e22223f616657d1196cfce1ffa
(index id 68508136212) `Gemma4ForCausalLM`, the class vllm-tt-plugin @ e3fc849 registers for
Gemma4ForCausalLM, Gemma4ForConditionalGeneration and Gemma4UnifiedForConditionalGeneration (and their
TT names; platform.py:729-764). Its weights come from models/demos/gemma4/tt/common.py @ 009a4e26
`create_tt_model`. What ttserve depends on:
- imports no vLLM itself, but imports HybridAttentionForCausalLM and allocate_vllm_kv_cache from
  tt_transformers' generator_vllm, which imports vLLM at its top: without vLLM it does not import;
- model_capabilities: no prefix caching; async decode unless GEMMA4_SUPPORTS_ASYNC_DECODE is 0/false
  (read at import); resumed_prefill_token_alignment 128 (SDPA_CHUNK_ALIGN, tt/generator.py); device
  sampling; chunked prefill;
- `_HYBRID_KV_CACHE_GROUPS_ENABLED = os.environ.get("GEMMA4_HYBRID_KV_CACHE_GROUPS", "0") != "0"`,
  read when the module is imported: off by default (every layer a full-attention spec, one page
  table); on, sliding layers form their own KV cache groups and the plugin sends one page table per
  group (page_tables_per_layer);
- get_kv_cache_spec: per layer, the sliding layers' head_dim / num_key_value_heads and the full
  layers' global_head_dim / num_global_key_value_heads (each falling back to the sliding value);
- get_max_tokens_all_users: GEMMA4_MAX_TOKENS_ALL_USERS when set, else the mixin's 131072;
- initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers=None,
  tt_data_parallel=1, optimizations=None): ValueError unless optimizations is None, "performance" or
  "accuracy"; the weights folder is hf_config._name_or_path (create_tt_model falls back to HF_MODEL,
  then GEMMA4_MODEL_PATH, only when it is empty); one model per data-parallel submesh
  (create_submeshes), each with max_batch_size // tt_data_parallel rows;
- allocate_kv_cache (the legacy uniform path) and allocate_kv_cache_per_layer (inherited, with
  kv-shared layers aliased); a layer whose cache shape is not its own (a full-attention layer given
  the sliding head_dim) fails in the real model at paged_update_cache ("Last dim of input tensor must
  match last dim of cache tensor"), here at allocation;
- prefill_forward / decode_forward take `page_tables_per_layer` (None from ttserve: the legacy
  page_table is broadcast to every layer) and floor resumed prefill starts to 128.
The speculative serving subclasses of the real file (TT_GEMMA4_SPEC) are not mirrored.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from models.tt_transformers.tt.generator import TTNN, Generator
from models.tt_transformers.tt.generator_vllm import HybridAttentionForCausalLM

# models/demos/gemma4/tt/generator.py: full-attention chunked SDPA needs chunk_start_idx % 128 == 0.
SDPA_CHUNK_ALIGN = 128


def align_num_cached_tokens_to_sdpa(num_cached_per_user: list[int]) -> list[int]:
    return [(int(n) // SDPA_CHUNK_ALIGN) * SDPA_CHUNK_ALIGN for n in num_cached_per_user]


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", hf_config)


def _layer_shapes(text_config: Any) -> list[tuple[str, int, int]]:
    """(layer type, num_kv_heads, head_dim) per layer, as get_kv_cache_spec states them."""
    sliding_kv = getattr(text_config, "num_key_value_heads", None)
    sliding_dim = getattr(text_config, "head_dim", None)
    full_kv = getattr(text_config, "num_global_key_value_heads", None) or sliding_kv
    full_dim = getattr(text_config, "global_head_dim", None) or sliding_dim
    return [(lt, full_kv, full_dim) if lt == "full_attention" else (lt, sliding_kv, sliding_dim)
            for lt in getattr(text_config, "layer_types", None) or []]


class Gemma4ForCausalLM(HybridAttentionForCausalLM):
    model_capabilities = {
        "supports_prefix_caching": False,
        "supports_async_decode": os.environ.get("GEMMA4_SUPPORTS_ASYNC_DECODE", "1").lower() in ("1", "true", "yes"),
        "resumed_prefill_token_alignment": SDPA_CHUNK_ALIGN,
        "supports_sample_on_device": True,
        "supports_chunked_prefill": True,
    }

    _HYBRID_KV_CACHE_GROUPS_ENABLED = os.environ.get("GEMMA4_HYBRID_KV_CACHE_GROUPS", "0") != "0"

    @classmethod
    def get_kv_cache_spec(cls, vllm_config: Any) -> dict[str, tuple[str, int, int]]:
        text_config = _text_config(vllm_config.model_config.hf_config)
        if getattr(text_config, "layer_types", None) is None:
            raise ValueError(f"{cls.__name__}.get_kv_cache_spec requires hf_config.text_config.layer_types")
        tp = vllm_config.parallel_config.tensor_parallel_size
        specs = {}
        for i, (kind, kv_heads, head_dim) in enumerate(_layer_shapes(text_config)):
            spec = "sliding_window" if kind == "sliding_attention" and cls._HYBRID_KV_CACHE_GROUPS_ENABLED else "full"
            specs[f"model.layers.{i}.self_attn"] = (spec, kv_heads // tp, head_dim)
        return specs

    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", **kwargs: Any) -> int:
        override = os.environ.get("GEMMA4_MAX_TOKENS_ALL_USERS")
        if override:
            return int(override)
        return super().get_max_tokens_all_users(model_name=model_name, **kwargs)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: str | None = None) -> Any:
        if optimizations not in (None, "performance", "accuracy"):
            raise ValueError(f"Gemma4 TT optimization profiles: None|performance|accuracy (got {optimizations!r})")
        model_path = (getattr(hf_config, "_name_or_path", None) or os.getenv("HF_MODEL")
                      or os.getenv("GEMMA4_MODEL_PATH", "/mnt/MLPerf/tt_dnn-models/google/gemma-4-26B-A4B-it"))
        for _ in range(tt_data_parallel):  # create_submeshes + create_tt_model per submesh
            TTNN.recorder.add("model.gemma4_create_tt_model", model_path=model_path,
                              max_batch_size=max_batch_size // tt_data_parallel, max_seq_len=max_seq_len)
        model = super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                              tt_data_parallel, optimizations)
        model.layer_shapes = _layer_shapes(_text_config(hf_config)) if hf_config is not None else []
        return model

    def allocate_kv_cache(self, kv_cache_shape: tuple, dtype: Any, num_layers: int) -> list:
        return Generator.allocate_kv_cache(self, kv_cache_shape, dtype, num_layers)

    def allocate_kv_cache_per_layer(self, per_layer_specs: list) -> list:
        for i, (shape, _, _) in enumerate(per_layer_specs):
            if i < len(getattr(self, "layer_shapes", [])):
                kind, _, head_dim = self.layer_shapes[i]
                if head_dim is not None and shape[-1] != head_dim:
                    raise RuntimeError(f"layer {i} ({kind}): Last dim of input tensor ({head_dim}) must match "
                                       f"last dim of cache tensor ({shape[-1]})")
        return super().allocate_kv_cache_per_layer(per_layer_specs)

    def prefill_forward(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        if page_tables_per_layer is not None:
            TTNN.recorder.add("model.page_tables_per_layer", count=len(page_tables_per_layer))
        start_pos = kwargs.get("start_pos")
        if start_pos is not None:
            kwargs["start_pos"] = torch.tensor(align_num_cached_tokens_to_sdpa(torch.as_tensor(start_pos).tolist()))
        return Generator.prefill_forward(self, *args, **kwargs)

    def decode_forward(self, *args: Any, page_tables_per_layer: Any = None, **kwargs: Any) -> Any:
        if page_tables_per_layer is not None:
            TTNN.recorder.add("model.page_tables_per_layer", count=len(page_tables_per_layer))
        return Generator.decode_forward(self, *args, **kwargs)
