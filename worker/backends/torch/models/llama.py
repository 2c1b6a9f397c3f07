"""Torch reference implementation of the Llama family behind tt-metal's generator contract.

One class covers LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head
q/k RMSNorm) and MistralForCausalLM (sliding window): GQA, RoPE (default, linear, llama3),
RMSNorm, SiLU MLP, optionally tied embeddings. Weights come straight from the checkpoint's
safetensors; transformers is not needed at run time.

The contract is the one tt-metal's models expose to serving systems
(models/tt_transformers/tt/generator_vllm.py and generator.py), with a paged KV cache:

* Lanes. `tt_data_parallel` lanes each own a KV cache with lane-local block ids. Batch row r
  belongs to lane r // max_batch_size (`max_batch_size` is rows per lane).
* KV cache. kv_cache[lane][layer] = [K, V], each [num_blocks, num_kv_heads, block_size,
  head_dim]. Position p of a row lives in block page_table[row, p // block_size] at offset
  p % block_size.
* Prefill. As in tt-metal, row i of `tokens` holds the request's tokens from position 0;
  `start_pos[i]` tokens already have KV in the cache (prefix cache or earlier chunks) and the
  chunk computed now is tokens[i, start_pos[i]:prompt_lens[i]]. `empty_slots[i]` is the batch
  row of prefill user i, which selects its lane.
* Decode. One token per row at position start_pos[r]; start_pos -1 marks an empty row, which
  writes no KV and whose output is garbage.
* Verify (speculative decoding). verify_forward computes a few tokens per row at once, a decode
  row's fed token and its draft tokens at the positions after it, and returns the logits of every
  one of them: chunked prefill's computation with every position's logits kept.
* Decode traces. With enable_trace, decode runs static shapes (every row of every lane, the whole
  page table), as a device replays its trace: a CUDA graph on CUDA (captured by
  warmup_model_decode), the same shapes eagerly on a CPU. Empty rows then write their K/V into a
  scratch block that allocate_kv_cache adds after the caller's blocks and no page table names.
* Hybrid KV cache groups (vLLM's hybrid KV cache manager, as Tenstorrent's vLLM plugin drives it:
  vllm-tt-plugin src/vllm_tt_plugin/model_runner.py `_build_per_layer_specs`,
  `_block_tables_per_layer`; tt-metal models/tt_transformers/tt/generator_vllm.py
  `allocate_vllm_kv_cache_per_layer`, `HybridAttentionForCausalLM`). allocate_kv_cache_per_layer
  lets several layers share one K/V buffer; the forwards' `page_tables_per_layer` gives each layer
  the page table of its group, through which it writes and reads that buffer. Groups own disjoint
  block ids, so layers sharing a buffer never touch each other's blocks. A sliding-window group's
  entries before the window (blocks the control plane freed) hold 0 or stale ids: never written
  (writes go to the positions computed now, inside the window) and read only under the sliding
  mask.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from safetensors import safe_open

from ttserve.worker.sampling import SamplingBatch, sample

from . import bf16_gemm, cpu_kernels, decode_attention, decode_step, paged_kv, prefill_attention
from .decode_graph import DecodeGraph
from .decode_step import DecodeStep
from .linear import BatchInvarianceError, Linear, SwiGLU, rows_invariant
from .paged_kv import KVCache


log = logging.getLogger(__name__)

Built = TypeVar("Built")

# allocate_kv_cache_per_layer's entries, one per layer: (shape, dtype, tensor_idx), as the plugin's
# `_build_per_layer_specs` builds them.
LayerSpec = tuple[Sequence[int], torch.dtype, int]


class CheckpointError(ValueError):
    """The checkpoint folder or its config cannot be served by the reference model."""


# --- configuration ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LlamaShape:
    """What the forward pass needs from config.json, normalised across config versions."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool | None  # None: config is silent, decided by the checkpoint
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # per layer: does the sliding window apply

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaShape:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act={act!r} is not supported (only silu)")
        heads = config["num_attention_heads"]
        layers = config["num_hidden_layers"]
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters; older configs keep
        # them at the top level.
        rope = dict(config.get("rope_parameters") or {})
        scaling = config.get("rope_scaling") or rope
        rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise CheckpointError(f"rope type {rope_type!r} is not supported "
                                  "(supported: default, linear, llama3)")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            rope_scaling=None if rope_type == "default" else {**scaling, "rope_type": rope_type},
            tie_word_embeddings=config.get("tie_word_embeddings"),
            **_sliding_window(config, layers),
        )


def _sliding_window(config: dict[str, Any], layers: int) -> dict[str, Any]:
    window = config.get("sliding_window")
    # Qwen2/3 carry a sliding_window value but apply it only with use_sliding_window.
    if window is None or config.get("use_sliding_window") is False:
        return {"sliding_window": None, "sliding_layers": (False,) * layers}
    if config.get("layer_types"):
        per_layer = tuple(t == "sliding_attention" for t in config["layer_types"])
    elif "max_window_layers" in config:
        per_layer = tuple(i >= config["max_window_layers"] for i in range(layers))
    else:
        per_layer = (True,) * layers
    return {"sliding_window": int(window), "sliding_layers": per_layer}


def _windows(shape: LlamaShape) -> list[int]:
    return [(shape.sliding_window or 0) if sliding else 0 for sliding in shape.sliding_layers]


def rope_tables(shape: LlamaShape, max_seq_len: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, head_dim] of `shape`'s RoPE, and its float32 angles
    [max_seq_len, head_dim / 2]. rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the
    sign folded into the sin table saves rotate_half's negation and concatenation in every layer."""
    freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * _rope_inv_freq(shape)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = emb.shape[-1] // 2
    sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
    return emb.cos().to(device, dtype), sin.to(device, dtype), freqs


def _rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = shape.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


# --- weights ---------------------------------------------------------------------------------

@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear                     # q, k, v projections stacked (and their biases): one matmul
    q_norm: torch.Tensor | None     # Qwen3: RMSNorm over head_dim, before RoPE
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    mlp: SwiGLU


class _Checkpoint(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors by name, read from the memory-mapped safetensors one at a time
    when asked for: loading converts each to the serving dtype as it goes, so the checkpoint's
    float32 copy of the whole model is never resident at once (SmolLM2: 540 MB)."""

    def __init__(self, model_path: Path) -> None:
        index = model_path / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (model_path / "model.safetensors").is_file():
            shards = ["model.safetensors"]
        else:
            raise CheckpointError(f"{model_path} has no model.safetensors or "
                                  "model.safetensors.index.json; only safetensors checkpoints load")
        self._files = [safe_open(str(model_path / shard), framework="pt") for shard in shards]
        self._where = {name: f for f in self._files for name in f.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# --- the model -------------------------------------------------------------------------------

@dataclass(slots=True)
class _Paging:
    """Where one page table puts a step's keys, for the layers that read through it."""

    block_table: torch.Tensor   # [B, T // block_size] block ids, 0 where the row needs none
    writes: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # lane -> (flat, blk, off)


@dataclass(slots=True)
class _Step:
    """Index plan of one forward call, shared by every layer."""

    tokens: torch.Tensor        # [B, S] token ids computed now
    positions: torch.Tensor     # [B, S] absolute positions (clamped into the RoPE table)
    # [B] index in S of each row's last real token, whose logits the forward returns; or [B, S']
    # (verify_forward: every position's logits, [B, S', vocab]).
    last: torch.Tensor
    # sliding? -> [B, 1, group*S, T]: 0 where a query may attend a key, -inf elsewhere (in the
    # model's dtype, built once per step: SDPA would convert a bool mask in every layer), repeated
    # for the `group` query heads that share a KV head (the GQA layout of _attention).
    masks: dict[bool, torch.Tensor]
    lanes: list[tuple[int, torch.Tensor | None]]  # (lane, rows of the batch; None = all)
    # Per layer. Layers that read one page table (every layer, unless the call passed
    # page_tables_per_layer; else one per KV cache group) share one object, built once per step.
    paging: list[_Paging]
    # Vision models (qwen2_5_vl.py): input embeddings [B, S, hidden] with the images' merged in
    # (None: embed `tokens`), and mRoPE positions [3, B, S] (None: `positions` on every axis).
    embeds: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None


@dataclass(slots=True)
class _Packed:
    """Index plan of one forward call on the CPU kernels' path: the step's real tokens packed
    back to back ([T], no padding), rows grouped by lane."""

    tokens: torch.Tensor        # [T] token ids
    positions: torch.Tensor     # [T] absolute positions
    # [B] index in T of each row's last token (in the caller's row order), or [B, S] of each
    # row's every position (_Step.last's two forms; a padding position repeats the row's last).
    last: torch.Tensor
    lanes: list[tuple[int, cpu_kernels.Attention]]


class TorchLlamaForCausalLM:
    """Llama-family decoder in plain torch, driven through the tt-metal generator contract.

    On a CPU in 16 bits, norms, RoPE and paged attention run vLLM CPU's compiled kernels when
    they are installed (worker/backends/torch/models/cpu_kernels.py): the KV cache then takes their layout and
    every forward packs its tokens without padding. Otherwise, and always in float32, plain torch."""

    model_capabilities = {
        "supports_prefix_caching": True,
        # decode_forward(read_from_device=False) leaves tokens in place for the next step.
        "supports_async_decode": True,
        "supports_sample_on_device": True,
        "supports_chunked_prefill": True,
    }
    # Checkpoint tensors an architecture cannot do without, beyond the Llama set.
    required_extras: tuple[str, ...] = ()
    # The vLLM CPU kernels' path may serve it (a vision model's embeddings and mRoPE need the
    # plain torch forward).
    allows_cpu_kernels: bool = True
    # Why a class that turns them off cannot use them (logged at allocate_kv_cache).
    no_cpu_kernels_reason = "its forward is not the one the kernels compute"
    # Serves vLLM's hybrid KV cache groups: sliding-window and full-attention layers in groups
    # with block tables of their own (allocate_kv_cache_per_layer, page_tables_per_layer). The
    # forwards honour per-layer tables for every class; the flag says which ones ask for groups,
    # as tt-metal's HybridAttentionForCausalLM._HYBRID_KV_CACHE_GROUPS_ENABLED does (generator_vllm.py).
    hybrid_kv_cache_groups: bool = False

    def __init__(self, shape: LlamaShape, state: Mapping[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_batch_size: int, max_seq_len: int, lanes: int,
                 batch_invariant: bool = False) -> None:
        self.shape = shape
        self.device = device
        self.dtype = dtype
        # Each row's bits independent of the rest of its step (linear.py, cpu_kernels.Attention):
        # the kernels' path only, checked at load and at allocate_kv_cache.
        self.batch_invariant = batch_invariant
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.lanes = lanes
        self._load(state)
        self._cos, self._sin, freqs = rope_tables(shape, max_seq_len, device, dtype)
        # The kernels' RoPE table: cos of each frequency, then its sin ([max_seq_len, head_dim]).
        self._cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device, dtype)
        self._decode_graph: DecodeGraph | None = None
        self.kernel_isa = ""  # set by allocate_kv_cache when the CPU kernels serve this model
        self.own_decode_attention = False  # and whether decode steps may run ttserve's kernel there
        self.own_prefill_attention = False  # and other steps ttserve's prefill kernel
        # decode_step.c per lane's cache (by its first key view's address), or why not; per allocation.
        self._decode_steps: dict[int, DecodeStep | str] = {}

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: torch.device, max_batch_size: int,
                              max_seq_len: int, tt_data_parallel: int = 1, *, model_path: str,
                              dtype: torch.dtype = torch.float32,
                              batch_invariant: bool = False) -> TorchLlamaForCausalLM:
        """Loads the checkpoint at `model_path`; `hf_config` is its parsed config.json.
        batch_invariant (ttserve's, not the contract's): every row's logits are the same bits
        whatever else its step computes (the worker's --batch-invariant)."""
        config = contract_config(hf_config, max_batch_size, max_seq_len, tt_data_parallel)
        shape = LlamaShape.from_config(config)
        state = _Checkpoint(Path(model_path))
        return cls(shape, state, torch.device(mesh_device), dtype, max_batch_size, max_seq_len,
                   tt_data_parallel, batch_invariant)

    @classmethod
    def kv_layer_windows(cls, hf_config: Mapping[str, Any]) -> list[int]:
        """Each layer's sliding window as this class's attention masks it (0: every position):
        what the worker's KV cache groups are made of (worker/kv_groups.py), so a sliding
        group's blocks go only where the mask no longer reads."""
        return _windows(LlamaShape.from_config(dict(hf_config)))

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        missing = [name for i in range(self.shape.num_layers) for name in
                   (f"model.layers.{i}.self_attn.{extra}" for extra in self.required_extras)
                   if name not in state]
        if missing:
            raise CheckpointError(f"{type(self).__name__} checkpoint lacks {missing[:4]}"
                                  f"{' ...' if len(missing) > 4 else ''}")

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise CheckpointError(f"checkpoint has no tensor {name!r}")
            return state[name].to(self.device, self.dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in state else None

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        invariant = self.batch_invariant
        if invariant and not self.allows_cpu_kernels:
            raise BatchInvarianceError(f"batch invariance needs vLLM CPU's kernels; {type(self).__name__}: "
                                       f"{self.no_cpu_kernels_reason}")
        tie = self.shape.tie_word_embeddings
        if tie or (tie is None and "lm_head.weight" not in state):
            self.lm_head = Linear(self.embed, batch_invariant=invariant)
        else:
            self.lm_head = Linear(take("lm_head.weight"), batch_invariant=invariant)
        self.layers = []
        for i in range(self.shape.num_layers):
            p = f"model.layers.{i}"
            biases = [maybe(f"{p}.self_attn.{n}_proj.bias") for n in "qkv"]
            self.layers.append(_Layer(
                input_norm=take(f"{p}.input_layernorm.weight"),
                qkv=Linear(torch.cat([take(f"{p}.self_attn.{n}_proj.weight") for n in "qkv"]),
                           torch.cat(biases) if all(b is not None for b in biases) else None,
                           batch_invariant=invariant),
                q_norm=maybe(f"{p}.self_attn.q_norm.weight"),
                k_norm=maybe(f"{p}.self_attn.k_norm.weight"),
                o=Linear(take(f"{p}.self_attn.o_proj.weight"), maybe(f"{p}.self_attn.o_proj.bias"),
                         batch_invariant=invariant),
                post_norm=take(f"{p}.post_attention_layernorm.weight"),
                mlp=SwiGLU(take(f"{p}.mlp.gate_proj.weight"), take(f"{p}.mlp.up_proj.weight"),
                           take(f"{p}.mlp.down_proj.weight"), batch_invariant=invariant),
            ))
        if self.device.type == "cpu" and self.dtype != torch.float32:
            log.info("GEMMs run %s", "ttserve's kernel (bf16_gemm.c)" if self.lm_head.kind == "ttserve" else
                     f"{self.lm_head.kind}, not ttserve's kernel: {bf16_gemm.unavailable(self.embed)}")
        if invariant:
            self._check_rows_invariant()

    def _check_rows_invariant(self) -> None:
        """Every distinct GEMM shape of layer 0 and the head, run alone and batched on this
        host's kernels: refuses to serve when a row's bits depend on its batch after all."""
        layer = self.layers[0]
        gemms = [("lm_head", self.lm_head, self.shape.hidden_size), ("qkv", layer.qkv, self.shape.hidden_size),
                 ("o_proj", layer.o, self.shape.num_heads * self.shape.head_dim),
                 ("gate_proj", layer.mlp.gate or layer.mlp.gate_up, self.shape.hidden_size),
                 ("down_proj", layer.mlp.down, self.shape.intermediate_size)]
        for name, gemm, width in gemms:
            if not rows_invariant(gemm, width, self.dtype):
                raise BatchInvarianceError(
                    f"batch invariance: {name} ({gemm.out_features} x {width}, {self.dtype}) gives rows "
                    "other bits in a batch than alone on this host's GEMMs; serve without --batch-invariant")

    # --- contract: cache ---------------------------------------------------------------------

    def allocate_kv_cache(self, kv_cache_shape: tuple[int, ...], dtype: torch.dtype,
                          num_layers: int) -> KVCache:
        """One cache per lane: [lane][layer] -> [K, V], each kv_cache_shape plus one scratch block
        (the last) that static-shape decode steps write their empty rows into. The tensors are
        views of one storage per lane: vLLM CPU's layout when its kernels serve the model
        (cpu_kernels.allocate), else worker/backends/torch/models/paged_kv.py's."""
        blocks, kv_heads, block_size, head_dim = self._check_kv_shape(kv_cache_shape, num_layers)
        self._decode_steps = {}
        why = (f"the KV cache's {dtype} is not the model's {self.dtype}" if dtype != self.dtype else
               f"{type(self).__name__}: {self.no_cpu_kernels_reason}" if not self.allows_cpu_kernels
               else cpu_kernels.unavailable(self.device, dtype, block_size, head_dim, self.shape.sliding_window))
        if why and self.batch_invariant:
            raise BatchInvarianceError(f"batch invariance needs vLLM CPU's attention kernel: {why}")
        if not why:
            self.kernel_isa = cpu_kernels.isa(dtype, block_size, head_dim)
            log.info("attention, norms and RoPE run vLLM CPU's kernels (%s)", self.kernel_isa)
            # Batch invariance keeps every step on vLLM's kernel (cpu_kernels.Attention.plan).
            why_not = ("batch invariance" if self.batch_invariant else decode_attention.unavailable(
                dtype, self.shape.num_heads, kv_heads, head_dim, block_size, self.kernel_isa))
            self.own_decode_attention = not why_not
            log.info("decode attention at 2+ (row, KV head) pairs per thread: %s",
                     f"vLLM's kernel ({why_not})" if why_not else "ttserve's kernel (decode_attention.c)")
            why_not = ("batch invariance" if self.batch_invariant else prefill_attention.unavailable(
                dtype, self.shape.num_heads, kv_heads, head_dim, block_size, self.kernel_isa))
            self.own_prefill_attention = not why_not
            log.info("prefill attention at 2+ work items per thread: %s",
                     f"vLLM's kernel ({why_not})" if why_not else "ttserve's kernel (prefill_attention.c)")
            return cpu_kernels.allocate(self.lanes, num_layers, blocks + 1, kv_heads, block_size, head_dim, dtype)
        self.kernel_isa, self.own_decode_attention, self.own_prefill_attention = "", False, False
        if self.device.type == "cpu" and dtype != torch.float32:
            log.info("attention, norms and RoPE run plain torch: %s", why)
        return paged_kv.allocate(self.lanes, num_layers, blocks + 1, kv_heads, block_size, head_dim,
                                 dtype, self.device)

    def allocate_kv_cache_per_layer(self, per_layer_specs: Sequence[LayerSpec]) -> KVCache:
        """The hybrid allocation: `per_layer_specs` holds (shape, dtype, tensor_idx) per decoder
        layer, in layer order (vllm-tt-plugin model_runner.py `_build_per_layer_specs`); layers
        with one tensor_idx share one K/V buffer and index disjoint blocks of it through their
        groups' page tables (tt-metal generator_vllm.py `allocate_vllm_kv_cache_per_layer`).

        Returns allocate_kv_cache's structure, kv_cache[lane][layer] = [K, V], each shape plus the
        scratch block; layers sharing a buffer get views of the same memory. Every entry must
        have one shape (this model's layers all have its KV heads and head_dim) and one dtype.
        Always paged_kv.py's layout: the vLLM CPU kernels' path does not take per-layer tables.
        """
        specs = list(per_layer_specs)
        if len(specs) != self.shape.num_layers:
            raise ValueError(f"per_layer_specs has {len(specs)} entries; the model has "
                             f"{self.shape.num_layers} layers (one entry per layer, in layer order)")
        shapes = {tuple(int(d) for d in shape) for shape, _, _ in specs}
        dtypes = {dtype for _, dtype, _ in specs}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(f"per_layer_specs must give every layer one shape and dtype, got shapes "
                             f"{sorted(shapes)} and dtypes {sorted(map(str, dtypes))}")
        (shape,), (dtype,) = shapes, dtypes
        blocks, kv_heads, block_size, head_dim = self._check_kv_shape(shape, len(specs))
        # Dense storage indices: the plugin numbers its buffers 0..n-1, tt-metal only keys by them.
        dense = {t: i for i, t in enumerate(sorted({int(t) for _, _, t in specs}))}
        if self.batch_invariant:
            raise BatchInvarianceError("batch invariance needs vLLM CPU's attention kernel, which takes no "
                                       "per-layer KV buffers (hybrid KV cache groups)")
        self.kernel_isa, self.own_decode_attention, self.own_prefill_attention = "", False, False
        self._decode_steps = {}
        if self.device.type == "cpu" and dtype != torch.float32:
            log.info("attention, norms and RoPE run plain torch: per-layer KV buffers are paged_kv.py's")
        return paged_kv.allocate(self.lanes, len(specs), blocks + 1, kv_heads, block_size, head_dim, dtype,
                                 self.device, tensor_of_layer=[dense[int(t)] for _, _, t in specs])

    def _check_kv_shape(self, kv_cache_shape: Sequence[int], num_layers: int) -> tuple[int, int, int, int]:
        blocks, kv_heads, block_size, head_dim = kv_cache_shape
        if (kv_heads, head_dim) != (self.shape.num_kv_heads, self.shape.head_dim):
            raise ValueError(f"kv_cache_shape {tuple(kv_cache_shape)} does not fit the model: "
                             f"num_kv_heads={self.shape.num_kv_heads}, head_dim={self.shape.head_dim}")
        if num_layers != self.shape.num_layers:
            raise ValueError(f"num_layers={num_layers}, the model has {self.shape.num_layers}")
        return blocks, kv_heads, block_size, head_dim

    # --- contract: forward passes ------------------------------------------------------------

    @torch.inference_mode()
    def prefill_forward(self, tokens: torch.Tensor, page_table: torch.Tensor, kv_cache: KVCache,
                        prompt_lens: Sequence[int] | torch.Tensor,
                        start_pos: Sequence[int] | torch.Tensor | None = None,
                        enable_trace: bool = False, sampling_params: SamplingBatch | None = None,
                        empty_slots: Sequence[int] | None = None,
                        page_tables_per_layer: Sequence[torch.Tensor] | None = None, **_: Any) -> torch.Tensor:
        """Computes tokens[i, start_pos[i]:prompt_lens[i]] of each prefill user i.

        Writes the chunk's K/V into the paged cache and attends over [0, prompt_lens[i]).
        Returns logits of each row's last token [B, 1, vocab] float32, or, with sampling_params,
        the sampled tokens [B] int64. With page_tables_per_layer (hybrid KV cache groups: one
        table per decoder layer, page_table's row layout), layer i pages through its own table
        and page_table is not read. Further keyword arguments of tt-metal's generator
        (model_id_warmup, warmup_prefill, ...) carry nothing here and are accepted and ignored.
        """
        del enable_trace  # eager torch: every shape runs as it comes
        chunk_tokens, start, end, lanes = self._prefill_inputs(tokens, prompt_lens, start_pos, empty_slots)
        logits = self._run(chunk_tokens, start, end, page_table, lanes, kv_cache,
                           layer_tables=self._layer_tables(page_tables_per_layer))
        if sampling_params is not None:
            return sample(logits, sampling_params)
        return logits.unsqueeze(1)

    def _layer_tables(self, page_tables_per_layer: Sequence[torch.Tensor] | None
                      ) -> list[torch.Tensor] | None:
        """page_tables_per_layer checked: one table per decoder layer, or None."""
        if page_tables_per_layer is None:
            return None
        tables = list(page_tables_per_layer)
        if len(tables) != self.shape.num_layers:
            raise ValueError(f"page_tables_per_layer has {len(tables)} tables; the model has "
                             f"{self.shape.num_layers} layers")
        return tables

    def _prefill_inputs(self, tokens: torch.Tensor, prompt_lens: Sequence[int] | torch.Tensor,
                        start_pos: Sequence[int] | torch.Tensor | None, empty_slots: Sequence[int] | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """A prefill call's arguments checked: the chunks' tokens [B, S], their start and end
        positions [B] and each row's lane."""
        batch = tokens.shape[0]
        end = _long(prompt_lens, batch)
        start = torch.zeros(batch, dtype=torch.long) if start_pos is None else _long(start_pos, batch)
        slots = list(range(batch)) if empty_slots is None else [int(s) for s in empty_slots]
        if len(slots) != batch:
            raise ValueError(f"empty_slots has {len(slots)} rows, tokens has {batch}")
        if bool((start < 0).any()) or bool((end < start).any()):
            raise ValueError(f"need 0 <= start_pos <= prompt_lens, got {start.tolist()} and "
                             f"{end.tolist()}")
        if int(end.max()) > tokens.shape[1]:
            raise ValueError(
                f"prompt_lens reach {int(end.max())} but tokens has {tokens.shape[1]} columns: "
                "row i must hold the request's tokens from position 0 (the chunk is "
                "tokens[i, start_pos[i]:prompt_lens[i]])")
        chunk = max(int((end - start).max()), 1)
        cols = (start[:, None] + torch.arange(chunk)).clamp(max=tokens.shape[1] - 1)
        return tokens.cpu().long().gather(1, cols), start, end, [s // self.max_batch_size for s in slots]

    @torch.inference_mode()
    def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor,
                       page_table: torch.Tensor, kv_cache: KVCache, enable_trace: bool = False,
                       read_from_device: bool = True, sampling_params: SamplingBatch | None = None,
                       page_tables_per_layer: Sequence[torch.Tensor] | None = None, **_: Any) -> torch.Tensor:
        """One token per row at position start_pos[r] (-1: empty row, no KV written).

        Row r uses kv_cache[r // max_batch_size]. Returns logits [R, 1, vocab] float32 or, with
        sampling_params, tokens [R] int64; on the model's device unless read_from_device.
        page_tables_per_layer: as prefill_forward's (each table's rows are page_table's rows).
        tt-metal's extra keywords (reset_batch, prompt_tokens, ...) are accepted and ignored.
        """
        rows = tokens.shape[0]
        if rows > self.lanes * self.max_batch_size:
            raise ValueError(f"decode batch has {rows} rows; the model has {self.lanes} lanes of "
                             f"{self.max_batch_size}")
        static = enable_trace and rows == self.lanes * self.max_batch_size
        fast = None if static or page_tables_per_layer is not None else self._fused_batch_decode(
            tokens, start_pos, page_table, kv_cache)
        if fast is not None:
            return self._decode_output(rows, *fast, sampling_params, read_from_device)
        pos = _long(start_pos, rows)
        live = (pos >= 0).nonzero().flatten()
        layer_tables = self._layer_tables(page_tables_per_layer)
        if static:
            logits = self._static_decode(tokens, pos, page_table, kv_cache, layer_tables)[live.to(self.device)]
        else:
            # Only active rows are computed: on a CPU every empty row would be a full forward
            # pass of wasted arithmetic.
            start = pos[live]

            def live_rows(table: torch.Tensor) -> torch.Tensor:
                return table.cpu()[live]

            if layer_tables is not None:
                layer_tables = _each_distinct(layer_tables, live_rows)
            logits = self._run(tokens.cpu().long().reshape(rows, 1)[live], start, start + 1,
                               live_rows(page_table), [int(r) // self.max_batch_size for r in live],
                               kv_cache, rope_offset=self._decode_rope_offset(live), layer_tables=layer_tables)
        return self._decode_output(rows, live, logits, sampling_params, read_from_device)

    def _decode_output(self, rows: int, live: torch.Tensor, logits: torch.Tensor,
                       sampling_params: SamplingBatch | None, read_from_device: bool) -> torch.Tensor:
        """decode_forward's result from the live rows' logits [len(live), vocab]."""
        live_dev = live.to(logits.device)
        if sampling_params is not None:
            out = torch.zeros(rows, dtype=torch.int64, device=logits.device)
            out[live_dev] = sample(logits, sampling_params.select(live.tolist()))
        elif logits.shape[0] == rows:
            out = logits.unsqueeze(1)  # every row live, in order
        else:
            # Empty rows' logits are garbage by contract: not zeroed (a [rows, vocab] fill per step).
            out = logits.new_empty(rows, 1, logits.shape[-1])
            out[live_dev, 0] = logits
        return self.read_decode_output(out) if read_from_device else out

    def _fused_batch_decode(self, tokens: torch.Tensor, start_pos: torch.Tensor | Sequence[int],
                            page_table: torch.Tensor, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(live rows, their logits) of the decode batch through decode_step.c, its paging made in
        one C call (decode_step.live_paging), when decode_step.c serves the whole step: the kernels'
        cache, every row in lane 0, positions as sequence positions (no RoPE offset), and a (row,
        KV head) pair for every thread. None: the general path (_run), which also says what is
        wrong with a refused batch."""
        if (not self.kernel_isa or not isinstance(start_pos, torch.Tensor) or start_pos.dim() != 1
                or start_pos.shape[0] > self.max_batch_size
                or type(self)._decode_rope_offset is not TorchLlamaForCausalLM._decode_rope_offset
                or not _kernel_layout(kv_cache)):
            return None
        fused = self._lane_decode_step(0, kv_cache)
        if fused is None:
            return None
        cache_blocks, _, block_size, _ = kv_cache[0][0][0].shape
        paging = decode_step.live_paging(tokens, start_pos, page_table, block_size, cache_blocks, self.max_seq_len)
        if paging is None or paging.rows.shape[0] * self.shape.num_kv_heads < torch.get_num_threads():
            return None
        return paging.rows, self._fused_forward(fused, paging.tokens, paging.positions, paging.slots,
                                                paging.block_table, paging.seq_lens)

    def _fused_forward(self, fused: DecodeStep, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor,
                       last: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of a decode-shaped step (one token a row) through decode_step.c: the
        embedding and first norm, the layers in one call, the LM head over rows `last` (all)."""
        residual = F.embedding(tokens, self.embed)
        h = cpu_kernels.rms_norm(residual, self.layers[0].input_norm, self.shape.rms_norm_eps)
        fused(h, residual, positions, slots, block_table, seq_lens)
        return self.lm_head(h if last is None else h[last]).float()

    @torch.inference_mode()
    def verify_forward(self, tokens: torch.Tensor, start_pos: Sequence[int] | torch.Tensor,
                       page_table: torch.Tensor, kv_cache: KVCache, num_tokens: Sequence[int] | torch.Tensor,
                       page_tables_per_layer: Sequence[torch.Tensor] | None = None,
                       empty_slots: Sequence[int] | None = None, **_: Any) -> torch.Tensor:
        """Speculative decoding's verify step: row i computes tokens[i, :num_tokens[i]] at
        positions start_pos[i] .. start_pos[i] + num_tokens[i] - 1 (a decode row's fed token, then
        its draft tokens), writing their K/V into the paged cache, in one forward.

        Returns float32 logits [B, S, vocab] of every position, on the model's device: [i, j] is
        the distribution after row i's j-th token (padding positions past num_tokens[i]: garbage).
        Row i is batch row empty_slots[i] (default i), whose lane is row // max_batch_size and,
        for mRoPE models, whose rope delta applies, as in decode_forward; page_table (and each of
        page_tables_per_layer) holds the B rows in the same order. KV a caller later rejects (its
        drafts) stays in the cache and is overwritten when those positions are computed again.
        """
        batch, width = tokens.shape
        start = _long(start_pos, batch)
        count = _long(num_tokens, batch)
        slots = list(range(batch)) if empty_slots is None else [int(s) for s in empty_slots]
        if len(slots) != batch:
            raise ValueError(f"empty_slots has {len(slots)} rows, tokens has {batch}")
        if batch and (bool((start < 0).any()) or bool((count < 1).any()) or int(count.max()) > width):
            raise ValueError(f"need start_pos >= 0 and 1 <= num_tokens <= {width} (tokens' columns), got "
                             f"{start.tolist()} and {count.tolist()}")
        return self._run(tokens.cpu().long(), start, start + count, page_table,
                         [s // self.max_batch_size for s in slots], kv_cache,
                         rope_offset=self._decode_rope_offset(torch.tensor(slots, dtype=torch.long)),
                         layer_tables=self._layer_tables(page_tables_per_layer), every=True)

    def read_decode_output(self, out: torch.Tensor, async_read: bool = False
                           ) -> torch.Tensor | tuple[torch.Tensor, list]:
        """Brings a decode result to the host. An asynchronous read from CUDA comes with the
        event that marks the copy done (the caller synchronizes on it before reading); on a CPU
        there is nothing to wait for."""
        host = out.to("cpu", non_blocking=async_read)
        if not async_read:
            return host
        if out.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
            return host, [copied]
        return host, []

    def process_decode_output_host(self, out: torch.Tensor, is_tokens: bool = False) -> torch.Tensor:
        return out.reshape(-1) if is_tokens else out

    def warmup_model_prefill(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to compile or capture: eager torch runs each shape as it comes."""

    @torch.inference_mode()
    def warmup_model_decode(self, kv_cache: KVCache | None = None, enable_trace: bool = False,
                            **_: Any) -> None:
        """With enable_trace on CUDA, captures the static decode as a CUDA graph (page tables as
        wide as max_seq_len needs); eager torch has nothing else to compile."""
        if not enable_trace or self.device.type != "cuda" or kv_cache is None:
            return
        block_size = kv_cache[0][0][0].shape[2]
        self._decode_graph = DecodeGraph(
            lambda tokens, pos, table: self._forward(self._static_step(tokens, pos, table, kv_cache), kv_cache),
            self.lanes * self.max_batch_size, -(-self.max_seq_len // block_size), self.device)

    # --- internals ---------------------------------------------------------------------------

    def _static_decode(self, tokens: torch.Tensor, pos: torch.Tensor, page_table: torch.Tensor,
                       kv_cache: KVCache, layer_tables: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [R, vocab] of every row through the static shapes: the captured graph when it
        fits these inputs, else the same computation eagerly."""
        graph = self._decode_graph
        # The graph was captured reading one page table; per-layer tables run the same static
        # step eagerly (a graph per table layout is not worth it for a reference model).
        if graph is not None and layer_tables is None and graph.fits(tokens, page_table):
            return graph.replay(tokens, pos, page_table.long())
        dev = self.device
        rows, width = page_table.shape
        if layer_tables is not None:
            if any(t.shape[0] < rows or t.shape[1] != width for t in layer_tables):
                raise ValueError(f"the static decode needs every per-layer page table as wide as "
                                 f"page_table ({width}) with its {rows} rows; got "
                                 f"{sorted({tuple(t.shape) for t in layer_tables})}")
            layer_tables = _each_distinct(layer_tables, lambda t: t[:rows].to(dev).long())
        step = self._static_step(tokens.to(dev).long().reshape(-1, 1), pos.to(dev),
                                 page_table.to(dev).long(), kv_cache, layer_tables)
        return self._forward(step, kv_cache)

    def _static_step(self, tokens: torch.Tensor, pos: torch.Tensor, page_table: torch.Tensor,
                     kv_cache: KVCache, layer_tables: list[torch.Tensor] | None = None) -> _Step:
        """The decode plan with shapes fixed by the batch ([R, 1]) and the page table ([R, W]):
        torch operations on the model's device only, nothing read back (capturable).
        `layer_tables` (one [R, W] table per layer, on the device) replace page_table layer by layer.

        Every row attends over all W blocks, masked to its own positions. An empty row
        (position -1) computes at position 0, attends to key 0 alone and writes into the
        scratch block; its output is never used.
        """
        rows, width = page_table.shape
        cache_blocks, _, block_size, _ = kv_cache[0][0][0].shape
        scratch = cache_blocks - 1
        dev = self.device
        live = pos >= 0
        at = pos.clamp(min=0)
        in_use = torch.arange(width, device=dev)[None, :] <= (at // block_size)[:, None]
        keys = torch.arange(width * block_size, device=dev)
        causal = keys[None, :] <= at[:, None]
        masks = {False: causal}
        if self.shape.sliding_window is not None:
            masks[True] = causal & (keys[None, :] > at[:, None] - self.shape.sliding_window)
        group = self.shape.num_heads // self.shape.num_kv_heads
        masks = {k: _additive(m[:, None, None, :].expand(rows, 1, group, m.shape[-1]), self.dtype)
                 for k, m in masks.items()}
        off = torch.where(live, at % block_size, 0)
        per_lane = self.max_batch_size
        lane_rows = [torch.arange(lane * per_lane, (lane + 1) * per_lane, device=dev)
                     for lane in range(self.lanes)]
        lanes = [(lane, None if self.lanes == 1 else r) for lane, r in enumerate(lane_rows)]

        def paging(page_table: torch.Tensor) -> _Paging:
            # Blocks past a row's position are padding: block 0, masked. Entries before a sliding
            # group's window (0 or stale) stay in [0, scratch) and are masked too.
            table = torch.where(in_use, page_table, 0).clamp(0, scratch - 1)
            blk = torch.where(live, table.gather(1, (at // block_size)[:, None]).squeeze(1), scratch)
            return _Paging(table, {lane: (r, blk[r], off[r]) for lane, r in enumerate(lane_rows)})

        sources = [page_table] * self.shape.num_layers if layer_tables is None else layer_tables
        return _Step(tokens=tokens, positions=at.clamp(max=self.max_seq_len - 1)[:, None],
                     last=torch.zeros(rows, dtype=torch.long, device=dev), masks=masks, lanes=lanes,
                     paging=_each_distinct(sources, paging))

    def _decode_rope_offset(self, rows: torch.Tensor) -> torch.Tensor | None:
        """What decode rows [n] add to their position for RoPE (mRoPE models: the request's rope
        delta); None: nothing."""
        return None

    def _run(self, chunk_tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
             page_table: torch.Tensor, lane_of_row: list[int], kv_cache: KVCache,
             rope_offset: torch.Tensor | None = None, layer_tables: list[torch.Tensor] | None = None,
             every: bool = False) -> torch.Tensor:
        """Float32 logits [B, vocab] of each row's last token of chunk_tokens [B, S], or with
        `every` [B, S, vocab] of each position (row i computes positions start[i]..end[i], rotated
        `rope_offset` further; layer i paging through layer_tables[i] when given), on the
        kernels' path when the cache is theirs (never with a rope offset: mRoPE models run plain
        torch; never with per-layer tables: allocate_kv_cache_per_layer never makes their cache)."""
        if self.kernel_isa and _kernel_layout(kv_cache):
            assert rope_offset is None, "the CPU kernels' path rotates at sequence positions"
            if layer_tables is not None:
                raise ValueError("page_tables_per_layer needs a cache from allocate_kv_cache_per_layer; "
                                 "this one is the vLLM CPU kernels' (allocate_kv_cache)")
            return self._forward_packed(self._pack(chunk_tokens, start, end, page_table, lane_of_row,
                                                   kv_cache, every), kv_cache)
        return self._forward(self._plan(chunk_tokens, start, end, page_table, lane_of_row, kv_cache,
                                        rope_offset, layer_tables, every), kv_cache)

    def _pack(self, chunk_tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
              page_table: torch.Tensor, lane_of_row: list[int], kv_cache: KVCache,
              every: bool = False) -> _Packed:
        """The packed plan: row i's real tokens chunk_tokens[i, :end[i] - start[i]], rows in
        lane order (each lane's tokens one contiguous range), with each token's cache slot; the
        logits of each row's last token, or with `every` of each of its positions."""
        batch = chunk_tokens.shape[0]
        if batch and int(end.max()) > self.max_seq_len:
            raise ValueError(f"position {int(end.max()) - 1} is beyond max_seq_len={self.max_seq_len}")
        if max(lane_of_row, default=0) >= self.lanes:
            raise ValueError(f"a row maps to lane {max(lane_of_row)}; the model has {self.lanes}")
        pt = page_table.cpu().long()[:batch]
        lens = (end - start).clamp(min=0)
        if batch and not every and len(set(lane_of_row)) == 1 and bool((lens == 1).all()):
            return self._pack_one_token_rows(chunk_tokens, start, end, pt, lane_of_row[0], kv_cache)
        return self._pack_chunks(chunk_tokens, start, end, pt, lens, lane_of_row, kv_cache, every)

    def _pack_one_token_rows(self, chunk_tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                             pt: torch.Tensor, lane: int, kv_cache: KVCache) -> _Packed:
        """_pack_chunks's plan for a decode-shaped step (one token a row, one lane), where its
        sorts, scans and gathers are the identity: the same plan in a few ops (its ~20 small torch
        calls took ~0.3 ms of a ~10 ms one-row decode step on a CPU)."""
        batch = chunk_tokens.shape[0]
        cache_blocks, _, block_size, _ = kv_cache[0][0][0].shape
        s = self.shape
        rows = torch.arange(batch)
        positions = start.long()
        table = _block_table(pt, end, block_size, cache_blocks)  # first: it says which row's table is short
        slots = pt[rows, positions // block_size] * block_size + positions % block_size
        return _Packed(chunk_tokens[:, 0], positions, rows, [(lane, cpu_kernels.Attention.plan(
            0, batch, slots, torch.ones(batch, dtype=torch.long), end, table, s.num_heads, s.num_kv_heads,
            s.head_dim, block_size, self.dtype, self.kernel_isa, kv_split=not self.batch_invariant,
            own_decode=self.own_decode_attention))])

    def _pack_chunks(self, chunk_tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor, pt: torch.Tensor,
                     lens: torch.Tensor, lane_of_row: list[int], kv_cache: KVCache, every: bool) -> _Packed:
        """_pack's plan for any step: pt the page table's rows as int64, lens each row's tokens."""
        batch, width = chunk_tokens.shape
        cache_blocks, _, block_size, _ = kv_cache[0][0][0].shape
        s = self.shape
        lane_rows = torch.tensor(lane_of_row, dtype=torch.long)
        order = torch.argsort(lane_rows, stable=True) if self.lanes > 1 else torch.arange(batch)
        lens_o = lens[order]
        first = torch.cumsum(lens_o, 0) - lens_o  # each ordered row's first token in T
        row_of = torch.repeat_interleave(order, lens_o)
        within = torch.arange(int(lens_o.sum())) - torch.repeat_interleave(first, lens_o)
        positions = start[row_of] + within
        last_o = (first + lens_o - 1).clamp(min=0)
        if every:  # position j of each row; past its length, its last token again (inside T)
            within_row = torch.minimum(torch.arange(width)[None, :], (lens_o - 1).clamp(min=0)[:, None])
            last_o = (first[:, None] + within_row).clamp(max=max(int(lens_o.sum()) - 1, 0))
        last = torch.empty_like(last_o)
        last[order] = last_o
        lanes = []
        lane_o = lane_rows[order]
        for lane in sorted(set(lane_of_row)):
            mine = (lane_o == lane).nonzero().flatten()
            rows = order[mine]
            lo, hi = int(first[mine[0]]), int(first[mine[-1]] + lens_o[mine[-1]])
            table = _block_table(pt[rows], end[rows], block_size, cache_blocks)
            pos = positions[lo:hi]
            slots = pt[row_of[lo:hi], pos // block_size] * block_size + pos % block_size
            lanes.append((lane, cpu_kernels.Attention.plan(
                lo, hi, slots, lens[rows], end[rows], table, s.num_heads, s.num_kv_heads, s.head_dim,
                block_size, self.dtype, self.kernel_isa, kv_split=not self.batch_invariant,
                own_decode=self.own_decode_attention, own_prefill=self.own_prefill_attention)))
        return _Packed(chunk_tokens[row_of, within], positions, last, lanes)

    def _forward_packed(self, step: _Packed, kv_cache: KVCache) -> torch.Tensor:
        """The kernels' forward: a residual stream, each RMSNorm fused with the add before it."""
        fused = self._decode_step(step, kv_cache)
        if fused is not None:
            ((_, attention),) = step.lanes
            return self._fused_forward(fused, step.tokens, step.positions, attention.slots, attention.block_table,
                                       attention.seq_lens, step.last)
        eps = self.shape.rms_norm_eps
        residual = F.embedding(step.tokens, self.embed)
        h = cpu_kernels.rms_norm(residual, self.layers[0].input_norm, eps)
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        # Once the last layer's attention has cached its K and V, only the rows the LM head reads
        # matter: the rest of that layer (a 128-token prompt's: ~2.8% of its prefill) is skipped.
        final = len(self.layers) - 1 if step.last.dim() == 1 and len(step.last) < len(step.tokens) else -1
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            a = self._attention_packed(layer, h, step, kv_cache, i, step.last if i == final else None)
            if i == final:
                residual = residual[step.last]
            cpu_kernels.add_rms_norm(a, residual, layer.post_norm, eps)
            h = layer.mlp(a)
            cpu_kernels.add_rms_norm(h, residual, next_norm, eps)
        return self.lm_head(h if final >= 0 else h[step.last]).float()

    def _decode_step(self, step: _Packed, kv_cache: KVCache) -> DecodeStep | None:
        """decode_step.c for this step when it is a decode-shaped step (exactly one token a row:
        a decode, a one-token prefill chunk or a verify step without drafts) of one lane with a
        (row, KV head) pair for every thread (its attention is ttserve's kernel, which gives
        each pair one thread), and the layers and cache allow it (decided once per lane's cache,
        the refusal logged)."""
        if len(step.lanes) != 1:
            return None
        lane, attention = step.lanes[0]
        rows = len(attention.seq_lens)
        starts = attention.query_start_loc
        if (attention.stop - attention.start != rows or rows * self.shape.num_kv_heads < torch.get_num_threads()
                or not torch.equal(starts, torch.arange(rows + 1, dtype=starts.dtype))):
            return None
        return self._lane_decode_step(lane, kv_cache)

    def _lane_decode_step(self, lane: int, kv_cache: KVCache) -> DecodeStep | None:
        """decode_step.c over this lane's cache, built (or refused, the reason logged) once."""
        caches = kv_cache[lane]
        key = caches[0][0].data_ptr()
        if key not in self._decode_steps:
            s = self.shape
            built = DecodeStep.build(self.layers, [tuple(c) for c in caches], self.final_norm, self._cos_sin,
                                     s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, s.sliding_window,
                                     self.own_decode_attention)
            log.info("decode steps' layers: %s", "one call (decode_step.c)" if isinstance(built, DecodeStep)
                     else f"operator by operator ({built})")
            self._decode_steps[key] = built
        built = self._decode_steps[key]
        return built if isinstance(built, DecodeStep) else None

    def _attention_packed(self, layer: _Layer, h: torch.Tensor, step: _Packed, kv_cache: KVCache,
                          index: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's attention output (after o) for every token, or for the tokens at `rows`
        (every token's K and V are cached either way)."""
        s = self.shape
        tokens = h.shape[0]
        q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = layer.qkv(h)
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        if layer.q_norm is not None:
            q = _rms_norm(q.reshape(tokens, s.num_heads, s.head_dim), layer.q_norm, s.rms_norm_eps).flatten(1)
            k = _rms_norm(k.reshape(tokens, s.num_kv_heads, s.head_dim), layer.k_norm, s.rms_norm_eps).flatten(1)
        cpu_kernels.rope(step.positions, q, k, s.head_dim, self._cos_sin)
        out = torch.empty(tokens, s.num_heads, s.head_dim, dtype=h.dtype, device=h.device)
        for lane, attention in step.lanes:
            t = slice(attention.start, attention.stop)
            attention(q[t].view(-1, s.num_heads, s.head_dim), k[t].view(-1, s.num_kv_heads, s.head_dim),
                      v[t].view(-1, s.num_kv_heads, s.head_dim), *kv_cache[lane][index], out[t])
        out = out.view(tokens, q_width)
        return layer.o(out if rows is None else out[rows])


    def _plan(self, chunk_tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
              page_table: torch.Tensor, lane_of_row: list[int], kv_cache: KVCache,
              rope_offset: torch.Tensor | None = None, layer_tables: list[torch.Tensor] | None = None,
              every: bool = False) -> _Step:
        """Builds the index plan: rows [B] compute chunk_tokens [B, S] at positions start..end
        (rotated at those positions plus `rope_offset` [B], when given), every layer paging
        through page_table, or layer i through layer_tables[i] (rows as page_table's); the
        forward returns each row's last token's logits, or with `every` each position's."""
        batch, width = chunk_tokens.shape
        cache_blocks, _, block_size, _ = kv_cache[0][0][0].shape
        if batch and int(end.max()) > self.max_seq_len:
            raise ValueError(f"position {int(end.max()) - 1} is beyond max_seq_len={self.max_seq_len}")
        if max(lane_of_row, default=0) >= self.lanes:
            raise ValueError(f"a row maps to lane {max(lane_of_row)}; the model has {self.lanes}")
        offsets = torch.arange(width)
        positions = start[:, None] + offsets
        valid = positions < end[:, None]  # real tokens: they write KV and are real queries

        # Every table is as wide as the longest row needs: one key range, one set of masks.
        num_blocks = max(int(((end + block_size - 1) // block_size).max()) if batch else 0, 1)

        # Invalid queries (padding, empty rows) attend to key 0 alone: their output is unused
        # and this keeps softmax away from an all-masked row (NaN).
        q_pos = torch.where(valid, positions, 0)
        keys = torch.arange(num_blocks * block_size)
        causal = keys[None, None, :] <= q_pos[:, :, None]
        masks = {False: causal}
        if self.shape.sliding_window is not None:
            window = keys[None, None, :] > q_pos[:, :, None] - self.shape.sliding_window
            masks[True] = causal & window
        group = self.shape.num_heads // self.shape.num_kv_heads
        masks = {k: m[:, None].expand(batch, group, width, m.shape[-1])
                 .reshape(batch, 1, group * width, m.shape[-1]) for k, m in masks.items()}

        flat = torch.arange(batch * width).reshape(batch, width)
        block_of = positions.clamp(max=num_blocks * block_size - 1) // block_size
        off = positions % block_size
        lanes: list[tuple[int, torch.Tensor | None]] = []
        mine = {}
        lane_rows = torch.tensor(lane_of_row, dtype=torch.long)
        for lane in sorted(set(lane_of_row)):
            rows = (lane_rows == lane).nonzero().flatten()
            lanes.append((lane, None if len(rows) == batch else rows.to(self.device)))
            mine[lane] = valid & (lane_rows == lane)[:, None]
        dev = self.device

        def paging(page_table: torch.Tensor) -> _Paging:
            table = _block_table(page_table, end, block_size, cache_blocks)
            blk = table.gather(1, block_of)
            return _Paging(table.to(dev), {lane: tuple(t[m].to(dev) for t in (flat, blk, off))
                                           for lane, m in mine.items()})

        sources = [page_table] * self.shape.num_layers if layer_tables is None else layer_tables
        return _Step(
            tokens=chunk_tokens.to(dev),
            positions=(positions if rope_offset is None else positions + rope_offset.cpu().long()[:, None])
            .clamp(0, self.max_seq_len - 1).to(dev),
            last=(offsets.expand(batch, width) if every else (end - start - 1).clamp(min=0)).to(dev),
            masks={k: _additive(v.to(dev), self.dtype) for k, v in masks.items()},
            lanes=lanes,
            paging=_each_distinct(sources, paging),
        )

    def _forward(self, step: _Step, kv_cache: KVCache) -> torch.Tensor:
        """Runs every layer; returns float32 logits [B, vocab] of each row's last real token
        (or [B, S, vocab] of each position: _Step.last)."""
        eps = self.shape.rms_norm_eps
        x = F.embedding(step.tokens, self.embed) if step.embeds is None else step.embeds
        cos, sin = self._rope(step)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, _rms_norm(x, layer.input_norm, eps), cos, sin, step, kv_cache, i)
            x = x + layer.mlp(_rms_norm(x, layer.post_norm, eps))
        return self.lm_head(_rms_norm(_at(x, step.last), self.final_norm, eps)).float()

    def _rope(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, S, 1, head_dim] of the step's positions (sin sign-folded, see __init__)."""
        return self._cos[step.positions].unsqueeze(2), self._sin[step.positions].unsqueeze(2)

    def _attention(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   step: _Step, kv_cache: KVCache, index: int) -> torch.Tensor:
        s = self.shape
        batch, width, _ = h.shape
        heads = s.num_heads + s.num_kv_heads
        qkv = layer.qkv(h)
        qk = qkv[..., :heads * s.head_dim].view(batch, width, heads, s.head_dim)
        v = qkv[..., heads * s.head_dim:].view(batch, width, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q, k = qk.split([s.num_heads, s.num_kv_heads], dim=2)
            qk = torch.cat([_rms_norm(q, layer.q_norm, s.rms_norm_eps),
                            _rms_norm(k, layer.k_norm, s.rms_norm_eps)], dim=2)
        # RoPE on q and k heads at once (sin carries rotate_half's sign, see __init__).
        qk = torch.addcmul(qk * cos, qk.roll(s.head_dim // 2, dims=-1), sin)
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=2)

        mask = step.masks[s.sliding_layers[index]]
        group = s.num_heads // s.num_kv_heads
        # GQA without copying K/V: the `group` query heads of one KV head become extra query rows.
        q = q.reshape(batch, width, s.num_kv_heads, group, s.head_dim).permute(0, 2, 3, 1, 4)
        k_flat = k.reshape(batch * width, s.num_kv_heads, s.head_dim)
        v_flat = v.reshape(batch * width, s.num_kv_heads, s.head_dim)
        out = None if len(step.lanes) == 1 else torch.empty_like(q)
        paging = step.paging[index]
        for lane, rows in step.lanes:
            flat, blk, off = paging.writes[lane]
            # Write first, then read: the chunk attends to its own keys through the cache.
            keys, values = paged_kv.write_then_gather(
                *kv_cache[lane][index], blk, off, k_flat[flat], v_flat[flat],
                paging.block_table if rows is None else paging.block_table[rows])
            q_l = q if rows is None else q[rows]
            m = mask if rows is None else mask[rows]
            n = q_l.shape[0]
            o = F.scaled_dot_product_attention(
                q_l.reshape(n, s.num_kv_heads, group * width, s.head_dim), keys.to(q.dtype),
                values.to(q.dtype), attn_mask=m)
            o = o.view(n, s.num_kv_heads, group, width, s.head_dim)
            if out is None:
                out = o
            else:
                out[rows] = o
        out = out.permute(0, 3, 1, 2, 4).reshape(batch, width, s.num_heads * s.head_dim)
        return layer.o(out)


def _at(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The hidden states x [B, S, H] at _Step.last: [B] -> [B, H]; [B, S'] -> [B, S', H]."""
    rows = torch.arange(x.shape[0], device=x.device)
    return x[rows, last] if last.dim() == 1 else x[rows[:, None], last]


def _each_distinct(tables: Sequence[torch.Tensor], build: Callable[[torch.Tensor], Built]) -> list[Built]:
    """build(table) for each table, computed once per distinct tensor object: the layers of one
    KV cache group (one table object in page_tables_per_layer) share the result."""
    built: dict[int, Built] = {}
    for table in tables:
        if id(table) not in built:  # ids are unique: every table is alive in `tables`
            built[id(table)] = build(table)
    return [built[id(table)] for table in tables]


def _block_table(page_table: torch.Tensor, end: torch.Tensor, block_size: int,
                 cache_blocks: int) -> torch.Tensor:
    """The [B, nb] block ids covering each row's [0, end); nb fits the longest row.

    Entries past a row's own blocks may be padding (-1, 0, anything): they become block 0,
    which the attention mask hides. Entries of a sliding-window group before its window (0 or
    stale ids: blocks the control plane freed) must still be in range; they are read only
    under the sliding mask.
    """
    batch = end.shape[0]
    pt = page_table.cpu().long()[:batch]
    needed = (end + block_size - 1) // block_size
    num_blocks = max(int(needed.max()) if batch else 0, 1)
    if num_blocks > pt.shape[1]:
        raise ValueError(f"page_table has {pt.shape[1]} blocks per row; position "
                         f"{int(end.max()) - 1} needs {num_blocks}")
    table = pt[:, :num_blocks]
    in_use = torch.arange(num_blocks)[None, :] < needed[:, None]
    used = table[in_use]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache_blocks):
        raise ValueError(f"page_table holds block ids outside [0, {cache_blocks}) inside a row's "
                         "sequence")
    return torch.where(in_use, table, 0)


def contract_config(hf_config: Any, max_batch_size: int, max_seq_len: int, tt_data_parallel: int) -> dict:
    """initialize_vllm_model's shared checks: config.json as a dict, and positive sizes."""
    if max_batch_size < 1 or tt_data_parallel < 1 or max_seq_len < 1:
        raise ValueError(f"max_batch_size={max_batch_size}, tt_data_parallel="
                         f"{tt_data_parallel} and max_seq_len={max_seq_len} must be positive")
    return hf_config if isinstance(hf_config, dict) else hf_config.to_dict()


def _kernel_layout(kv_cache: KVCache) -> bool:
    """Whether the cache is cpu_kernels.allocate's: K and V the halves of one block's rows."""
    k, v = kv_cache[0][0]
    block_size, head_dim = k.shape[2], k.shape[3]
    return (k.stride(1) == 2 * block_size * head_dim and k.stride(2) == head_dim
            and v.data_ptr() - k.data_ptr() == block_size * head_dim * k.element_size())


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 (torch upcasts a 16-bit input inside rms_norm), as transformers'
    # LlamaRMSNorm; the weight is applied before the one rounding to x's dtype, where
    # transformers rounds, then multiplies: equal in float32, within bf16 rounding otherwise.
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def _long(values: Sequence[int] | torch.Tensor, rows: int) -> torch.Tensor:
    t = values.detach().cpu().long().reshape(-1) if isinstance(values, torch.Tensor) \
        else torch.tensor([int(v) for v in values], dtype=torch.long)
    if t.numel() < rows:
        raise ValueError(f"expected {rows} values, got {t.numel()}")
    return t[:rows]


class TorchQwen2ForCausalLM(TorchLlamaForCausalLM):
    """Qwen2: Llama with q/k/v projection biases."""

    required_extras = ("q_proj.bias", "k_proj.bias", "v_proj.bias")


class TorchQwen3ForCausalLM(TorchLlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before RoPE."""

    required_extras = ("q_norm.weight", "k_norm.weight")


class TorchMistralForCausalLM(TorchLlamaForCausalLM):
    """Mistral: Llama with an optional sliding attention window (from config)."""
