"""The ttnn backend's contract with ttnn and with tt-metal models, checked against recording fakes
(call order and arguments), including device-resident decode inputs across two pipelined decode
steps, plus one run against the real ttnn wheel on a chipless host."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakes import fake_tt_generator
from fakes.fake_tt_generator import SamplingParams
from fakes.fake_tt_model import make_model_class, next_token
from fakes.fake_ttnn import FabricConfig, FabricReliabilityMode, FakeTtnn, MeshShape, Recorder

from ttserve.worker.backends.ttnn import backend as ttnn_backend
from ttserve.worker.backends.ttnn import mesh_device
from ttserve.worker.backends.ttnn.backend import ModelContractError, TtnnBackend
from ttserve.worker.backends.ttnn.mesh_device import (ChipProbe, DeviceError, MeshOpenError, TraceRegionError,
                                                      TtnnUnavailable, close_mesh, device_params, open_mesh, probe,
                                                      probe_chips, require_chips)
from ttserve.worker.batch import ServingConfig
from ttserve.worker.planning.mesh import resolve_mesh
from ttserve.worker.planning.options import TraceFlags
from ttserve.worker.sampling import SamplingBatch

REPO = Path(__file__).resolve().parents[1]
NO_CHIPS = RuntimeError("TT_FATAL @ /project/tt_metal/llrt/tt_cluster.cpp:129: num_chips > 0\ninfo:\n"
                        "No chips detected in the cluster\nbacktrace:\n --- _ttnncpp.so(+0xb233e8)")


def mesh(name: str):
    return resolve_mesh(name, 32)


# ---- opening and closing the mesh ----------------------------------------------------------------

def test_fabric_is_set_before_the_mesh_opens_with_the_default_trace_region():
    ttnn = FakeTtnn()
    opened = open_mesh(mesh("T3K"), {}, ttnn=ttnn)
    assert ttnn.recorder.calls == [
        ("ttnn.set_fabric_config", {"config": FabricConfig.FABRIC_1D,
                                    "reliability_mode": FabricReliabilityMode.STRICT_INIT}),
        ("ttnn.open_mesh_device", {"mesh_shape": MeshShape(1, 8), "trace_region_size": 50_000_000}),
    ]
    assert opened.get_num_devices() == 8


@pytest.mark.parametrize("name, fabric", [("TG", FabricConfig.FABRIC_1D_RING),
                                          ("BH-Galaxy", FabricConfig.FABRIC_2D_TORUS_XY),
                                          ("P150x4", FabricConfig.FABRIC_1D)])
def test_default_fabric_reaches_ttnn(name, fabric):
    ttnn = FakeTtnn()
    open_mesh(mesh(name), {}, ttnn=ttnn)
    assert ttnn.recorder.only("ttnn.set_fabric_config")[0]["config"] is fabric
    assert ttnn.recorder.only("ttnn.open_mesh_device")[0]["mesh_shape"] == MeshShape(*mesh(name).shape)


def test_requested_fabric_and_reliability_mode_reach_ttnn():
    ttnn = FakeTtnn()
    open_mesh(mesh("T3K"), {"fabric_config": "FABRIC_2D", "fabric_reliability_mode": "RELAXED_INIT"},
              ttnn=ttnn)
    assert ttnn.recorder.only("ttnn.set_fabric_config") == [
        {"config": FabricConfig.FABRIC_2D, "reliability_mode": FabricReliabilityMode.RELAXED_INIT}]


def test_a_single_device_gets_no_fabric_even_when_one_is_asked_for(caplog):
    ttnn = FakeTtnn()
    with caplog.at_level(logging.WARNING):
        open_mesh(mesh("N150"), {"fabric_config": "FABRIC_1D"}, ttnn=ttnn)
    assert ttnn.recorder.names() == ["ttnn.open_mesh_device"]
    assert "fabric_config=FABRIC_1D ignored" in caplog.text


def test_device_params_and_dispatch_axis_are_passed_to_open_after_the_fabric():
    ttnn = FakeTtnn()
    options = {"trace_region_size": 220_000_000, "worker_l1_size": 1_344_544, "l1_small_size": 32768,
               "dispatch_core_axis": "col"}
    open_mesh(mesh("TG"), options, ttnn=ttnn)
    assert ttnn.recorder.names() == ["ttnn.set_fabric_config", "ttnn.DispatchCoreConfig",
                                     "ttnn.open_mesh_device"]
    assert ttnn.recorder.only("ttnn.DispatchCoreConfig") == [{"axis": ttnn.DispatchCoreAxis.COL}]
    opened = ttnn.recorder.only("ttnn.open_mesh_device")[0]
    assert opened["dispatch_core_config"].axis is ttnn.DispatchCoreAxis.COL
    assert {k: opened[k] for k in ("trace_region_size", "worker_l1_size", "l1_small_size")} == {
        "trace_region_size": 220_000_000, "worker_l1_size": 1_344_544, "l1_small_size": 32768}


def test_no_trace_region_is_reserved_without_tracing():
    assert device_params({"trace_mode": "none", "trace_region_size": 9}) == {}
    assert device_params({"trace_mode": "decode_only"}) == {"trace_region_size": 50_000_000}
    assert device_params({"l1_small_size": 8192}) == {"trace_region_size": 50_000_000, "l1_small_size": 8192}


def test_a_failed_open_resets_the_fabric_and_says_why_in_one_line():
    ttnn = FakeTtnn(fail={"open_mesh_device": RuntimeError("TT_FATAL @ x.cpp:1: ok\ninfo:\n"
                                                           "Device 3 is busy\nbacktrace:\n --- a")})
    with pytest.raises(MeshOpenError) as e:
        open_mesh(mesh("T3K"), {}, ttnn=ttnn)
    assert str(e.value) == "opening mesh T3K (1x8): Device 3 is busy"
    assert ttnn.recorder.names()[-1] == "ttnn.set_fabric_config"
    assert ttnn.recorder.only("ttnn.set_fabric_config")[-1]["config"] is FabricConfig.DISABLED


def test_no_chips_while_setting_the_fabric_is_the_one_line_unavailable_error():
    ttnn = FakeTtnn(fail={"set_fabric_config": NO_CHIPS})
    with pytest.raises(TtnnUnavailable) as e:
        open_mesh(mesh("T3K"), {}, ttnn=ttnn)
    assert str(e.value) == ("ttnn backend: no Tenstorrent chips detected on this host "
                            "(ttnn: No chips detected in the cluster); use --backend torch or sim")
    assert "open_mesh_device" not in " ".join(ttnn.recorder.names())


def test_close_reads_the_profiler_then_closes_submeshes_then_the_mesh_then_resets_the_fabric():
    ttnn = FakeTtnn(submeshes=2)
    opened = open_mesh(mesh("T3K"), {}, ttnn=ttnn)
    ttnn.recorder.calls.clear()
    close_mesh(opened, ttnn=ttnn)
    assert ttnn.recorder.calls == [
        ("ttnn.ReadDeviceProfiler", {"mesh": "mesh"}),
        ("ttnn.close_mesh_device", {"mesh": "mesh/0"}),
        ("ttnn.close_mesh_device", {"mesh": "mesh/1"}),
        ("ttnn.close_mesh_device", {"mesh": "mesh"}),
        ("ttnn.set_fabric_config", {"config": FabricConfig.DISABLED,
                                    "reliability_mode": FabricReliabilityMode.STRICT_INIT}),
    ]


def test_a_single_device_closes_without_a_fabric_reset():
    ttnn = FakeTtnn()
    backend = TtnnBackend(mesh("N150"), {}, ttnn=ttnn)
    backend.open()
    backend.close()
    backend.close()  # a second close is a no-op
    assert ttnn.recorder.names() == ["ttnn.open_mesh_device", "ttnn.ReadDeviceProfiler",
                                     "ttnn.close_mesh_device"]


def test_a_patched_ttnn_module_is_used_when_none_is_passed(monkeypatch):
    ttnn = FakeTtnn()
    monkeypatch.setitem(sys.modules, "ttnn", ttnn)
    open_mesh(mesh("N300"), {"trace_mode": "none"}, ttnn=None)
    assert ttnn.recorder.names() == ["ttnn.set_fabric_config", "ttnn.open_mesh_device"]


# ---- the model on the mesh -----------------------------------------------------------------------

def opened_backend(name: str = "T3K", **options) -> tuple[TtnnBackend, FakeTtnn, type]:
    ttnn = FakeTtnn()
    backend = TtnnBackend(mesh(name), options, ttnn=ttnn)
    backend.open()
    ttnn.recorder.calls.clear()
    return backend, ttnn, make_model_class(ttnn)


def initialize(backend: TtnnBackend, model_cls: type, monkeypatch, num_lanes: int = 1, max_num_seqs: int = 32,
               max_model_len: int = 128):
    monkeypatch.setattr(ttnn_backend, "hf_config_for", lambda path: "hf-config")
    return backend.initialize(model_cls, Path("unused"), {},
                              ServingConfig(num_lanes, max_num_seqs, max_model_len, max_model_len))


def test_the_model_is_initialized_on_the_mesh_with_the_whole_meshs_batch(monkeypatch):
    backend, ttnn, model_cls = opened_backend()
    model = initialize(backend, model_cls, monkeypatch, num_lanes=4, max_num_seqs=32, max_model_len=4096)
    call = ttnn.recorder.only("model.initialize_vllm_model")[0]
    assert call["mesh_device"] is backend.mesh and model.mesh_device is backend.mesh
    assert (call["hf_config"], call["max_batch_size"], call["max_seq_len"], call["tt_data_parallel"]) == (
        "hf-config", 128, 4096, 4)
    assert call["optimizations"] == "performance"  # the model's own default: not passed when unset


def test_the_optimizations_option_reaches_the_model_and_a_model_without_it_is_refused(monkeypatch):
    backend, ttnn, model_cls = opened_backend(optimizations="accuracy")
    initialize(backend, model_cls, monkeypatch)
    assert ttnn.recorder.only("model.initialize_vllm_model")[0]["optimizations"] == "accuracy"

    class Plain:
        @classmethod
        def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len,
                                  tt_data_parallel=1):
            return cls()

    with pytest.raises(ModelContractError, match="takes no optimizations"):
        initialize(backend, Plain, monkeypatch)


def test_kv_heads_are_split_over_a_lanes_chips():
    assert TtnnBackend(mesh("T3K"), {}).kv_cache_shape(100, 8, 64, 128) == (100, 1, 64, 128)
    assert TtnnBackend(mesh("TG"), {}).kv_cache_shape(100, 8, 64, 128, tt_data_parallel=4) == (100, 1, 64, 128)
    assert TtnnBackend(mesh("N300"), {}).kv_cache_shape(100, 8, 64, 128) == (100, 4, 64, 128)
    assert TtnnBackend(mesh("N150"), {}).kv_cache_shape(100, 8, 64, 128) == (100, 8, 64, 128)
    assert TtnnBackend(mesh("TG"), {}).kv_cache_shape(100, 8, 64, 128) == (100, 1, 64, 128)


# ---- warmup --------------------------------------------------------------------------------------

def rows(max_num_seqs: int, num_lanes: int = 1) -> ServingConfig:
    return ServingConfig(num_lanes, max_num_seqs, 4096, 4096)


def no_progress(*_) -> None:
    pass


def warmup_calls(recorder: Recorder) -> list[tuple[str, bool]]:
    return [(name.removeprefix("model.warmup_model_"), details["enable_trace"])
            for name, details in recorder.calls if name.startswith("model.warmup_model_")]


@pytest.mark.parametrize("trace_mode, expected", [
    ("all", [("prefill", False), ("decode", False), ("prefill", True), ("decode", True)]),
    ("decode_only", [("prefill", False), ("decode", False), ("decode", True)]),
    ("none", [("prefill", False), ("decode", False)]),
])
def test_warmup_compiles_every_shape_untraced_before_capturing(trace_mode, expected):
    backend, ttnn, model_cls = opened_backend(trace_mode=trace_mode)
    model = model_cls(backend.mesh, 32)
    backend.warmup(model, "kv", rows(32), 64, no_progress)
    # the capture pass of prefill really runs: the Generator's once-only guard is reset before it
    assert warmup_calls(ttnn.recorder) == expected


def test_warmup_passes_the_cache_shapes_and_sampling_ceiling():
    backend, ttnn, model_cls = opened_backend(sample_on_device_mode="decode_only")
    backend.warmup(model_cls(backend.mesh, 32), "kv", rows(32, num_lanes=4), 2080, no_progress)
    for call in ttnn.recorder.only("model.warmup_model_prefill"):
        assert call["kv_cache"] == "kv" and call["can_sample_on_device"] is False
    for call in ttnn.recorder.only("model.warmup_model_decode"):
        assert (call["kv_cache"], call["max_batch_size"], call["num_blocks"]) == ("kv", 128, 2080)
        assert call["can_sample_on_device"] is True


def test_warmup_reports_progress_to_the_end():
    backend, _, model_cls = opened_backend()
    seen = []
    backend.warmup(model_cls(backend.mesh, 32), "kv", rows(32), 8, lambda *event: seen.append(event))
    assert [(phase, done, total) for phase, done, total, _ in seen] == (
        [("compile", 0, 4), ("compile", 1, 4), ("compile", 2, 4), ("capture", 3, 4), ("capture", 4, 4)])
    assert seen[0][3] == "compile prefill" and "warm in" in seen[-1][3]


def test_a_too_small_trace_region_is_reported_with_the_size_needed():
    backend, _, model_cls = opened_backend()
    model = model_cls(backend.mesh, 32)

    def capture(**kwargs):
        if kwargs["enable_trace"]:
            raise RuntimeError("TT_FATAL @ mesh_trace.cpp:9: ok\ninfo:\nCreating trace buffers of size "
                               "61440000B on MeshDevice 1, but only 50000000B is allocated for trace "
                               "region.\nbacktrace:\n --- x")

    model.warmup_model_decode = capture
    with pytest.raises(TraceRegionError) as e:
        backend.warmup(model, "kv", rows(32), 8, no_progress)
    assert "needs 61,440,000 bytes but the trace region holds 50,000,000" in str(e.value)
    assert "tt.trace_region_size 61440000" in str(e.value)


def test_a_warmup_hook_needing_unknown_arguments_is_a_contract_error():
    backend, _, model_cls = opened_backend()
    model = model_cls(backend.mesh, 32)
    model.warmup_model_prefill = lambda kv_cache, enable_trace, sampling_params: None
    with pytest.raises(ModelContractError, match="sampling_params"):
        backend.warmup(model, "kv", rows(32), 8, no_progress)


# ---- steps -------------------------------------------------------------------------------------

ROWS = 4


def step(tokens=(5, 9, 0, 0), positions=(3, 7, -1, -1), blocks=((1,), (2,), (3,), (4,))) -> dict:
    """decode_forward's inputs for a 4-row mesh batch (host tensors, as the contract has them)."""
    return {"tokens": torch.tensor(tokens).reshape(-1, 1), "start_pos": torch.tensor(positions),
            "page_table": torch.tensor(blocks, dtype=torch.int32), "kv_cache": "kv"}


def greedy(rows: int = ROWS, seed=None) -> SamplingParams:
    return SamplingParams(temperature=[0.0] * rows, top_k=[1] * rows, top_p=[1.0] * rows,
                          seed=seed or [None] * rows)


def prefill_inputs() -> dict:
    return {"tokens": torch.tensor([[4, 5, 6]]), "page_table": torch.tensor([[1]], dtype=torch.int32),
            "kv_cache": "kv", "prompt_lens": torch.tensor([3]), "start_pos": torch.tensor([0]),
            "empty_slots": [0]}


def sequence(recorder: Recorder) -> list[tuple]:
    """The calls in order, with the argument that tells each apart."""
    key = {"model.decode_forward": lambda d: (d["reset_batch"], d["inputs"]),
           "model.read_decode_output": lambda d: d["async_read"],
           "model.process_decode_output_host": lambda d: d["is_tokens"],
           "ttnn.record_event": lambda d: d["event"], "ttnn.event_synchronize": lambda d: d["event"]}
    return [(name, key[name](details)) if name in key else (name,) for name, details in recorder.calls]


@pytest.mark.parametrize("trace_mode, flags", [("all", TraceFlags(True, True)),
                                               ("decode_only", TraceFlags(False, True)),
                                               ("none", TraceFlags(False, False))])
def test_each_step_kind_gets_its_trace_flag(trace_mode, flags):
    backend, ttnn, model_cls = opened_backend(trace_mode=trace_mode)
    model = model_cls(backend.mesh, ROWS)
    assert backend.trace == flags
    logits = backend.prefill(model, **prefill_inputs())
    assert int(logits.reshape(1, -1).argmax()) == next_token(6, 2, model.vocab_size)
    backend.finish_decode(model, backend.launch_decode(model, None, **step()))
    assert ttnn.recorder.only("model.prefill_forward")[0]["enable_trace"] is flags.prefill
    assert ttnn.recorder.only("model.decode_forward")[0]["enable_trace"] is flags.decode


def test_async_decode_launches_reads_asynchronously_then_syncs_every_event_before_processing():
    backend, ttnn, model_cls = opened_backend(sample_on_device_mode="all")
    model = model_cls(backend.mesh, ROWS)
    params = greedy()
    pending = backend.launch_decode(model, params, **step())  # the first decode: its inputs reload
    call = ttnn.recorder.only("model.decode_forward")[0]
    assert (call["tokens"], call["start_pos"], call["enable_trace"], call["read_from_device"],
            call["sampling_params"], call["reset_batch"]) == ([5, 9, 0, 0], [3, 7, -1, -1], True, False, params, True)
    # one read event per data-parallel group: one here (tt-metal's Generator.read_decode_output)
    assert sequence(ttnn.recorder) == [("model.decode_forward", (True, "host")), ("model.read_decode_output", True),
                                       ("ttnn.record_event", 1)]
    assert backend.decodes_in_flight == 1 and pending.is_tokens
    ttnn.recorder.calls.clear()
    tokens = backend.finish_decode(model, pending).reshape(-1).tolist()
    # (tokens, log-probs) from the model: the tokens alone come back
    assert tokens == [next_token(5, 3, 64), next_token(9, 7, 64), 0, 0]
    assert sequence(ttnn.recorder) == [("ttnn.event_synchronize", 1), ("model.process_decode_output_host", True)]
    assert backend.decodes_in_flight == 0


def test_host_sampled_async_decode_processes_logits():
    backend, ttnn, model_cls = opened_backend()
    model = model_cls(backend.mesh, ROWS)
    pending = backend.launch_decode(model, None, **step())
    logits = backend.finish_decode(model, pending)
    assert logits.shape == (ROWS, 1, 64) and int(logits[0].argmax()) == next_token(5, 3, 64)
    assert ttnn.recorder.only("model.process_decode_output_host") == [{"is_tokens": False}]


def test_a_decode_read_back_early_is_processed_once(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch)
    pending = launch(backend, model, greedy())
    # the next step drops row 1, so row 0's token must come to the host: read back early
    second = launch(backend, model, greedy(), pending, [0], tokens=(0, 0, 0, 0), positions=(4, -1, -1, -1))
    assert pending.read and backend.decodes_in_flight == 2  # read, not finished
    early = pending.result
    assert backend.finish_decode(model, pending) is early
    # a second readback of one submission would corrupt it (the plugin's DeferredDecodeOutput)
    assert [n for n, _ in ttnn.recorder.calls].count("model.process_decode_output_host") == 1
    assert [d["event"] for d in ttnn.recorder.only("ttnn.event_synchronize")] == [1]
    backend.finish_decode(model, second)


def test_at_most_two_decodes_are_in_flight():
    backend, _, model_cls = opened_backend()
    model = model_cls(backend.mesh, ROWS)
    first, second = backend.launch_decode(model, None, **step()), backend.launch_decode(model, None, **step())
    with pytest.raises(AssertionError, match="third"):
        backend.launch_decode(model, None, **step())
    backend.finish_decode(model, first)
    backend.finish_decode(model, second)
    with pytest.raises(AssertionError):
        backend.finish_decode(model, second)


def test_reset_batch_reaches_only_a_model_that_takes_it():
    backend, ttnn, model_cls = opened_backend(sample_on_device_mode="all")
    model = model_cls(backend.mesh, ROWS)
    backend.finish_decode(model, backend.launch_decode(model, greedy(), **step()))
    assert ttnn.recorder.only("model.decode_forward")[-1]["reset_batch"] is True  # a first decode reloads
    backend.reset()
    older = make_model_class(ttnn, takes_reset_batch=False)(backend.mesh, ROWS)
    backend.finish_decode(older, backend.launch_decode(older, greedy(), **step()))
    assert ttnn.recorder.only("model.decode_forward")[-1]["reset_batch"] is None  # not passed


def test_a_host_sampled_decode_of_a_legacy_generator_is_never_sent_reset_batch(monkeypatch):
    # The plugin sends reset_batch only with device sampling (async_decode.py submit_decode); a
    # decode_forward(*args, **kwargs) that forwards to a decode without it (tt-metal's Qwen3-VL)
    # would raise TypeError on it. Rows placed, kept and freed: none of these decodes gets one.
    backend, ttnn, _ = opened_backend(sample_on_device_mode="all")
    older = make_model_class(ttnn, takes_reset_batch=False)

    class Forwarding(older):
        def decode_forward(self, *args, **kwargs):
            return super().decode_forward(*args, **kwargs)

    model = Forwarding(backend.mesh, ROWS)
    for positions in ((3, 7, -1, -1), (4, 8, -1, -1), (5, -1, -1, -1), (6, -1, 2, -1)):
        backend.finish_decode(model, backend.launch_decode(model, None, **step(positions=positions)))
    calls = ttnn.recorder.only("model.decode_forward")
    assert [(c["reset_batch"], c["inputs"]) for c in calls] == [(None, "host")] * 4
    # the same generator, sampled on the device, is sent it (and refuses it, as the real one would)
    with pytest.raises(TypeError, match="reset_batch"):
        backend.launch_decode(model, greedy(), **step())


def test_each_data_parallel_group_records_one_read_event_and_all_are_waited_for(monkeypatch):
    backend, ttnn, model_cls = opened_backend(sample_on_device_mode="all")
    model = initialize(backend, model_cls, monkeypatch, num_lanes=2, max_num_seqs=2)
    ttnn.recorder.calls.clear()
    pending = backend.launch_decode(model, greedy(), **step())
    assert [d["event"] for d in ttnn.recorder.only("ttnn.record_event")] == [1, 2]
    backend.finish_decode(model, pending)
    assert sequence(ttnn.recorder)[-3:] == [("ttnn.event_synchronize", 1), ("ttnn.event_synchronize", 2),
                                            ("model.process_decode_output_host", True)]


@pytest.mark.parametrize("trace_mode, model, keeps", [
    ("all", {}, True), ("decode_only", {}, True), ("none", {}, False), ("all", {"takes_reset_batch": False}, False),
    ("all", {"decode_contract": 1}, True), ("all", {"decode_contract": 2}, True),
    # fail-closed without the capability, as the plugin: such a model may lack token feedback
    ("all", {"supports_async_decode": False}, False), ("all", {"decode_contract": 1, "supports_async_decode": False},
                                                       False)])
def test_only_a_traced_decode_of_a_model_that_declares_async_decode_keeps_its_inputs(trace_mode, model, keeps):
    backend, ttnn, _ = opened_backend(trace_mode=trace_mode)
    model = make_model_class(ttnn, **model)(backend.mesh, ROWS)
    assert backend.keeps_decode_inputs(model) is keeps


def test_a_device_failure_in_a_step_is_one_line():
    backend, _, model_cls = opened_backend()
    model = model_cls(backend.mesh, ROWS)

    def broken(**_):
        raise RuntimeError("TT_THROW @ dispatch.cpp:3: tt::exception\ninfo:\nTimeout waiting for device\n"
                           "backtrace:\n --- a")

    model.decode_forward = broken
    with pytest.raises(DeviceError, match=r"^decode: Timeout waiting for device$"):
        backend.launch_decode(model, None, **step())


# ---- device-resident decode inputs across pipelined steps ----------------------------------------

def resident_backend(monkeypatch, takes_reset_batch: bool = True, model: dict | None = None,
                     **options) -> tuple[TtnnBackend, FakeTtnn, object]:
    """A backend with an initialized fake model; `model`: make_model_class's keywords."""
    backend, ttnn, _ = opened_backend(**{"sample_on_device_mode": "all", **options})
    model = initialize(backend, make_model_class(ttnn, **{"takes_reset_batch": takes_reset_batch, **(model or {})}),
                       monkeypatch, max_num_seqs=ROWS, max_model_len=256)
    ttnn.recorder.calls.clear()
    return backend, ttnn, model


def launch(backend: TtnnBackend, model, params=None, previous=None, carried_rows=(), **inputs):
    return backend.launch_decode(model, params, **step(**inputs), previous=previous, carried_rows=carried_rows)


def test_a_pipelined_pair_runs_the_second_step_on_the_tokens_the_first_left_on_the_device(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch)
    assert backend.resident_tokens
    first = launch(backend, model, greedy())
    # step 2 is launched before step 1 is read back: its carried rows are placeholders (0)
    second = launch(backend, model, greedy(), first, [0, 1], tokens=(0, 0, 0, 0),
                    positions=(4, 8, -1, -1))
    assert sequence(ttnn.recorder) == [
        ("model.decode_forward", (True, "host")), ("model.read_decode_output", True), ("ttnn.record_event", 1),
        ("model.decode_forward", (False, "device")), ("model.read_decode_output", True), ("ttnn.record_event", 2)]
    calls = ttnn.recorder.only("model.decode_forward")
    assert [c["tokens"] for c in calls] == [[5, 9, 0, 0], [0, 0, 0, 0]]
    assert [c["start_pos"] for c in calls] == [[3, 7, -1, -1], [4, 8, -1, -1]]
    assert all(c["read_from_device"] is False and c["enable_trace"] is True for c in calls)
    # empty rows get a zeroed page-table row
    assert calls[0]["page_table"].tolist() == [[1], [2], [0], [0]]
    ttnn.recorder.calls.clear()
    a, b = next_token(5, 3, 64), next_token(9, 7, 64)
    assert backend.finish_decode(model, first).reshape(-1).tolist() == [a, b, 0, 0]
    assert backend.finish_decode(model, second).reshape(-1).tolist() == [
        next_token(a, 4, 64), next_token(b, 8, 64), 0, 0]
    assert sequence(ttnn.recorder) == [
        ("ttnn.event_synchronize", 1), ("model.process_decode_output_host", True),
        ("ttnn.event_synchronize", 2), ("model.process_decode_output_host", True)]


def test_a_pipelined_step_that_drops_a_row_reads_the_previous_step_back_first(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch)
    first = launch(backend, model, greedy())
    ttnn.recorder.calls.clear()
    # row 1 finished (max_tokens) with step 1: the device must stop decoding it, so every input
    # is uploaded, and row 0's token has to come from step 1's readback
    second = launch(backend, model, greedy(), first, [0], tokens=(0, 0, 0, 0),
                    positions=(4, -1, -1, -1))
    a = next_token(5, 3, 64)
    assert sequence(ttnn.recorder) == [
        ("ttnn.event_synchronize", 1), ("model.process_decode_output_host", True),
        ("model.decode_forward", (True, "host")), ("model.read_decode_output", True), ("ttnn.record_event", 2)]
    call = ttnn.recorder.only("model.decode_forward")[0]
    assert call["tokens"] == [a, 0, 0, 0] and call["page_table"].tolist() == [[1], [0], [0], [0]]
    ttnn.recorder.calls.clear()
    assert backend.finish_decode(model, first).reshape(-1).tolist()[:2] == [a, next_token(9, 7, 64)]
    assert ttnn.recorder.calls == []  # read once, early
    assert backend.finish_decode(model, second).reshape(-1).tolist()[0] == next_token(a, 4, 64)


def test_a_new_block_in_a_steady_step_refreshes_only_the_page_table(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch)
    first = launch(backend, model, greedy(), positions=(15, 7, -1, -1))
    second = launch(backend, model, greedy(), first, [0, 1], tokens=(0, 0, 0, 0),
                    positions=(16, 8, -1, -1), blocks=((1, 5), (2, 0), (3, 0), (4, 0)))
    call = ttnn.recorder.only("model.decode_forward")[1]
    assert (call["reset_batch"], call["inputs"]) == (False, "device+page_table")
    backend.finish_decode(model, first)
    a = next_token(5, 15, 64)
    assert backend.finish_decode(model, second).reshape(-1).tolist()[0] == next_token(a, 16, 64)


def test_steady_steps_keep_the_device_seeds_and_a_prefill_resets_them(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch)
    seeded = SamplingParams(temperature=[0.8, 0.0, 0.0, 0.0], top_k=[50, 1, 1, 1], top_p=[0.9, 1.0, 1.0, 1.0],
                            seed=[1234, None, None, None])
    out = backend.finish_decode(model, launch(backend, model, seeded))
    a = out.reshape(-1).tolist()[0]
    assert a == (next_token(5, 3, 64) + 1234) % 64
    backend.finish_decode(model, launch(backend, model, seeded, tokens=(a, 0, 0, 0), positions=(4, 8, -1, -1)))
    backend.prefill(model, **prefill_inputs(), sampling_params=None)
    backend.finish_decode(model, launch(backend, model, seeded, positions=(5, 9, -1, -1)))
    assert [c["reset_batch"] for c in ttnn.recorder.only("model.decode_forward")] == [True, False, True]


def test_a_host_sampled_step_makes_the_next_device_step_upload_its_inputs(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch)
    backend.finish_decode(model, launch(backend, model, greedy()))
    backend.finish_decode(model, launch(backend, model, None, tokens=(1, 2, 0, 0), positions=(4, 8, -1, -1)))
    backend.finish_decode(model, launch(backend, model, greedy(), tokens=(3, 4, 0, 0), positions=(5, 9, -1, -1)))
    # the host-sampled step reloads from the host without being told (None: no reset_batch passed)
    assert [(c["reset_batch"], c["inputs"]) for c in ttnn.recorder.only("model.decode_forward")] == [
        (True, "host"), (None, "host"), (True, "host")]


def test_untraced_decode_never_keeps_tokens_and_resets_only_when_rows_change(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch, trace_mode="none")
    assert not backend.resident_tokens
    for positions in ((3, 7, -1, -1), (4, 8, -1, -1), (5, -1, -1, -1)):
        backend.finish_decode(model, launch(backend, model, greedy(), positions=positions))
    assert [(c["reset_batch"], c["inputs"]) for c in ttnn.recorder.only("model.decode_forward")] == [
        (True, "host"), (False, "host"), (True, "host")]


def test_a_model_without_reset_batch_is_never_fed_from_the_device(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch, takes_reset_batch=False)
    assert not backend.resident_tokens
    with pytest.raises(AssertionError, match="cannot take its decode tokens from the device"):
        launch(backend, model, greedy(), launch(backend, model, greedy()), [0])


def test_a_legacy_model_without_async_decode_resets_only_on_transitions_and_gets_real_tokens(monkeypatch):
    # the plugin's legacy path: reset_batch follows the layout whatever the capabilities say
    backend, ttnn, model = resident_backend(monkeypatch, model={"supports_async_decode": False})
    assert not backend.resident_tokens
    first = backend.finish_decode(model, launch(backend, model, greedy())).reshape(-1)
    a, b = next_token(5, 3, 64), next_token(9, 7, 64)
    second = launch(backend, model, greedy(), first, [0, 1], tokens=(0, 0, 0, 0), positions=(4, 8, -1, -1))
    calls = ttnn.recorder.only("model.decode_forward")
    assert [(c["reset_batch"], c["inputs"]) for c in calls] == [(True, "host"), (False, "device")]
    assert calls[1]["tokens"] == [a, b, 0, 0]  # a token already on the host is no placeholder
    assert backend.finish_decode(model, second).reshape(-1).tolist()[:2] == [next_token(a, 4, 64),
                                                                             next_token(b, 8, 64)]


def test_a_resident_step_still_fills_carried_tokens_the_host_already_has(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch)
    first = backend.finish_decode(model, launch(backend, model, greedy())).reshape(-1)
    backend.finish_decode(model, launch(backend, model, greedy(), first, [0, 1], tokens=(0, 0, 0, 0),
                                        positions=(4, 8, -1, -1)))
    call = ttnn.recorder.only("model.decode_forward")[1]
    assert (call["reset_batch"], call["inputs"]) == (False, "device")
    assert call["tokens"] == [next_token(5, 3, 64), next_token(9, 7, 64), 0, 0]


def test_a_contract_model_without_async_decode_reloads_its_inputs_every_decode(monkeypatch):
    # DECODE_RELOAD_CONTRACT.md: the capability is fail-closed, "a full forward-input reload on
    # every version-1 decode"; the sampling state still resets only on a transition.
    backend, ttnn, model = resident_backend(monkeypatch, model={"decode_contract": 1, "supports_async_decode": False,
                                                                "token_feedback": False})
    assert not backend.resident_tokens
    first = backend.finish_decode(model, launch(backend, model, greedy())).reshape(-1)
    a, b = next_token(5, 3, 64), next_token(9, 7, 64)
    second = launch(backend, model, greedy(), first, [0, 1], tokens=(0, 0, 0, 0), positions=(4, 8, -1, -1))
    commands = ttnn.recorder.only("model.decode_commands")
    assert [c["reload_inputs"] for c in commands] == [True, True]
    assert [c["reload_page_table"] for c in commands] == [False, False]
    assert [(c["reload_sampling_params"], c["reset_sampling_state"]) for c in commands] == [(True, True),
                                                                                            (False, False)]
    assert ttnn.recorder.only("model.decode_forward")[1]["tokens"] == [a, b, 0, 0]
    assert backend.finish_decode(model, second).reshape(-1).tolist()[:2] == [next_token(a, 4, 64),
                                                                             next_token(b, 8, 64)]
    # what tt-metal's generator does when asked to run such a model on its resident inputs
    with pytest.raises(ValueError, match="no on-device decode token feedback"):
        model.decode_forward(**step(positions=(5, 9, -1, -1)), sampling_params=greedy(), read_from_device=False,
                             reload_inputs=False, reload_page_table=False, reload_sampling_params=False,
                             reset_sampling_state=False)


@pytest.mark.parametrize("version", [1, 2])
def test_a_later_contract_version_gets_the_same_commands(monkeypatch, version):
    # versions above 1 are backward-compatible supersets (DECODE_RELOAD_CONTRACT.md)
    backend, ttnn, model = resident_backend(monkeypatch, model={"decode_contract": version})
    assert backend.resident_tokens
    first = launch(backend, model, greedy(), positions=(15, 7, -1, -1))
    second = launch(backend, model, greedy(), first, [0, 1], tokens=(0, 0, 0, 0), positions=(16, 8, -1, -1),
                    blocks=((1, 5), (2, 0), (3, 0), (4, 0)))
    commands = ttnn.recorder.only("model.decode_commands")
    assert [(c["reload_inputs"], c["reload_page_table"], c["reload_sampling_params"], c["reset_sampling_state"])
            for c in commands] == [(True, False, True, True), (False, True, False, False)]
    assert all(c["reset_batch"] is None for c in ttnn.recorder.only("model.decode_forward"))
    a = backend.finish_decode(model, first).reshape(-1).tolist()[0]
    assert backend.finish_decode(model, second).reshape(-1).tolist()[0] == next_token(a, 16, 64)
    assert not ttnn.recorder.only("model.stale_page_table") and not ttnn.recorder.only("model.stale_sampling_params")


SEEDED = SamplingParams(temperature=[0.8, 0.0, 0.0, 0.0], top_k=[20, 1, 1, 1], top_p=[0.9, 1.0, 1.0, 1.0],
                        seed=[1234, None, None, None])


@pytest.mark.parametrize("trace_mode", ["none", "all"])
def test_a_switch_to_device_sampling_on_the_same_rows_uploads_the_sampling_state(monkeypatch, trace_mode):
    # the plugin's host -> device transition: reload, reload params, reset state, traced or not
    backend, ttnn, model = resident_backend(monkeypatch, model={"decode_contract": 1}, trace_mode=trace_mode)
    backend.finish_decode(model, launch(backend, model, None))
    out = backend.finish_decode(model, launch(backend, model, SEEDED, tokens=(1, 2, 0, 0), positions=(4, 8, -1, -1)))
    backend.finish_decode(model, launch(backend, model, SEEDED, tokens=(3, 4, 0, 0), positions=(5, 9, -1, -1)))
    commands = ttnn.recorder.only("model.decode_commands")
    assert [(c["reload_sampling_params"], c["reset_sampling_state"]) for c in commands] == [
        (False, False), (True, True), (False, False)]
    assert [c["reload_inputs"] for c in commands] == [True, True, trace_mode == "none"]
    assert out.reshape(-1).tolist()[0] == (next_token(1, 4, 64) + 1234) % 64
    assert not ttnn.recorder.only("model.stale_sampling_params")


def test_a_legacy_untraced_switch_to_device_sampling_resets_the_batch(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch, trace_mode="none")
    backend.finish_decode(model, launch(backend, model, None))
    out = backend.finish_decode(model, launch(backend, model, SEEDED, tokens=(1, 2, 0, 0), positions=(4, 8, -1, -1)))
    backend.finish_decode(model, launch(backend, model, SEEDED, tokens=(3, 4, 0, 0), positions=(5, 9, -1, -1)))
    assert [c["reset_batch"] for c in ttnn.recorder.only("model.decode_forward")] == [None, True, False]
    assert out.reshape(-1).tolist()[0] == (next_token(1, 4, 64) + 1234) % 64


def test_the_contract_fake_refuses_what_the_contract_refuses(monkeypatch):
    backend, ttnn, model = resident_backend(monkeypatch, model={"decode_contract": 1}, trace_mode="none")
    commands = {"reload_inputs": False, "reload_page_table": False, "reload_sampling_params": False,
                "reset_sampling_state": False}
    with pytest.raises(ValueError, match="Non-traced decode rebuilds"):
        model.decode_forward(**step(), sampling_params=greedy(), enable_trace=False, **commands)
    with pytest.raises(ValueError, match="reset_sampling_state needs authoritative"):
        model.decode_forward(**step(), sampling_params=greedy(), **{**commands, "reset_sampling_state": True})
    with pytest.raises(ValueError, match="predates it"):
        model.decode_forward(**step(), **{**commands, "reload_inputs": True}, reset_batch=True)


def test_device_sampling_params_are_tt_metals_with_a_seed_per_row(monkeypatch):
    fake_tt_generator.install(monkeypatch)
    backend, _, _ = resident_backend(monkeypatch)
    params = backend.sampling_params(SamplingBatch([0.0, 0.7], [0, 40], [1.0, 0.95]), [None, 7])
    assert params == SamplingParams(temperature=[0.0, 0.7], top_k=[0, 40], top_p=[1.0, 0.95], seed=[None, 7])


# ---- probing the host ----------------------------------------------------------------------------

def test_probe_without_ttnn_says_so_at_once():
    assert probe() == (False, probe_chips().reason)
    if sys.version_info[:2] not in ((3, 10), (3, 12)):
        assert "ttnn is not installed for this Python" in probe()[1]


@pytest.fixture
def ttnn_installed(monkeypatch):
    real = mesh_device.importlib.util.find_spec
    monkeypatch.setattr(mesh_device.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "ttnn" else real(name, *a))


def test_probe_without_device_nodes_does_not_start_ttnn(ttnn_installed, tmp_path, monkeypatch):
    monkeypatch.setattr(mesh_device.subprocess, "run", lambda *a, **k: pytest.fail("started ttnn"))
    ok, reason = probe(device_dir=str(tmp_path / "absent"))
    assert not ok and reason == (f"no Tenstorrent chips detected on this host "
                                 f"(no devices under {tmp_path / 'absent'})")


def test_probe_checks_visible_devices_against_the_device_nodes(ttnn_installed, tmp_path, monkeypatch):
    for node in ("0", "1"):
        (tmp_path / node).touch()
    monkeypatch.setenv("TT_VISIBLE_DEVICES", "1,4")
    assert probe(device_dir=str(tmp_path)) == (
        False, f"TT_VISIBLE_DEVICES names device(s) 4, but this host has 0,1 under {tmp_path}")
    monkeypatch.setenv("TT_VISIBLE_DEVICES", "one")
    assert "not a device id" in probe(device_dir=str(tmp_path))[1]


def test_probe_reads_what_the_child_process_found(ttnn_installed, monkeypatch):
    answer = {"num_devices": 32, "arch": "wormhole_b0", "cluster": "GALAXY"}
    monkeypatch.setattr(mesh_device.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout="log line\nTTSERVE_PROBE " + json.dumps(answer) + "\n", stderr=""))
    assert probe_chips(device_dir=None) == ChipProbe(True, "32 wormhole_b0 chip(s), cluster GALAXY",
                                                     32, "wormhole_b0", True, "GALAXY")


def test_probe_runs_ttnn_in_a_child_and_reports_an_import_failure(ttnn_installed):
    found = probe_chips(device_dir=None, timeout_s=30)   # a real child; this Python has no ttnn
    assert not found.ok and "import ttnn failed" in found.reason


def test_probe_never_hangs_on_a_stuck_ttnn(ttnn_installed, monkeypatch):
    monkeypatch.setattr(mesh_device, "_PROBE_SCRIPT", "import time; time.sleep(60)")
    found = probe_chips(device_dir=None, timeout_s=0.5)
    assert not found.ok and "did not answer within" in found.reason and "hung" in found.reason


def test_requiring_chips_on_a_host_without_them_fails_in_one_line(ttnn_installed, tmp_path):
    with pytest.raises(TtnnUnavailable) as e:
        require_chips(device_dir=str(tmp_path))
    assert str(e.value) == (f"ttnn backend: no Tenstorrent chips detected on this host (no devices "
                            f"under {tmp_path}); use --backend torch or sim")


# ---- the real wheel --------------------------------------------------------------------------------

TTNN_VENV_HELP = ("no Python with ttnn: create one with `/root/.pyenv/versions/3.12.1/bin/python3.12 -m venv "
                  ".venv-ttnn && .venv-ttnn/bin/pip install ttnn==0.81.1` (or set TTSERVE_TTNN_PYTHON)")


def _ttnn_python() -> str | None:
    for candidate in (os.environ.get("TTSERVE_TTNN_PYTHON"), REPO / ".venv-ttnn/bin/python",
                      "/tmp/ttnn312/bin/python"):
        if candidate and Path(candidate).exists():
            check = subprocess.run([str(candidate), "-c", "import importlib.util as u, sys; "
                                    "sys.exit(u.find_spec('ttnn') is None)"], capture_output=True)
            if check.returncode == 0:
                return str(candidate)
    return None


def test_real_ttnn_on_a_chipless_host_refuses_fast_and_clearly():
    python = _ttnn_python()
    if python is None:
        pytest.skip(TTNN_VENV_HELP)
    if Path(mesh_device.DEVICE_DIR).exists():
        pytest.skip("this host has Tenstorrent chips; the chipless check does not apply")
    done = subprocess.run([python, str(REPO / "tests/ttnn_real_check.py"), str(REPO)],
                          capture_output=True, text=True, timeout=120)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line, f"no result (status {done.returncode}): {done.stderr[-2000:]}"
    result = json.loads(line[len("RESULT "):])

    assert result["missing_names"] == []
    assert set(result["fabric_allowed"]) <= set(result["fabric_members"])
    assert set(result["reliability_allowed"]) <= set(result["reliability_members"])
    assert {"ROW", "COL"} <= set(result["axis_members"])

    assert result["probe"]["value"][0] is False
    assert "no Tenstorrent chips detected on this host" in result["probe"]["value"][1]
    assert result["probe_ttnn"]["value"] == [
        False, "no Tenstorrent chips detected on this host (ttnn: No chips detected in the cluster)"]
    expected = ("ttnn backend: no Tenstorrent chips detected on this host (ttnn: No chips detected in "
                "the cluster); use --backend torch or sim")
    for key in ("require", "open_n150", "open_t3k", "open_axis"):
        assert result[key]["error"] == "TtnnUnavailable" and result[key]["message"] == expected, key
    # Fast: no call waited for the probe's child process to time out (its reason would say "did
    # not answer within"); the bound is loose, for a loaded machine, yet far below the timeout.
    for key in ("probe", "probe_ttnn", "require", "open_n150", "open_t3k", "open_axis"):
        assert "did not answer within" not in json.dumps(result[key]), (key, result[key])
        assert result[key]["seconds"] < mesh_device.PROBE_TIMEOUT_S / 2, (key, result[key])
