"""The runner on the production path: ModelRunner driven through TtnnBackend, on a
recording fake mesh and a fake tt-metal model with deterministic tokens (tests/fakes).

Checks the tokens returned and what reached the model: warmup order and progress, prefill rows
of the page table, decode padded to the mesh's rows with position -1 for empty rows, trace flags
per trace_mode, tt-metal SamplingParams with seeds on the device path, the host sampler for a
batch that needs it, and a pipelined decode pair running on device-resident tokens."""
from __future__ import annotations

import json

import pytest
import torch
from fakes import fake_tt_generator
from fakes.fake_tt_generator import SamplingParams
from fakes.fake_tt_model import make_model_class, next_token
from fakes.fake_ttnn import FakeTtnn

from ttserve.worker.backends.ttnn.backend import TtnnBackend
from ttserve.worker.batch import DecodeItem, HostSampling, NewRequest, PrefillChunk, ServingConfig, StepBatch
from ttserve.worker.device import PendingDecode
from ttserve.worker.planning.mesh import resolve_mesh
from ttserve.worker.runner import DeviceOptions, ModelRunner

VOCAB = 64
BLOCK = 16
CONFIG = ServingConfig(num_lanes=1, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256)
ROWS = CONFIG.num_lanes * CONFIG.max_num_seqs
PROMPTS = {"greedy": [1, 5, 9, 13, 17], "seeded": [2, 4, 6]}
ROW = {"greedy": 0, "seeded": 2}
BLOCKS = {"greedy": [3], "seeded": [7]}
SEED = 1234


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "max_position_embeddings": 256, "eos_token_id": 2}))
    return tmp_path


def ttnn_runner(model_dir, monkeypatch, **tt) -> tuple[ModelRunner, FakeTtnn, list]:
    fake_tt_generator.install(monkeypatch)
    ttnn = FakeTtnn()
    backend = TtnnBackend(resolve_mesh("N300", 2), tt, ttnn=ttnn)
    runner = ModelRunner(model_dir, make_model_class(ttnn, vocab_size=VOCAB), "LlamaForCausalLM", backend,
                         torch.bfloat16, block_size=BLOCK, kv_cache_bytes=0,
                         options=DeviceOptions(tt, backend_traces=True, kv_tokens_per_lane=4096))
    progress: list = []
    runner.warmup(CONFIG, lambda phase, done, total, detail: progress.append((phase, done, total, detail)))
    return runner, ttnn, progress


def new_requests(host: HostSampling | None = None) -> list[NewRequest]:
    return [NewRequest("greedy", 0, ROW["greedy"], 0.0, 1.0, 0, None, host=host),
            NewRequest("seeded", 0, ROW["seeded"], 0.8, 0.9, 20, SEED)]


def prefill(runner: ModelRunner, host: HostSampling | None = None):
    return runner.execute(StepBatch(1, "prefill", new_requests=new_requests(host), prefill=[
        PrefillChunk(rid, ids, 0, BLOCKS[rid], True) for rid, ids in PROMPTS.items()]))


def expected(rid: str, token: int, position: int, on_device: bool = True) -> int:
    """The fake's token: its device sampler adds a sampled row's seed; the host sampler picks the
    logits' target."""
    target = next_token(token, position, VOCAB)
    return (target + SEED) % VOCAB if on_device and rid == "seeded" else target


def decode(runner: ModelRunner, step_id: int, last: dict[str, int], position: dict[str, int],
           **batch) -> StepBatch:
    return StepBatch(step_id, "decode", decode=[DecodeItem(rid, last[rid], position[rid], []) for rid in last],
                     **batch)


def model_calls(ttnn: FakeTtnn) -> list[str]:
    return [name for name, _ in ttnn.recorder.calls if name.startswith(("model.", "ttnn.event"))]


# ---- warmup ------------------------------------------------------------------------------------

@pytest.mark.parametrize("trace_mode, captured", [("all", ["prefill", "decode"]), ("decode_only", ["decode"]),
                                                  ("none", [])])
def test_warmup_builds_the_model_on_the_mesh_then_compiles_before_capturing(model_dir, monkeypatch, trace_mode,
                                                                            captured):
    runner, ttnn, progress = ttnn_runner(model_dir, monkeypatch, trace_mode=trace_mode,
                                         sample_on_device_mode="decode_only")
    init = ttnn.recorder.only("model.initialize_vllm_model")[0]
    assert (init["max_batch_size"], init["max_seq_len"], init["tt_data_parallel"]) == (ROWS, 256, 1)
    assert init["hf_config"].vocab_size == VOCAB  # a transformers config, as tt-metal reads it
    kv = ttnn.recorder.only("model.allocate_kv_cache")[0]
    # 4 seqs x 256 tokens in 16-token blocks, and block 0 (the null block the model's padding
    # writes into); 2 KV heads over the N300's 2 chips; head_dim 64 / 4
    assert (kv["kv_cache_shape"], kv["dtype"], kv["num_layers"]) == ((64 + 1, 1, BLOCK, 16), torch.bfloat16, 2)
    assert runner.layout.num_blocks_per_lane == 64
    warmups = [(n.removeprefix("model.warmup_model_"), d["enable_trace"]) for n, d in ttnn.recorder.calls
               if n.startswith("model.warmup_model_")]
    assert warmups == [("prefill", False), ("decode", False)] + [(kind, True) for kind in captured]
    decode_warmup = ttnn.recorder.only("model.warmup_model_decode")[0]
    assert (decode_warmup["max_batch_size"], decode_warmup["num_blocks"], decode_warmup["can_sample_on_device"]) == (
        ROWS, 256 // BLOCK, True)
    assert ttnn.recorder.only("model.warmup_model_prefill")[0]["can_sample_on_device"] is False
    steps = 2 + len(captured)
    assert [(p, d, t) for p, d, t, _ in progress] == (
        [("load", 0, 1), ("load", 1, 1), ("allocate", 0, 1), ("allocate", 1, 1)]
        + [("compile", i, steps) for i in range(3)] + [("capture", i, steps) for i in range(3, steps + 1)])
    assert progress[4][3] == "compile prefill"


# ---- prefill and decode on the device ------------------------------------------------------------

@pytest.mark.parametrize("trace_mode", ["all", "decode_only", "none"])
def test_prefill_then_decode_sample_on_the_device_with_tt_metal_params(model_dir, monkeypatch, trace_mode):
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, trace_mode=trace_mode, sample_on_device_mode="all")
    ttnn.recorder.calls.clear()
    first = prefill(runner)
    assert first.sampled_on_device
    last = {rid: expected(rid, ids[-1], len(ids) - 1) for rid, ids in PROMPTS.items()}
    assert first.tokens == last

    call = ttnn.recorder.only("model.prefill_forward")[0]
    assert call["enable_trace"] is (trace_mode == "all")
    assert call["empty_slots"] == [ROW["greedy"], ROW["seeded"]]
    assert call["prompt_lens"] == [5, 3] and call["start_pos"] == [0, 0]
    # Device block = the control plane's + 1: block 0 takes padding (TtnnBackend.null_block).
    assert call["page_table"][:, 0].tolist() == [BLOCKS["greedy"][0] + 1, BLOCKS["seeded"][0] + 1]
    assert call["tokens"].tolist() == [PROMPTS["greedy"], PROMPTS["seeded"] + [0, 0]]
    params = call["sampling_params"]
    assert isinstance(params, SamplingParams)
    assert params == SamplingParams(temperature=[0.0, 0.8], top_k=[0, 20], top_p=[1.0, 0.9], seed=[None, SEED])

    position = {rid: len(ids) for rid, ids in PROMPTS.items()}
    for step_id in range(2, 5):
        ttnn.recorder.calls.clear()
        result = runner.execute(decode(runner, step_id, last, position))
        last = {rid: expected(rid, last[rid], position[rid]) for rid in last}
        assert result.tokens == last and result.sampled_on_device and result.traced is (trace_mode != "none")
        call = ttnn.recorder.only("model.decode_forward")[0]
        assert call["start_pos"] == [position["greedy"], -1, position["seeded"], -1]
        assert call["page_table"][:, 0].tolist() == [BLOCKS["greedy"][0] + 1, 0, BLOCKS["seeded"][0] + 1, 0]
        assert call["enable_trace"] is (trace_mode != "none") and call["read_from_device"] is False
        assert call["sampling_params"].seed == [None, None, SEED, None]
        # the first decode after a prefill reloads the device's inputs (and seeds); then steady
        assert call["reset_batch"] is (step_id == 2)
        assert ttnn.recorder.only("model.read_decode_output") == [{"async_read": True}]
        # one read event: one data-parallel group (tt-metal's Generator.read_decode_output)
        assert model_calls(ttnn) == ["model.decode_forward", "model.read_decode_output", "ttnn.event_synchronize",
                                     "model.process_decode_output_host"]
        position = {rid: p + 1 for rid, p in position.items()}


# ---- host sampling -------------------------------------------------------------------------------

@pytest.mark.parametrize("host", [HostSampling(logprobs=2), HostSampling(presence_penalty=0.5)],
                         ids=["logprobs", "penalty"])
def test_a_batch_that_needs_the_host_sampler_gets_logits_and_the_next_returns_to_the_device(
        model_dir, monkeypatch, host):
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, sample_on_device_mode="all")
    ttnn.recorder.calls.clear()
    first = prefill(runner, host)
    assert not first.sampled_on_device
    assert ttnn.recorder.only("model.prefill_forward")[0]["sampling_params"] is None
    last = {rid: expected(rid, ids[-1], len(ids) - 1, on_device=False) for rid, ids in PROMPTS.items()}
    assert first.tokens == last
    assert set(first.logprobs) == ({"greedy"} if host.logprobs else set())

    position = {rid: len(ids) for rid, ids in PROMPTS.items()}
    ttnn.recorder.calls.clear()
    result = runner.execute(decode(runner, 2, last, position))
    last = {rid: expected(rid, last[rid], position[rid], on_device=False) for rid in last}
    assert result.tokens == last and not result.sampled_on_device
    call = ttnn.recorder.only("model.decode_forward")[0]
    assert call["sampling_params"] is None and call["tokens"] == [
        first.tokens["greedy"], 0, first.tokens["seeded"], 0]
    # host-sampled: no reset_batch (the plugin sends it only with device sampling); it reloads anyway
    assert call["reset_batch"] is None and call["inputs"] == "host"
    assert ttnn.recorder.only("model.process_decode_output_host") == [{"is_tokens": False}]
    if host.logprobs:
        logprobs = result.logprobs["greedy"]
        assert logprobs.token_ids[0] == last["greedy"] and logprobs.rank == 1 and len(logprobs.token_ids) == 3

    # the request that needed the host leaves: the next batch samples on the device again
    position = {"seeded": position["seeded"] + 1}
    ttnn.recorder.calls.clear()
    result = runner.execute(decode(runner, 3, {"seeded": last["seeded"]}, position, released_ids=["greedy"]))
    assert result.sampled_on_device and result.tokens == {"seeded": expected("seeded", last["seeded"],
                                                                             position["seeded"])}
    call = ttnn.recorder.only("model.decode_forward")[0]
    assert call["reset_batch"] is True and call["inputs"] == "host"
    assert call["start_pos"] == [-1, -1, position["seeded"], -1]


# ---- async decode: a pipelined pair on device-resident tokens --------------------------------------

def test_a_pipelined_decode_pair_feeds_the_second_step_from_the_device(model_dir, monkeypatch):
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, sample_on_device_mode="all")
    assert runner.async_decode and runner.backend.resident_tokens
    last = prefill(runner).tokens
    position = {rid: len(ids) for rid, ids in PROMPTS.items()}
    ttnn.recorder.calls.clear()

    # as the worker's step stream does it: launch N, launch N+1, finish N, finish N+1
    n = runner.launch(decode(runner, 2, last, position, async_readback=True))
    assert n.deferred and isinstance(runner._previous_tokens, PendingDecode)
    follow = StepBatch(3, "decode", async_readback=True, decode=[
        DecodeItem(rid, 0, position[rid] + 1, [], use_previous_token=True) for rid in last])
    n1 = runner.launch(follow)
    assert n1.deferred
    assert model_calls(ttnn) == ["model.decode_forward", "model.read_decode_output",
                                 "model.decode_forward", "model.read_decode_output"]  # nothing waited for
    calls = ttnn.recorder.only("model.decode_forward")
    assert [(c["reset_batch"], c["inputs"]) for c in calls] == [(True, "host"), (False, "device")]
    assert calls[1]["tokens"] == [0, 0, 0, 0]  # placeholders: the model runs on its own inputs
    assert calls[1]["start_pos"] == [position["greedy"] + 1, -1, position["seeded"] + 1, -1]

    first, second = runner.finish(n), runner.finish(n1)
    step2 = {rid: expected(rid, last[rid], position[rid]) for rid in last}
    step3 = {rid: expected(rid, step2[rid], position[rid] + 1) for rid in last}
    assert (first.step_id, first.tokens) == (2, step2) and (second.step_id, second.tokens) == (3, step3)

    # step 3 ended "greedy" (say max_tokens): the next follow-up carries "seeded" only, so the device
    # must drop row 0, which needs every input uploaded from the host; step 3's tokens are already
    # read back (finished), and are not read again
    ttnn.recorder.calls.clear()
    n2 = runner.launch(StepBatch(4, "decode", async_readback=True, released_ids=["greedy"], decode=[
        DecodeItem("seeded", 0, position["seeded"] + 2, [], use_previous_token=True)]))
    assert model_calls(ttnn) == ["model.decode_forward", "model.read_decode_output"]
    call = ttnn.recorder.only("model.decode_forward")[0]
    assert (call["reset_batch"], call["inputs"]) == (True, "host")
    assert call["tokens"] == [0, 0, step3["seeded"], 0]
    assert runner.finish(n2).tokens == {"seeded": expected("seeded", step3["seeded"], position["seeded"] + 2)}


def test_the_runner_returns_a_pipelined_decode_after_the_next_batch_is_launched(model_dir, monkeypatch):
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, sample_on_device_mode="all")
    last = prefill(runner).tokens
    position = {rid: len(ids) for rid, ids in PROMPTS.items()}
    assert runner.step(decode(runner, 2, last, position, async_readback=True)) == []  # held on the device
    follow = StepBatch(3, "decode", async_readback=True, decode=[
        DecodeItem(rid, 0, position[rid] + 1, [], use_previous_token=True) for rid in last])
    [second] = runner.step(follow)                      # step 2 comes back once step 3 is launched
    assert (second.step_id, second.kind) == (2, "decode") and second.total_s >= second.model_s > 0
    [third, flush] = runner.step(StepBatch(4, "empty"))  # a flush returns the held step, then itself
    assert (third.step_id, flush.step_id) == (3, 4) and not runner._deferred


def test_a_stream_that_ends_with_a_decode_in_flight_leaves_the_next_stream_a_clean_device(
        model_dir, monkeypatch):
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, sample_on_device_mode="all")
    position = {rid: len(ids) for rid, ids in PROMPTS.items()}
    for stream in range(2):
        last = prefill(runner).tokens
        held = runner.launch(decode(runner, 2, last, position, async_readback=True))
        runner.launch(StepBatch(3, "decode", async_readback=True, decode=[
            DecodeItem(rid, 0, position[rid] + 1, [], use_previous_token=True) for rid in last]))
        assert runner.finish(held).tokens  # the control plane went away with step 3 in flight
        runner.reset()  # the next step stream
        assert runner.backend.decodes_in_flight == 0
    ttnn.recorder.calls.clear()
    last = prefill(runner).tokens
    runner.launch(decode(runner, 2, last, position, async_readback=True))
    call = ttnn.recorder.only("model.decode_forward")[0]
    assert (call["reset_batch"], call["inputs"]) == (True, "host")  # nothing of the old stream reused


def test_a_carried_row_whose_step_is_still_in_flight_is_read_back_before_an_unsteady_launch(
        model_dir, monkeypatch):
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, sample_on_device_mode="all")
    last = prefill(runner).tokens
    position = {rid: len(ids) for rid, ids in PROMPTS.items()}
    n = runner.launch(decode(runner, 2, last, position, async_readback=True))
    ttnn.recorder.calls.clear()
    # "greedy" is aborted while step 2 is on the device: step 3 changes the rows
    n1 = runner.launch(StepBatch(3, "decode", async_readback=True, released_ids=["greedy"], decode=[
        DecodeItem("seeded", 0, position["seeded"] + 1, [], use_previous_token=True)]))
    assert model_calls(ttnn)[:3] == ["ttnn.event_synchronize", "model.process_decode_output_host",
                                     "model.decode_forward"]
    step2 = {rid: expected(rid, last[rid], position[rid]) for rid in last}
    assert ttnn.recorder.only("model.decode_forward")[0]["tokens"] == [0, 0, step2["seeded"], 0]
    assert runner.finish(n).tokens == {"seeded": step2["seeded"]}  # "greedy" was released meanwhile
    assert runner.finish(n1).tokens == {"seeded": expected("seeded", step2["seeded"], position["seeded"] + 1)}


@pytest.mark.parametrize("tt", [{"trace_mode": "none", "sample_on_device_mode": "all"}, {}],
                         ids=["untraced", "host-sampling"])
def test_without_traced_device_sampling_decode_is_not_pipelined(model_dir, monkeypatch, tt):
    runner, _, _ = ttnn_runner(model_dir, monkeypatch, **tt)
    assert not runner.async_decode
    last = prefill(runner).tokens
    launched = runner.launch(decode(runner, 2, last, {rid: len(ids) for rid, ids in PROMPTS.items()},
                                    async_readback=True))
    assert not launched.deferred


def test_closing_the_runner_releases_the_model_then_closes_the_mesh(model_dir, monkeypatch):
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, sample_on_device_mode="all")
    last = prefill(runner).tokens
    runner.launch(decode(runner, 2, last, {rid: len(ids) for rid, ids in PROMPTS.items()},
                         async_readback=True))
    ttnn.recorder.calls.clear()
    runner.close()
    backend = runner.backend
    assert runner.model is None and backend.mesh is None and backend.decodes_in_flight == 0
    assert "ttnn.close_mesh_device" in [name for name, _ in ttnn.recorder.calls]


def test_warmup_can_be_turned_off(model_dir, monkeypatch):
    runner, ttnn, progress = ttnn_runner(model_dir, monkeypatch, enable_model_warmup=False)
    assert not ttnn.recorder.only("model.warmup_model_prefill") + ttnn.recorder.only("model.warmup_model_decode")
    assert progress[-1][:3] == ("compile", 0, 0) and runner.config is not None  # ready all the same


def test_a_released_rows_page_table_is_cleared_before_the_row_serves_again(model_dir, monkeypatch):
    """A model pads prefills through the zero-padded page table (into the null block): ids a
    released request left in its row past a new request's blocks would send the new request's
    padding into blocks another request now owns."""
    runner, ttnn, _ = ttnn_runner(model_dir, monkeypatch, trace_mode="none")
    runner.execute(StepBatch(1, "prefill", new_requests=[NewRequest("a", 0, ROW["greedy"], 0.0, 1.0, 0, None)],
                             prefill=[PrefillChunk("a", list(range(1, 40)), 0, [3, 4, 5], True)]))
    ttnn.recorder.calls.clear()
    runner.execute(StepBatch(2, "prefill", released_ids=["a"],
                             new_requests=[NewRequest("b", 0, ROW["greedy"], 0.0, 1.0, 0, None)],
                             prefill=[PrefillChunk("b", [1, 5, 9], 0, [9], True)]))
    [call] = ttnn.recorder.only("model.prefill_forward")
    assert call["page_table"][0].tolist()[:3] == [9 + 1, 0, 0]  # b's block (device id), then nothing of a's
