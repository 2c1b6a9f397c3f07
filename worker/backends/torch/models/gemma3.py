"""Torch reference implementation of Gemma 3's text model (Gemma3ForCausalLM) behind tt-metal's
generator contract.

Gemma 3 is llama.py's decoder (paged KV cache, GQA, lanes, chunked prefill, static decode) with
hybrid attention and Gemma's arithmetic, as transformers' models/gemma3/modeling_gemma3.py
computes it:

* Local and global layers (config `layer_types`; older configs: every `sliding_window_pattern`-th
  layer global). A local layer attends within `sliding_window` (position p sees p-W+1..p: the
  sliding mask of llama.py) and rotates with the local RoPE base; a global layer attends to the
  whole context and rotates with the global base and its scaling (transformers 5:
  rope_parameters["sliding_attention"] / ["full_attention"]; older configs: rope_local_base_freq,
  and rope_theta with rope_scaling).
* RMSNorm x * rsqrt(mean(x^2) + eps) * (1 + w), in float32, rounded to the model's dtype once.
  Four per layer: around attention (input, post_attention) and around the MLP (pre_feedforward,
  post_feedforward), each output norm applied before its residual add; plus per-head q and k
  norms before RoPE.
* MLP down(gelu_tanh(gate(x)) * up(x)); embeddings scaled by sqrt(hidden_size) rounded to the
  weight dtype (a tied head reads the unscaled table); attention scores scaled by
  query_pre_attn_scalar ** -0.5; logits tanh-softcapped by final_logit_softcapping when set.
* `attn_logit_softcapping` is read and not applied: Gemma 3 replaced Gemma 2's attention
  softcapping with q/k norms, and transformers (5.19: Gemma3Attention passes no softcap) and
  vLLM (attn_logits_soft_cap=None) ignore the field too.

The fast paths of llama.py, for this model:

* vLLM CPU's kernels and the packed prefill (16 bits on a CPU): off (`allows_cpu_kernels`): they
  compute Llama's norms and one RoPE base, without Gemma's sandwich norms, embedding scale or
  window. Every dtype runs the plain torch forward on the paged cache.
* Linear layers keep linear.py's GEMM choice (ttserve's, oneDNN, packed or F.linear); the MLP is
  SwiGLU's loaded projections with gelu_tanh in place of silu.
* Attention is llama.py's (SDPA over the paged cache, the per-layer window mask): the q/k norms
  and the query_pre_attn_scalar scale ride in the q/k/v projection (_NormedQKV).
* Verify (verify_forward, speculative decoding): llama.py's, through this module's `_forward`,
  which returns every position's logits when the plan asks (`_at`).
* Static decode (enable_trace) and its CUDA graph (DecodeGraph): served. `_static_step` builds the
  full and sliding masks, and this module's `_forward` reads nothing back to the host.
* Hybrid KV cache groups (`hybrid_kv_cache_groups`): on. The local and the global layers keep
  block tables of their own and share buffers (llama.py's allocate_kv_cache_per_layer,
  page_tables_per_layer); `_forward` hands layer i to llama.py's attention, which pages through
  layer i's table. tt-metal's HybridAttentionForCausalLM (models/tt_transformers/tt/generator_vllm.py)
  has the same switch, `_HYBRID_KV_CACHE_GROUPS_ENABLED`, off there: its get_kv_cache_spec gives
  every layer a FullAttentionSpec (its comment: the device ops index a sliding group's table at
  absolute positions, and vLLM's zeroed entries sent them onto block 0). Here a layer writes only
  the entries of the positions it computes, which its group holds, and reads the others (0 or
  stale once freed) under the sliding mask.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .linear import Linear, SwiGLU
from .llama import (CheckpointError, LlamaShape, TorchLlamaForCausalLM, _at, _Checkpoint, _Layer, rope_tables,
                    _Step, _windows, contract_config)
from .paged_kv import KVCache

# transformers' Gemma3TextConfig.default_theta: RoPE bases when a config names none.
GLOBAL_ROPE_THETA = 1_000_000.0
LOCAL_ROPE_THETA = 10_000.0
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True, slots=True)
class Gemma3Shape(LlamaShape):
    """LlamaShape (rope_theta and rope_scaling: the global layers') and what Gemma 3 adds."""

    local_rope_layers: tuple[bool, ...]  # per layer: a "sliding_attention" layer, local RoPE base
    local_rope_theta: float
    local_rope_scaling: dict[str, Any] | None
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Gemma3Shape:
        act = config.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise CheckpointError(f"hidden_activation={act!r} is not supported (only gelu_pytorch_tanh)")
        if config.get("use_bidirectional_attention"):
            raise CheckpointError("use_bidirectional_attention (Gemma 3 as an encoder) is not a causal LM")
        layer_types = _layer_types(config)
        full, local = _rope_by_layer_type(config)
        # LlamaShape reads what Gemma shares with Llama, one layer type's RoPE at a time; the
        # activation is Gemma's (checked above), not Llama's hidden_act.
        common = {k: v for k, v in config.items() if k not in ("hidden_act", "rope_scaling", "rope_theta")}
        common["layer_types"] = list(layer_types)
        shape = LlamaShape.from_config({**common, "rope_parameters": full})
        local_shape = LlamaShape.from_config({**common, "rope_parameters": local})
        final_cap = config.get("final_logit_softcapping")
        return cls(
            **{f.name: getattr(shape, f.name) for f in dataclasses.fields(LlamaShape)},
            local_rope_layers=tuple(t == "sliding_attention" for t in layer_types),
            local_rope_theta=local_shape.rope_theta,
            local_rope_scaling=local_shape.rope_scaling,
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
            final_logit_softcapping=float(final_cap) if final_cap else None,
        )


def _layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if not types:  # configs before layer_types: every pattern-th layer is global
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - set(LAYER_TYPES):
        raise CheckpointError(f"layer_types {types} must name {LAYER_TYPES} for each of {layers} layers")
    return tuple(types)


def _rope_by_layer_type(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """RoPE parameters of the global and of the local layers."""
    params = dict(config.get("rope_parameters") or {})
    if {"full_attention", "sliding_attention"} & params.keys():  # transformers 5
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # the global base and scaling at the top level, and the local base
        full = {**params, **(config.get("rope_scaling") or {}),
                "rope_theta": params.get("rope_theta") or config.get("rope_theta")}
        local = {"rope_theta": config.get("rope_local_base_freq")}
    full["rope_theta"] = full.get("rope_theta") or GLOBAL_ROPE_THETA
    local["rope_theta"] = local.get("rope_theta") or LOCAL_ROPE_THETA
    return full, local


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm as transformers' Gemma3RMSNorm computes it: in float32, with `weight` the
    float32 (1 + w), one rounding to x's dtype at the end."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's float32 scale 1 + w from w as loaded (in the model's dtype, as transformers
    holds it), so the 1 is not rounded into a 16-bit weight."""
    return 1.0 + w.float()


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class _NormedQKV:
    """Gemma's q/k/v projection as llama.py's attention calls it (`layer.qkv`): the stacked
    projection, then every q and k head RMS-normed (before RoPE, as transformers). q's norm
    weight also carries sqrt(head_dim / query_pre_attn_scalar), so the attention's
    1 / sqrt(head_dim) makes Gemma's query_pre_attn_scalar ** -0.5 (1 when they are equal, as in
    the 1B-12B releases)."""

    __slots__ = ("linear", "weight", "eps")

    def __init__(self, linear: Linear, weight: torch.Tensor, eps: float) -> None:
        self.linear = linear
        self.weight = weight  # [q heads + kv heads, head_dim], float32
        self.eps = eps

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        qkv = self.linear(h)
        heads, head_dim = self.weight.shape
        qk = qkv[..., :heads * head_dim].unflatten(-1, (heads, head_dim))
        return torch.cat([_norm(qk, self.weight, self.eps).flatten(-2), qkv[..., heads * head_dim:]], dim=-1)


class _GeluTanhGLU:
    """Gemma's MLP, down(gelu_tanh(gate(x)) * up(x)), on the projections linear.SwiGLU loaded."""

    __slots__ = ("glu",)

    def __init__(self, glu: SwiGLU) -> None:
        self.glu = glu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.glu.down(self.glu.gated(x, "gelu_tanh"))


@dataclass(slots=True)
class _Gemma3Layer(_Layer):
    """A layer as llama.py's attention reads it, in Gemma's terms: input_norm and post_norm
    (post_attention_layernorm, on the attention's output) hold float32 (1 + w); qkv applies the
    q/k norms (q_norm and k_norm stay None); mlp is the gelu_tanh MLP, with its own two norms."""

    pre_ff_norm: torch.Tensor
    post_ff_norm: torch.Tensor


class TorchGemma3ForCausalLM(TorchLlamaForCausalLM):
    """Gemma 3 (text): local sliding-window and global layers, Gemma's norms, MLP and scales."""

    required_extras = ("q_norm.weight", "k_norm.weight")
    allows_cpu_kernels = False
    no_cpu_kernels_reason = "the kernels compute Llama's norms and one RoPE base (Gemma has (1 + w) norms, two bases)"
    hybrid_kv_cache_groups = True
    shape: Gemma3Shape

    def __init__(self, shape: Gemma3Shape, state: Mapping[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_batch_size: int, max_seq_len: int, lanes: int) -> None:
        super().__init__(shape, state, device, dtype, max_batch_size, max_seq_len, lanes)
        # The global layers' cos and sin are llama.py's tables; the local layers' come the same way
        # from the local base.
        local = dataclasses.replace(shape, rope_theta=shape.local_rope_theta, rope_scaling=shape.local_rope_scaling)
        self._local_cos, self._local_sin, _ = rope_tables(local, max_seq_len, device, dtype)
        # transformers: a float32 scalar, rounded to the weight dtype (bf16: sqrt(3072) -> 55.5).
        self._embed_scale = torch.tensor(shape.hidden_size ** 0.5).to(device, dtype)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: torch.device, max_batch_size: int,
                              max_seq_len: int, tt_data_parallel: int = 1, *, model_path: str,
                              dtype: torch.dtype = torch.float32) -> TorchGemma3ForCausalLM:
        config = contract_config(hf_config, max_batch_size, max_seq_len, tt_data_parallel)
        return cls(Gemma3Shape.from_config(config), _Checkpoint(Path(model_path)), torch.device(mesh_device),
                   dtype, max_batch_size, max_seq_len, tt_data_parallel)

    @classmethod
    def kv_layer_windows(cls, hf_config: Mapping[str, Any]) -> list[int]:
        """As llama.py's, from Gemma 3's layer types (older configs: sliding_window_pattern)."""
        return _windows(Gemma3Shape.from_config(dict(hf_config)))

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Llama's tensors (same names), then Gemma's view of them and its MLP norms."""
        super()._load(state)
        s = self.shape

        def norm(name: str) -> torch.Tensor:
            if name not in state:
                raise CheckpointError(f"checkpoint has no tensor {name!r}")
            return _plus_one(state[name].to(self.device, self.dtype))

        # Folded into q's norm weight: see _NormedQKV.
        q_scale = (s.head_dim / s.query_pre_attn_scalar) ** 0.5
        self.final_norm = _plus_one(self.final_norm)
        self.layers = [_Gemma3Layer(
            input_norm=_plus_one(layer.input_norm),
            qkv=_NormedQKV(layer.qkv, torch.cat([
                (_plus_one(layer.q_norm) * q_scale).expand(s.num_heads, s.head_dim),
                _plus_one(layer.k_norm).expand(s.num_kv_heads, s.head_dim)]), s.rms_norm_eps),
            q_norm=None, k_norm=None, o=layer.o,
            post_norm=_plus_one(layer.post_norm),
            mlp=_GeluTanhGLU(layer.mlp),
            pre_ff_norm=norm(f"model.layers.{i}.pre_feedforward_layernorm.weight"),
            post_ff_norm=norm(f"model.layers.{i}.post_feedforward_layernorm.weight"),
        ) for i, layer in enumerate(self.layers)]

    def _forward(self, step: _Step, kv_cache: KVCache) -> torch.Tensor:
        """Runs every layer; returns float32 logits [B, vocab] of each row's last real token
        (or [B, S, vocab] of each position: llama.py's _Step.last)."""
        s = self.shape
        eps = s.rms_norm_eps
        x = F.embedding(step.tokens, self.embed) * self._embed_scale
        ropes = {False: self._rope(step),
                 True: (self._local_cos[step.positions].unsqueeze(2), self._local_sin[step.positions].unsqueeze(2))}
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[s.local_rope_layers[i]]
            # Layer i: its mask, and its KV cache group's page table (step.paging[i]).
            attended = self._attention(layer, _norm(x, layer.input_norm, eps), cos, sin, step, kv_cache, i)
            x = x + _norm(attended, layer.post_norm, eps)
            x = x + _norm(layer.mlp(_norm(x, layer.pre_ff_norm, eps)), layer.post_ff_norm, eps)
        logits = self.lm_head(_norm(_at(x, step.last), self.final_norm, eps))
        return _softcap(logits, s.final_logit_softcapping).float()
