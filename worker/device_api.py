"""How the runner calls a model on each kind of device.

The generator contract is the same everywhere; what differs is how a model is built (a torch
device and per-lane rows, or a ttnn mesh and whole-mesh rows), the KV cache's shape and dtype,
warmup (compile then capture), the sampling-parameter type, and how a decode's readback is
awaited. `TorchDevice` serves the torch reference models and the sim; `TtnnDevice` drives
tt-metal models on a mesh through `TtnnBackend`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .batch import ServingConfig
from .sampling import SamplingBatch

Progress = Callable[[str, int, int, str], None]


@dataclass(slots=True)
class PendingDecode:
    device_out: Any      # the step's output where the device keeps it (next step's tokens)
    host_out: Any        # the readback under way
    events: list[Any]
    is_tokens: bool


class TorchDevice:
    """The torch reference models and the sim: one torch device (or a simulated mesh)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, traced: Callable[[str], bool]) -> None:
        self.device = device
        self.dtype = dtype
        self.traced = traced
        self.resident_tokens = True  # next-step tokens can be read off device_out by row

    def initialize(self, model_cls: type, model_path: Path, hf_config: dict, config: ServingConfig) -> Any:
        return model_cls.initialize_vllm_model(
            hf_config, self.device, config.max_num_seqs, config.max_model_len,
            tt_data_parallel=config.num_lanes, model_path=str(model_path), dtype=self.dtype)

    def allocate_kv_cache(self, model: Any, num_blocks: int, num_kv_heads: int, block_size: int,
                          head_dim: int, num_layers: int, num_lanes: int) -> Any:
        return model.allocate_kv_cache((num_blocks, num_kv_heads, block_size, head_dim), self.dtype, num_layers)

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
        return batch

    def prefill(self, model: Any, **kwargs: Any) -> Any:
        return model.prefill_forward(**kwargs, enable_trace=self.traced("prefill"))

    def launch_decode(self, model: Any, sampling_params: Any, **kwargs: Any) -> PendingDecode:
        out = model.decode_forward(**kwargs, sampling_params=sampling_params,
                                   enable_trace=self.traced("decode"), read_from_device=False)
        host_out, events = model.read_decode_output(out, async_read=True)
        return PendingDecode(out, host_out, list(events), sampling_params is not None)

    def finish_decode(self, model: Any, pending: PendingDecode) -> Any:
        for event in pending.events:
            event.synchronize()  # the sim's events; torch's readback has none
        return model.process_decode_output_host(pending.host_out, is_tokens=pending.is_tokens)

    def device_tokens(self, pending: PendingDecode) -> torch.Tensor:
        return getattr(pending.device_out, "tokens", pending.device_out).reshape(-1)

    def close(self) -> None:
        pass


class TtnnDevice:
    """tt-metal models on a ttnn mesh (the production path), through TtnnBackend."""

    resident_tokens = False  # feeding device-resident tokens by row is not wired for ttnn yet

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def traced(self, kind: str) -> bool:
        return self.backend.trace.prefill if kind == "prefill" else self.backend.trace.decode

    def initialize(self, model_cls: type, model_path: Path, hf_config: dict, config: ServingConfig) -> Any:
        from .ttnn_backend import hf_config_for
        if self.backend.mesh is None:
            self.backend.open()
        # tt-metal's max_batch_size is the whole mesh's rows; it gives each lane an equal share.
        return self.backend.initialize_model(
            model_cls, hf_config_for(model_path), max_batch_size=config.num_lanes * config.max_num_seqs,
            max_seq_len=config.max_model_len, tt_data_parallel=config.num_lanes)

    def allocate_kv_cache(self, model: Any, num_blocks: int, num_kv_heads: int, block_size: int,
                          head_dim: int, num_layers: int, num_lanes: int) -> Any:
        shape = self.backend.kv_cache_shape(num_blocks, num_kv_heads, block_size, head_dim, num_lanes)
        return model.allocate_kv_cache(shape, torch.bfloat16, num_layers)

    def warmup(self, model: Any, kv_cache: Any, config: ServingConfig, page_table_width: int,
               progress: Progress) -> None:
        self.backend.warmup(model, kv_cache, max_batch_size=config.num_lanes * config.max_num_seqs,
                            num_blocks=page_table_width, progress=progress)

    def sampling_params(self, batch: SamplingBatch, seeds: list[int | None]) -> Any:
        """tt-metal's own SamplingParams (lists per row); seeds instead of host generators."""
        from models.tt_transformers.tt.generator import SamplingParams  # a tt-metal host only
        return SamplingParams(temperature=[float(t) for t in batch.temperature], top_k=[int(k) for k in batch.top_k],
                              top_p=[float(p) for p in batch.top_p], seed=[s or 0 for s in seeds])

    def prefill(self, model: Any, **kwargs: Any) -> Any:
        return self.backend.prefill(model, **kwargs)

    def launch_decode(self, model: Any, sampling_params: Any, **kwargs: Any) -> Any:
        return self.backend.launch_decode(model, sampling_params=sampling_params, **kwargs)

    def finish_decode(self, model: Any, pending: Any) -> Any:
        return self.backend.finish_decode(model, pending)

    def device_tokens(self, pending: Any) -> torch.Tensor:
        raise NotImplementedError("async decode with device-resident tokens is not wired for ttnn")

    def close(self) -> None:
        self.backend.close()
