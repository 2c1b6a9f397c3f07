"""The production backend: a ttnn mesh on Tenstorrent chips, and tt-metal models driven through
the generator contract (`initialize_vllm_model`, `warmup_model_prefill/decode`,
`prefill_forward`, `decode_forward`, `read_decode_output`, `process_decode_output_host`).

The order that matters, and who owns it here:
- start-up: `probe_chips` (a child process, bounded in time) -> `open_mesh`: the fabric is set
  before the mesh opens; `close_mesh`: submeshes, then the mesh, then the fabric reset.
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
This module passes `reset_batch` and reads back idempotently (`read_back`); the bookkeeping of
what the device holds is `TtnnDevice`'s (worker/device_api.py), which needs torch.

ttnn is imported only when a device is used: this module loads on any host, and its names are
those of ttnn 0.81.1. Nothing here imports torch or other ttserve modules than mesh and options.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from .mesh import MeshError, MeshSpec, fabric_for, parse_visible_devices
from .options import DEFAULT_TRACE_REGION_SIZE, TraceFlags, device_sampling, trace_flags

log = logging.getLogger(__name__)

DEVICE_DIR = "/dev/tenstorrent"   # the kernel driver's nodes, one per PCIe device id
PROBE_TIMEOUT_S = 60.0            # a Galaxy's cluster discovery takes seconds, a hung chip forever
MAX_DECODES_IN_FLIGHT = 2
GALAXY_CLUSTERS = ("GALAXY", "TG", "BLACKHOLE_GALAXY")

# device_api.Progress's shape; restated because this module stays importable without torch
# (a ttnn-only environment runs its start-up checks).
Progress = Callable[[str, int, int, str], None]  # phase, completed, total, detail


class TtnnUnavailable(RuntimeError):
    """ttnn cannot run here (not importable, or no chips); the message is one line."""


class DeviceError(RuntimeError):
    """A ttnn call failed; the message says which and why, in one line."""


class MeshOpenError(DeviceError):
    """The mesh did not open (a busy or unhealthy chip, a bad device parameter)."""


class TraceRegionError(DeviceError):
    """A trace needs more room than tt.trace_region_size gives it."""


class ModelContractError(TypeError):
    """The model class lacks or misnames a part of the generator contract."""


# ---- is there anything to run on? ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChipProbe:
    ok: bool
    reason: str                 # why not, or what was found
    num_devices: int = 0        # what ttnn reports (already narrowed by TT_VISIBLE_DEVICES)
    arch: str | None = None     # ttnn's arch name, e.g. "wormhole_b0", "blackhole"
    is_galaxy: bool = False
    cluster: str | None = None  # ttnn.cluster.get_cluster_type().name, e.g. "GALAXY", "T3K", "N300"


_PROBE_MARK = "TTSERVE_PROBE "
_PROBE_SCRIPT = f"""
import json
def answer(**fields):
    print({_PROBE_MARK!r} + json.dumps(fields), flush=True)
try:
    import ttnn
except Exception as e:
    answer(error="import ttnn failed: " + type(e).__name__ + ": " + str(e))
    raise SystemExit(0)
try:
    n = int(ttnn.GetNumAvailableDevices())
    arch = str(ttnn.get_arch_name())
    cluster = ttnn.cluster.get_cluster_type().name
except Exception as e:
    answer(error=str(e))
else:
    answer(num_devices=n, arch=arch, cluster=cluster)
"""


def probe(timeout_s: float = PROBE_TIMEOUT_S, device_dir: str | None = DEVICE_DIR) -> tuple[bool, str]:
    """Whether ttnn imports and sees chips here, and why not. Never hangs: see `probe_chips`."""
    found = probe_chips(timeout_s, device_dir)
    return found.ok, found.reason


def probe_chips(timeout_s: float = PROBE_TIMEOUT_S, device_dir: str | None = DEVICE_DIR) -> ChipProbe:
    """What ttnn sees on this host, asked in a child process that is killed after `timeout_s`.

    Cheap checks first: without a ttnn module or without driver device nodes under `device_dir`
    (None skips that check) the answer comes without starting anything. The child process keeps
    a hung chip or driver from hanging the worker, and keeps ttnn's cluster state out of it.
    """
    if importlib.util.find_spec("ttnn") is None:
        return ChipProbe(False, f"ttnn is not installed for this Python "
                                f"({sys.version_info.major}.{sys.version_info.minor}); "
                                "ttnn wheels exist for Python 3.10 and 3.12")
    if device_dir is not None and not os.environ.get("TT_METAL_SIMULATOR"):
        refusal = _device_nodes_refusal(device_dir)
        if refusal:
            return ChipProbe(False, refusal)
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return ChipProbe(False, f"ttnn did not answer within {timeout_s:.0f} s: a chip or its driver "
                                "may be hung (tt-smi -r resets the chips)")
    answer = next((json.loads(line[len(_PROBE_MARK):]) for line in reversed(done.stdout.splitlines())
                   if line.startswith(_PROBE_MARK)), None)
    if answer is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return ChipProbe(False, f"the ttnn probe exited with status {done.returncode}: {tail}")
    if "error" in answer:
        return ChipProbe(False, _chips_problem(answer["error"]))
    if answer["num_devices"] < 1:
        return ChipProbe(False, "no Tenstorrent chips detected on this host (ttnn counts 0 devices)")
    return ChipProbe(True, f"{answer['num_devices']} {answer['arch']} chip(s), cluster {answer['cluster']}",
                     answer["num_devices"], answer["arch"], answer["cluster"] in GALAXY_CLUSTERS,
                     answer["cluster"])


def require_chips(timeout_s: float = PROBE_TIMEOUT_S, device_dir: str | None = DEVICE_DIR) -> ChipProbe:
    """`probe_chips`, raising the one-line start-up failure when there is nothing to run on."""
    found = probe_chips(timeout_s, device_dir)
    if not found.ok:
        raise TtnnUnavailable(unavailable_message(found.reason))
    return found


def unavailable_message(reason: str) -> str:
    return f"ttnn backend: {reason}; use --backend torch or sim"


def _device_nodes_refusal(device_dir: str) -> str | None:
    try:
        nodes = sorted(int(n) for n in os.listdir(device_dir) if n.isdigit())
    except OSError:
        nodes = []
    if not nodes:
        return f"no Tenstorrent chips detected on this host (no devices under {device_dir})"
    try:
        visible = parse_visible_devices(os.environ.get("TT_VISIBLE_DEVICES"))
    except MeshError as e:
        return str(e)
    missing = sorted(set(visible or []) - set(nodes))
    if missing:
        return (f"TT_VISIBLE_DEVICES names device(s) {','.join(map(str, missing))}, but this host has "
                f"{','.join(map(str, nodes))} under {device_dir}")
    return None


def _chips_problem(error: str) -> str:
    detail = _one_line(error)
    if "no chips detected" in error.lower():
        return f"no Tenstorrent chips detected on this host (ttnn: {detail})"
    return f"ttnn cannot use the chips on this host ({detail})"


def _one_line(error: BaseException | str) -> str:
    """The line of a tt-metal error that says what went wrong (TT_FATAL puts it after "info:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if "info:" in lines and lines.index("info:") + 1 < len(lines):
        return lines[lines.index("info:") + 1]
    return lines[0] if lines else type(error).__name__


# ---- the mesh --------------------------------------------------------------------------------

def device_params(options: Mapping[str, Any]) -> dict[str, int]:
    """`open_mesh_device` keyword arguments from the tt options.

    The trace region is reserved only when some step kind is traced (default 50,000,000 bytes).
    """
    params = {}
    if trace_flags(options).any:
        params["trace_region_size"] = int(options.get("trace_region_size", DEFAULT_TRACE_REGION_SIZE))
    for key in ("worker_l1_size", "l1_small_size"):
        if key in options:
            params[key] = int(options[key])
    return params


def open_mesh(spec: MeshSpec, options: Mapping[str, Any], *, ttnn: Any = None, cluster: str | None = None) -> Any:
    """Opens `spec` as one ttnn mesh device; the fabric (by default the host `cluster`'s) is
    configured before the mesh opens."""
    t = _load_ttnn(ttnn)
    requested = options.get("fabric_config")
    fabric = fabric_for(spec, requested, cluster)
    if requested not in (None, "DISABLED") and fabric is None:
        log.warning("tt.fabric_config=%s ignored: %s is a single device", requested, spec.name)
    if fabric:
        reliability = options.get("fabric_reliability_mode", "STRICT_INIT")
        log.info("fabric %s (%s) for mesh %s", fabric, reliability, spec.name)
        with _device_errors(f"setting fabric {fabric}", MeshOpenError):
            t.set_fabric_config(_member(t, "FabricConfig", fabric, "fabric_config"),
                                _member(t, "FabricReliabilityMode", reliability, "fabric_reliability_mode"))
    try:
        kwargs: dict[str, Any] = device_params(options)
        axis = options.get("dispatch_core_axis")
        with _device_errors(f"opening mesh {spec.name} ({spec.rows}x{spec.cols})", MeshOpenError):
            if axis:
                # 0.81.1 builds the dispatch config against the cluster: after the fabric is set.
                kwargs["dispatch_core_config"] = t.DispatchCoreConfig(
                    axis=t.DispatchCoreAxis.COL if axis == "col" else t.DispatchCoreAxis.ROW)
            mesh = t.open_mesh_device(t.MeshShape(spec.rows, spec.cols), **kwargs)
    except BaseException:
        if fabric:
            _reset_fabric_quietly(t)
        raise
    log.info("opened mesh %s (%dx%d): %s", spec.name, spec.rows, spec.cols,
             ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "default device parameters")
    return mesh


def close_mesh(mesh: Any, *, reset_fabric: bool | None = None, ttnn: Any = None) -> None:
    """Closes submeshes, then the mesh, then resets the fabric (by default when multi-device)."""
    t = _load_ttnn(ttnn)
    if reset_fabric is None:
        reset_fabric = mesh.get_num_devices() > 1
    if hasattr(t, "ReadDeviceProfiler"):
        t.ReadDeviceProfiler(mesh)   # flushes device profiling; a no-op in builds without it
    for submesh in mesh.get_submeshes():
        t.close_mesh_device(submesh)
    t.close_mesh_device(mesh)
    if reset_fabric:
        t.set_fabric_config(t.FabricConfig.DISABLED)


def _reset_fabric_quietly(t: Any) -> None:
    try:
        t.set_fabric_config(t.FabricConfig.DISABLED)
    except Exception as e:  # the original failure is the one to report
        log.debug("fabric reset after a failed open also failed: %s", _one_line(e))


def _member(t: Any, enum: str, name: str, option: str) -> Any:
    try:
        return getattr(getattr(t, enum), name)
    except AttributeError:
        raise MeshOpenError(f"tt.{option} = {name!r} is not a ttnn.{enum} member in ttnn "
                            f"{_ttnn_version()}") from None


def _ttnn_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ttnn")
    except PackageNotFoundError:
        return "(version unknown)"


@contextmanager
def _device_errors(doing: str, error: type[DeviceError] = DeviceError) -> Iterator[None]:
    """Turns ttnn's multi-line RuntimeErrors into one-line errors of a specific type."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, (TtnnUnavailable, DeviceError)):
            raise
        text = str(e)
        if "no chips detected" in text.lower():
            raise TtnnUnavailable(unavailable_message(_chips_problem(text))) from None
        trace = _TRACE_REGION.search(text)
        if trace:
            need, have = int(trace.group(1)), int(trace.group(2))
            raise TraceRegionError(
                f"{doing}: a trace needs {need:,} bytes but the trace region holds {have:,}; "
                f"set --additional-config.tt.trace_region_size {need} or more") from None
        raise error(f"{doing}: {_one_line(e)}") from e


_TRACE_REGION = re.compile(r"trace buffers of size (\d+)B.*?only (\d+)B is allocated for trace region",
                           re.S)


def _load_ttnn(module: Any) -> Any:
    """The given ttnn module (tests pass a fake), else the real one (a sys.modules patch works)."""
    if module is not None:
        return module
    try:
        return importlib.import_module("ttnn")
    except ImportError as e:
        raise TtnnUnavailable(unavailable_message(f"ttnn is not importable ({e})")) from None


# ---- driving a tt-metal model ------------------------------------------------------------------

@dataclass(slots=True)
class PendingDecode:
    """A decode launched on the device whose readback is under way."""
    host_out: Any          # host tensors being filled by the non-blocking readback
    events: list[Any]      # ttnn events to synchronize before host_out is complete
    is_tokens: bool        # sampled on the device (token ids), else logits
    result: Any = None     # the host result once read back (see TtnnBackend.read_back)
    read: bool = False


class TtnnBackend:
    """One mesh and the rules for driving tt-metal models on it (traces, warmup, async decode).

    The runner keeps the model, KV cache and page tables; it asks this object how to call them.
    """

    name = "ttnn"

    def __init__(self, spec: MeshSpec, options: Mapping[str, Any], *, ttnn: Any = None,
                 cluster: str | None = None) -> None:
        self.spec = spec
        self.options = dict(options)
        self.trace: TraceFlags = trace_flags(self.options)
        self.cluster = cluster
        self.fabric = fabric_for(spec, self.options.get("fabric_config"), cluster)
        self._ttnn_module = ttnn
        self.mesh: Any = None
        self._in_flight = 0

    @property
    def ttnn(self) -> Any:
        return _load_ttnn(self._ttnn_module)

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

    # ---- model and KV cache ----
    def initialize_model(self, model_cls: type, hf_config: Any, *, max_batch_size: int,
                         max_seq_len: int, tt_data_parallel: int = 1) -> Any:
        """`model_cls.initialize_vllm_model` on this mesh.

        `hf_config` is a transformers PretrainedConfig (tt-metal reads attributes such as
        `_name_or_path`), see `hf_config_for`. `max_batch_size` is the whole mesh's rows: every
        lane's capacity together; tt-metal gives each of the `tt_data_parallel` submeshes an
        equal share.
        """
        assert self.mesh is not None, "open() the mesh before initializing a model"
        kwargs: dict[str, Any] = {"max_seq_len": max_seq_len, "tt_data_parallel": tt_data_parallel}
        needed = {"max_seq_len"}
        if tt_data_parallel != 1:
            needed.add("tt_data_parallel")
        if "optimizations" in self.options:
            kwargs["optimizations"] = self.options["optimizations"]
            needed.add("optimizations")
        init = model_cls.initialize_vllm_model
        return _call_accepting(init, f"{model_cls.__name__}.initialize_vllm_model", kwargs, needed,
                               hf_config, self.mesh, max_batch_size)

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                       tt_data_parallel: int = 1) -> tuple[int, int, int, int]:
        """The per-layer K (and V) shape the model allocates: KV heads split over the chips of one
        data-parallel copy, as the plugin computes it (model_runner.py `_kv_cache_shape`)."""
        devices = max(1, self.spec.num_devices // tt_data_parallel)
        return (num_blocks, num_kv_heads // min(devices, num_kv_heads), block_size, head_dim)

    # ---- warmup ----
    def warmup(self, model: Any, kv_cache: Any, *, max_batch_size: int, num_blocks: int,
               progress: Progress | None = None) -> None:
        """Compiles every shape untraced, then captures the traces that `trace_mode` asks for.

        `max_batch_size` is the mesh's decode rows (all lanes); `num_blocks` the page-table width
        (min(ceil(max_model_len / block_size), blocks in the KV cache)).
        """
        report = progress or (lambda *_: None)
        prefill = {"kv_cache": kv_cache, "can_sample_on_device": device_sampling(self.options, "prefill")}
        decode = {"kv_cache": kv_cache, "max_batch_size": max_batch_size, "num_blocks": num_blocks,
                  "can_sample_on_device": device_sampling(self.options, "decode")}
        steps = [("compile", "prefill", False), ("compile", "decode", False)]
        steps += [("capture", "prefill", True)] if self.trace.prefill else []
        steps += [("capture", "decode", True)] if self.trace.decode else []
        started = time.perf_counter()
        # Each shape is reported once done, under its phase (compile, capture): the worker's
        # metrics count shapes by phase.
        report("compile", 0, len(steps), "compile prefill")
        for done, (phase, kind, enable_trace) in enumerate(steps, start=1):
            if phase == "capture" and kind == "prefill" and hasattr(model, "already_warmed_up_prefill"):
                # tt-metal's Generator runs its prefill warmup once; the capture pass must run again.
                model.already_warmed_up_prefill = False
            method = getattr(model, f"warmup_model_{kind}")
            kwargs = {**(prefill if kind == "prefill" else decode), "enable_trace": enable_trace}
            with _device_errors(f"warmup ({phase} {kind})"):
                _call_accepting(method, f"{type(model).__name__}.warmup_model_{kind}", kwargs,
                                {"enable_trace"})
            report(phase, done, len(steps), f"{phase} {kind} done" if done < len(steps)
                   else f"{phase} {kind} done; warm in {time.perf_counter() - started:.1f} s")

    # ---- steps ----
    def prefill(self, model: Any, rope_deltas: bool = False, **kwargs: Any) -> Any:
        """`prefill_forward` with this mesh's prefill trace flag (tokens, page_table, kv_cache,
        prompt_lens, start_pos, sampling_params, empty_slots as the contract names them; a vision
        model's pixel_values and image_grid_thw). An mRoPE model returns (output, rope_deltas)
        (models/demos/qwen25_vl/tt/generator_vllm.py; the plugin's model_runner.py unpacks it when
        the model uses mRoPE): with rope_deltas, (host output, rope_deltas)."""
        with _device_errors("prefill"):
            out = model.prefill_forward(**kwargs, enable_trace=self.trace.prefill)
        if rope_deltas:
            out, deltas = out
            return host_output(out), deltas
        return host_output(out)

    def keeps_decode_inputs(self, model: Any) -> bool:
        """Whether `model` can run a decode on the inputs the previous one left on the device:
        only a traced decode keeps them (an untraced one uploads the host tensors every step),
        and only a `decode_forward` that takes `reset_batch` can be told when they are stale."""
        return self.trace.decode and _takes_reset_batch(type(model))

    def decode(self, model: Any, *, sampling_params: Any = None, reset_batch: bool | None = None,
               inputs_resident: bool = False, page_table_changed: bool = True, **kwargs: Any) -> Any:
        """A decode step read back before returning: token ids [rows] when `sampling_params`
        asks the device to sample, else logits."""
        commands = _decode_commands(model, reset_batch, inputs_resident, page_table_changed, sampling_params)
        with _device_errors("decode"):
            out = model.decode_forward(**kwargs, **commands, sampling_params=sampling_params,
                                       enable_trace=self.trace.decode, read_from_device=False)
            host = model.read_decode_output(out, async_read=False)
            return host_output(model.process_decode_output_host(host, is_tokens=sampling_params is not None))

    def launch_decode(self, model: Any, *, sampling_params: Any = None, reset_batch: bool | None = None,
                      inputs_resident: bool = False, page_table_changed: bool = True,
                      **kwargs: Any) -> PendingDecode:
        """Starts a decode step and its non-blocking readback; finish it with `finish_decode`.

        `reset_batch` (passed only when not None) tells the model to reload its decode inputs
        from the host tensors; False lets a traced, device-sampled decode run on the tokens and
        positions the previous decode left on the device. The readback is enqueued right after
        the step, before any later step can overwrite the trace's output."""
        assert self._in_flight < MAX_DECODES_IN_FLIGHT, "finish a decode before launching a third"
        commands = _decode_commands(model, reset_batch, inputs_resident, page_table_changed, sampling_params)
        with _device_errors("decode"):
            out = model.decode_forward(**kwargs, **commands, sampling_params=sampling_params,
                                       enable_trace=self.trace.decode, read_from_device=False)
            host_out, events = model.read_decode_output(out, async_read=True)
        self._in_flight += 1
        return PendingDecode(host_out, list(events), sampling_params is not None)

    def read_back(self, model: Any, pending: PendingDecode) -> Any:
        """Waits for `pending`'s readback and returns its host result. Idempotent: a decode read
        early (the next step needs its tokens on the host) is processed once, and `finish_decode`
        returns the same result."""
        if not pending.read:
            with _device_errors("decode readback"):
                for event in pending.events:
                    self.ttnn.event_synchronize(event)
                pending.result = host_output(
                    model.process_decode_output_host(pending.host_out, is_tokens=pending.is_tokens))
            pending.read = True
        return pending.result

    def finish_decode(self, model: Any, pending: PendingDecode) -> Any:
        """Waits for the readback of `pending` (unless already read) and returns its host result."""
        assert self._in_flight > 0, "finish_decode without a launched decode"
        self._in_flight -= 1
        return self.read_back(model, pending)

    @property
    def decodes_in_flight(self) -> int:
        return self._in_flight


def host_output(out: Any) -> Any:
    """The token ids or logits of a host result: newer tt-metal generators return
    (tokens or logits, log-probs), older ones the tensor alone (the plugin unpacks both,
    vllm_tt_plugin/async_decode.py `finalize_decode`)."""
    return out[0] if isinstance(out, tuple) else out


def _decode_commands(model: Any, reset_batch: bool | None, inputs_resident: bool, page_table_changed: bool,
                     sampling_params: Any) -> dict[str, bool]:
    """How a decode tells the model which of its device-resident inputs are stale.

    Adapters of the decode input-update contract (`decode_input_update_contract = 1`, tt-metal
    models/common/decode_contract.py) take four explicit commands and refuse the legacy
    `reset_batch`: the host inputs reload unless the decode runs on the ones the last decode left
    on the device (`inputs_resident`); then only a changed page table is copied (a full reload
    restages it anyway); sampling parameters and state reload with a reset device-sampled batch.
    Older generators take `reset_batch` (or not at all) and notice a changed page table themselves.
    """
    if _input_update_contract(type(model)) == 1:
        sampling = bool(reset_batch) and sampling_params is not None
        return {"reload_inputs": not inputs_resident, "reload_page_table": inputs_resident and page_table_changed,
                "reload_sampling_params": sampling, "reset_sampling_state": sampling}
    if reset_batch is None:
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
    return _input_update_contract(model_cls) == 1 or _takes_keyword(model_cls.decode_forward, "reset_batch")


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
