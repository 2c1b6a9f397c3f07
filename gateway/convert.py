"""The one place the gateway converts between vLLM's engine-core objects and engine.proto.

Requests: `EngineCoreRequest` (built by vLLM's InputProcessor: prompt token ids, a fully resolved
SamplingParams with max_tokens filled and the model's EOS merged in) -> `AddRequest`.
Images: the `mm_features` vLLM's multimodal processor made for the served model (one per image:
its processed tensors, its placeholder range, its content hash) -> `MultiModalInput`s, tensors
bit for bit.
Outputs: `RequestOutput` (one request's delta in a control-plane step) -> `EngineCoreOutput`, with
the per-request facts the proto does not repeat (prompt length, EOS id) kept in `RequestTrack`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from ttserve.gateway import vllm_compat

vllm_compat.prepare()

from vllm.v1.engine import (EngineCoreEvent, EngineCoreEventType,  # noqa: E402
                            EngineCoreOutput, EngineCoreRequest, FinishReason)
from vllm.v1.metrics.stats import PrefillStats  # noqa: E402
from vllm.v1.outputs import LogprobsLists  # noqa: E402

from ttserve.protocol import MESSAGE_LIMITS  # noqa: E402
from ttserve.tensor_wire import tensor_to_pb  # noqa: E402
from ttserve.tracing import trace_headers  # noqa: E402
from ttserve.v1 import engine_pb2, multimodal_pb2  # noqa: E402

_UINT64 = 1 << 64
# An AddRequest must fit the gRPC message limit (both edges use the same one); what is left after
# the images' tensors is room for the prompt and options.
MAX_ADD_REQUEST_BYTES = dict(MESSAGE_LIMITS)["grpc.max_send_message_length"] - (1 << 20)

FINISH_REASONS: dict[int, FinishReason | None] = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: None,
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    engine_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}




def unsupported_by_protocol(request: EngineCoreRequest) -> str | None:
    """Why engine.proto cannot carry this request (a message for the user), or None.

    Options the proto carries are passed through and the control plane decides (it refuses
    prompt_logprobs, for one); these are the ones it has no field for, so sending the request
    would silently drop them.
    """
    sp = request.sampling_params
    if sp is None:
        return "only text generation is served (pooling/embedding requests are not supported)"
    if request.prompt_embeds is not None:
        return "prompt embeddings are not supported by ttserve yet"
    for feature in request.mm_features or ():
        if feature.modality != "image":
            return f"{feature.modality} inputs are not supported: ttserve serves images only"
        if feature.data is None:
            # vLLM's processor cache would send a repeated image as a reference to the engine's
            # copy; the gateway runs with --mm-processor-cache-gb 0, so this is a bug.
            return "an image arrived without its processed data (is --mm-processor-cache-gb set?)"
        is_embed = feature.mm_position.is_embed
        if is_embed is not None and not bool(is_embed.all()):
            return "images whose placeholders are not all embeddings are not supported by ttserve yet"
    if request.lora_request is not None:
        return "LoRA adapters are not supported by ttserve yet"
    if request.priority != 0:
        # Refused, not carried and ignored: the control plane schedules first come, first served.
        return (f"priority {request.priority}: this ttserve release schedules requests first come, "
                "first served (vLLM's --scheduling-policy fcfs); send priority 0 or leave it out")
    unsupported = [name for name, is_set in (
        ("logprob_token_ids", sp.logprob_token_ids is not None),
        ("prompt_logprob_token_ids", sp.prompt_logprob_token_ids is not None),
        ("structured outputs with structural_tag",
         sp.structured_outputs is not None and sp.structured_outputs.structural_tag is not None),
        ("repetition_detection", sp.repetition_detection is not None),
        ("thinking_token_budget", sp.thinking_token_budget is not None),
    ) if is_set]
    if unsupported:
        return (f"{', '.join(unsupported)}: not supported by this ttserve release yet; "
                "remove it from the request")
    return None


def eos_token_ids(request: EngineCoreRequest) -> list[int]:
    """The model's EOS ids for this request, as the control plane's `eos_token_ids`.

    vLLM resolves them into the sampling params: the primary EOS in `eos_token_id` (None when
    ignore_eos), generation_config's other EOS ids moved into `stop_token_ids` (unless
    ignore_eos), and every id that ends generation in `all_stop_token_ids` (which min_tokens
    holds back). What `all_stop_token_ids` has beyond `stop_token_ids` are the EOS ids proper.
    """
    sp = request.sampling_params
    assert sp is not None
    ids = set(sp.all_stop_token_ids) - set(sp.stop_token_ids or ())
    if sp.eos_token_id is not None:
        ids.add(sp.eos_token_id)
    return sorted(ids)


def structured_output(request: EngineCoreRequest, disable_any_whitespace: bool = True,
                      disable_additional_properties: bool = True) -> engine_pb2.StructuredOutput | None:
    """The request's structured-output spec as vLLM's frontend validated it (the text its
    get_structured_output_key yields), or None. The two flags are the gateway's
    --structured-outputs-config; the request's own can only turn them on. By default JSON is
    compact and schema objects take only their listed properties (as vLLM's default xgrammar
    backend enforces them; tool-call schemas rely on it)."""
    sp = request.sampling_params
    so = sp.structured_outputs if sp is not None else None
    if so is None:
        return None
    out = engine_pb2.StructuredOutput(
        backend=so._backend or "",
        whitespace_flexible=not (disable_any_whitespace or so.disable_any_whitespace),
        disable_additional_properties=disable_additional_properties or so.disable_additional_properties)
    if so.json is not None:
        out.json = so.json if isinstance(so.json, str) else json.dumps(so.json)
    elif so.json_object:
        out.json_object = True
    elif so.regex is not None:
        out.regex = so.regex
    elif so.choice is not None:
        out.choice = so.choice if isinstance(so.choice, str) else json.dumps(so.choice)
    elif so.grammar is not None:
        out.grammar = so.grammar
    else:
        return None
    return out


def to_add_request(request: EngineCoreRequest, disable_any_whitespace: bool = True,
                   disable_additional_properties: bool = True) -> engine_pb2.AddRequest:
    sp = request.sampling_params
    assert sp is not None and sp.max_tokens is not None, "InputProcessor fills max_tokens"
    sampling = engine_pb2.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens, stop_token_ids=sp.stop_token_ids or (), ignore_eos=sp.ignore_eos,
        logit_bias={int(k): v for k, v in (sp.logit_bias or {}).items()},
        allowed_token_ids=sp.allowed_token_ids or (),
        bad_words=[engine_pb2.BadWords(token_ids=ids) for ids in (sp.bad_words_token_ids or ())])
    if sp.seed is not None:
        sampling.seed = sp.seed % _UINT64  # vLLM allows negative seeds; keep them distinct
    if sp.logprobs is not None:
        sampling.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        sampling.prompt_logprobs = sp.prompt_logprobs
    add = engine_pb2.AddRequest(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids or (),
        sampling=sampling, eos_token_ids=eos_token_ids(request), arrival_time=request.arrival_time,
        cache_salt=request.cache_salt or "", priority=request.priority)
    spec = structured_output(request, disable_any_whitespace, disable_additional_properties)
    if spec is not None:
        add.structured_output.CopyFrom(spec)
    add.mm_inputs.extend(mm_inputs(request))
    # The W3C context of the gateway's HTTP span (vLLM's serving layer copied it from the
    # request's rewritten headers; http_tracing.py): the control plane's spans are its children.
    add.trace_headers.update(trace_headers(request.trace_headers or {}))
    return add


def mm_inputs(request: EngineCoreRequest) -> list[multimodal_pb2.MultiModalInput]:
    """The request's images (unsupported_by_protocol has checked them), in prompt order."""
    out = []
    for feature in sorted(request.mm_features or (), key=lambda f: f.mm_position.offset):
        item = feature.data
        assert item is not None
        message = multimodal_pb2.MultiModalInput(
            modality=feature.modality, hash=feature.identifier, offset=feature.mm_position.offset,
            length=feature.mm_position.length)
        for name, element in item.items():
            if not hasattr(element.data, "dtype"):
                raise TypeError(f"the processor's {name} is not one tensor ({type(element.data).__name__})")
            message.data[name].CopyFrom(tensor_to_pb(element.data))
        out.append(message)
    return out


def too_large(add: engine_pb2.AddRequest) -> str | None:
    """Why this AddRequest cannot travel (a message for the user), or None."""
    size = add.ByteSize()
    if size <= MAX_ADD_REQUEST_BYTES:
        return None
    images = sum(m.ByteSize() for m in add.mm_inputs)
    return (f"the request takes {size / 2**20:.1f} MiB on the wire ({len(add.mm_inputs)} image(s): "
            f"{images / 2**20:.1f} MiB), more than the {MAX_ADD_REQUEST_BYTES / 2**20:.0f} MiB a request "
            "may: send fewer or smaller images")


@dataclass(slots=True)
class RequestTrack:
    """What the gateway remembers about a request it sent, to build its outputs."""
    request_id: str
    num_prompt_tokens: int
    eos_token_id: int | None
    queued_ts: float = field(default_factory=time.monotonic)  # gateway monotonic clock
    num_cached_tokens: int = 0
    started: bool = False  # an output has been delivered
    # EngineCoreRequest.trace_headers, for the request's finishing output: vLLM's `llm_request`
    # span (OutputProcessor.do_tracing) takes its parent from there. None: not traced.
    trace_headers: dict[str, str] | None = None

    @classmethod
    def of(cls, request: EngineCoreRequest) -> "RequestTrack":
        sp = request.sampling_params
        return cls(request_id=request.request_id,
                   num_prompt_tokens=len(request.prompt_token_ids or ()),
                   eos_token_id=sp.eos_token_id if sp is not None else None,
                   trace_headers=trace_headers(request.trace_headers or {}) or None)


def to_engine_core_output(out: engine_pb2.RequestOutput, track: RequestTrack) -> EngineCoreOutput | None:
    """The vLLM output for one request's step delta; None for a delta that carries nothing.

    The first output delivered is where vLLM reads the prompt's prefill stats (cached tokens)
    and the request's queued/scheduled events, and it ends the request's "prefilling" phase for
    TTFT; an empty unfinished delta (e.g. a prefill chunk) is therefore held back.
    """
    track.num_cached_tokens = max(track.num_cached_tokens, out.num_cached_tokens)
    finish_reason = FINISH_REASONS.get(out.finish_reason, FinishReason.ERROR)
    if not out.new_token_ids and finish_reason is None:
        return None
    stop_reason: int | None = None
    if finish_reason is FinishReason.STOP and out.HasField("stop_token_id") \
            and out.stop_token_id != track.eos_token_id:
        stop_reason = out.stop_token_id  # vLLM reports stop token ids, not the EOS, as stop_reason
    output = EngineCoreOutput(request_id=out.request_id, new_token_ids=list(out.new_token_ids),
                              finish_reason=finish_reason, stop_reason=stop_reason,
                              new_logprobs=logprobs_lists(out))
    # On every output, as vLLM's scheduler sets it: the frontend may finish the request itself (a
    # stop string its detokenizer finds), and vLLM's llm_request span takes its parent from there.
    output.trace_headers = track.trace_headers
    if not track.started:
        track.started = True
        cached = min(track.num_cached_tokens, track.num_prompt_tokens)
        output.prefill_stats = PrefillStats(
            num_prompt_tokens=track.num_prompt_tokens,
            num_computed_tokens=track.num_prompt_tokens - cached,
            num_cached_tokens=cached, num_local_cached_tokens=cached)
        # The proto carries no per-request scheduling times: queue time reads as 0 and the
        # whole wait until the first token as prefill time.
        output.events = [EngineCoreEvent(EngineCoreEventType.QUEUED, track.queued_ts),
                         EngineCoreEvent(EngineCoreEventType.SCHEDULED, track.queued_ts)]
    return output


def logprobs_lists(out: engine_pb2.RequestOutput) -> LogprobsLists | None:
    """vLLM's LogprobsLists for a delta's tokens: one row per new token, the sampled token in
    column 0 and the request's top-k after it (every row of a request has the same width)."""
    if not out.logprobs:
        return None
    # The control plane sends one entry per new token (wire.output_to_pb asserts it).
    assert len(out.logprobs) == len(out.new_token_ids), "one TokenLogprobs per new token"
    return LogprobsLists(
        logprob_token_ids=np.array([list(lp.token_ids) for lp in out.logprobs], dtype=np.int64),
        logprobs=np.array([list(lp.logprobs) for lp in out.logprobs], dtype=np.float32),
        sampled_token_ranks=np.array([lp.rank for lp in out.logprobs], dtype=np.int64))


def finished_output(request_id: str, reason: FinishReason = FinishReason.ERROR,
                    trace_headers: dict[str, str] | None = None) -> EngineCoreOutput:
    """An output that ends a request the control plane can no longer finish; `trace_headers`:
    its track's (RequestTrack.trace_headers)."""
    return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=reason,
                            trace_headers=trace_headers)
