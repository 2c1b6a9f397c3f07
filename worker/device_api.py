"""How the runner calls a model on each kind of device.

The generator contract is the same everywhere; what differs is how a model is built (a torch
device and per-lane rows, or a ttnn mesh and whole-mesh rows), the KV cache's shape and dtype,
warmup (compile then capture), the sampling-parameter type, and how a decode's readback is
awaited. `TorchDevice` serves the torch reference models and the sim; `TtnnDevice` drives
tt-metal models on a mesh through `TtnnBackend`.

Decode inputs carried from the previous step (`carried_rows`, the rows whose request feeds the
token the previous decode sampled): a torch model returns that step's tokens as a tensor the
next step indexes by row. A tt-metal model never takes a device tensor as `tokens`; a traced,
device-sampled decode instead keeps its tokens and positions in the trace's inputs and ignores
the host ones unless `reset_batch` (or its own checks) says they are stale (the contract, with
references, is in worker/ttnn_backend.py). So `TtnnDevice` tracks what the device holds and, per
step, either lets the model run on it (`reset_batch=False`, carried rows are placeholders) or
reads the previous decode back and uploads real tokens (`reset_batch=True`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .batch import ServingConfig
from .host_heap import release_free_heap
from .sampling import SamplingBatch

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int, str], None]  # phase, completed, total, detail


@dataclass(slots=True)
class PendingDecode:
    device_out: Any      # the step's output where the device keeps it (next step's tokens)
    host_out: Any        # the readback under way
    events: list[Any]
    is_tokens: bool


class TorchDevice:
    """The torch reference models and the sim: one torch device (or a simulated mesh). Every
    step runs on every thread the worker has (worker/config.py says how they wait between a
    step's parallel regions)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, traced: Callable[[str], bool]) -> None:
        self.device = device
        self.dtype = dtype
        self.traced = traced
        self.resident_tokens = True  # next-step tokens can be read off device_out by row

    # The reference models and the sim batch every lane's rows in one forward: lanes in process,
    # any top_k on the (torch) sampler, and a KV budget from bytes (the sim's from its profile).
    def lanes_in_process(self, model_cls: type) -> bool:
        return True

    def max_top_k(self, capabilities: Mapping[str, Any]) -> int | None:
        return None

    def check(self, model_cls: type, model_path: Path, config: ServingConfig) -> None:
        pass

    def kv_tokens_per_lane(self, model_cls: type, model_path: Path, config: ServingConfig,
                           block_size: int) -> int | None:
        return None

    def initialize(self, model_cls: type, model_path: Path, hf_config: dict, config: ServingConfig) -> Any:
        model = model_cls.initialize_vllm_model(
            hf_config, self.device, config.max_num_seqs, config.max_model_len,
            tt_data_parallel=config.num_lanes, model_path=str(model_path), dtype=self.dtype)
        release_free_heap()  # the checkpoint's float32 copies, freed while loading
        return model

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

    def prefill(self, model: Any, rope_deltas: bool = False, **kwargs: Any) -> Any:
        """The model's prefill output; with rope_deltas (an mRoPE model), (output, rope_deltas),
        as such a model returns them."""
        return model.prefill_forward(**kwargs, enable_trace=self.traced("prefill"))

    def launch_decode(self, model: Any, sampling_params: Any, *, tokens: torch.Tensor, previous: Any = None,
                      carried_rows: Sequence[int] = (), **kwargs: Any) -> PendingDecode:
        """`previous` is what `device_tokens` (or a finished decode) gave: token ids by row."""
        if carried_rows:
            rows = list(carried_rows)
            tokens[rows, 0] = previous[rows].to(tokens.device, tokens.dtype)
        out = model.decode_forward(tokens=tokens, **kwargs, sampling_params=sampling_params,
                                   enable_trace=self.traced("decode"), read_from_device=False)
        host_out, events = model.read_decode_output(out, async_read=True)
        return PendingDecode(out, host_out, list(events), sampling_params is not None)

    def finish_decode(self, model: Any, pending: PendingDecode) -> Any:
        for event in pending.events:
            event.synchronize()  # the sim's events, or the CUDA copy's (none on a CPU)
        return model.process_decode_output_host(pending.host_out, is_tokens=pending.is_tokens)

    def device_tokens(self, pending: PendingDecode) -> torch.Tensor:
        return getattr(pending.device_out, "tokens", pending.device_out).reshape(-1)

    def reset(self) -> None:
        pass  # nothing of a decode outlives its readback

    def close(self) -> None:
        pass


class ResidentTokens:
    """The token ids a launched tt-metal decode sampled, still on the device (in the model's
    decode inputs) until its readback completes; the runner hands it back as the next step's
    `previous`, and only `TtnnDevice` reads it."""

    __slots__ = ("pending",)

    def __init__(self, pending: Any) -> None:
        self.pending = pending


class TtnnDevice:
    """tt-metal models on a ttnn mesh (the production path), through TtnnBackend.

    Invariant: `_next_positions` is not None exactly when the model's trace inputs hold the
    inputs of a decode that continues the last one (each active row's sampled token at its
    position + 1, empty rows at -1): the last decode was traced and sampled on the device, the
    model takes `reset_batch`, and no prefill ran since (a prefill switches the generator's mode,
    and its next decode reloads from the host).
    """

    def __init__(self, backend: Any, variant: str | None = None, env: Mapping[str, str] = os.environ) -> None:
        self.backend = backend
        self.variant = variant                             # the selector value that chose the class
        self.env = env
        self._keeps_inputs = False                         # known once the model is built
        self._next_positions: torch.Tensor | None = None
        self._active: torch.Tensor | None = None           # the last decode's rows; None after prefill
        self._page_table: torch.Tensor | None = None       # the last decode's page table
        self.kv_dtype = torch.bfloat16                     # the model config's, once initialized

    @property
    def resident_tokens(self) -> bool:
        """A decode may take the previous one's tokens from the device: only a traced decode of
        a model that takes `reset_batch` (TtnnBackend.keeps_decode_inputs)."""
        return self._keeps_inputs

    def traced(self, kind: str) -> bool:
        return self.backend.trace.prefill if kind == "prefill" else self.backend.trace.decode

    # ---- tt-metal's rules for the class (worker/tt_models.py) ----
    def family(self, model_cls: type) -> Any:
        from .tt_models import ModelFamily
        return ModelFamily(model_cls.__name__, model_cls.__module__, self.variant)

    def lanes_in_process(self, model_cls: type) -> bool:
        from .tt_models import folds_dp_into_lanes
        return folds_dp_into_lanes(self.family(model_cls), self.env)

    def max_top_k(self, capabilities: Mapping[str, Any]) -> int | None:
        from .tt_models import device_top_k
        return device_top_k(capabilities)

    def check(self, model_cls: type, model_path: Path, config: ServingConfig) -> None:
        """Refuses (ValueError, before any weight loads) a serving configuration the class would
        assert on, and a checkpoint variable that names other weights."""
        from .tt_models import capability_problem, checkpoint_environment, data_parallel_problem, image_input_problem
        family = self.family(model_cls)
        problem = (data_parallel_problem(family, config.num_lanes, config.max_num_seqs, self.backend.spec)
                   or checkpoint_environment(family, model_path, self.env).problem
                   or capability_problem(model_cls.__name__, getattr(model_cls, "model_capabilities", None) or {})
                   or image_input_problem(model_cls.__name__))
        if problem:
            raise ValueError(problem)

    def kv_tokens_per_lane(self, model_cls: type, model_path: Path, config: ServingConfig,
                           block_size: int) -> int | None:
        from .tt_models import kv_budget, tt_data_parallel
        budget = kv_budget(model_cls, model_name=str(model_path), num_devices=self.backend.spec.num_devices,
                           tt_data_parallel=tt_data_parallel(self.family(model_cls), config.num_lanes,
                                                             self.backend.spec),
                           max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                           block_size=block_size)
        log.info("KV budget: %d tokens per lane = %s", budget.tokens_per_lane, budget.source)
        return budget.tokens_per_lane

    def initialize(self, model_cls: type, model_path: Path, hf_config: dict, config: ServingConfig) -> Any:
        from .tt_models import apply_environment, checkpoint_environment, kv_cache_dtype, tt_data_parallel
        self.kv_dtype = getattr(torch, kv_cache_dtype(hf_config))
        from .ttnn_backend import hf_config_for
        family = self.family(model_cls)
        # tt-metal's model code finds its weights through this variable (HF_MODEL, ...).
        apply_environment(checkpoint_environment(family, model_path, self.env).to_set)
        if self.backend.mesh is None:
            self.backend.open()
        # tt-metal's max_batch_size is the whole mesh's rows; it gives each lane an equal share.
        model = self.backend.initialize_model(
            model_cls, hf_config_for(model_path), max_batch_size=config.num_lanes * config.max_num_seqs,
            max_seq_len=config.max_model_len,
            tt_data_parallel=tt_data_parallel(family, config.num_lanes, self.backend.spec))
        self._keeps_inputs = self.backend.keeps_decode_inputs(model)
        return model

    def allocate_kv_cache(self, model: Any, num_blocks: int, num_kv_heads: int, block_size: int,
                          head_dim: int, num_layers: int, num_lanes: int) -> Any:
        """One (K, V) pair per layer, in the model config's dtype. A class with
        `allocate_kv_cache_per_layer` (tt-metal's hybrid-attention models) gets the per-layer
        specs, as the plugin prefers; here every layer has the same shape (uniform attention)."""
        from .tt_models import tt_data_parallel
        spec = self.backend.spec
        shape = self.backend.kv_cache_shape(num_blocks, num_kv_heads, block_size, head_dim,
                                            tt_data_parallel(self.family(type(model)), num_lanes, spec))
        dtype = self.kv_dtype
        if callable(getattr(model, "allocate_kv_cache_per_layer", None)):
            return model.allocate_kv_cache_per_layer([(shape, dtype, layer) for layer in range(num_layers)])
        return model.allocate_kv_cache(shape, dtype, num_layers)

    def warmup(self, model: Any, kv_cache: Any, config: ServingConfig, page_table_width: int,
               progress: Progress) -> None:
        self.backend.warmup(model, kv_cache, max_batch_size=config.num_lanes * config.max_num_seqs,
                            num_blocks=page_table_width, progress=progress)
        self._next_positions = self._active = self._page_table = None  # warmup ran the traces on dummy inputs

    def sampling_params(self, batch: SamplingBatch, seeds: list[int | None]) -> Any:
        """tt-metal's own SamplingParams (lists per row); seeds instead of host generators, None
        for a row without one (as the plugin sends them: async_decode.py `submit_decode`)."""
        from models.tt_transformers.tt.generator import SamplingParams  # a tt-metal host only
        # top_k == 1 is argmax only with top_p = 0: tt-metal's sampler otherwise samples such a row
        # at its temperature (tt-metal issue 46827; the plugin forces it, input_batch.py).
        top_k = [int(k) for k in batch.top_k]
        return SamplingParams(temperature=[float(t) for t in batch.temperature], top_k=top_k,
                              top_p=[0.0 if k == 1 else float(p) for k, p in zip(top_k, batch.top_p)],
                              seed=list(seeds))

    def prefill(self, model: Any, rope_deltas: bool = False, **kwargs: Any) -> Any:
        self._next_positions = self._active = self._page_table = None
        out = self.backend.prefill(model, rope_deltas=rope_deltas, **kwargs)
        out, deltas = out if rope_deltas else (out, None)
        if kwargs.get("sampling_params") is not None:
            out = out.reshape(-1)
        return (out, deltas) if rope_deltas else out

    def launch_decode(self, model: Any, sampling_params: Any, *, tokens: torch.Tensor, start_pos: torch.Tensor,
                      page_table: torch.Tensor, previous: Any = None, carried_rows: Sequence[int] = (),
                      **kwargs: Any) -> Any:
        """Launches a decode whose `carried_rows` take the previous decode's tokens.

        When the device's inputs are this step's (same rows, each one position further, the last
        decode sampled on the device and so does this one) the model runs on them with
        `reset_batch=False` and the carried rows' host tokens stay placeholders, as the plugin's
        steady decode does. Otherwise the previous decode is read back first (an early, single
        readback, like the plugin's drain) and the model reloads everything from the host
        (`reset_batch=True`). Untraced or host-sampled decodes upload the host tensors anyway;
        they get `reset_batch` only when the rows changed, so device seeds are not re-applied
        every step. Empty rows (position -1) get a zeroed page-table row, as in the plugin.

        A continuing row's explicit token is the one this device sampled (the control plane
        feeds back the worker's own tokens), so the model may ignore it. The model must refresh
        only its page table when that alone changes (tt-metal's generator does; the plugin
        relies on it too: a block appended in steady decode does not reset its batch).
        """
        active = start_pos >= 0
        on_device = sampling_params is not None
        resident = (on_device and self._next_positions is not None
                    and torch.equal(start_pos, self._next_positions))
        if carried_rows and not resident:
            rows = list(carried_rows)
            tokens[rows, 0] = self._host_tokens(model, previous)[rows].to(tokens.dtype)
        rows_changed = self._active is None or not torch.equal(active, self._active)
        reset = not resident if on_device and self.traced("decode") else rows_changed
        table = page_table.masked_fill(~active[:, None], 0)
        table_changed = self._page_table is None or not torch.equal(table, self._page_table)
        pending = self.backend.launch_decode(
            model, sampling_params=sampling_params, reset_batch=reset, inputs_resident=resident,
            page_table_changed=table_changed, tokens=tokens, start_pos=start_pos, page_table=table, **kwargs)
        self._active, self._page_table = active, table
        self._next_positions = (torch.where(active, start_pos + 1, start_pos)
                                if on_device and self._keeps_inputs else None)
        return pending

    def _host_tokens(self, model: Any, previous: Any) -> torch.Tensor:
        if isinstance(previous, ResidentTokens):
            return self.backend.read_back(model, previous.pending).reshape(-1)
        return previous

    def finish_decode(self, model: Any, pending: Any) -> Any:
        return self.backend.finish_decode(model, pending)

    def device_tokens(self, pending: Any) -> ResidentTokens:
        assert self._keeps_inputs, "this model cannot take its decode tokens from the device"
        return ResidentTokens(pending)

    def reset(self) -> None:
        """The next decode reloads its inputs from the host (a new step stream's rows)."""
        self._next_positions = self._active = self._page_table = None

    def close(self) -> None:
        self.backend.close()
