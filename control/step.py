"""What one device step does, as the scheduler plans it (domain objects, not protobuf)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .images import ImageInput
from .request import Request


class StepKind(enum.Enum):
    EMPTY = "empty"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True, frozen=True)
class GroupBlocks:
    """A request's blocks in one KV group past the first, with a step's item (device.proto
    GroupBlocks): the ids appended to its table, and how many leading entries its sliding window
    no longer reads (cumulative)."""
    new_block_ids: list[int]
    num_skipped_blocks: int = 0


@dataclass(slots=True)
class PrefillWork:
    request: Request
    start: int                  # first token position of the chunk
    end: int                    # one past the chunk's last position
    new_block_ids: list[int]   # the first KV group's (the only one of most models)
    sample: bool                # the chunk ends the known tokens: the next token is sampled
    bitmask: bytes = b""        # the request's grammar mask for the sampled token; b"" = none
    images: list[ImageInput] = field(default_factory=list)  # sent with this chunk (images.unsent)
    groups: list[GroupBlocks] = field(default_factory=list)  # KV groups past the first


@dataclass(slots=True)
class DecodeWork:
    request: Request
    token_id: int | None        # the last token, fed at `position`; None: the token the worker
    position: int               # sampled for this request in the step before (async decode)
    new_block_ids: list[int]
    bitmask: bytes = b""        # the request's grammar mask for the sampled token; b"" = none
    groups: list[GroupBlocks] = field(default_factory=list)  # KV groups past the first
    # Speculative decoding: tokens proposed for position + 1, ... (a verify row; speculation.py).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    """One step of one lane. Invariant: prefill and decode are never both non-empty."""
    kind: StepKind = StepKind.EMPTY
    lane: int = 0
    # Requests whose device state the worker creates before running this step.
    new_requests: list[Request] = field(default_factory=list)
    # Requests whose device state the worker drops before running this step.
    released_ids: list[str] = field(default_factory=list)
    prefill: list[PrefillWork] = field(default_factory=list)
    decode: list[DecodeWork] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.end - w.start for w in self.prefill) + len(self.decode)
