"""The one place the worker converts between protobuf and its domain objects."""
from __future__ import annotations

from collections.abc import Iterable

import ttserve
from ttserve.protocol import PROTOCOL_VERSION
from ttserve.tensor_wire import tensor_from_pb
from ttserve.v1 import device_pb2, multimodal_pb2

from .batch import (DecodeItem, Description, GroupBlocks, HostSampling, ImageInput, NewRequest, PrefillChunk,
                    ServingConfig, StepBatch, StepResult)

_KIND = {device_pb2.STEP_KIND_EMPTY: "empty", device_pb2.STEP_KIND_PREFILL: "prefill",
         device_pb2.STEP_KIND_DECODE: "decode"}


def batch_from_pb(b: device_pb2.StepBatch) -> StepBatch:
    return StepBatch(
        step_id=b.step_id, kind=_KIND[b.kind],
        new_requests=[NewRequest(r.request_id, r.lane, r.row, r.sampling.temperature,
                                 r.sampling.top_p or 1.0, r.sampling.top_k,
                                 r.sampling.seed if r.sampling.HasField("seed") else None,
                                 r.sampling.min_tokens, list(r.sampling.min_tokens_blocked_ids),
                                 r.num_output_tokens, _host_sampling(r))
                      for r in b.new_requests],
        released_ids=list(b.released_request_ids),
        prefill=[PrefillChunk(c.request_id, list(c.token_ids), c.start_pos, list(c.new_block_ids), c.sample,
                              c.token_bitmask, list(c.cached_token_ids), [_image(m) for m in c.mm_inputs],
                              _groups(c.groups))
                 for c in b.prefill],
        decode=[DecodeItem(d.request_id, d.token_id, d.position, list(d.new_block_ids), d.use_previous_token,
                           d.token_bitmask, _groups(d.groups), list(d.draft_token_ids)) for d in b.decode],
        async_readback=b.async_readback)


def _groups(groups: Iterable[device_pb2.GroupBlocks]) -> list[GroupBlocks]:
    return [GroupBlocks(list(g.new_block_ids), g.num_skipped_blocks) for g in groups]


def _image(m: multimodal_pb2.MultiModalInput) -> ImageInput:
    # The control plane refuses malformed tensors at admission; one that still arrives (a peer
    # that skipped it) raises TensorError and fails the step with its message.
    return ImageInput(m.hash, m.offset, m.length, {name: tensor_from_pb(t) for name, t in m.data.items()})


def _host_sampling(r: device_pb2.NewRequest) -> HostSampling | None:
    s = r.sampling
    host = HostSampling(
        min_p=s.min_p, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0, logit_bias=dict(s.logit_bias),
        allowed_token_ids=list(s.allowed_token_ids),
        bad_words=[list(w.token_ids) for w in s.bad_words if w.token_ids],
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_token_ids=list(r.prompt_token_ids), output_token_ids=list(r.output_token_ids))
    return host if host.active else None


def _sampled_pb(request_id: str, token_id: int, r: StepResult) -> device_pb2.SampledToken:
    sampled = device_pb2.SampledToken(request_id=request_id, token_id=token_id,
                                      num_accepted_drafts=r.num_accepted.get(request_id, 0))
    logprobs = r.logprobs.get(request_id)
    if logprobs is not None:
        sampled.logprob_token_ids.extend(logprobs.token_ids)
        sampled.logprobs.extend(logprobs.logprobs)
        sampled.rank = logprobs.rank
    for draft in r.draft_logprobs.get(request_id, ()):
        sampled.draft_logprobs.add(token_ids=draft.token_ids, logprobs=draft.logprobs, rank=draft.rank)
    return sampled


def result_to_pb(r: StepResult) -> device_pb2.StepResult:
    return device_pb2.StepResult(
        step_id=r.step_id,
        tokens=[_sampled_pb(rid, t, r) for rid, t in r.tokens.items()],
        refused=[device_pb2.RefusedRequest(request_id=rid, message=m) for rid, m in r.refused.items()],
        timings=device_pb2.StepTimings(model_s=r.model_s, total_s=r.total_s,
                                       traced=r.traced, sampled_on_device=r.sampled_on_device))


def step_error_to_pb(step_id: int, error: str) -> device_pb2.StepResult:
    """The result of a step that failed on the device (every step held with it fails too)."""
    return device_pb2.StepResult(step_id=step_id, error=error)


def draining_to_pb() -> device_pb2.StepResult:
    """The step stream's notice that this worker shuts down."""
    return device_pb2.StepResult(draining=True)


def probe_to_pb() -> device_pb2.StepResult:
    """Another control plane asks for the step stream: answer (StepBatch.probe_answer) if alive."""
    return device_pb2.StepResult(probe=True)


def description_to_pb(d: Description) -> device_pb2.DeviceDescription:
    caps = d.capabilities
    pb = device_pb2.DeviceDescription(
        protocol_version=PROTOCOL_VERSION, version=ttserve.__version__, backend=d.backend,
        device=d.device, model_path=d.model_path, architecture=d.architecture,
        vocab_size=d.vocab_size, max_position_embeddings=d.max_position_embeddings,
        capabilities=device_pb2.ModelCapabilities(
            supports_prefix_caching=caps.get("supports_prefix_caching", False),
            supports_async_decode=caps.get("supports_async_decode", False),
            supports_sample_on_device=caps.get("supports_sample_on_device", False),
            supports_chunked_prefill=caps.get("supports_chunked_prefill", False),
            single_execute_lanes=d.lanes_in_process),
        eos_token_ids=d.eos_token_ids, ready=d.ready, async_decode=d.async_decode,
        mixture_of_experts=d.mixture_of_experts, mrope=d.mrope,
        supports_images=d.supports_images, image_token_id=d.image_token_id, dtype=d.dtype, draining=d.draining,
        supports_speculative_decoding=d.supports_speculative_decoding)
    if d.config is not None:
        pb.config.CopyFrom(config_to_pb(d.config))
        pb.num_blocks_per_lane = d.num_blocks_per_lane
        pb.block_size = d.block_size
        pb.decode_batch_size = d.config.max_num_seqs
        pb.prefill_buckets.extend(d.prefill_buckets)
        pb.max_prefill_batch_size = d.max_prefill_batch_size
        for window, layers in d.kv_groups:
            pb.kv_groups.add(sliding_window=window, layers=layers)
    return pb


def progress_to_pb(phase: str, completed: int, total: int, detail: str) -> device_pb2.WarmupProgress:
    return device_pb2.WarmupProgress(phase=phase, completed=completed, total=total, detail=detail)


def warm_to_pb(description: Description) -> device_pb2.WarmupProgress:
    """Warmup's last message: done, with what the worker now serves."""
    return device_pb2.WarmupProgress(phase="done", completed=1, total=1, done=True,
                                     description=description_to_pb(description))


def config_from_pb(w: device_pb2.WarmupRequest) -> ServingConfig:
    return ServingConfig(num_lanes=w.num_lanes or 1, max_num_seqs=w.max_num_seqs,
                         max_model_len=w.max_model_len, max_num_batched_tokens=w.max_num_batched_tokens)


def config_to_pb(c: ServingConfig) -> device_pb2.WarmupRequest:
    return device_pb2.WarmupRequest(num_lanes=c.num_lanes, max_num_seqs=c.max_num_seqs,
                                    max_model_len=c.max_model_len,
                                    max_num_batched_tokens=c.max_num_batched_tokens)
