"""Validation of every step item before it reaches the model: a bad item (a row outside its lane
or held by another request, a block id outside the lane's KV cache, a position no block covers, a
token id outside the vocabulary, a request twice in one step, a sampling value out of range; with
hybrid KV groups, a later group's table out of step with the first's or skipping a block the
item's window still reads; draft tokens the worker cannot verify, `_drafts_problem`) is refused
with a message and dropped from the batch, failing only its request; the rest of the step runs.
Nothing is clamped: a clamped block id writes another request's KV.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Protocol

from .batch import DecodeItem, HostSampling, NewRequest, PrefillChunk, StepBatch


@dataclass(frozen=True, slots=True)
class Limits:
    num_lanes: int
    max_num_seqs: int            # rows per lane
    num_blocks_per_lane: int
    block_size: int
    max_model_len: int
    page_table_width: int        # blocks a request may hold
    vocab_size: int
    # Per KV group, its sliding window (0: full attention; worker/kv_groups.py): items carry a
    # GroupBlocks for each group past the first.
    windows: tuple[int, ...] = (0,)
    # The model verifies draft tokens (speculative decoding); else a decode item with drafts is refused.
    speculative: bool = False


class Held(Protocol):
    """What the worker holds of a request (the runner's RequestState)."""
    row: int
    block_ids: list[int]
    group_lengths: list[int]  # entries of each later KV group's table (RequestState)
    prefix: list[int]        # its prompt tokens, while its prefill runs
    host: HostSampling | None  # options only the host sampler applies (read for draft tokens)

    @property
    def blocked_token_ids(self) -> list[int] | None:
        """Ids min_tokens still masks (read for draft tokens)."""
        ...


def check_batch(batch: StepBatch, limits: Limits, live: Mapping[str, Held]) -> tuple[StepBatch, dict[str, str]]:
    """The batch without its bad items, and why each refused request was refused.

    `live`: the requests the worker holds state for. Runs every step: nothing is built per live
    request unless the step adds requests (their rows are checked against the live ones).
    """
    refused: dict[str, str] = {}

    def refuse(request_id: str, problem: str) -> None:
        refused.setdefault(request_id, problem)

    released = set(batch.released_ids)
    # (blocks held, prompt tokens held) of the requests this step has touched so far.
    held: dict[str, tuple[int, int]] = {}
    added: dict[str, NewRequest] = {}
    if batch.new_requests:
        rows = {state.row: rid for rid, state in live.items() if rid not in released}
        for new in batch.new_requests:
            problem = _new_request_problem(new, limits, rows)
            if problem:
                refuse(new.request_id, problem)
                continue
            rows[new.row] = new.request_id
            held[new.request_id] = (0, 0)
            added[new.request_id] = new
    seen: set[str] = set()
    for item in (*batch.prefill, *batch.decode):
        rid = item.request_id
        if rid in seen:
            refuse(rid, "appears twice in one step")
        seen.add(rid)
        if rid not in held and rid not in refused:
            state = live.get(rid) if rid not in released else None
            if state is None:
                refuse(rid, "has no device state on this worker (never added in this step stream, or released)")
            else:
                held[rid] = (len(state.block_ids), len(state.prefix))
    for item in (*batch.prefill, *batch.decode):
        if item.request_id in refused:
            continue
        blocks, prompt = held[item.request_id]
        problem = _item_problem(item, limits, blocks, prompt)
        if not problem and isinstance(item, DecodeItem) and item.draft_token_ids:
            problem = _drafts_problem(item, limits, blocks + len(item.new_block_ids),
                                      added.get(item.request_id) or live[item.request_id])
        if not problem and (item.groups or len(limits.windows) > 1):
            # A request has one item per step (a second is refused above): its tables before it.
            lengths = [] if item.request_id in added else live[item.request_id].group_lengths
            problem = _groups_problem(item, limits, blocks + len(item.new_block_ids), lengths)
        if problem:
            refuse(item.request_id, problem)
        else:
            end = item.start_pos + len(item.token_ids) if isinstance(item, PrefillChunk) else prompt
            held[item.request_id] = (blocks + len(item.new_block_ids), end)
    if not refused:
        return batch, refused
    return replace(batch,
                   new_requests=[n for n in batch.new_requests if n.request_id not in refused],
                   prefill=[c for c in batch.prefill if c.request_id not in refused],
                   decode=[d for d in batch.decode if d.request_id not in refused]), refused


def _groups_problem(item: PrefillChunk | DecodeItem, limits: Limits, length: int, lengths: list[int]) -> str | None:
    """Every later KV group's table keeps as many entries as the first's (`length` after this
    item), its ids inside the lane, and skips no block the item reads: its first position p reads
    from p - W + 1 on. `lengths`: the tables' entries before the item (empty: none yet)."""
    groups = len(limits.windows)
    if len(item.groups) != groups - 1:
        return f"carries blocks of {len(item.groups) + 1} KV group(s); this worker's model has {groups}"
    first = item.start_pos if isinstance(item, PrefillChunk) else item.position
    for g, blocks in enumerate(item.groups, start=1):
        bad = [b for b in blocks.new_block_ids if not 0 <= b < limits.num_blocks_per_lane]
        if bad:
            return (f"KV group {g}: block id(s) {', '.join(map(str, bad[:4]))} outside the lane's KV cache "
                    f"(0..{limits.num_blocks_per_lane - 1})")
        before = lengths[g - 1] if lengths else 0
        entries = max(before, blocks.num_skipped_blocks) + len(blocks.new_block_ids)
        if entries != length:
            return f"KV group {g}: its table would have {entries} entries, the first group's {length}"
        window = limits.windows[g]
        readable = max(0, first - window + 1) // limits.block_size if window else 0
        if blocks.num_skipped_blocks > readable:
            return (f"KV group {g}: {blocks.num_skipped_blocks} skipped blocks, but position {first} reads from "
                    f"block {readable} on (window {window or 'all'})")
    return None


def _drafts_problem(item: DecodeItem, limits: Limits, blocks: int, request: NewRequest | Held) -> str | None:
    """A verify row (device.proto DecodeItem.draft_token_ids) the worker can run: a model that
    verifies, the token fed explicitly (its drafts follow it), no grammar bitmask, every draft
    position inside max_model_len and the item's `blocks`, the ids in the vocabulary, and a
    request whose distribution comes from the logits alone (HostSampling.draft_problem, and
    min_tokens no longer masking), which the control plane never sends drafts for otherwise."""
    drafts = item.draft_token_ids
    if not limits.speculative:
        return "carries draft tokens, but this worker's model cannot verify them (no speculative decoding)"
    if item.use_previous_token:
        return "carries draft tokens with use_previous_token: a verify row feeds its token explicitly"
    if item.token_bitmask:
        return "carries draft tokens with a grammar bitmask: a grammar's drafts cannot be verified"
    last = item.position + len(drafts)
    if last >= limits.max_model_len:
        return f"its {len(drafts)} draft tokens reach position {last}, past max_model_len {limits.max_model_len}"
    if last >= blocks * limits.block_size:
        return (f"its {len(drafts)} draft tokens reach position {last}, but its blocks cover "
                f"{blocks * limits.block_size} tokens")
    bad = [t for t in drafts if not 0 <= t < limits.vocab_size]
    if bad:
        return f"draft token id(s) {', '.join(map(str, bad[:4]))} outside the vocabulary (0..{limits.vocab_size - 1})"
    if isinstance(request, NewRequest):
        host, masking = request.host, request.num_output_tokens < request.min_tokens and request.min_tokens_blocked_ids
    else:
        host, masking = request.host, request.blocked_token_ids
    problem = (host.draft_problem if host is not None else None) or (
        "min_tokens still masks its stop tokens" if masking else None)
    if problem:
        return f"carries draft tokens, but its sampling reads more than the logits ({problem}): they cannot be verified"
    return None


def _new_request_problem(new: NewRequest, limits: Limits, rows: Mapping[int, str]) -> str | None:
    if not 0 <= new.lane < limits.num_lanes:
        return f"lane {new.lane} is outside this worker's {limits.num_lanes} lane(s)"
    first = new.lane * limits.max_num_seqs
    if not first <= new.row < first + limits.max_num_seqs:
        return (f"row {new.row} is outside lane {new.lane} (rows {first}..{first + limits.max_num_seqs - 1})")
    if rows.get(new.row, new.request_id) != new.request_id:
        return f"row {new.row} is held by request {rows[new.row]}"
    if not (math.isfinite(new.temperature) and new.temperature >= 0):
        return f"temperature {new.temperature} must be a finite number >= 0"
    if not (math.isfinite(new.top_p) and 0 < new.top_p <= 1):
        return f"top_p {new.top_p} must be in (0, 1]"
    if new.top_k < -1:
        return f"top_k {new.top_k} must be -1 or 0 (off) or a positive count"
    return None


def _item_problem(item: PrefillChunk | DecodeItem, limits: Limits, held: int, prompt_held: int) -> str | None:
    bad = [b for b in item.new_block_ids if not 0 <= b < limits.num_blocks_per_lane]
    if bad:
        return (f"block id(s) {', '.join(map(str, bad[:4]))} outside the lane's KV cache "
                f"(0..{limits.num_blocks_per_lane - 1})")
    if held + len(item.new_block_ids) > limits.page_table_width:
        return (f"would hold {held + len(item.new_block_ids)} blocks, more than the "
                f"{limits.page_table_width} of a max_model_len sequence")
    covered = (held + len(item.new_block_ids)) * limits.block_size
    if isinstance(item, PrefillChunk):
        end = item.start_pos + len(item.token_ids)
        tokens = [*item.token_ids, *item.cached_token_ids]
        if not item.token_ids:
            return f"a prefill chunk at {item.start_pos} has no tokens"
        if end > limits.max_model_len:
            return f"a prefill chunk ends at {end}, past max_model_len {limits.max_model_len}"
        if end > covered:
            return f"a prefill chunk ends at {end}, but its blocks cover {covered} tokens"
        known = len(item.cached_token_ids) if item.cached_token_ids else prompt_held
        if known != item.start_pos:
            return (f"a prefill chunk starts at {item.start_pos}, but the worker holds {known} of the "
                    "request's tokens (a prefix-cache hit sends them as cached_token_ids)")
        for image in item.images:
            # An image is computed whole, in one chunk: never cut by the chunk's start or end.
            if image.end > end or image.offset < item.start_pos < image.end:
                return (f"an image's placeholders [{image.offset}, {image.end}) cross the prefill chunk "
                        f"[{item.start_pos}, {end}); a chunk may not split an image")
    else:
        tokens = [] if item.use_previous_token else [item.token_id]
        if not 0 <= item.position < limits.max_model_len:
            return f"decode position {item.position} is outside 0..{limits.max_model_len - 1}"
        if item.position >= covered:
            return f"decode position {item.position}, but its blocks cover {covered} tokens"
    bad_tokens = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad_tokens:
        return f"token id(s) {', '.join(map(str, bad_tokens[:4]))} outside the vocabulary (0..{limits.vocab_size - 1})"
    return None
