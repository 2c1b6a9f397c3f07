"""Step batches and results inside the worker (domain objects; protobuf stays in wire.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(slots=True)
class PrefillChunk:
    request_id: str
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    sample: bool


@dataclass(slots=True)
class DecodeItem:
    request_id: str
    token_id: int
    position: int
    new_block_ids: list[int]
    use_previous_token: bool = False


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
    tokens: dict[str, int] = field(default_factory=dict)
    model_s: float = 0.0
    sample_s: float = 0.0
    total_s: float = 0.0
    traced: bool = False
    sampled_on_device: bool = False


@dataclass(slots=True, frozen=True)
class ServingConfig:
    """What the control plane asks the worker to serve (Warmup)."""
    num_lanes: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
