"""Step batches and results inside the worker, and what it tells a control plane about itself
(domain objects; protobuf stays in wire.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ttserve.host_sampling import TokenLogprobs, draft_problem, has_penalties, needs_host_sampler

__all__ = ["DecodeItem", "Description", "GroupBlocks", "HostSampling", "ImageInput", "NewRequest", "PrefillChunk",
           "ServingConfig", "StepBatch", "StepResult", "TokenLogprobs"]


@dataclass(slots=True)
class HostSampling:
    """One request's sampling options that only the host sampler applies (vLLM's semantics),
    and the token history its penalties and bad words read. The runner appends every token the
    request samples to `output_token_ids`."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    logprobs: int | None = None                # top-k logprobs per sampled token; None = none
    prompt_token_ids: list[int] = field(default_factory=list)   # read by repetition_penalty
    output_token_ids: list[int] = field(default_factory=list)   # read by penalties, bad words

    @property
    def has_penalties(self) -> bool:
        return has_penalties(self)

    @property
    def active(self) -> bool:
        """Some option is set: the request's batches are sampled on the host."""
        return needs_host_sampler(self)

    @property
    def draft_problem(self) -> str | None:
        """Why its draft tokens cannot be verified (ttserve/host_sampling.py `draft_problem`)."""
        return draft_problem(self)


@dataclass(slots=True)
class NewRequest:
    request_id: str
    lane: int
    row: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_tokens: int = 0
    min_tokens_blocked_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    host: HostSampling | None = None    # None: nothing beyond what the device path expresses


@dataclass(slots=True)
class ImageInput:
    """One image of a request as its processor made it (multimodal.proto): its placeholders are
    prompt[offset, offset + length); `data` holds the processor's tensors by name
    (pixel_values, image_grid_thw)."""
    hash: str
    offset: int
    length: int
    data: dict[str, Any] = field(default_factory=dict)  # name -> torch.Tensor

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(slots=True, frozen=True)
class GroupBlocks:
    """A request's blocks in one KV group past the first (device.proto GroupBlocks): ids appended
    to the group's table, and how many of its leading entries are gone (a sliding window's)."""
    new_block_ids: list[int]
    num_skipped_blocks: int = 0


@dataclass(slots=True)
class PrefillChunk:
    request_id: str
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    sample: bool
    token_bitmask: bytes = b""     # grammar mask of the sampled token (device.proto); b"" = none
    cached_token_ids: list[int] = field(default_factory=list)  # [0, start_pos) on a request's first chunk
    images: list[ImageInput] = field(default_factory=list)  # not sent before, starting before the chunk's end
    groups: list[GroupBlocks] = field(default_factory=list)  # KV groups past the first


@dataclass(slots=True)
class DecodeItem:
    request_id: str
    token_id: int
    position: int
    new_block_ids: list[int]
    use_previous_token: bool = False
    token_bitmask: bytes = b""     # grammar mask of the sampled token (device.proto); b"" = none
    groups: list[GroupBlocks] = field(default_factory=list)  # KV groups past the first
    # Speculative decoding: tokens proposed for position + 1, + 2, ... (a verify row; device.proto).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepBatch:
    step_id: int
    kind: str                      # "empty" | "prefill" | "decode"
    new_requests: list[NewRequest] = field(default_factory=list)
    released_ids: list[str] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[DecodeItem] = field(default_factory=list)
    async_readback: bool = False


@dataclass(slots=True)
class StepResult:
    step_id: int
    kind: str = ""                 # empty | prefill | decode
    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # requests that asked
    model_s: float = 0.0           # launch to readback
    total_s: float = 0.0           # the batch's arrival to its result
    traced: bool = False
    sampled_on_device: bool = False
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why its items were dropped
    # A verify step's rows (speculative decoding): drafts accepted, which come before `tokens`'s
    # token, and for the requests that asked, the logprobs of each accepted draft in order.
    num_accepted: dict[str, int] = field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class ServingConfig:
    """What the control plane asks the worker to serve (Warmup)."""
    num_lanes: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int


@dataclass(slots=True)
class Description:
    """What the worker serves (device.proto DeviceDescription): the model, and once warm its
    realized layout (`config` None until then)."""
    backend: str                   # torch | ttnn | sim
    device: str
    model_path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    capabilities: dict[str, bool]  # the class's model_capabilities
    lanes_in_process: bool
    eos_token_ids: list[int]
    ready: bool
    async_decode: bool
    mixture_of_experts: bool
    mrope: bool
    supports_images: bool
    image_token_id: int            # 0 unless supports_images
    dtype: str                     # torch's name, e.g. bfloat16
    draining: bool
    config: ServingConfig | None = None
    num_blocks_per_lane: int = 0
    block_size: int = 0
    prefill_buckets: list[int] = field(default_factory=list)  # empty: any length runs (eagerly)
    max_prefill_batch_size: int = 0
    # Hybrid KV cache groups once warm, (window, layers) each (worker/kv_groups.py); empty: one.
    kv_groups: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # Decode rows may carry draft tokens (DecodeItem.draft_token_ids): the model verifies them.
    supports_speculative_decoding: bool = False
