"""Mirrors tt-metal models/demos/llama3_70b_galaxy/tt/generator_vllm.py as of the newest stored
version (code index id 60437679140), the Galaxy generator versions (TT_LLAMA_TEXT_VER=
llama3_70b_galaxy, TT_QWEN3_TEXT_VER=qwen3_32b_galaxy):
- no vLLM import (versions up to 0be6ffc8 had `import vllm.envs as envs` at the top);
- initialize_vllm_model asserts `optimizations is None`, then initialize_vllm_text_transformer
  (Llama) or initialize_vllm_text_transformer_qwen (Qwen3) asserts "Total DP ({tt_data_parallel})
  must be divisible by dp_attention_factor ({factor})" with the factor mesh_device.shape[1],
  divides tt_data_parallel by it, cuts the mesh with tt_transformers' create_submeshes (which
  asserts "Unsupported device split: {n} devices, {dp} groups") and builds TtModelArgs (Llama,
  model_config.py) or TtQwenModelArgs (Qwen3, qwen_model_config.py) per submesh with
  max_batch_size // tt_data_parallel: both read their checkpoint from the environment and take
  32-device submeshes only, so on an 8x4 mesh only 4 lanes load;
- model_capabilities: Llama prefix caching, async decode and device sampling; Qwen3 device
  sampling only;
- no get_max_tokens_all_users: the plugin falls back to 131072;
- both adapters subclass generator.py's `Generator` (fakes of it: ./generator.py) and forward
  `prefill_forward(*args, **kwargs)` to its `prefill_forward_text` and `decode_forward(*args,
  **kwargs)` to its `decode_forward` unchanged, so they inherit its decode input-update contract
  (`decode_input_update_contract`, the four commands, `reset_batch` refused). Their
  allocate_kv_cache(kv_cache_shape, dtype, num_layers) (one spec per layer in the real one) is
  the recording fake's.
"""
from __future__ import annotations

from typing import Any

from fakes.fake_ttnn import FakeMesh

from models.demos.llama3_70b_galaxy.tt.generator import Generator
from models.demos.llama3_70b_galaxy.tt.model_config import LlamaOptimizations, TtModelArgs
from models.demos.llama3_70b_galaxy.tt.qwen_model_config import TtQwenModelArgs
from models.tt_transformers.tt.generator import TTNN


def create_submeshes(mesh_device: Any, data_parallel: int) -> list[Any]:
    """tt_transformers' create_submeshes (models/tt_transformers/tt/generator.py, imported from
    there by the real module): the whole mesh for one group, else equal submeshes, after the
    split assert. Only the submeshes' device counts matter to the model args here."""
    if data_parallel == 1:
        return [mesh_device]
    rows, cols = mesh_device.shape
    devices = rows * cols
    assert devices % data_parallel == 0, f"Unsupported device split: {devices} devices, {data_parallel} groups"
    each = devices // data_parallel
    return [FakeMesh(TTNN.recorder, f"{mesh_device.name}/{i}", each, shape=(1, each)) for i in range(data_parallel)]


def _build_model_args(args_cls: type, hf_config: Any, tt_data_parallel: int, mesh_device: Any, max_batch_size: int,
                      max_seq_len: int, **extra: Any) -> list[Any]:
    """The common part of initialize_vllm_text_transformer[_qwen], up to the model args."""
    dp_attention_factor = mesh_device.shape[1]
    assert tt_data_parallel % dp_attention_factor == 0, (
        f"Total DP ({tt_data_parallel}) must be divisible by dp_attention_factor ({dp_attention_factor})")
    tt_data_parallel //= dp_attention_factor
    name = getattr(hf_config, "_name_or_path", "") or ""
    model_args = []
    for submesh in create_submeshes(mesh_device, tt_data_parallel):
        args = args_cls(submesh, instruct="Instruct" in name or "DeepSeek-R1-Distill-Llama-70B" in name,
                        max_batch_size=max_batch_size // tt_data_parallel, max_seq_len=max_seq_len, **extra)
        TTNN.recorder.add("model.galaxy_model_args", args_cls=args_cls.__name__, ckpt_dir=args.CKPT_DIR,
                          num_devices=args.num_devices, max_batch_size=args.max_batch_size)
        model_args.append(args)
    return model_args


def initialize_vllm_text_transformer(hf_config: Any, tt_data_parallel: int, mesh_device: Any, max_batch_size: int,
                                     max_seq_len: int, n_layers: int | None = None) -> list[Any]:
    return _build_model_args(TtModelArgs, hf_config, tt_data_parallel, mesh_device, max_batch_size, max_seq_len,
                             optimizations=LlamaOptimizations.performance)


def initialize_vllm_text_transformer_qwen(hf_config: Any, tt_data_parallel: int, mesh_device: Any,
                                          max_batch_size: int, max_seq_len: int,
                                          n_layers: int | None = None) -> list[Any]:
    return _build_model_args(TtQwenModelArgs, hf_config, tt_data_parallel, mesh_device, max_batch_size,
                             max_seq_len)


class _GalaxyGenerator(Generator):
    _initialize = staticmethod(initialize_vllm_text_transformer)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int,
                              max_seq_len: int = 131072, n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: Any = None) -> Any:
        assert optimizations is None, "Custom optimizations are not supported for this model"
        cls._initialize(hf_config, tt_data_parallel, mesh_device, max_batch_size, max_seq_len, n_layers)
        return super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                             tt_data_parallel, None)

    def prefill_forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().prefill_forward_text(*args, **kwargs)

    def decode_forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().decode_forward(*args, **kwargs)


class LlamaForCausalLM(_GalaxyGenerator):
    model_capabilities = {"supports_async_decode": True, "supports_prefix_caching": True,
                          "supports_sample_on_device": True}


class QwenForCausalLM(_GalaxyGenerator):
    model_capabilities = {"supports_sample_on_device": True}
    _initialize = staticmethod(initialize_vllm_text_transformer_qwen)
