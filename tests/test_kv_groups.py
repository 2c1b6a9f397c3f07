"""Hybrid KV cache groups: the worker's grouping of layers (worker/kv_groups.py), and the control
plane's per-group block tables in one shared pool (control/blocks.py): sliding groups give back
what their window no longer reads, the prefix cache and preemption work per group, and the
accounting stays exact under random traffic."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.control.blocks import BlockPool
from ttserve.control.lanes import LaneGroup
from ttserve.control.phase import PhasePolicy
from ttserve.control.request import FinishReason, Request, RequestStatus, SamplingParams
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.serving_plan import lane_capacity
from ttserve.control.wire import WorkerDescription, step_batch_to_pb
from ttserve.worker.backends.torch.models.gemma3 import TorchGemma3ForCausalLM
from ttserve.worker.backends.torch.models.llama import TorchLlamaForCausalLM
from ttserve.worker.kv_groups import group_layers, uniform

from test_lanes import step  # one step of a lane group, every row sampling token 7

EOS = 2
S, F = "sliding_attention", "full_attention"


# ---- the worker's groups ----------------------------------------------------------------------
def gemma3_config(**fields) -> dict:
    """A Gemma 3 text config.json's fields the reference model reads (tiny sizes)."""
    return {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 16, **fields}


def test_tiny_gemma3_groups_its_two_full_and_four_sliding_layers_in_pairs():
    windows = TorchGemma3ForCausalLM.kv_layer_windows(gemma3_config(
        num_hidden_layers=6, sliding_window=16, layer_types=[S, S, F, S, S, F]))
    assert windows == [16, 16, 0, 16, 16, 0]
    groups = group_layers(windows)
    assert groups.windows == (0, 16, 16)
    assert groups.layers == ((2, 5), (0, 1), (3, 4))
    assert groups.group_size == 2
    assert groups.group_of_layer == (1, 1, 0, 2, 2, 0)
    # Layer i of every group shares buffer i: 2, 0 and 3 share buffer 0.
    assert groups.tensor_of_layer == (0, 1, 0, 0, 1, 1)


def test_gemma3_1b_makes_one_full_group_and_six_sliding_groups_of_four():
    # Gemma 3 1B: 26 layers, every sixth global (an older config: sliding_window_pattern).
    windows = TorchGemma3ForCausalLM.kv_layer_windows(gemma3_config(
        num_hidden_layers=26, sliding_window=512, sliding_window_pattern=6))
    assert windows.count(0) == 4 and windows[5] == 0 and windows[0] == 512
    groups = group_layers(windows)
    assert groups.group_size == 4
    assert groups.windows == (0,) + (512,) * 6
    assert [len(layers) for layers in groups.layers] == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(layer for layers in groups.layers for layer in layers) == list(range(26))


def test_the_groups_follow_the_mask_the_model_applies():
    # Qwen2 carries a sliding_window it does not apply (use_sliding_window false): no window.
    qwen = gemma3_config(num_hidden_layers=4, sliding_window=4096, use_sliding_window=False)
    assert TorchLlamaForCausalLM.kv_layer_windows(qwen) == [0] * 4
    assert TorchGemma3ForCausalLM.kv_layer_windows(gemma3_config(num_hidden_layers=2, layer_types=[S, F])) == [0, 0]


def test_near_equal_kinds_make_fewer_fuller_groups_and_one_kind_is_one_group():
    alternating = group_layers([128 if i % 2 == 0 else 0 for i in range(24)])  # GPT-OSS-like
    assert alternating.windows == (0, 128) and alternating.group_size == 12
    assert group_layers([0] * 8) == uniform(8)
    assert group_layers([4096] * 8) == uniform(8)  # every layer slides: no full group to share with
    assert not uniform(8).hybrid


# ---- the control plane's tables ---------------------------------------------------------------
def make(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 10) -> Request:
    return Request(rid, [first + (j % 7) for j in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS})))


def lane(num_blocks: int = 64, block_size: int = 4, windows=(0, 8, 8), caching: bool = False,
         max_num_seqs: int = 4, budget: int = 8, max_model_len: int = 64) -> LaneGroup:
    config = SchedulerConfig(max_num_seqs, budget, max_model_len)
    return LaneGroup([Scheduler(config, BlockPool(num_blocks, block_size, caching, windows))], PhasePolicy(2))


def check_tables(g: LaneGroup) -> None:
    """Every running request's tables: as many entries in every group, a sliding group holding
    exactly the blocks its window still reads, no block in two places unless shared by a hit."""
    for scheduler in g.lanes:
        pool = scheduler.pool
        pool.check()
        held = set()
        for r in scheduler.running:
            logical = len(r.block_tables[0])
            for g_index, (table, skipped) in enumerate(zip(r.block_tables, r.num_skipped_blocks)):
                assert skipped + len(table) == logical
                window = pool.windows[g_index]
                want = max(0, r.num_computed_tokens - window + 1) // pool.block_size if window else 0
                assert skipped == want, (r.request_id, g_index, skipped, want)
                held |= set(table)
            assert logical * pool.block_size >= r.num_computed_tokens
        assert len(held) == pool.num_used


def test_a_sliding_group_gives_back_blocks_out_of_its_window_as_a_request_decodes():
    g = lane(windows=(0, 8), block_size=4)
    r = make("a", 6, max_tokens=30)
    g.lanes[0].add(r)
    used = []
    while not r.is_finished:
        step(g)
        check_tables(g)
        used.append(g.lanes[0].pool.num_used)
    # 36 tokens: the full group ends at 9 blocks; the window of 8 never needs more than 3.
    assert max(used) <= 9 + 3
    assert g.lanes[0].pool.num_used == 0


def test_the_worker_gets_each_later_groups_new_blocks_and_skipped_count():
    g = lane(windows=(0, 8), block_size=4, budget=64)
    r = make("a", 12, max_tokens=10)
    g.lanes[0].add(r)
    plan = step(g)
    chunk = plan.lanes[0].prefill[0]
    assert len(chunk.new_block_ids) == 3 and len(chunk.groups) == 1
    assert len(chunk.groups[0].new_block_ids) == 3 and chunk.groups[0].num_skipped_blocks == 0
    assert not set(chunk.new_block_ids) & set(chunk.groups[0].new_block_ids)
    # Prefilled 12: the next position (12) reads 5..12, so block 0 (tokens 0-3) is gone.
    assert r.num_skipped_blocks == [0, 1]
    plan = step(g)  # decode at position 12: a new block in each group, one skipped
    item = plan.lanes[0].decode[0]
    assert len(item.new_block_ids) == 1 and item.groups[0].num_skipped_blocks == 1
    batch = step_batch_to_pb(1, plan.kind, plan.lanes, 4)
    assert [g.num_skipped_blocks for g in batch.decode[0].groups] == [1]
    assert list(batch.decode[0].groups[0].new_block_ids) == item.groups[0].new_block_ids


def test_a_prefix_hit_takes_only_the_window_a_sliding_group_still_reads():
    g = lane(windows=(0, 8), block_size=4, caching=True, budget=64)
    first = make("a", 26, max_tokens=1)
    g.lanes[0].add(first)
    while g.has_work:
        step(g)
    pool = g.lanes[0].pool
    second = make("b", 26, max_tokens=3)
    hashes = second.full_block_hashes(4, 25)
    hit = pool.lookup(hashes)
    # 6 full blocks: resume at 24, whose window reads 17..23: blocks 4 and 5 (16-23).
    assert hit.num_blocks == 6 and hit.skipped == [0, 4]
    assert len(hit.tables[0]) == 6 and len(hit.tables[1]) == 2
    g.lanes[0].add(second)
    while g.has_work:
        step(g)
        check_tables(g)
    assert second.num_cached_tokens == 24 and second.output_token_ids == [7, 7, 7]


def test_a_hit_shortens_to_what_every_group_still_caches():
    pool = BlockPool(32, 4, enable_caching=True, windows=(0, 8))
    full = pool.allocate(4)
    sliding = pool.allocate(4)
    for i, (a, b) in enumerate(zip(full, sliding)):
        pool.cache(a, 0, 100 + i)
        if i != 2:              # the sliding group's block 2 was never cached (or evicted)
            pool.cache(b, 1, 100 + i)
    hit = pool.lookup([100, 101, 102, 103])
    # Resume at 16 reads 9..15 (blocks 2, 3): block 2 is missing; at 12 it reads 5..11 (1, 2):
    # missing too; at 8 it reads 1..7 (blocks 0, 1): both cached.
    assert hit.num_blocks == 2 and hit.skipped == [0, 0] and hit.tables == [full[:2], sliding[:2]]


def test_a_full_pool_preempts_and_the_victim_recomputes_in_every_group():
    g = lane(num_blocks=12, windows=(0, 8), block_size=4, budget=16, max_model_len=40)
    a, b = make("a", 8, max_tokens=20), make("b", 8, max_tokens=20, first=30)
    g.lanes[0].add(a)
    g.lanes[0].add(b)
    steps = 0
    while g.has_work:
        steps += 1
        assert steps < 500
        step(g)
        check_tables(g)
    assert g.lanes[0].num_preemptions > 0
    assert a.output_token_ids == [7] * 20 and b.output_token_ids == [7] * 20
    assert g.lanes[0].pool.num_free == 12


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.booleans(), st.integers(0, 8)),
                min_size=1, max_size=10),
       st.sampled_from([(0, 4), (0, 8, 8), (0, 0, 5), (0, 12)]), st.integers(14, 40), st.booleans(), st.data())
def test_hybrid_tables_stay_exact_under_random_traffic(specs, windows, num_blocks, caching, data):
    """Arrivals, EOS, aborts, chunked prefills, prefix hits and preemption, any mix of full and
    sliding groups: the tables hold what check_tables says, every request ends, every block comes
    back."""
    block_size = 4
    chunk = 8
    description = WorkerDescription("w", "torch", "cpu", "m", "a", 64, 64, [EOS], True, caching,
                                    num_blocks_per_lane=num_blocks, block_size=block_size, kv_windows=windows)
    max_model_len = min(lane_capacity(description, chunk), 48)
    if max_model_len < 2 * block_size:
        return  # no room for a request and its output: the serving plan would refuse the worker
    g = lane(num_blocks, block_size, windows, caching, max_num_seqs=3, budget=chunk, max_model_len=max_model_len)
    pending = [(arrive, make(str(i), min(p, max_model_len - 1), t, first=10 + i % 3), abort)
               for i, (p, t, abort, arrive) in enumerate(specs)]
    everyone = [r for _, r, _ in pending]
    steps = 0
    while pending or g.has_work:
        steps += 1
        assert steps < 3000, "no progress"
        for entry in [e for e in pending if e[0] <= steps]:
            pending.remove(entry)
            g.lanes[0].add(entry[1])
        step(g, data.draw(st.sampled_from([7, 7, 7, EOS])))
        check_tables(g)
        for r, spec in zip(everyone, specs):
            if spec[2] and r.status is RequestStatus.RUNNING and r.output_token_ids:
                g.lanes[0].finish(r, FinishReason.ABORT)
    assert all(r.is_finished for r in everyone)
    assert g.lanes[0].pool.num_free == num_blocks


def test_lane_capacity_counts_what_each_group_holds_of_one_sequence():
    def capacity(blocks: int, windows: tuple[int, ...], chunk: int = 16) -> int:
        return lane_capacity(WorkerDescription("w", "torch", "cpu", "m", "a", 64, 64, [], True, True,
                                               num_blocks_per_lane=blocks, block_size=16, kv_windows=windows), chunk)
    assert capacity(64, (0,)) == 64 * 16
    # Two groups: the full one takes a block per 16 tokens, the sliding one (window 16, chunks
    # of 16) at most ceil(31 / 16) + 1 = 3.
    assert capacity(64, (0, 16)) == (64 - 3) * 16
    assert capacity(64, (0, 0)) == 32 * 16
    assert capacity(2, (0, 16)) == 16  # one block each
    with pytest.raises(AssertionError):
        BlockPool(8, 4, windows=(8, 0))  # group 0 is full attention


def test_a_released_requests_blocks_are_evicted_tail_first_across_groups():
    """Logical block i of every group goes before block i - 1 of any: a later hit shortens a
    block at a time instead of losing group 0's whole prefix first."""
    g = lane(num_blocks=32, windows=(0, 64), block_size=4, caching=True, budget=64)
    g.lanes[0].add(make("a", 26, max_tokens=1))
    while g.has_work:
        step(g)
    pool = g.lanes[0].pool
    hashes = make("b", 26).full_block_hashes(4, 25)
    assert pool.lookup(hashes).num_blocks == 6
    pool.allocate(pool.num_free - len(pool._hash_of))  # the blocks nothing cached (never used, partial)
    hits = []
    for _ in range(4):
        hits.append(pool.lookup(hashes).num_blocks)
        pool.allocate(2)
    assert hits == [6, 5, 4, 3]
