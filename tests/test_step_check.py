"""The worker's validation of step items (worker/step_check.py): each bad item is refused with a
reason that names it, only its request is dropped, and nothing is clamped."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from ttserve.worker.batch import DecodeItem, GroupBlocks, ImageInput, NewRequest, PrefillChunk, StepBatch
from ttserve.worker.step_check import Limits, check_batch

LIMITS = Limits(num_lanes=2, max_num_seqs=4, num_blocks_per_lane=16, block_size=4, max_model_len=32,
                page_table_width=8, vocab_size=100)
@dataclass
class Held:
    row: int
    block_ids: list[int]
    prefix: list[int] = field(default_factory=list)


LIVE = {"old": Held(1, [5, 6])}   # row 1, two blocks, prompt in


def new(rid: str, row: int, lane: int = 0, **sampling) -> NewRequest:
    return NewRequest(rid, lane, row, sampling.get("temperature", 0.0), sampling.get("top_p", 1.0),
                      sampling.get("top_k", 0), None)


def good_prefill() -> tuple[NewRequest, PrefillChunk]:
    return new("good", 0), PrefillChunk("good", [5, 6, 7], 0, [3], True)


@pytest.mark.parametrize("bad_new, bad_item, reason", [
    (new("bad", 9), PrefillChunk("bad", [1], 0, [4], True), "row 9 is outside lane 0 (rows 0..3)"),
    (new("bad", 1), PrefillChunk("bad", [1], 0, [4], True), "row 1 is held by request old"),
    (new("bad", 2, lane=2), PrefillChunk("bad", [1], 0, [4], True), "lane 2 is outside this worker's 2 lane(s)"),
    (new("bad", 2), PrefillChunk("bad", [1], 0, [16], True), "block id(s) 16 outside the lane's KV cache (0..15)"),
    (new("bad", 2), PrefillChunk("bad", [1] * 5, 0, [4], True), "ends at 5, but its blocks cover 4 tokens"),
    (new("bad", 2), PrefillChunk("bad", [100], 0, [4], True), "token id(s) 100 outside the vocabulary"),
    (new("bad", 2), PrefillChunk("bad", [1], 40, [4], True), "ends at 41, past max_model_len 32"),
    (new("bad", 2), PrefillChunk("bad", [], 0, [4], True), "has no tokens"),
    (new("bad", 2), PrefillChunk("bad", [1], 0, list(range(9)), True), "more than the 8 of a max_model_len"),
    (new("bad", 2, temperature=math.nan), PrefillChunk("bad", [1], 0, [4], True), "temperature nan"),
    (new("bad", 2, top_p=0.0), PrefillChunk("bad", [1], 0, [4], True), "top_p 0.0 must be in (0, 1]"),
    (None, PrefillChunk("ghost", [1], 0, [4], True), "has no device state on this worker"),
    (new("bad", 2), PrefillChunk("bad", [1] * 4, 0, [4], False, images=[ImageInput("h", 2, 3)]),
     "an image's placeholders [2, 5) cross the prefill chunk [0, 4)"),
])
def test_a_bad_item_is_refused_alone_with_its_reason(bad_new, bad_item, reason):
    good_new, good_chunk = good_prefill()
    batch = StepBatch(1, "prefill", new_requests=[good_new] + ([bad_new] if bad_new else []),
                      prefill=[good_chunk, bad_item])
    kept, refused = check_batch(batch, LIMITS, LIVE)
    [(rid, problem)] = refused.items()
    assert rid == bad_item.request_id and reason in problem, problem
    assert [c.request_id for c in kept.prefill] == ["good"] and [n.request_id for n in kept.new_requests] == ["good"]


def test_decode_items_are_checked_against_the_blocks_they_hold():
    batch = StepBatch(2, "decode", decode=[DecodeItem("old", 5, 7, []), DecodeItem("old2", 5, 8, [])])
    kept, refused = check_batch(batch, LIMITS, {**LIVE, "old2": Held(2, [7, 8])})
    assert refused == {"old2": "decode position 8, but its blocks cover 8 tokens"}
    assert [d.request_id for d in kept.decode] == ["old"]
    _, refused = check_batch(StepBatch(3, "decode", decode=[DecodeItem("old", 5, 7, []), DecodeItem("old", 5, 7, [])]),
                             LIMITS, LIVE)
    assert refused == {"old": "appears twice in one step"}


def test_a_valid_batch_passes_unchanged():
    good_new, good_chunk = good_prefill()
    batch = StepBatch(1, "prefill", new_requests=[good_new], prefill=[good_chunk], released_ids=["old"])
    kept, refused = check_batch(batch, LIMITS, LIVE)
    assert kept is batch and refused == {}
    # a released request's row is free again within the same step
    kept, refused = check_batch(StepBatch(2, "prefill", new_requests=[new("n", 1)], released_ids=["old"],
                                          prefill=[PrefillChunk("n", [1], 0, [2], True)]), LIMITS, LIVE)
    assert refused == {}


# ---- hybrid KV cache groups: one table per group (worker/kv_groups.py) --------------------------
HYBRID = Limits(num_lanes=1, max_num_seqs=4, num_blocks_per_lane=32, block_size=4, max_model_len=64,
                page_table_width=16, vocab_size=100, windows=(0, 8))


@dataclass
class HeldHybrid(Held):
    group_lengths: list[int] = field(default_factory=list)


def test_a_prefix_hits_first_chunk_skips_entries_its_group_never_held():
    # A hit of 4 blocks resumes at 16, which reads 9..15: the sliding group skips blocks 0 and 1,
    # holds 2 and 3, and both tables end with the chunk's new block.
    chunk = PrefillChunk("hit", [1, 2, 3], 16, [0, 1, 2, 3, 4], True, cached_token_ids=[7] * 16,
                         groups=[GroupBlocks([10, 11, 12], num_skipped_blocks=2)])
    kept, refused = check_batch(StepBatch(1, "prefill", new_requests=[new("hit", 0)], prefill=[chunk]), HYBRID, {})
    assert not refused and kept.prefill == [chunk]


@pytest.mark.parametrize("groups, reason", [
    ([], "carries blocks of 1 KV group(s); this worker's model has 2"),
    ([GroupBlocks([40])], "KV group 1: block id(s) 40 outside"),
    ([GroupBlocks([10, 11])], "KV group 1: its table would have 5 entries, the first group's 4"),
    # Position 10 reads 3..10 (window 8): block 0 (tokens 0-3) is still read.
    ([GroupBlocks([10], num_skipped_blocks=1)], "KV group 1: 1 skipped blocks, but position 10 reads from block 0"),
])
def test_a_later_groups_table_out_of_step_or_skipping_what_the_item_reads_is_refused(groups, reason):
    live = {"r": HeldHybrid(0, [1, 2, 3], group_lengths=[3])}
    item = DecodeItem("r", 5, 10, [4], groups=groups)
    _, refused = check_batch(StepBatch(1, "decode", decode=[item]), HYBRID, live)
    assert reason in refused["r"], refused
