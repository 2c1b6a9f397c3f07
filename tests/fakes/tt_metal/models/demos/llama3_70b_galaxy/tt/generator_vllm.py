"""Mirrors tt-metal models/demos/llama3_70b_galaxy/tt/generator_vllm.py, the Galaxy generator
versions (TT_LLAMA_TEXT_VER=llama3_70b_galaxy, TT_QWEN3_TEXT_VER=qwen3_32b_galaxy):
- `import vllm.envs` at module top;
- initialize_vllm_model asserts `optimizations is None` and that the lane count divides over the
  mesh's columns: "Total DP ({tt_data_parallel}) must be divisible by dp_attention_factor
  ({dp_attention_factor})", the factor being mesh_device.shape[1];
- no get_max_tokens_all_users: the plugin falls back to 131072.
"""
from __future__ import annotations

from typing import Any

import vllm.envs as envs  # noqa: F401 - imported at the top, as the real module does

from fakes.fake_tt_model import make_model_class
from models.tt_transformers.tt.generator import TTNN

_Generator = make_model_class(TTNN)


class _GalaxyGenerator(_Generator):
    model_capabilities = {"supports_prefix_caching": True}

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int,
                              max_seq_len: int = 131072, n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: Any = None) -> Any:
        assert optimizations is None, "Custom optimizations are not supported for this model"
        dp_attention_factor = mesh_device.shape[1]
        assert tt_data_parallel % dp_attention_factor == 0, (
            f"Total DP ({tt_data_parallel}) must be divisible by dp_attention_factor ({dp_attention_factor})")
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, None)


class LlamaForCausalLM(_GalaxyGenerator):
    pass


class QwenForCausalLM(_GalaxyGenerator):
    model_capabilities = {}
