"""Mirrors tt-metal models/demos/deepseek_v3/tt/generator_vllm.py @ 01656bf7108e0be1924cbc405b321693bd352574
(index id 54556495232), with the KV cache shape of models/demos/deepseek_v3/tt/mla/mla1d.py
@ 0035d040699247da12bc8740d53158aea94fdc3a (`MLA1D.create_state`). What ttserve depends on:
- imports no vLLM (the real module imports ttnn, loguru and tt-metal's own modules only);
- model_capabilities: no prefix caching, device sampling; nothing about async decode;
- get_max_tokens_all_users: max_model_len * max_num_seqs for a "DeepSeek-R1-0528" checkpoint on
  Wormhole, a ValueError for anything else ("DeepSeek-R1-0528 not supported on non-Wormhole devices");
- initialize_vllm_model raises ValueError without DEEPSEEK_V3_HF_MODEL, for tt_data_parallel <= 0 or
  other than the mesh's device count (rows x cols), and for a max_batch_size that tt_data_parallel
  does not divide; the generator then runs (max_batch_size // tt_data_parallel) * mesh cols rows per
  mesh row (`batch_size_per_row`);
- allocate_kv_cache(kv_cache_shape, dtype, num_layers) asserts num_layers == the config's
  num_hidden_layers, aligns its paged config to the shape's block_size and block count, and hands
  the shape to every layer's MLA state (KvCacheConfig), which caches one latent per token:
  (max_num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim) when it builds the shape itself.
  The fake asserts that shape (a K/V-shaped cache would be a wrong-sized MLA cache on the device);
- prefill_forward(**kwargs): asserts every start_pos is 0 (no prefix caching), drops enable_trace,
  and prefills user by user (row i of the page table is user empty_slots[i]), each prompt padded
  to a multiple of the paged block size. With sampling_params it returns the sampled token ids
  [B] (int64); without, host logits [B, S, V] where S is the longest prompt rounded up to the
  block size: each user's logits of every position cut to its prompt_len, then padded by repeating
  its last real row. All prompt_lens 0: zeros [B] or [B, V];
- decode_forward(**kwargs) takes tokens [B, 1] (squeezed), start_pos, page_table, kv_cache,
  enable_trace, read_from_device, sampling_params, reset_batch (sampling is reinitialized only
  with reset_batch); device sampling returns device tokens unless read_from_device (then host token
  ids), host sampling returns host logits [B, 1, V] whatever read_from_device says;
- read_decode_output passes a host tensor through ((tensor, []) with async_read) and turns device
  tokens into host token ids (again with no events).
The base DeepseekGenerator this class extends at 01656bf (models/demos/deepseek_v3/tt/generator.py)
is not in the index: the stored versions (ids 51801428865, 54245576761) predate it (no vllm_context
argument, no _validate_and_initialize_sampling or sample_decode_on_device). The fake's base does
only what generator_vllm.py @01656bf calls on it, with signatures taken from those calls; the
real base also loads and converts weights (into DEEPSEEK_V3_CACHE, else ./generated/deepseek_v3),
loads the tokenizer before any mesh check, and validates max_seq_len, none of which this fake does.
Neither this class nor any stored base defines process_decode_output_host: the plugin calls it
only for a decode output that is not already a host tensor (vllm-tt-plugin e3fc849 async_decode.py
`finalize_decode`), and read_decode_output here always returns host tensors. The fake defines none
either. From that generator.py: warmup_model_prefill(kv_cache, enable_trace, can_sample_on_device,
non_greedy_decoding_on_device) only warns; warmup_model_decode is WarmupForwardMixin's.

The computation is the recording fakes' (tests/fakes/fake_tt_model.py): the token after (token,
position) is `next_token`; host logits put HOST_LOGIT on it; a device-sampled row with a
temperature above 0 adds the seed it was given at the last reset. Calls are recorded on the
`TTNN` of models.tt_transformers.tt.generator (pass it to TtnnBackend).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fakes.fake_tt_model import HOST_LOGIT, FakeDeviceTensor, next_token

from models.common.utility_functions import is_wormhole_b0
from models.tt_transformers.tt.generator import TTNN, SamplingParams

USERS_PER_ROW = 32     # models/demos/deepseek_v3/utils/config_helpers.py
TILE_SIZE = 32         # ttnn.TILE_SIZE: the default paged block size (MLA get_valid_paged_config)
PAD_TOKEN_ID = 0       # the real one pads with its tokenizer's pad_token_id


@dataclass
class PagedAttentionConfig:  # models/tt_transformers/tt/common.py
    block_size: int = TILE_SIZE
    max_num_blocks: int = 0


class DeepseekGenerator:
    """The part of models/demos/deepseek_v3/tt/generator.py's DeepseekGenerator the vLLM class
    relies on: its state after construction, the run configs that allocate_kv_cache prepares,
    the warmups (WarmupForwardMixin's decode warmup; a prefill warmup), and a model that computes
    `next_token` per position."""

    def __init__(self, hf_config: Any = None, mesh_device: Any = None, model_path: Path | None = None,
                 cache_dir: Path | None = None, tokenizer: Any = None, max_seq_len: int | None = None,
                 vllm_context: bool = False, batch_size_per_row: int = USERS_PER_ROW) -> None:
        rows, cols = mesh_device.shape[0], mesh_device.shape[1]
        if batch_size_per_row > USERS_PER_ROW:
            raise ValueError(f"batch_size_per_row {batch_size_per_row} exceeds the supported maximum {USERS_PER_ROW}")
        if batch_size_per_row % cols:
            raise ValueError(f"batch_size_per_row {batch_size_per_row} must be divisible by dp_factor={cols}")
        self.hf_config = hf_config
        self.mesh_device = mesh_device
        self.model_path = model_path
        self.cache_dir = cache_dir
        self.tokenizer = tokenizer
        self.vllm_context = vllm_context
        self.batch_size_per_row = batch_size_per_row
        self.batch_size = batch_size_per_row * rows
        self.paged_config: PagedAttentionConfig | None = PagedAttentionConfig(TILE_SIZE)
        self.model_run_config_prefill: dict | None = None
        self.model_run_config_decode: dict | None = None
        self.kv_cache_shape: tuple | None = None
        self.kv_cache: list | None = None
        self.seeds: list[int | None] | None = None
        self.vocab_size = int(hf_config.vocab_size)

    # ---- what allocate_kv_cache prepares ----
    def _prepare_run_configs(self, mode: str, kv_cache_override: Any = None) -> None:
        shape = kv_cache_override["kv_cache_shape"]
        # MLA1D.create_state: the override's shape is the cache's, as given.
        config = {"kvpe_cache_shape": tuple(shape), "dtype": kv_cache_override["dtype"]}
        if mode == "prefill":
            self.model_run_config_prefill = config
        else:
            self.model_run_config_decode = config

    def get_kv_cache(self) -> list:
        return [("kvpe", layer) for layer in range(int(self.hf_config.num_hidden_layers))]

    def set_kv_cache(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache

    # ---- warmups ----
    def warmup_model_prefill(self, kv_cache: Any, enable_trace: bool, can_sample_on_device: bool,
                             non_greedy_decoding_on_device: bool) -> None:
        """DeepseekGenerator's: it only warns (no prefill warmup, no prefill traces)."""
        TTNN.recorder.add("model.warmup_model_prefill", kv_cache=kv_cache, enable_trace=enable_trace,
                          can_sample_on_device=can_sample_on_device)

    def warmup_model_decode(self, kv_cache: Any, enable_trace: bool, max_batch_size: int, num_blocks: int,
                            can_sample_on_device: bool, non_greedy_decoding_on_device: bool) -> None:
        """WarmupForwardMixin's (models/common/warmup.py): a read-back decode of zeros per sampling
        configuration (here greedy on the device if it may sample there, then host logits)."""
        TTNN.recorder.add("model.warmup_model_decode", kv_cache=kv_cache, enable_trace=enable_trace,
                          max_batch_size=max_batch_size, num_blocks=num_blocks,
                          can_sample_on_device=can_sample_on_device)
        greedy = SamplingParams(temperature=[0.0] * max_batch_size, top_k=[1] * max_batch_size,
                                top_p=[1.0] * max_batch_size)
        for params in ([greedy] if can_sample_on_device else []) + [None]:
            self.decode_forward(tokens=torch.zeros(max_batch_size, 1, dtype=torch.int32),
                                start_pos=torch.zeros(max_batch_size, dtype=torch.int32),
                                page_table=torch.zeros(max_batch_size, num_blocks, dtype=torch.int32),
                                kv_cache=kv_cache, enable_trace=enable_trace, read_from_device=True,
                                sampling_params=params)

    # ---- the model ----
    def _validate_and_initialize_sampling(self, sampling_params: Any, sample_on_device: bool,
                                          enable_trace: bool = False) -> None:
        self.seeds = list(sampling_params.seed) if isinstance(sampling_params.seed, list) else None

    def _prefill(self, user_tokens: torch.Tensor, user_id: int, page_table: Any, local_user_id: int,
                 sample_on_device: bool, prompt_len: int) -> torch.Tensor:
        """Logits of every position of one padded prompt, [1, 1, S, V] (a sampled prefill returns
        the same; the fake samples them in `_sample_device`)."""
        length = user_tokens.shape[-1]
        logits = torch.zeros(1, 1, length, self.vocab_size)
        for position in range(length):
            logits[0, 0, position, next_token(int(user_tokens[position]), position, self.vocab_size)] = HOST_LOGIT
        return logits

    def _sample_device(self, logits: torch.Tensor, temperatures: list[float],
                       seeds: list[int | None] | None) -> list[int]:
        """Row r of `logits` [R, V]: its argmax, plus the row's seed at a temperature above 0 (the
        recording fake's device sampler)."""
        tokens = [int(t) for t in logits.argmax(-1).reshape(-1).tolist()]
        return [(t + ((seeds[r] if seeds and r < len(seeds) else None) or 0)) % self.vocab_size
                if temperatures[r] > 0 else t for r, t in enumerate(tokens)]

    def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, enable_trace: bool = False,
                       page_table: Any = None, sample_on_device: bool = False) -> torch.Tensor:
        """The base generator's decode: logits [1, 1, B, V] (on the host unless sampled on the device)."""
        logits = torch.zeros(1, 1, tokens.shape[0], self.vocab_size)
        for row, (token, position) in enumerate(zip(tokens.tolist(), start_pos.tolist())):
            if position >= 0:
                logits[0, 0, row, next_token(int(token), int(position), self.vocab_size)] = HOST_LOGIT
        return logits


def _pad_tokens(tokens: torch.Tensor, pad_value: int, block_size: int) -> torch.Tensor:
    """[B, S] -> [B, S rounded up to block_size], padded with pad_value."""
    length = tokens.shape[1]
    padded = -(-length // block_size) * block_size
    if padded == length:
        return tokens
    out = torch.full((tokens.shape[0], padded), pad_value, dtype=tokens.dtype)
    out[:, :length] = tokens
    return out


def _row(value: Any, row: int) -> Any:
    return value[row] if isinstance(value, list) else value


class DeepseekV3ForCausalLM(DeepseekGenerator):
    model_capabilities = {"supports_prefix_caching": False, "supports_sample_on_device": True}

    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                                 **kwargs: Any) -> int:
        if "DeepSeek-R1-0528" in model_name and is_wormhole_b0():
            if max_model_len is None or max_num_seqs is None:
                raise ValueError("DeepSeek-R1-0528 on Wormhole requires max_model_len and max_num_seqs")
            return int(max_model_len) * int(max_num_seqs)
        raise ValueError("DeepSeek-R1-0528 not supported on non-Wormhole devices")

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, optimizations: str | None = None) -> DeepseekV3ForCausalLM:
        TTNN.recorder.add("model.initialize_vllm_model", hf_config=hf_config, mesh_device=mesh_device,
                          max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                          tt_data_parallel=tt_data_parallel, optimizations=optimizations)
        model_path = os.environ.get("DEEPSEEK_V3_HF_MODEL")
        cache_dir = os.environ.get("DEEPSEEK_V3_CACHE")
        if not model_path:
            raise ValueError("DEEPSEEK_V3_HF_MODEL is not set. Set the environment variable or initialize via the "
                             "demo entrypoint with an explicit --model-path.")
        rows, cols = mesh_device.shape[0], mesh_device.shape[1]
        if tt_data_parallel <= 0:
            raise ValueError(f"tt_data_parallel must be > 0, got {tt_data_parallel}")
        if tt_data_parallel != rows * cols:
            raise ValueError(f"Unsupported tt_data_parallel/mesh layout for Deepseek vLLM bridge: "
                             f"tt_data_parallel={tt_data_parallel}, mesh_shape={mesh_device.shape}. Expected "
                             f"tt_data_parallel to equal mesh world size ({rows * cols})")
        if max_batch_size % tt_data_parallel:
            raise ValueError(f"Global max_batch_size {max_batch_size} must be divisible by tt_data_parallel "
                             f"{tt_data_parallel}")
        return cls(hf_config=hf_config, mesh_device=mesh_device, model_path=Path(model_path),
                   cache_dir=Path(cache_dir) if cache_dir else None, tokenizer=None, max_seq_len=max_seq_len,
                   vllm_context=True, batch_size_per_row=(max_batch_size // tt_data_parallel) * cols)

    @property
    def cache_path(self) -> Any:
        return self.cache_dir

    def allocate_kv_cache(self, kv_cache_shape: tuple, dtype: Any, num_layers: int) -> list:
        TTNN.recorder.add("model.allocate_kv_cache", kv_cache_shape=tuple(kv_cache_shape), dtype=dtype,
                          num_layers=num_layers)
        layers = int(self.hf_config.num_hidden_layers)
        assert num_layers == layers, (
            f"Number of layers {num_layers} does not match the number of layers in the model {layers}")
        kvpe_dim = int(self.hf_config.kv_lora_rank) + int(self.hf_config.qk_rope_head_dim)
        # What MLA1D.create_state builds itself: one latent head of kv_lora_rank + qk_rope_head_dim.
        assert kv_cache_shape[1] == 1 and kv_cache_shape[3] == kvpe_dim, (
            f"MLA cache shape {tuple(kv_cache_shape)}: expected (blocks, 1, block_size, {kvpe_dim})")
        block_size, blocks = int(kv_cache_shape[2]), int(kv_cache_shape[0])
        if (self.paged_config is None or self.paged_config.block_size != block_size
                or self.paged_config.max_num_blocks != blocks):
            self.paged_config = PagedAttentionConfig(block_size=block_size, max_num_blocks=blocks)
        self.kv_cache_shape = tuple(kv_cache_shape)
        override = {"kv_cache_shape": tuple(kv_cache_shape), "dtype": dtype}
        self._prepare_run_configs("prefill", kv_cache_override=override)
        self._prepare_run_configs("decode", kv_cache_override=override)
        return self.get_kv_cache()

    def prefill_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start_pos = kwargs.get("start_pos", None)
        assert start_pos is None or all(int(x) == 0 for x in start_pos), (
            f"Prefix caching is not supported for DeepseekV3ForCausalLM, got start_pos: {start_pos}")
        assert self.model_run_config_prefill is not None, "Model run config prefill is not initialized"
        enable_trace = kwargs.pop("enable_trace", None)
        tokens = kwargs["tokens"]
        lengths = [int(n) for n in kwargs["prompt_lens"]]
        page_table = kwargs.get("page_table", None)
        kv_cache = kwargs.get("kv_cache", None)
        empty_slots = kwargs.get("empty_slots", None)
        sampling_params = kwargs.get("sampling_params", None)
        on_device = sampling_params is not None
        TTNN.recorder.add("model.prefill_forward", tokens=tokens.clone(), prompt_lens=lengths,
                          start_pos=None if start_pos is None else [int(x) for x in start_pos],
                          empty_slots=None if empty_slots is None else list(empty_slots),
                          sampling_params=sampling_params, enable_trace=enable_trace)
        if all(length == 0 for length in lengths):
            if on_device:
                return torch.zeros(tokens.shape[0], dtype=torch.int64)
            return torch.zeros(tokens.shape[0], self.vocab_size)
        if kv_cache is not None and not any(entry is None for entry in kv_cache):
            self.set_kv_cache(kv_cache)
        block = self.paged_config.block_size if self.paged_config is not None else USERS_PER_ROW
        padded_len = -(-max(lengths) // block) * block
        if on_device:
            self._validate_and_initialize_sampling(sampling_params, on_device, enable_trace=False)
        outputs = []
        for i, prompt_len in enumerate(lengths):
            user_id = empty_slots[i] if empty_slots is not None else i
            if prompt_len == 0:
                outputs.append(torch.tensor(0, dtype=torch.int64) if on_device
                               else torch.zeros(padded_len, self.vocab_size))
                continue
            user_tokens = _pad_tokens(tokens[i, :prompt_len].unsqueeze(0), PAD_TOKEN_ID, block).squeeze(0)
            logits = self._prefill(user_tokens, user_id, page_table, local_user_id=i,
                                   sample_on_device=on_device, prompt_len=prompt_len)
            if on_device:
                last = logits[0, 0, prompt_len - 1:prompt_len]
                [token] = self._sample_device(last, [float(_row(sampling_params.temperature, i))],
                                              [_row(sampling_params.seed, i)])
                outputs.append(torch.tensor(token, dtype=torch.int64))
                continue
            user_logits = logits.squeeze(0).squeeze(0)[:prompt_len]          # [S, V] -> the prompt's rows
            if prompt_len < padded_len:
                user_logits = torch.cat([user_logits, user_logits[-1:].expand(padded_len - prompt_len, -1)])
            outputs.append(user_logits)
        return torch.stack(outputs)

    def decode_forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.model_run_config_decode is not None, "Model run config decode is not initialized"
        page_table = kwargs.get("page_table", None)
        kv_cache = kwargs.get("kv_cache", None)
        enable_trace = kwargs.get("enable_trace", False)
        read_from_device = kwargs.get("read_from_device", True)
        sampling_params = kwargs.get("sampling_params", None)
        on_device = sampling_params is not None
        reset_batch = kwargs.get("reset_batch", False)
        TTNN.recorder.add("model.decode_forward", tokens=kwargs["tokens"].reshape(-1).tolist(),
                          start_pos=kwargs["start_pos"].tolist(), page_table=page_table, enable_trace=enable_trace,
                          read_from_device=read_from_device, sampling_params=sampling_params,
                          reset_batch=reset_batch)
        if kv_cache is not None and not any(entry is None for entry in kv_cache):
            self.set_kv_cache(kv_cache)
        tokens = kwargs["tokens"].squeeze(1)
        if on_device and reset_batch:
            self._validate_and_initialize_sampling(sampling_params, on_device, enable_trace=enable_trace)
        logits = super().decode_forward(tokens=tokens, start_pos=kwargs["start_pos"], enable_trace=enable_trace,
                                        page_table=page_table, sample_on_device=on_device)
        if on_device:
            temperatures = [float(_row(sampling_params.temperature, r)) for r in range(tokens.shape[0])]
            sampled = self._sample_device(logits[0, 0], temperatures, self.seeds)
            if read_from_device:
                return torch.tensor(sampled, dtype=torch.int64)
            return FakeDeviceTensor(sampled, is_tokens=True)
        return logits.squeeze(0).squeeze(0).unsqueeze(1)     # [1, 1, B, V] -> [B, 1, V]

    def read_decode_output(self, tt_out: Any, async_read: bool = False) -> Any:
        TTNN.recorder.add("model.read_decode_output", async_read=async_read)
        if isinstance(tt_out, torch.Tensor):
            return (tt_out, []) if async_read else tt_out
        if isinstance(tt_out, FakeDeviceTensor):
            host = torch.tensor(tt_out.values, dtype=torch.int64)
            return (host, []) if async_read else host
        raise TypeError(f"Unsupported decode output type from DeepseekV3ForCausalLM: {type(tt_out)}")
