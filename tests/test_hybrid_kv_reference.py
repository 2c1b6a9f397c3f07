"""Hybrid KV cache groups on the torch reference models (worker/backends/torch/models/llama.py
allocate_kv_cache_per_layer and page_tables_per_layer, gemma3.py hybrid_kv_cache_groups), as
vLLM's hybrid KV cache manager drives them through Tenstorrent's plugin
(vllm-tt-plugin model_runner.py `_build_per_layer_specs`, `_block_tables_per_layer`).

tiny-gemma3's layers are (S, S, F, S, S, F) with a 16-token window. The worker groups them as
vLLM does: full [2, 5], sliding [0, 1], sliding [3, 4]; a layer's tensor_idx is its position in
its group, so layers 2, 0, 3 share buffer 0 and layers 5, 1, 4 share buffer 1. The groups draw
disjoint block ids from one pool; a sliding group frees the blocks that fell wholly out of its
window before each step (its table entries then read 0) and the pool hands them straight to the
next group or row that needs a block. Greedy tokens through that cache must be transformers'
generate, token for token, past the window; with one page table for every layer the shared
buffers collide and they are not.
"""
from __future__ import annotations

import pytest
import torch

from ttserve.worker.backends.torch.models import TorchGemma3ForCausalLM, TorchLlamaForCausalLM
from ttserve.worker.backends.torch.models import paged_kv
from ttserve.worker.planning.tiny_gemma3 import LAYER_TYPES, SLIDING_WINDOW
from ttserve.worker.runner import ModelRunner

BLOCK = 16
WIDTH = 8               # page-table blocks per row: 128 positions
POOL = 32               # the caller's blocks (the scratch block comes after them)
CHUNK = 16
DECODE_STEPS = 40
# Blocks are handed out in this order within a row: the sliding groups first, so what one
# sliding group frees goes to the other (and, across rows, to the other row).
GROUPS = {"sliding-a": (0, 1), "sliding-b": (3, 4), "full": (2, 5)}
# The oracle text, one torch thread and the checkpoint's config: test_gemma3_reference's.
from test_gemma3_reference import TEXT, config, one_torch_thread  # noqa: E402,F401


@pytest.fixture(scope="module")
def prompts(hf_tiny_gemma3) -> list[list[int]]:
    ids = hf_tiny_gemma3[0](TEXT)["input_ids"]
    return [ids[:40], ids[3:37]]


@pytest.fixture(scope="module")
def expected(hf_tiny_gemma3, prompts) -> list[list[int]]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            g = hf_tiny_gemma3[1].generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS + 1, do_sample=False)
        out.append(g[0, len(ids):].tolist())
    assert all(len(set(o)) > 10 for o in out), out
    return out


def load(folder, config: dict) -> TorchGemma3ForCausalLM:
    return TorchGemma3ForCausalLM.initialize_vllm_model(config, torch.device("cpu"), max_batch_size=2,
                                                        max_seq_len=256, tt_data_parallel=1,
                                                        model_path=str(folder), dtype=torch.float32)


def specs(model: TorchGemma3ForCausalLM, blocks: int = POOL) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    s = model.shape
    tensor_idx = {layer: i for layers in GROUPS.values() for i, layer in enumerate(layers)}
    return [((blocks, s.num_kv_heads, BLOCK, s.head_dim), model.dtype, tensor_idx[i]) for i in range(s.num_layers)]


class Blocks:
    """The control plane's part: one pool of block ids for every group, each group's table per
    row. A sliding group frees, before a step computing from `start`, the blocks wholly before
    start - window + 1 (vLLM's SlidingWindowManager: no query of the step sees them) and sets
    their entries to 0; the pool is LIFO, so the next block anyone needs is the one just freed."""

    def __init__(self, rows: int) -> None:
        self.free = [b for b in torch.randperm(POOL, generator=torch.Generator().manual_seed(3)).tolist() if b]
        self.free.append(0)  # popped first and recycled: the 0 entries of freed sliding blocks name a live block
        self.tables = {g: [[0] * WIDTH for _ in range(rows)] for g in GROUPS}
        self.owned = {g: [set() for _ in range(rows)] for g in GROUPS}
        self.owners: dict[int, list[tuple[str, int]]] = {}  # block -> every (group, row) it served

    def step(self, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Frees and allocates for rows computing [start, end); returns page_tables_per_layer."""
        for row, (start, _) in enumerate(spans):
            for g in GROUPS:
                if g == "full":
                    continue
                for j in sorted(self.owned[g][row]):
                    if (j + 1) * BLOCK <= start - SLIDING_WINDOW + 1:
                        self.owned[g][row].discard(j)
                        self.free.append(self.tables[g][row][j])
                        self.tables[g][row][j] = 0
        for row, (start, end) in enumerate(spans):
            for g in GROUPS:
                for j in range(-(-end // BLOCK)):
                    past_window = g != "full" and (j + 1) * BLOCK <= start - SLIDING_WINDOW + 1
                    if j in self.owned[g][row] or past_window:
                        continue
                    block = self.free.pop()
                    self.owned[g][row].add(j)
                    self.tables[g][row][j] = block
                    self.owners.setdefault(block, []).append((g, row))
        group_table = {g: torch.tensor(t, dtype=torch.int32) for g, t in self.tables.items()}
        return [group_table[next(g for g, layers in GROUPS.items() if i in layers)] for i in range(len(LAYER_TYPES))]


def greedy(model: TorchGemma3ForCausalLM, prompts: list[list[int]], enable_trace: bool,
           per_layer: bool = True) -> list[list[int]]:
    """Chunked prefill of both rows (16-token chunks), then DECODE_STEPS decode steps, through the
    shared buffers; page_table is the full group's table (the plugin passes one group's)."""
    kv = model.allocate_kv_cache_per_layer(specs(model))
    blocks = Blocks(len(prompts))
    tokens = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    out: list[list[int]] = [[] for _ in prompts]
    for lo in range(0, max(map(len, prompts)), CHUNK):
        spans = [(min(lo, len(p)), min(lo + CHUNK, len(p))) for p in prompts]
        tables = blocks.step(spans)
        logits = model.prefill_forward(tokens, tables[2], kv, prompt_lens=[e for _, e in spans],
                                       start_pos=[s for s, _ in spans], empty_slots=[0, 1],
                                       page_tables_per_layer=tables if per_layer else None)
        for i, (s, e) in enumerate(spans):
            if e == len(prompts[i]) and s < e:
                out[i].append(int(logits[i, 0].argmax()))
    for step in range(DECODE_STEPS):
        pos = [len(p) + step for p in prompts]
        tables = blocks.step([(p, p + 1) for p in pos])
        logits = model.decode_forward(torch.tensor([[o[-1]] for o in out]), torch.tensor(pos), tables[2], kv,
                                      enable_trace=enable_trace,
                                      page_tables_per_layer=tables if per_layer else None)
        for i in range(len(prompts)):
            out[i].append(int(logits[i, 0].argmax()))
    # The pool really recycled sliding blocks: to the other sliding group, and to the other row.
    served = [owners for owners in blocks.owners.values() if len(owners) > 1]
    assert any(len({g for g, _ in o if g != "full"}) > 1 for o in served), blocks.owners
    assert any(len({r for _, r in o}) > 1 for o in served), blocks.owners
    return out


def test_the_flag_and_the_grouping_are_the_workers(config):
    assert TorchGemma3ForCausalLM.hybrid_kv_cache_groups and not TorchLlamaForCausalLM.hybrid_kv_cache_groups
    types = ["S" if t == "sliding_attention" else "F" for t in LAYER_TYPES]
    assert types == ["S", "S", "F", "S", "S", "F"] and SLIDING_WINDOW == BLOCK == CHUNK
    assert [types[i] for i in GROUPS["full"]] == ["F", "F"]
    assert all(types[i] == "S" for g in ("sliding-a", "sliding-b") for i in GROUPS[g])


def test_layers_of_one_tensor_idx_share_one_buffer(tiny_gemma3, config):
    model = load(tiny_gemma3, config)
    kv = model.allocate_kv_cache_per_layer(specs(model))
    assert len(kv) == 1 and len(kv[0]) == model.shape.num_layers
    k = [layer[0] for layer in kv[0]]
    assert all(t.shape == (POOL + 1, model.shape.num_kv_heads, BLOCK, model.shape.head_dim) for t in k)
    ptr = [t.data_ptr() for t in k]
    assert ptr[2] == ptr[0] == ptr[3] and ptr[5] == ptr[1] == ptr[4] and ptr[0] != ptr[1]
    # The fast path finds each layer's buffer, the one it shares.
    storage = [paged_kv._layer_storage(*layer) for layer in kv[0]]
    assert all(s is not None for s in storage)
    assert storage[0].data_ptr() == storage[2].data_ptr() != storage[1].data_ptr() == storage[4].data_ptr()
    kv[0][0][0][7, :, 3] = 1.0  # layer 0 writes block 7: layer 2 sees it, layer 1 does not
    assert kv[0][2][0][7, :, 3].eq(1).all() and not kv[0][1][0].any()


@pytest.mark.parametrize("change, match", [
    (lambda s: s[:-1], "5 entries; the model has 6 layers"),
    (lambda s: [*s, s[0]], "7 entries"),
    (lambda s: [s[0], *((shape, torch.bfloat16, t) for shape, _, t in s[1:])], "one shape and dtype"),
    (lambda s: [((s[0][0][0] + 1, *s[0][0][1:]), *s[0][1:]), *s[1:]], "one shape and dtype"),
    (lambda s: [((shape[0], shape[1] + 1, *shape[2:]), d, t) for shape, d, t in s], "does not fit the model"),
])
def test_allocate_kv_cache_per_layer_refuses_specs_that_do_not_fit(tiny_gemma3, config, change, match):
    model = load(tiny_gemma3, config)
    with pytest.raises(ValueError, match=match):
        model.allocate_kv_cache_per_layer(change(specs(model)))


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager-decode", "static-decode"])
def test_greedy_tokens_through_shared_buffers_and_group_tables_are_transformers_generate(
        tiny_gemma3, config, prompts, expected, enable_trace):
    assert all(len(p) + DECODE_STEPS > 4 * SLIDING_WINDOW for p in prompts)
    model = load(tiny_gemma3, config)
    # Each step's plan builds one paging per group table, not one per layer; the static decode
    # runs when asked for (a full batch), and the eager one otherwise.
    distinct, static = [], []
    forward, static_decode = model._forward, model._static_decode
    model._forward = lambda step, kv: distinct.append(len({id(p) for p in step.paging})) or forward(step, kv)
    model._static_decode = lambda *args: static.append(1) or static_decode(*args)
    assert greedy(model, prompts, enable_trace) == expected
    assert set(distinct) == {len(GROUPS)}
    assert len(static) == (DECODE_STEPS if enable_trace else 0)


def test_one_page_table_for_every_layer_collides_in_the_shared_buffers(tiny_gemma3, config, prompts, expected):
    """The control: without page_tables_per_layer, layers sharing a buffer write the same slots."""
    assert greedy(load(tiny_gemma3, config), prompts, enable_trace=False, per_layer=False) != expected


def test_page_tables_per_layer_must_name_every_layer(tiny_gemma3, config):
    model = load(tiny_gemma3, config)
    kv = model.allocate_kv_cache_per_layer(specs(model))
    table = torch.zeros(2, WIDTH, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_tables_per_layer has 5 tables"):
        model.prefill_forward(torch.zeros(1, 4, dtype=torch.long), table, kv, prompt_lens=[4],
                              page_tables_per_layer=[table] * 5)
    narrow = torch.zeros(2, WIDTH - 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="as wide as page_table"):
        model.decode_forward(torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 0]), table, kv,
                             enable_trace=True, page_tables_per_layer=[narrow] * 6)
