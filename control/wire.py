"""The one place the control plane converts between protobuf and its domain objects."""
from __future__ import annotations

from dataclasses import dataclass, field

from ttserve.tensor_wire import tensor_problem
from ttserve.v1 import device_pb2, engine_pb2

from .grammar import GrammarSpec
from .images import ImageInput
from .request import FinishReason, Request, SamplingParams, TokenLogprobs
from .session import Admission, RequestOutput, SessionMessage, Verdict
from .step import GroupBlocks, StepKind, StepPlan

_FINISH = {None: engine_pb2.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
           FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
           FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT, FinishReason.ERROR: engine_pb2.FINISH_REASON_ERROR}
_VERDICT = {Verdict.ACCEPTED: engine_pb2.Admission.VERDICT_ACCEPTED,
            Verdict.INVALID_ARGUMENT: engine_pb2.Admission.VERDICT_INVALID_ARGUMENT,
            Verdict.UNAVAILABLE: engine_pb2.Admission.VERDICT_UNAVAILABLE,
            Verdict.OVERLOADED: engine_pb2.Admission.VERDICT_OVERLOADED}
_STEP_KIND = {StepKind.EMPTY: device_pb2.STEP_KIND_EMPTY, StepKind.PREFILL: device_pb2.STEP_KIND_PREFILL,
              StepKind.DECODE: device_pb2.STEP_KIND_DECODE}


# ---- engine.proto ------------------------------------------------------------------------
def request_from_pb(add: engine_pb2.AddRequest, client_id: int) -> tuple[Request, list[str]]:
    """The request, and the names of options it sets that this release does not apply."""
    s = add.sampling
    sampling = SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0,
        top_k=max(s.top_k, 0), seed=s.seed if s.HasField("seed") else None,
        min_tokens=s.min_tokens, stop_token_ids=frozenset(s.stop_token_ids),
        eos_token_ids=frozenset(add.eos_token_ids), ignore_eos=s.ignore_eos,
        min_p=s.min_p, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items() if b)),
        allowed_token_ids=tuple(s.allowed_token_ids),
        bad_words=tuple(tuple(w.token_ids) for w in s.bad_words if w.token_ids),
        logprobs=s.logprobs if s.HasField("logprobs") else None)
    unsupported = ["prompt_logprobs"] if s.HasField("prompt_logprobs") else []
    if add.priority:  # first come, first served: a priority would be ignored, so it is refused
        unsupported.append(f"priority {add.priority} (requests are scheduled first come, first served)")
    request = Request(request_id=add.request_id, prompt_token_ids=list(add.prompt_token_ids),
                      sampling=sampling, client_id=client_id,
                      cache_salt=add.cache_salt, tenant=add.tenant, held_bytes=add.ByteSize(),
                      grammar_spec=_grammar_spec(add),
                      images=[ImageInput(m.hash, m.offset, m.length, m) for m in add.mm_inputs],
                      trace_headers=dict(add.trace_headers))
    if add.HasField("resumption"):
        request.resumed(list(add.resumption.output_token_ids))
    if any(m.modality != "image" for m in add.mm_inputs):
        unsupported.append("multimodal inputs other than images")
    return request, unsupported


def mm_inputs_problem(add: engine_pb2.AddRequest) -> str | None:
    """Why the request's image tensors are malformed (the worker would fail its step on them)."""
    for i, m in enumerate(add.mm_inputs):
        for name, tensor in m.data.items():
            problem = tensor_problem(tensor)
            if problem:
                return f"image {i}'s {name}: {problem}"
    return None


def _grammar_spec(add: engine_pb2.AddRequest) -> GrammarSpec | None:
    if not add.HasField("structured_output"):
        return None
    so = add.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    text = "" if kind == "json_object" else getattr(so, kind)
    return GrammarSpec(kind, text, so.whitespace_flexible, so.disable_additional_properties)


def output_to_pb(out: RequestOutput) -> engine_pb2.RequestOutput:
    """A request's delta as its session sends it."""
    pb = engine_pb2.RequestOutput(request_id=out.request_id, new_token_ids=out.new_token_ids,
                                  finish_reason=_FINISH[out.finish_reason], error=out.error,
                                  invalid_request=out.invalid, worker=out.worker, lane=out.lane)
    if out.num_cached_tokens:
        pb.num_cached_tokens = out.num_cached_tokens
    if out.stop_token_id is not None:
        pb.stop_token_id = out.stop_token_id
    if out.logprobs:
        pb.logprobs.extend(engine_pb2.TokenLogprobs(token_ids=lp.token_ids, logprobs=lp.logprobs,
                                                    rank=lp.rank) for lp in out.logprobs)
    return pb


def session_message_to_pb(message: SessionMessage) -> engine_pb2.ServerMessage:
    """What the engine queued for a session (an Admission or a step's outputs), as it is sent."""
    if isinstance(message, Admission):
        return engine_pb2.ServerMessage(admission=engine_pb2.Admission(
            request_id=message.request_id, verdict=_VERDICT[message.verdict], message=message.message))
    return engine_pb2.ServerMessage(outputs=engine_pb2.StepOutputs(
        step_id=message.step_id, timestamp=message.timestamp, outputs=[output_to_pb(o) for o in message.outputs]))


# ---- device.proto ------------------------------------------------------------------------
@dataclass(slots=True)
class WorkerDescription:
    address: str
    backend: str
    device: str
    model_path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    supports_chunked_prefill: bool
    supports_prefix_caching: bool
    single_execute_lanes: bool = False
    mixture_of_experts: bool = False
    mrope: bool = False
    async_decode: bool = False
    supports_images: bool = False
    dtype: str = ""
    num_blocks_per_lane: int = 0
    block_size: int = 0
    prefill_buckets: list[int] = field(default_factory=list)
    max_prefill_batch_size: int = 0
    draining: bool = False
    protocol_version: int = 0
    # Per KV group, its sliding window in tokens (0: full attention; group 0 always is): (0,)
    # for a model of one group, and until warm (device.proto kv_groups).
    kv_windows: tuple[int, ...] = (0,)
    supports_speculative_decoding: bool = False  # it verifies DecodeItem.draft_token_ids


def describe_request_pb() -> device_pb2.DescribeRequest:
    return device_pb2.DescribeRequest()


def description_from_pb(d: device_pb2.DeviceDescription, address: str) -> WorkerDescription:
    return WorkerDescription(
        address=address, backend=d.backend, device=d.device, model_path=d.model_path,
        architecture=d.architecture, vocab_size=d.vocab_size,
        max_position_embeddings=d.max_position_embeddings, eos_token_ids=list(d.eos_token_ids),
        supports_chunked_prefill=d.capabilities.supports_chunked_prefill,
        supports_prefix_caching=d.capabilities.supports_prefix_caching,
        single_execute_lanes=d.capabilities.single_execute_lanes,
        mixture_of_experts=d.mixture_of_experts, mrope=d.mrope, async_decode=d.async_decode,
        supports_images=d.supports_images, dtype=d.dtype,
        num_blocks_per_lane=d.num_blocks_per_lane, block_size=d.block_size,
        prefill_buckets=list(d.prefill_buckets), max_prefill_batch_size=d.max_prefill_batch_size,
        draining=d.draining, protocol_version=d.protocol_version,
        kv_windows=tuple(g.sliding_window for g in d.kv_groups) or (0,),
        supports_speculative_decoding=d.supports_speculative_decoding)


def warmup_request_to_pb(num_lanes: int, max_num_seqs: int, max_model_len: int,
                         max_num_batched_tokens: int) -> device_pb2.WarmupRequest:
    return device_pb2.WarmupRequest(num_lanes=num_lanes, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                    max_num_batched_tokens=max_num_batched_tokens)


@dataclass(slots=True, frozen=True)
class WarmupProgress:
    phase: str
    completed: int
    total: int
    detail: str
    description: WorkerDescription | None = None   # set on the last (done): the warm worker

    @property
    def done(self) -> bool:
        return self.description is not None

    @property
    def fraction(self) -> float:
        """0-1, as the worker reports it."""
        if self.done:
            return 1.0
        return self.completed / self.total if self.total else 0.0


def warmup_progress_from_pb(p: device_pb2.WarmupProgress, address: str) -> WarmupProgress:
    return WarmupProgress(p.phase, p.completed, p.total, p.detail,
                          description_from_pb(p.description, address) if p.done else None)


def probe_answer_pb() -> device_pb2.StepBatch:
    """This control plane is alive: the answer to the worker's probe (StepResult.probe)."""
    return device_pb2.StepBatch(probe_answer=True)


def empty_step_batch_to_pb(step_id: int) -> device_pb2.StepBatch:
    """An empty flush: the worker returns any result it holds (a pipelined decode's)."""
    return device_pb2.StepBatch(step_id=step_id)


def step_batch_to_pb(step_id: int, kind: StepKind, lanes: list[StepPlan], max_num_seqs: int,
                     async_readback: bool = False) -> device_pb2.StepBatch:
    """The merged step batch of a lane group's slices (row = lane * max_num_seqs + slot)."""
    batch = device_pb2.StepBatch(step_id=step_id, kind=_STEP_KIND[kind], async_readback=async_readback)
    for plan in lanes:
        batch.released_request_ids.extend(plan.released_ids)
        for request in plan.new_requests:
            batch.new_requests.append(_new_request_pb(request, plan.lane, max_num_seqs))
        started = {id(r) for r in plan.new_requests}
        for work in plan.prefill:
            all_ids = work.request.all_token_ids
            # A request's first chunk after a prefix-cache hit carries the cached tokens: the
            # worker holds no others of it, and the generator may recompute below start_pos.
            cached = all_ids[:work.start] if work.start and id(work.request) in started else []
            item = batch.prefill.add(request_id=work.request.request_id, token_ids=all_ids[work.start:work.end],
                                     start_pos=work.start, new_block_ids=work.new_block_ids, sample=work.sample,
                                     token_bitmask=work.bitmask, cached_token_ids=cached,
                                     mm_inputs=[image.payload for image in work.images],
                                     groups=_groups_pb(work.groups))
            if work.request.trace is not None:  # None unless tracing is on (request_trace.py)
                item.traceparent = work.request.trace.prefill_parent()
        for work in plan.decode:
            if work.token_id is None:
                item = batch.decode.add(request_id=work.request.request_id, use_previous_token=True,
                                        position=work.position, new_block_ids=work.new_block_ids,
                                        groups=_groups_pb(work.groups))
            else:
                item = batch.decode.add(request_id=work.request.request_id, token_id=work.token_id,
                                        position=work.position, new_block_ids=work.new_block_ids,
                                        token_bitmask=work.bitmask, groups=_groups_pb(work.groups),
                                        draft_token_ids=work.draft_token_ids)
            if work.request.trace is not None:
                item.traceparent = work.request.trace.decode_parent()
    return batch


def _groups_pb(groups: list[GroupBlocks]) -> list[device_pb2.GroupBlocks]:
    return [device_pb2.GroupBlocks(new_block_ids=g.new_block_ids, num_skipped_blocks=g.num_skipped_blocks)
            for g in groups]


def _new_request_pb(request: Request, lane: int, max_num_seqs: int) -> device_pb2.NewRequest:
    s = request.sampling
    sampling = device_pb2.DeviceSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias),
        allowed_token_ids=s.allowed_token_ids,
        bad_words=[device_pb2.TokenSequence(token_ids=w) for w in s.bad_words])
    if s.seed is not None:
        sampling.seed = s.seed
    if s.logprobs is not None:
        sampling.logprobs = s.logprobs
    if s.min_tokens > len(request.output_token_ids):
        sampling.min_tokens = s.min_tokens
        blocked = s.stop_token_ids if s.ignore_eos else s.stop_token_ids | s.eos_token_ids
        sampling.min_tokens_blocked_ids.extend(sorted(blocked))
    new = device_pb2.NewRequest(request_id=request.request_id, lane=lane,
                                row=lane * max_num_seqs + request.slot, sampling=sampling,
                                num_output_tokens=len(request.output_token_ids))
    # The token history penalties and bad words read (sent in full at each admission, so a
    # resumed request's history is rebuilt, never appended to a stale one).
    if s.repetition_penalty != 1.0:
        new.prompt_token_ids.extend(request.prompt_token_ids)
    if s.has_penalties or s.bad_words:
        new.output_token_ids.extend(request.output_token_ids)
    return new


@dataclass(slots=True)
class StepOutcome:
    step_id: int
    sampled: dict[str, int]
    total_s: float
    traced: bool
    sampled_on_device: bool
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # requests that asked
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why the worker dropped it
    error: str = ""         # the step failed inside the model (the worker dropped its device state)
    draining: bool = False  # not a result: the worker's notice that it shuts down
    probe: bool = False     # not a result: another control plane asks for the worker; answer it
    accepted: dict[str, int] = field(default_factory=dict)  # verify rows: drafts accepted
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per accepted draft


def step_result_from_pb(result: device_pb2.StepResult) -> StepOutcome:
    t = result.timings
    logprobs = {s.request_id: TokenLogprobs(list(s.logprob_token_ids), list(s.logprobs), s.rank)
                for s in result.tokens if s.logprob_token_ids}
    return StepOutcome(step_id=result.step_id, sampled={s.request_id: s.token_id for s in result.tokens},
                       total_s=t.total_s, traced=t.traced,
                       sampled_on_device=t.sampled_on_device, logprobs=logprobs,
                       refused={r.request_id: r.message for r in result.refused}, error=result.error,
                       draining=result.draining, probe=result.probe,
                       accepted={s.request_id: s.num_accepted_drafts for s in result.tokens if s.num_accepted_drafts},
                       draft_logprobs={s.request_id: [TokenLogprobs(list(d.token_ids), list(d.logprobs), d.rank)
                                                      for d in s.draft_logprobs]
                                       for s in result.tokens if s.draft_logprobs})
