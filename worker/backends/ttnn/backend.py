"""The production backend: tt-metal's model classes on a ttnn mesh, driven through the generator
contract (`initialize_vllm_model`, `warmup_model_prefill/decode`, `prefill_forward`,
`decode_forward`, `read_decode_output`, `process_decode_output_host`).

The order that matters, and who owns it here:
- start-up: `probe_chips` then `open_mesh` (worker/backends/ttnn/mesh_device.py); the class's rules
  (`check`, the KV budget, `tt_data_parallel`, the checkpoint variable) are tt_models.py's.
- warmup (`TtnnBackend.warmup`): every shape is compiled untraced first, then traces are captured,
  so no program-cache allocation happens while a trace is live.
- async decode (`launch_decode` / `finish_decode`): `decode_forward(read_from_device=False)` ->
  `read_decode_output(async_read=True)` -> `ttnn.event_synchronize` per event ->
  `process_decode_output_host`; at most two decodes in flight, each read back exactly once.

Device-resident decode inputs (what makes two decodes in flight possible). The public contract,
as tt-metal's models implement it and the TT vLLM plugin drives it:
- `decode_forward`'s `tokens` and `start_pos` are always host torch tensors: no tt-metal
  generator takes a device tensor as the next step's tokens (`Generator.decode_forward_text`
  chunks them with `torch.chunk`, models/tt_transformers/tt/generator.py).
- A traced decode that samples on the device keeps its inputs on the device: the sampler writes
  each row's token into the trace's token input (`sampling.sample(..., tt_out_tok=x)`) and
  positions advance there (`ttnn.plus_one(current_pos, skip_negative_entries=True)`), both in
  `Transformer.ttnn_decode_forward` / `_increment_decode_positions_device`
  (models/tt_transformers/tt/model.py). The generator copies the host `tokens`/`start_pos` into
  the trace inputs only when `reset_inputs = reset_batch or <prefill since the last decode> or
  not sampling_on_device or <sampling mode changed>` (`Generator._decode_forward_trace_text`); a
  changed page table alone refreshes only the page table (current generators; earlier ones
  reloaded every input then, and so cannot overlap steps that append a block). Otherwise the
  host values are ignored.
- The plugin (tenstorrent/vllm-tt-plugin @ e3fc849, src/vllm_tt_plugin/) overlaps steps with
  exactly that: in steady decode it passes host tokens that may lag one step (model_runner.py
  `_prepare_model_inputs`, input_batch.py `_build_decode_input`) with `reset_batch=False`;
  `reset_batch` is True only when the decode layout changed (a request placed or a slot freed,
  input_batch.py:844-932, model_runner.py:1133, input_batch.py:1181), and any such step first
  drains the pending readbacks (model_runner.py:1371-1372, 1421-1428) so the host tokens it then
  uploads are real. Empty slots get position -1 and a zeroed page-table row (input_batch.py:1153,
  1161). Readbacks are finalized exactly once (async_decode.py:75-90: a second readback of one
  submission corrupts it).
So `TtnnBackend` tracks what the device's decode inputs hold (`DecodeInputs`) and, per step,
either lets the model run on them (`reset_batch=False`) or reads the previous decode back first
(once: `PendingDecode.read`) and uploads real tokens (`reset_batch=True`). A carried row's host
token stays a placeholder only while the previous decode is still on the device, which only a
model declaring `supports_async_decode` is given (the runner pipelines nothing else); a token
already on the host is always filled in, for a generator that reloads on its own.

Where the decode input-update contract differs (tt-metal models/common/decode_contract.py; the
plugin at 1f10755, docs/DECODE_RELOAD_CONTRACT.md and async_decode.py `plan_decode_reload`): an
adapter declaring `decode_input_update_contract >= 1` (versions above 1 are supersets) gets four
commands instead of `reset_batch` and infers nothing itself. `reload_inputs` is False only for a
traced, device-sampled decode continuing the last one on a model that declares
`supports_async_decode` (the capability is fail-closed: without it every decode reloads);
`reload_page_table` then copies a changed page table alone; `reload_sampling_params` and
`reset_sampling_state` come with a device-sampled transition (first decode, a prefill since, the
rows or the sampling mode changed), traced or not. A legacy adapter keeps the behaviour above
whatever its capabilities, as the plugin's legacy path does (its capability only gates the
overlap), except that an untraced switch to device sampling resets its batch here too, so the
seeds reach the device. A legacy adapter is sent `reset_batch` only on a decode sampled on the
device, as the plugin sends it (async_decode.py `submit_decode` @ e3fc849, inside
`if perform_device_sampling`): a host-sampled decode reloads its inputs anyway, and some
`decode_forward(*args, **kwargs)` adapters forward to a decode that takes no `reset_batch` (see
`_decode_commands`).
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ...batch import ServingConfig
from ...device import PendingDecode, Progress
from ...planning.mesh import MeshSpec, fabric_for
from ...planning.options import TraceFlags, device_sampling, trace_flags
from ...sampling import SamplingBatch
from .mesh_device import close_mesh, device_errors, load_ttnn, open_mesh
from .tt_models import (ModelFamily, apply_environment, capability_problem, checkpoint_environment,
                        data_parallel_problem, device_top_k, folds_dp_into_lanes, image_input_problem, kv_budget,
                        kv_cache_dtype, max_model_len_problem, one_prefill_user, tt_data_parallel)

log = logging.getLogger(__name__)

MAX_DECODES_IN_FLIGHT = 2


class ModelContractError(TypeError):
    """The model class lacks or misnames a part of the generator contract."""


@dataclass(slots=True, frozen=True)
class DecodeInputs:
    """What the last decode left in the model's decode inputs, for the next decode to compare."""
    active: torch.Tensor                 # [rows] bool: rows with a position
    page_table: torch.Tensor             # the page table it ran on (empty rows zeroed)
    on_device: bool                      # it sampled on the device (a change is a transition)
    # Each active row's position + 1 (empty rows -1): the positions the trace's inputs hold now,
    # when the decode was traced, sampled on the device and the model takes a reload signal
    # (`reset_batch` or the contract's commands); None: the inputs hold nothing a decode may
    # run on (the host reloads them).
    next_positions: torch.Tensor | None


class TtnnBackend:
    """One ttnn mesh and tt-metal's model classes on it (implements worker/device.py's
    DeviceBackend).

    Invariant: `_inputs` is None after warmup, a prefill (it switches the generator's mode, and
    its next decode reloads from the host) and a new step stream; else it describes the last
    decode. `_inputs.next_positions` is not None exactly when the model's trace inputs hold the
    inputs of a decode that continues the last one; `_keeps_inputs` says whether a decode may
    also rely on them (`keeps_decode_inputs`).
    """

    # tt-metal's vision classes drop sampling_params in prefill and return logits
    # (models/demos/qwen25_vl and qwen3_vl tt/generator_vllm.py `prefill_forward`).
    vision_prefill_samples_on_host = True
    # tt-metal pads prefills (tt_transformers to powers of two, the Galaxy generator to 128) and
    # writes the padding's KV through the zero-padded page table: into block 0, which vLLM never
    # gives a request (its null block).
    null_block = True

    def __init__(self, spec: MeshSpec, options: Mapping[str, Any], *, variant: str | None = None,
                 env: Mapping[str, str] = os.environ, cluster: str | None = None, ttnn: Any = None) -> None:
        self.spec = spec
        self.options = dict(options)
        self.trace: TraceFlags = trace_flags(self.options)
        self.variant = variant                             # the selector value that chose the class
        self.env = env
        self.cluster = cluster
        self.fabric = fabric_for(spec, self.options.get("fabric_config"), cluster)
        self._ttnn_module = ttnn
        self.mesh: Any = None
        self.kv_dtype = torch.bfloat16                     # the model config's, once initialized
        self._keeps_inputs = False                         # known once the model is built
        self._inputs: DecodeInputs | None = None
        self._in_flight = 0                                # decodes launched and not finished

    @property
    def ttnn(self) -> Any:
        return load_ttnn(self._ttnn_module)

    # ---- life of the mesh ----
    def open(self) -> Any:
        assert self.mesh is None, "mesh already open"
        self.mesh = open_mesh(self.spec, self.options, ttnn=self._ttnn_module, cluster=self.cluster)
        return self.mesh

    def close(self) -> None:
        """Closes the mesh. Release the model (and its traces) first."""
        if self.mesh is None:
            return
        mesh, self.mesh = self.mesh, None
        close_mesh(mesh, reset_fabric=self.fabric is not None, ttnn=self._ttnn_module)

    # ---- tt-metal's rules for the class (tt_models.py) ----
    def family(self, model_cls: type) -> ModelFamily:
        return ModelFamily(model_cls.__name__, model_cls.__module__, self.variant)

    @property
    def resident_tokens(self) -> bool:
        """A decode may take the previous one's tokens from the device: only a traced decode of
        a model that takes a reload signal and declares `supports_async_decode`
        (`keeps_decode_inputs`)."""
        return self._keeps_inputs

    def lanes_in_process(self, model_cls: type) -> bool:
        return folds_dp_into_lanes(self.family(model_cls), self.env)

    def max_top_k(self, capabilities: Mapping[str, Any]) -> int | None:
        return device_top_k(capabilities)

    def max_prefill_users(self, model_cls: type, images: bool) -> int | None:
        """One for a vision class that cannot mix text-only and image users in a prefill."""
        return 1 if images and one_prefill_user(model_cls.__name__) else None

    def check(self, model_cls: type, model_path: Path, config: ServingConfig) -> None:
        """Refuses (ValueError, before any weight loads) a serving configuration the class would
        assert on, and a checkpoint variable that names other weights."""
        family = self.family(model_cls)
        problem = (data_parallel_problem(family, config.num_lanes, config.max_num_seqs, self.spec)
                   or max_model_len_problem(family, model_path, config.max_model_len, self.spec)
                   or checkpoint_environment(family, model_path, self.env).problem
                   or capability_problem(model_cls.__name__, getattr(model_cls, "model_capabilities", None) or {})
                   or image_input_problem(model_cls.__name__))
        if problem:
            raise ValueError(problem)

    def kv_tokens_per_lane(self, model_cls: type, model_path: Path, config: ServingConfig,
                           block_size: int) -> int | None:
        budget = kv_budget(model_cls, model_name=str(model_path), num_devices=self.spec.num_devices,
                           tt_data_parallel=tt_data_parallel(self.family(model_cls), config.num_lanes, self.spec),
                           max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                           block_size=block_size)
        log.info("KV budget: %d tokens per lane = %s", budget.tokens_per_lane, budget.source)
        return budget.tokens_per_lane

    # ---- model and KV cache ----
    def initialize(self, model_cls: type, model_path: Path, hf_config: dict, config: ServingConfig) -> Any:
        """`model_cls.initialize_vllm_model` on this mesh (opened here if it is not yet).

        tt-metal reads a transformers PretrainedConfig (attributes such as `_name_or_path`), see
        `hf_config_for`. Its `max_batch_size` is the whole mesh's rows: every lane's capacity
        together; tt-metal gives each of the `tt_data_parallel` submeshes an equal share.
        """
        self.kv_dtype = getattr(torch, kv_cache_dtype(hf_config))
        family = self.family(model_cls)
        # tt-metal's model code finds its weights through this variable (HF_MODEL, ...).
        apply_environment(checkpoint_environment(family, model_path, self.env).to_set)
        if self.mesh is None:
            self.open()
        dp = tt_data_parallel(family, config.num_lanes, self.spec)
        kwargs: dict[str, Any] = {"max_seq_len": config.max_model_len, "tt_data_parallel": dp}
        needed = {"max_seq_len"}
        if dp != 1:
            needed.add("tt_data_parallel")
        if "optimizations" in self.options:
            kwargs["optimizations"] = self.options["optimizations"]
            needed.add("optimizations")
        model = _call_accepting(model_cls.initialize_vllm_model, f"{model_cls.__name__}.initialize_vllm_model",
                                kwargs, needed, hf_config_for(model_path), self.mesh,
                                config.num_lanes * config.max_num_seqs)
        self._keeps_inputs = self.keeps_decode_inputs(model)
        return model

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                       tt_data_parallel: int = 1) -> tuple[int, int, int, int]:
        """The per-layer K (and V) shape the model allocates: KV heads split over the chips of one
        data-parallel copy, as the plugin computes it (model_runner.py `_kv_cache_shape`)."""
        devices = max(1, self.spec.num_devices // tt_data_parallel)
        return (num_blocks, num_kv_heads // min(devices, num_kv_heads), block_size, head_dim)

    def verifies_drafts(self, model_cls: type) -> bool:
        """Never on a mesh today. The TT plugin's speculative contract (vllm_tt_plugin's spec
        decode contract module, its issue #110) is not ttserve's `verify_forward`: a class declares
        `model_capabilities["supports_spec_decode"]`, `spec_requirements` and a `spec_plan`
        classmethod returning SpecPlan (effective k, rows per request, accept modes "logits" or
        "argmax_ids"), and verifies through `decode_forward` over a [B, 1 + K] block, with
        `propose_draft_tokens` for device drafters. ttserve drives none of it yet, so a mesh
        worker reports no speculative decoding and its rows never carry drafts (`ttserve check`
        says so); n-gram drafts (a host drafter there, requiring nothing of the model) are what it
        would take first."""
        return False

    def hybrid_kv_cache(self, model_cls: type) -> bool:
        """Never on a mesh today. The plugin sends `page_tables_per_layer` only when vLLM forms
        several KV groups, and tt-metal's `HybridAttentionForCausalLM.get_kv_cache_spec`
        (models/tt_transformers/tt/generator_vllm.py, the version that adds the class) emits
        FullAttentionSpec for every layer, one group: "SlidingWindowSpec is temporarily disabled:
        TT-side decode passes the absolute position to paged_update_cache / paged_sdpa_decode ...
        positions beyond the sliding window collapse onto physical block 0 and silently corrupt
        the cache". A class with `_HYBRID_KV_CACHE_GROUPS_ENABLED` on is refused before it loads
        (tt_models.hybrid_kv_cache_problem)."""
        return False

    def allocate_kv_cache(self, model: Any, num_blocks: int, num_kv_heads: int, block_size: int,
                          head_dim: int, num_layers: int, num_lanes: int,
                          tensor_of_layer: Sequence[int] | None = None) -> Any:
        """One (K, V) pair per layer, in the model config's dtype. A class with
        `allocate_kv_cache_per_layer` (tt-metal's hybrid-attention models) gets the per-layer
        specs, as the plugin prefers: each layer its own buffer, or with hybrid KV groups
        (`tensor_of_layer`) the buffer it shares with layer i of every other group."""
        shape = self.kv_cache_shape(num_blocks, num_kv_heads, block_size, head_dim,
                                    tt_data_parallel(self.family(type(model)), num_lanes, self.spec))
        dtype = self.kv_dtype
        if callable(getattr(model, "allocate_kv_cache_per_layer", None)):
            tensors = tensor_of_layer if tensor_of_layer is not None else range(num_layers)
            return model.allocate_kv_cache_per_layer([(shape, dtype, t) for t in tensors])
        assert tensor_of_layer is None, "hybrid KV groups need allocate_kv_cache_per_layer (hybrid_kv_cache)"
        return model.allocate_kv_cache(shape, dtype, num_layers)

    # ---- warmup ----
    def warmup(self, model: Any, kv_cache: Any, config: ServingConfig, page_table_width: int,
               progress: Progress) -> None:
        """Compiles every shape untraced, then captures the traces that `trace_mode` asks for:
        decode at the mesh's rows (all lanes), with `page_table_width` blocks (tt-metal's
        `num_blocks`: min(ceil(max_model_len / block_size), blocks in the KV cache))."""
        prefill = {"kv_cache": kv_cache, "can_sample_on_device": device_sampling(self.options, "prefill")}
        decode = {"kv_cache": kv_cache, "max_batch_size": config.num_lanes * config.max_num_seqs,
                  "num_blocks": page_table_width, "can_sample_on_device": device_sampling(self.options, "decode")}
        steps = [("compile", "prefill", False), ("compile", "decode", False)]
        steps += [("capture", "prefill", True)] if self.trace.prefill else []
        steps += [("capture", "decode", True)] if self.trace.decode else []
        started = time.perf_counter()
        # Each shape is reported once done, under its phase (compile, capture): the worker's
        # metrics count shapes by phase.
        progress("compile", 0, len(steps), "compile prefill")
        for done, (phase, kind, enable_trace) in enumerate(steps, start=1):
            if phase == "capture" and kind == "prefill" and hasattr(model, "already_warmed_up_prefill"):
                # tt-metal's Generator runs its prefill warmup once; the capture pass must run again.
                model.already_warmed_up_prefill = False
            method = getattr(model, f"warmup_model_{kind}")
            kwargs = {**(prefill if kind == "prefill" else decode), "enable_trace": enable_trace}
            with device_errors(f"warmup ({phase} {kind})"):
                _call_accepting(method, f"{type(model).__name__}.warmup_model_{kind}", kwargs,
                                {"enable_trace"})
            progress(phase, done, len(steps), f"{phase} {kind} done" if done < len(steps)
                     else f"{phase} {kind} done; warm in {time.perf_counter() - started:.1f} s")
        self._inputs = None  # warmup ran the traces on dummy inputs

    # ---- steps ----
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

    def prefill(self, model: Any, rope_deltas: bool = False, **inputs: Any) -> Any:
        """`prefill_forward` with this mesh's prefill trace flag. An mRoPE model returns (output,
        rope_deltas) (models/demos/qwen25_vl/tt/generator_vllm.py; the plugin's model_runner.py
        unpacks it when the model uses mRoPE)."""
        self._inputs = None
        with device_errors("prefill"):
            out = model.prefill_forward(**inputs, enable_trace=self.trace.prefill)
        out, deltas = out if rope_deltas else (out, None)
        out = host_output(out)
        if inputs.get("sampling_params") is not None:
            out = out.reshape(-1)
        return (out, deltas) if rope_deltas else out

    def keeps_decode_inputs(self, model: Any) -> bool:
        """Whether `model` can run a decode on the inputs the previous one left on the device:
        only a traced decode keeps them (an untraced one uploads the host tensors every step),
        only a `decode_forward` that takes `reset_batch` (or the contract's commands) can be told
        when they are stale, and only a model declaring `supports_async_decode` feeds its sampled
        tokens back into them (fail-closed, as the plugin: tt-metal's generator refuses
        `reload_inputs=False` for a model without on-device token feedback, and such a model
        leaves the capability off)."""
        capabilities = getattr(model, "model_capabilities", None) or {}
        return (self.trace.decode and _takes_reset_batch(type(model))
                and bool(capabilities.get("supports_async_decode", False)))

    def launch_decode(self, model: Any, sampling_params: Any, *, tokens: torch.Tensor, start_pos: torch.Tensor,
                      page_table: torch.Tensor, kv_cache: Any, previous: torch.Tensor | PendingDecode | None = None,
                      carried_rows: Sequence[int] = (), **inputs: Any) -> PendingDecode:
        """Launches a decode whose `carried_rows` take the previous decode's tokens.

        A transition (the first decode, one after a prefill or `reset`, changed rows, or a
        change between host and device sampling) reloads everything from the host and, sampled
        on the device, the sampling parameters and state. The device's inputs continue the last
        decode when there is no transition, each row is one position further, and the last
        decode and this one are traced and sampled on the device. A legacy generator then runs
        on them (`reset_batch=False`); a contract adapter only when `keeps_decode_inputs`
        (`reload_inputs=False`), and only then may the carried rows' tokens still be on the
        device (placeholders on the host). Otherwise a previous decode still on the device is
        read back first (an early, single readback, like the plugin's drain) and the inputs
        reload from the host. Untraced or host-sampled decodes upload the host tensors anyway;
        an untraced device-sampled decode gets `reset_batch` only on a transition, so device
        seeds are not re-applied every step, and a host-sampled decode of a legacy generator
        gets no `reset_batch` at all (`_decode_commands`). Empty rows (position -1) get a zeroed
        page-table row, as in the plugin.

        A continuing row's explicit token is the one this device sampled (the control plane
        feeds back the worker's own tokens), so the model may ignore it; a carried row's token
        already on the host is filled in all the same. The model must refresh only its page
        table when that alone changes (tt-metal's generator does; the plugin relies on it too:
        a block appended in steady decode does not reset its batch).

        The readback is enqueued right after the step, before any later step can overwrite the
        trace's output.
        """
        assert not isinstance(previous, PendingDecode) or self._keeps_inputs, \
            "this model cannot take its decode tokens from the device"
        last = self._inputs
        active = start_pos >= 0
        on_device = sampling_params is not None
        rows_changed = last is None or not torch.equal(active, last.active)
        transition = rows_changed or last.on_device != on_device
        continues = (on_device and not transition and last.next_positions is not None
                     and torch.equal(start_pos, last.next_positions))
        resident = continues and self._keeps_inputs
        on_device_pending = isinstance(previous, PendingDecode) and not previous.read
        if carried_rows and not (resident and on_device_pending):
            rows = list(carried_rows)
            tokens[rows, 0] = self._host_tokens(model, previous)[rows].to(tokens.dtype)
        # A legacy generator's reset_batch: a traced device-sampled decode resets unless it
        # continues; an untraced one on a transition (so seeds reach the device after host
        # sampling); a host-sampled one is sent none (_decode_commands).
        reset = (not continues if self.trace.decode else transition) if on_device else False
        table = page_table.masked_fill(~active[:, None], 0)
        table_changed = last is None or not torch.equal(table, last.page_table)

        assert self._in_flight < MAX_DECODES_IN_FLIGHT, "finish a decode before launching a third"
        commands = _decode_commands(model, reset, resident, table_changed, sampling_params, transition)
        with device_errors("decode"):
            out = model.decode_forward(tokens=tokens, start_pos=start_pos, page_table=table, kv_cache=kv_cache,
                                       **inputs, **commands, sampling_params=sampling_params,
                                       enable_trace=self.trace.decode, read_from_device=False)
            host_out, events = model.read_decode_output(out, async_read=True)
        self._in_flight += 1
        tracked = on_device and self.trace.decode and _takes_reset_batch(type(model))
        self._inputs = DecodeInputs(active, table, on_device,
                                    torch.where(active, start_pos + 1, start_pos) if tracked else None)
        # device_out is not kept: a carried row reads the trace's inputs, never this output.
        return PendingDecode(None, host_out, list(events), on_device)

    def _host_tokens(self, model: Any, previous: torch.Tensor | PendingDecode | None) -> torch.Tensor:
        assert previous is not None, "carried rows without a previous decode"
        if isinstance(previous, PendingDecode):
            return self._read_back(model, previous).reshape(-1)
        return previous

    def _read_back(self, model: Any, pending: PendingDecode) -> Any:
        """Waits for `pending`'s readback and returns its host result. Idempotent: a decode read
        early (the next step needs its tokens on the host) is processed once, and `finish_decode`
        returns the same result."""
        if not pending.read:
            with device_errors("decode readback"):
                for event in pending.events:
                    self.ttnn.event_synchronize(event)
                out = pending.host_out
                # As the plugin (async_decode.py finalize_decode @e3fc849): a result already on the
                # host (a tensor, or a tuple of tensors) is used as it is; anything else goes
                # through process_decode_output_host, which a model returning device tensors must have.
                if not is_host_output(out):
                    process = getattr(model, "process_decode_output_host", None)
                    if process is None:
                        raise AttributeError(f"{type(model).__name__} returned decode output of type "
                                             f"{type(out).__name__}, not a host tensor, and has no "
                                             "process_decode_output_host to read it back")
                    out = process(out, is_tokens=pending.is_tokens)
                pending.result = host_output(out)
            pending.read = True
        return pending.result

    def finish_decode(self, model: Any, pending: PendingDecode) -> Any:
        """Waits for the readback of `pending` (unless already read) and returns its host result."""
        assert self._in_flight > 0, "finish_decode without a launched decode"
        self._in_flight -= 1
        return self._read_back(model, pending)

    @property
    def decodes_in_flight(self) -> int:
        return self._in_flight

    def verify(self, model: Any, **inputs: Any) -> Any:
        raise NotImplementedError("ttserve drives no TT speculative decoding contract yet (verifies_drafts)")

    def reset(self) -> None:
        """The next decode reloads its inputs from the host (a new step stream's rows)."""
        self._inputs = None


def is_host_output(out: Any) -> bool:
    """A torch tensor, or a tuple of them (None allowed), as the plugin's _is_host_decode_output."""
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, tuple) and all(t is None or isinstance(t, torch.Tensor) for t in out)


def host_output(out: Any) -> Any:
    """The token ids or logits of a host result: newer tt-metal generators return
    (tokens or logits, log-probs), older ones the tensor alone (the plugin unpacks both,
    vllm_tt_plugin/async_decode.py `finalize_decode`)."""
    return out[0] if isinstance(out, tuple) else out


def _decode_commands(model: Any, reset_batch: bool, inputs_resident: bool, page_table_changed: bool,
                     sampling_params: Any, transition: bool) -> dict[str, bool]:
    """How a decode tells the model which of its device-resident inputs are stale.

    Adapters of the decode input-update contract (`decode_input_update_contract >= 1`, tt-metal
    models/common/decode_contract.py; a later version is a superset of version 1, as the plugin
    reads it) take four explicit commands and refuse the legacy `reset_batch`: the host inputs
    reload unless the decode runs on the ones the last decode left on the device
    (`inputs_resident`); then only a changed page table is copied (a full reload restages it
    anyway); sampling parameters and state reload on a device-sampled `transition` (which always
    reloads the inputs too: a sampler may align its seeds to the host positions only then).
    Older generators take `reset_batch` (or not at all) and notice a changed page table themselves.

    A legacy generator is sent `reset_batch` only when the decode samples on the device, as the
    plugin does (async_decode.py `submit_decode` @ e3fc849 adds it inside `if
    perform_device_sampling`). A host-sampled decode needs none, as read in tt_transformers'
    generator.py (search index ids 7625586423 and 66647718705, no commit named):
    `Generator._decode_forward_trace_text` copies the host tokens, positions and page table into
    the trace inputs whenever `reset_inputs = reset_batch or not sampling_on_device` (the later
    version adds `or sampling_mode_changed`); the untraced `_decode_forward_no_trace_text`
    prepares every input from the host on each call; and the decode entry point reads
    `reset_batch` otherwise only to reset the device sampler's seeds and penalty state, inside
    `if sampling_params is not None` (id 7625586423 passes the trace `reset_batch=mode_switched`
    instead, the later one `reset_batch or mode_switched`). Sending it would break a generator
    whose `decode_forward(*args, **kwargs)` forwards to a decode without it: Qwen3-VL's
    generator_vllm.py @ 1d1ec002 hands everything to models/demos/qwen3_vl/tt/generator.py
    @ 5f866a08 `decode_forward(tokens, start_pos, page_table, kv_cache, enable_trace,
    read_from_device, sampling_params)` (a TypeError on every decode). Such an adapter declares
    no `supports_sample_on_device`, so it is never sampled on the device here.
    """
    if _input_update_contract(type(model)) >= 1:
        sampling = transition and sampling_params is not None
        assert not sampling or not inputs_resident, "a sampling reset needs authoritative inputs"
        return {"reload_inputs": not inputs_resident, "reload_page_table": inputs_resident and page_table_changed,
                "reload_sampling_params": sampling, "reset_sampling_state": sampling}
    if sampling_params is None:
        return {}
    if not _takes_reset_batch(type(model)):
        if reset_batch:
            log.debug("%s.decode_forward takes no reset_batch; its inputs reload on their own",
                      type(model).__name__)
        return {}
    return {"reset_batch": reset_batch}


@functools.lru_cache(maxsize=None)
def _input_update_contract(model_cls: type) -> int:
    return int(getattr(model_cls, "decode_input_update_contract", 0) or 0)


@functools.lru_cache(maxsize=None)
def _takes_reset_batch(model_cls: type) -> bool:
    """Asked every decode step: inspect.signature costs tens of µs, so once per model class. An
    adapter of the input-update contract is told the same through its own commands."""
    return _input_update_contract(model_cls) >= 1 or _takes_keyword(model_cls.decode_forward, "reset_batch")


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def hf_config_for(model_path: Any) -> Any:
    """The checkpoint's transformers config, as tt-metal's initialize_vllm_model expects."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(model_path))


def _call_accepting(fn: Callable[..., Any], what: str, kwargs: dict[str, Any], needed: set[str],
                    *args: Any) -> Any:
    """Calls `fn` with the keywords it declares (all of them if it takes **kwargs).

    tt-metal's models differ in which optional keywords they take; a keyword in `needed` that
    `fn` does not take, or a required parameter ttserve cannot fill, is a contract error.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    params = signature.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        missing = sorted(k for k in needed if k not in params)
        if missing:
            raise ModelContractError(f"{what}{signature} takes no {', '.join(missing)}")
        kwargs = {k: v for k, v in kwargs.items() if k in params}
        if "non_greedy_decoding_on_device" in params and "can_sample_on_device" in kwargs:
            kwargs["non_greedy_decoding_on_device"] = kwargs["can_sample_on_device"]  # older tt-metal
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise ModelContractError(f"{what}{signature}: {e}") from None
    return fn(*args, **kwargs)
