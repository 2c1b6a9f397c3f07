"""Gateway conversions between vLLM's engine-core objects and engine.proto (no processes)."""
from __future__ import annotations

import pytest

from ttserve.gateway import convert
from ttserve.gateway.errors import ControlPlaneUnavailable, RequestRefused
from ttserve.v1 import engine_pb2

from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.engine import EngineCoreEventType, EngineCoreRequest, FinishReason

EOS = 2
GENERATION_CONFIG = {"eos_token_id": [EOS, 5]}  # a model with a second EOS id


def core_request(prompt=(1, 2, 3), request_id="req-1", **sampling) -> EngineCoreRequest:
    """An EngineCoreRequest as vLLM's InputProcessor leaves it: max_tokens set, EOS merged."""
    sampling.setdefault("max_tokens", 16)
    sp = SamplingParams(**sampling)
    sp.update_from_generation_config(GENERATION_CONFIG, EOS)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=list(prompt), mm_features=None,
                             sampling_params=sp, pooling_params=None, arrival_time=1234.5,
                             lora_request=None, cache_salt=None, data_parallel_rank=None)


# ---- requests ------------------------------------------------------------------------------
def test_add_request_carries_identity_prompt_and_scheduling_fields():
    req = core_request(prompt=[10, 11, 12])
    req.cache_salt, req.priority = "tenant-a", 3
    add = convert.to_add_request(req)
    assert add.request_id == "req-1"
    assert list(add.prompt_token_ids) == [10, 11, 12]
    assert add.arrival_time == 1234.5
    assert add.cache_salt == "tenant-a" and add.priority == 3
    assert convert.to_add_request(core_request()).cache_salt == ""


def test_add_request_carries_sampling_fields():
    req = core_request(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=42,
                       presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                       max_tokens=33, min_tokens=4, stop_token_ids=[7, 8],
                       logit_bias={100: -5.0, 200: 2.5}, allowed_token_ids=[1, 2, 3])
    req.sampling_params._bad_words_token_ids = [[9], [10, 11]]
    s = convert.to_add_request(req).sampling
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert s.top_k == 40 and s.min_p == pytest.approx(0.05)
    assert s.HasField("seed") and s.seed == 42
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, 0.25)
    assert s.repetition_penalty == pytest.approx(1.1)
    assert s.max_tokens == 33 and s.min_tokens == 4
    assert set(s.stop_token_ids) == {7, 8, 5}  # generation_config's extra EOS joins the stop ids
    assert not s.ignore_eos
    assert dict(s.logit_bias) == {100: -5.0, 200: 2.5}
    assert list(s.allowed_token_ids) == [1, 2, 3]
    assert [list(b.token_ids) for b in s.bad_words] == [[9], [10, 11]]
    assert not s.HasField("logprobs") and not s.HasField("prompt_logprobs")


def test_neutral_sampling_is_sent_as_neutral_values():
    s = convert.to_add_request(core_request()).sampling
    assert not s.HasField("seed")
    assert (s.min_p, s.presence_penalty, s.frequency_penalty) == (0, 0, 0)
    assert s.repetition_penalty == 1.0 and s.top_p == 1.0 and s.top_k in (0, -1)
    assert not s.logit_bias and not s.allowed_token_ids and not s.bad_words


def test_greedy_request_is_sent_greedy_with_its_filters_off():
    # temperature 0 is also the protobuf default, so it alone would pass with the field unset:
    # vLLM turns the filters of a greedy request off, and top_p must arrive as the 1.0 it sets.
    s = convert.to_add_request(core_request(temperature=0.0, top_p=0.5, top_k=40, min_p=0.2)).sampling
    assert s.temperature == 0.0 and s.top_p == 1.0 and s.top_k in (0, -1) and s.min_p == 0.0
    # The smallest temperature vLLM samples at (it raises lower ones to 0.01) is not sent as greedy.
    tiny = convert.to_add_request(core_request(temperature=0.001)).sampling
    assert tiny.temperature == pytest.approx(0.01)


def test_negative_seed_maps_to_a_distinct_uint64():
    a = convert.to_add_request(core_request(seed=-2)).sampling.seed
    b = convert.to_add_request(core_request(seed=-3)).sampling.seed
    assert a == 2**64 - 2 and b == 2**64 - 3  # (vLLM reads seed=-1 as "no seed")


def test_logprob_fields_are_passed_when_set():
    s = convert.to_add_request(core_request(logprobs=3, prompt_logprobs=1)).sampling
    assert s.logprobs == 3 and s.prompt_logprobs == 1


def test_eos_ids_are_the_models_eos_and_stop_ids_stay_separate():
    add = convert.to_add_request(core_request(stop_token_ids=[7]))
    assert list(add.eos_token_ids) == [EOS]
    assert set(add.sampling.stop_token_ids) == {5, 7}


def test_ignore_eos_still_reports_every_eos_id_and_only_user_stop_ids():
    add = convert.to_add_request(core_request(stop_token_ids=[7], ignore_eos=True))
    assert add.sampling.ignore_eos
    assert list(add.eos_token_ids) == [EOS, 5]
    assert list(add.sampling.stop_token_ids) == [7]


@pytest.mark.parametrize("sampling, word", [
    ({"logprob_token_ids": [3, 4]}, "logprob_token_ids"),
    ({"structured_outputs": StructuredOutputsParams(structural_tag='{"structures": []}')}, "structural_tag"),
])
def test_options_the_protocol_cannot_carry_are_named(sampling, word):
    reason = convert.unsupported_by_protocol(core_request(**sampling))
    assert reason is not None and word in reason


@pytest.mark.parametrize("params, kind, text", [
    (StructuredOutputsParams(json={"type": "object"}), "json", '{"type": "object"}'),
    (StructuredOutputsParams(json='{"type": "string"}'), "json", '{"type": "string"}'),
    (StructuredOutputsParams(json_object=True), "json_object", True),
    (StructuredOutputsParams(regex="a+"), "regex", "a+"),
    (StructuredOutputsParams(choice=["x", "y"]), "choice", '["x", "y"]'),
    (StructuredOutputsParams(grammar="start: /a+/"), "grammar", "start: /a+/"),
])
def test_structured_outputs_are_carried_with_compact_json_by_default(params, kind, text):
    request = core_request(structured_outputs=params)
    assert convert.unsupported_by_protocol(request) is None
    so = convert.to_add_request(request).structured_output
    assert so.WhichOneof("kind") == kind and getattr(so, kind) == text
    assert not so.whitespace_flexible
    assert so.disable_additional_properties  # as vLLM's default xgrammar backend enforces schemas
    flexible = convert.to_add_request(request, disable_any_whitespace=False,
                                      disable_additional_properties=False).structured_output
    assert flexible.whitespace_flexible and not flexible.disable_additional_properties


def test_request_without_structured_output_carries_none():
    assert not convert.to_add_request(core_request()).HasField("structured_output")


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.5, presence_penalty=1.0),  # a plain request
    dict(logprobs=5, prompt_logprobs=1),  # carried for the control plane to decide
], ids=["plain", "logprobs"])
def test_requests_the_protocol_can_carry_are_accepted(sampling):
    assert convert.unsupported_by_protocol(core_request(**sampling)) is None


# ---- outputs -------------------------------------------------------------------------------
def request_output(request_id="req-1", tokens=(), finish=engine_pb2.FINISH_REASON_UNSPECIFIED,
                   stop_token_id=None, cached=0, error=""):
    out = engine_pb2.RequestOutput(request_id=request_id, new_token_ids=list(tokens), finish_reason=finish,
                                   num_cached_tokens=cached, error=error)
    if stop_token_id is not None:
        out.stop_token_id = stop_token_id
    return out


def test_first_output_carries_prefill_stats_and_events_then_plain_deltas():
    track = convert.RequestTrack.of(core_request(prompt=range(100)))
    first = convert.to_engine_core_output(request_output(tokens=[5], cached=64), track)
    assert first.new_token_ids == [5] and first.finish_reason is None
    stats = first.prefill_stats
    assert (stats.num_prompt_tokens, stats.num_cached_tokens, stats.num_computed_tokens) == (100, 64, 36)
    assert stats.num_local_cached_tokens == 64
    assert [e.type for e in first.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    second = convert.to_engine_core_output(request_output(tokens=[6, 7]), track)
    assert second.new_token_ids == [6, 7]
    assert second.prefill_stats is None and second.events is None


def test_empty_unfinished_delta_is_held_back_but_its_cached_count_kept():
    track = convert.RequestTrack.of(core_request(prompt=range(50)))
    assert convert.to_engine_core_output(request_output(cached=32), track) is None
    first = convert.to_engine_core_output(request_output(tokens=[1]), track)
    assert first.prefill_stats.num_cached_tokens == 32


def test_cached_count_never_exceeds_the_prompt():
    track = convert.RequestTrack.of(core_request(prompt=[1, 2]))
    out = convert.to_engine_core_output(request_output(tokens=[3], cached=999), track)
    assert out.prefill_stats.num_cached_tokens == 2 and out.prefill_stats.num_computed_tokens == 0


@pytest.mark.parametrize("finish, expected", [
    (engine_pb2.FINISH_REASON_STOP, FinishReason.STOP),
    (engine_pb2.FINISH_REASON_LENGTH, FinishReason.LENGTH),
    (engine_pb2.FINISH_REASON_ABORT, FinishReason.ABORT),
    (engine_pb2.FINISH_REASON_ERROR, FinishReason.ERROR),
    (engine_pb2.FINISH_REASON_UNSPECIFIED, None),
    (99, FinishReason.ERROR),  # a reason from a newer control plane: the request still ends
])
def test_finish_reasons_map_to_vllms(finish, expected):
    track = convert.RequestTrack.of(core_request())
    out = convert.to_engine_core_output(request_output(tokens=[4], finish=finish), track)
    assert out.finish_reason == expected
    assert out.finished == (expected is not None)


def test_finished_empty_delta_is_delivered():
    track = convert.RequestTrack.of(core_request())
    out = convert.to_engine_core_output(request_output(finish=engine_pb2.FINISH_REASON_ABORT), track)
    assert out is not None and out.new_token_ids == [] and out.finish_reason == FinishReason.ABORT


def test_stop_token_becomes_stop_reason_but_eos_does_not():
    track = convert.RequestTrack.of(core_request(stop_token_ids=[7]))
    by_stop_id = convert.to_engine_core_output(
        request_output(tokens=[7], finish=engine_pb2.FINISH_REASON_STOP, stop_token_id=7), track)
    assert by_stop_id.stop_reason == 7
    by_eos = convert.to_engine_core_output(
        request_output(tokens=[EOS], finish=engine_pb2.FINISH_REASON_STOP, stop_token_id=EOS), track)
    assert by_eos.stop_reason is None
    unset = convert.to_engine_core_output(
        request_output(tokens=[EOS], finish=engine_pb2.FINISH_REASON_STOP), track)
    assert unset.stop_reason is None


def test_stop_token_id_only_counts_with_a_stop_finish():
    track = convert.RequestTrack.of(core_request())
    out = convert.to_engine_core_output(
        request_output(tokens=[7], finish=engine_pb2.FINISH_REASON_LENGTH, stop_token_id=7), track)
    assert out.stop_reason is None


def test_logprobs_become_vllms_logprobs_lists_sampled_token_first():
    track = convert.RequestTrack.of(core_request(logprobs=2))
    out = request_output(tokens=[7, 9])
    out.logprobs.add(token_ids=[7, 7, 3], logprobs=[-0.1, -0.1, -2.5], rank=1)
    out.logprobs.add(token_ids=[9, 4, 9], logprobs=[-1.5, -0.5, -1.5], rank=2)
    lists = convert.to_engine_core_output(out, track).new_logprobs
    assert lists.logprob_token_ids.tolist() == [[7, 7, 3], [9, 4, 9]]
    assert lists.logprobs.flatten().tolist() == pytest.approx([-0.1, -0.1, -2.5, -1.5, -0.5, -1.5])
    assert lists.sampled_token_ranks.tolist() == [1, 2]
    assert convert.to_engine_core_output(request_output(tokens=[5]), track).new_logprobs is None


def test_lost_request_ends_with_error():
    out = convert.finished_output("req-9")
    assert out.request_id == "req-9" and out.new_token_ids == [] and out.finish_reason == FinishReason.ERROR


# ---- refusals ------------------------------------------------------------------------------
def test_refusals_map_to_http_400_and_503_with_the_control_planes_message():
    bad = create_error_response(RequestRefused("prompt too long for this model"))
    assert bad.error.code == 400 and bad.error.message == "prompt too long for this model"
    busy = create_error_response(ControlPlaneUnavailable("control plane at h:1 is unreachable"))
    assert busy.error.code == 503 and "h:1 is unreachable" in busy.error.message


@pytest.mark.parametrize("flags, words", [
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "belongs to the control plane"),
    (["--enable-lora"], "LoRA"),
])
def test_engine_side_features_are_refused_at_start_up(flags, words, smollm2):
    from ttserve.gateway.server import StartupError, parse_vllm_args
    with pytest.raises(StartupError, match=words):
        parse_vllm_args(["--model", str(smollm2), *flags])


def test_max_logprobs_above_twenty_is_clamped_with_a_warning(smollm2, caplog):
    from ttserve.gateway.server import parse_vllm_args
    assert parse_vllm_args(["--model", str(smollm2), "--max-logprobs", "50"]).max_logprobs == 20
    assert "clamped to 20" in caplog.text


# ---- images ----------------------------------------------------------------------------------
def image_feature(offset: int, length: int, pixels, grid, identifier: str = "hash-1", modality: str = "image"):
    import torch
    from vllm.multimodal.inputs import (MultiModalBatchedField, MultiModalFeatureSpec, MultiModalFieldElem,
                                        MultiModalKwargsItem, PlaceholderRange)
    item = MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField()),
        "image_grid_thw": MultiModalFieldElem(data=torch.tensor(grid), field=MultiModalBatchedField())})
    return MultiModalFeatureSpec(data=item, modality=modality, identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_images_travel_as_tensors_with_their_placeholders_and_hash_in_prompt_order():
    import torch
    from ttserve.tensor_wire import tensor_from_pb
    pixels = [torch.randn(16, 1176).to(torch.bfloat16), torch.randn(4, 1176).to(torch.bfloat16)]
    req = core_request(prompt=[1] * 20)
    req.mm_features = [image_feature(12, 1, pixels[1], [1, 2, 2], "second"),
                       image_feature(2, 4, pixels[0], [1, 4, 4], "first")]
    assert convert.unsupported_by_protocol(req) is None
    add = convert.to_add_request(req)
    assert [(m.hash, m.offset, m.length, m.modality) for m in add.mm_inputs] == [
        ("first", 2, 4, "image"), ("second", 12, 1, "image")]
    back = tensor_from_pb(add.mm_inputs[0].data["pixel_values"])
    assert back.dtype == torch.bfloat16 and torch.equal(back, pixels[0])
    assert tensor_from_pb(add.mm_inputs[1].data["image_grid_thw"]).tolist() == [1, 2, 2]
    assert convert.too_large(add) is None


def test_unservable_multimodal_inputs_are_named():
    import torch
    req = core_request(prompt=[1] * 8)
    req.mm_features = [image_feature(0, 4, torch.zeros(16, 4), [1, 4, 4], modality="video")]
    assert "video inputs are not supported" in convert.unsupported_by_protocol(req)
    req.mm_features = [image_feature(0, 4, torch.zeros(16, 4), [1, 4, 4])]
    req.mm_features[0].data = None
    assert "without its processed data" in convert.unsupported_by_protocol(req)


def test_a_request_beyond_the_message_limit_is_refused_with_its_size(monkeypatch):
    import torch
    monkeypatch.setattr(convert, "MAX_ADD_REQUEST_BYTES", 1 << 20)
    req = core_request(prompt=[1] * 8)
    req.mm_features = [image_feature(0, 4, torch.zeros(256, 1176), [1, 16, 16])]  # 1.1 MiB of float32
    reason = convert.too_large(convert.to_add_request(req))
    assert reason == ("the request takes 1.1 MiB on the wire (1 image(s): 1.1 MiB), more than the 1 MiB a "
                      "request may: send fewer or smaller images")
