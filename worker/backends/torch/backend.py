"""The torch backend: ttserve's reference models (worker/backends/torch/models/) on one torch
device, and the simulated mesh's model (worker/backends/sim/), through the generator contract.

A decode's carried rows (the rows whose request feeds the token the previous decode sampled) take
that step's tokens by row from its output tensor, where the model left them: a launched-ahead
decode needs no readback before the next one starts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ...batch import ServingConfig
from ...device import PendingDecode, Progress
from ...sampling import SamplingBatch
from .host_heap import keep_step_buffers, release_free_heap


class TorchBackend:
    """One torch device (or a simulated mesh). Every step runs on every thread the worker has
    (worker/config.py says how they wait between a step's parallel regions).

    The reference models and the sim batch every lane's rows in one forward: lanes in process,
    any top_k on the (torch) sampler, any prefill batch, and a KV budget from bytes (the sim's
    from its profile, worker/config.py)."""

    # next-step tokens are read off a launched decode's device_out by row
    resident_tokens = True
    # The reference Qwen2.5-VL stands for tt-metal's vision classes (it is their correctness
    # oracle), whose prefill returns logits: its prefill batches are sampled on the host as theirs.
    vision_prefill_samples_on_host = True
    null_block = False  # the reference models write only real positions (traced empty rows: a scratch block)

    def __init__(self, device: torch.device, dtype: torch.dtype, traced: Callable[[str], bool],
                 batch_invariant: bool = False) -> None:
        self.device = device
        self.dtype = dtype
        self.traced = traced
        self.batch_invariant = batch_invariant  # the reference models' (planning/preflight.py checks the class)

    def lanes_in_process(self, model_cls: type) -> bool:
        return True

    def max_top_k(self, capabilities: Mapping[str, Any]) -> int | None:
        return None

    def max_prefill_users(self, model_cls: type, images: bool) -> int | None:
        return None

    def check(self, model_cls: type, model_path: Path, config: ServingConfig) -> None:
        pass

    def kv_tokens_per_lane(self, model_cls: type, model_path: Path, config: ServingConfig,
                           block_size: int) -> int | None:
        return None

    def initialize(self, model_cls: type, model_path: Path, hf_config: dict, config: ServingConfig) -> Any:
        invariant = {"batch_invariant": True} if self.batch_invariant else {}
        model = model_cls.initialize_vllm_model(
            hf_config, self.device, config.max_num_seqs, config.max_model_len,
            tt_data_parallel=config.num_lanes, model_path=str(model_path), dtype=self.dtype, **invariant)
        release_free_heap()  # the checkpoint's float32 copies, freed while loading
        keep_step_buffers()  # from here on, each step reuses the last one's freed pages
        return model

    def verifies_drafts(self, model_cls: type) -> bool:
        """The reference models and the sim declare `verify_forward` (ttserve's own entry point)."""
        return callable(getattr(model_cls, "verify_forward", None))

    def hybrid_kv_cache(self, model_cls: type) -> bool:
        """A reference model that reads a page table per layer says so (gemma3.py)."""
        return bool(getattr(model_cls, "hybrid_kv_cache_groups", False))

    def allocate_kv_cache(self, model: Any, num_blocks: int, num_kv_heads: int, block_size: int,
                          head_dim: int, num_layers: int, num_lanes: int,
                          tensor_of_layer: Sequence[int] | None = None) -> Any:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        if tensor_of_layer is not None:
            return model.allocate_kv_cache_per_layer([(shape, self.dtype, t) for t in tensor_of_layer])
        return model.allocate_kv_cache(shape, self.dtype, num_layers)

    def warmup(self, model: Any, kv_cache: Any, config: ServingConfig, page_table_width: int,
               progress: Progress) -> None:
        """Compile every shape untraced first, then capture the traced ones, so no program
        cache allocation happens while a trace is live."""
        passes = [("compile", False)] + ([("capture", True)] if self.traced("prefill") or self.traced("decode") else [])
        for phase, trace in passes:
            progress(phase, 0, 2, "prefill shapes")
            model.warmup_model_prefill(kv_cache=kv_cache, enable_trace=trace and self.traced("prefill"))
            progress(phase, 1, 2, "decode shape")
            model.warmup_model_decode(kv_cache=kv_cache, enable_trace=trace and self.traced("decode"),
                                      max_batch_size=config.max_num_seqs)
            progress(phase, 2, 2, "done")

    def sampling_params(self, batch: SamplingBatch, seeds: list[int | None]) -> Any:
        return batch  # the reference models sample with the host sampler's own batch

    def prefill(self, model: Any, rope_deltas: bool = False, **inputs: Any) -> Any:
        """The model's prefill output; with rope_deltas (an mRoPE model), (output, rope_deltas),
        as such a model returns them."""
        return model.prefill_forward(**inputs, enable_trace=self.traced("prefill"))

    def launch_decode(self, model: Any, sampling_params: Any, *, tokens: torch.Tensor, start_pos: torch.Tensor,
                      page_table: torch.Tensor, kv_cache: Any, previous: torch.Tensor | PendingDecode | None = None,
                      carried_rows: Sequence[int] = (), **inputs: Any) -> PendingDecode:
        if carried_rows:
            rows = list(carried_rows)
            tokens[rows, 0] = _tokens_by_row(previous)[rows].to(tokens.device, tokens.dtype)
        out = model.decode_forward(tokens=tokens, start_pos=start_pos, page_table=page_table, kv_cache=kv_cache,
                                   **inputs, sampling_params=sampling_params, enable_trace=self.traced("decode"),
                                   read_from_device=False)
        host_out, events = model.read_decode_output(out, async_read=True)
        return PendingDecode(out, host_out, list(events), sampling_params is not None)

    def finish_decode(self, model: Any, pending: PendingDecode) -> Any:
        if not pending.read:
            for event in pending.events:
                event.synchronize()  # the sim's events, or the CUDA copy's (none on a CPU)
            pending.result = model.process_decode_output_host(pending.host_out, is_tokens=pending.is_tokens)
            pending.read = True
        return pending.result

    def verify(self, model: Any, **inputs: Any) -> Any:
        """The reference models' verify_forward (speculative decoding): eager, never traced (its
        shapes change with every step's drafts); logits stay on the model's device."""
        return model.verify_forward(**inputs)

    def reset(self) -> None:
        pass  # nothing of a decode outlives its readback

    def close(self) -> None:
        pass


def _tokens_by_row(previous: torch.Tensor | PendingDecode | None) -> torch.Tensor:
    """The previous decode's tokens by row: a host tensor, or a launched decode's output where the
    model left it (the sim's SimOutput carries them as `tokens`)."""
    if isinstance(previous, PendingDecode):
        return getattr(previous.device_out, "tokens", previous.device_out).reshape(-1)
    assert previous is not None, "a carried row without the previous decode's tokens"
    return previous
