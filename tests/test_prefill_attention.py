"""ttserve's prefill attention kernel (worker/backends/torch/models/prefill_attention.c), on vLLM
CPU's KV cache as vLLM's own cpu_attn_reshape_and_cache writes it: causal chunks over cached
prefixes against a float64 reference and against vLLM's kernel, a row's independence from the rest
of its step and from the thread count, when a step plans it, and how it is refused."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from ttserve.worker.backends.torch.models import cpu_kernels, prefill_attention

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable(torch.device("cpu"), BF16, 64, 64, None) != "",
                                reason="vLLM CPU's kernels do not load here")


def kernel_here() -> str:
    return prefill_attention.unavailable(BF16, 9, 3, 64, 64, "vec")


def _case(heads: int, kv_heads: int, dim: int, block: int, chunks: list[tuple[int, int]], seed: int = 0):
    """A cache of random keys and values over scattered blocks (stale values in the unwritten
    slots, as a reused block has), each row's context written by vLLM's reshape_and_cache; the
    step's queries (a view into a fused q/k/v projection, as the model has them), block table,
    lengths and query offsets. chunks: (context after the step, the step's queries) per row."""
    g = torch.Generator().manual_seed(seed)
    lens = [n for n, _ in chunks]
    per_row = [-(-n // block) for n in lens]
    blocks = sum(per_row) + 3
    (k_cache, v_cache), = cpu_kernels.allocate(1, 1, blocks, kv_heads, block, dim, BF16)[0]
    k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(BF16) * 50)
    v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(BF16) * 50)
    order = torch.randperm(blocks, generator=g).tolist()
    table = torch.zeros(len(chunks), max(per_row), dtype=torch.int32)
    for r, n in enumerate(per_row):
        table[r, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    slots = torch.tensor([int(table[r, p // block]) * block + p % block for r, n in enumerate(lens) for p in range(n)])
    k = torch.randn(len(slots), kv_heads, dim, generator=g).to(BF16)
    v = torch.randn(len(slots), kv_heads, dim, generator=g).to(BF16)
    torch.ops._C.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, "vec" if block % 32 == 0 else "vec16")
    tokens = sum(q for _, q in chunks)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(BF16) * 3
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor([q for _, q in chunks]), 0, out=query_start_loc[1:])
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), query_start_loc


def _reference(q, k_cache, v_cache, table, seq_lens, query_start_loc) -> torch.Tensor:
    """float64 causal attention of each row's queries over its keys, read through the contract's views."""
    tokens, heads, dim = q.shape
    kv_heads, block = k_cache.shape[1], k_cache.shape[2]
    flat = torch.empty(0, dtype=BF16).set_(k_cache.untyped_storage(), k_cache.storage_offset(),
                                           (k_cache.shape[0], kv_heads, 2, block * dim))
    out = torch.empty(tokens, heads, dim, dtype=torch.float64)
    for r in range(len(seq_lens)):
        n, a, b = int(seq_lens[r]), int(query_start_loc[r]), int(query_start_loc[r + 1])
        ids = table[r, :-(-n // block)].long()
        keys = flat[ids, :, 0].view(-1, kv_heads, dim, block).permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, :n]
        values = flat[ids, :, 1].view(-1, kv_heads, block, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
        group = heads // kv_heads
        qr = q[a:b].double().view(b - a, kv_heads, group, dim).permute(1, 2, 0, 3)   # [kv, group, queries, dim]
        scores = qr @ keys.double().transpose(1, 2).unsqueeze(1) / math.sqrt(dim)  # [kv, group, queries, keys]
        positions = torch.arange(n - (b - a), n).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(n).unsqueeze(0) > positions, float("-inf"))
        weighted = scores.softmax(-1) @ values.double().unsqueeze(1)                 # [kv, group, queries, dim]
        out[a:b] = weighted.permute(2, 0, 1, 3).reshape(b - a, heads, dim)
    return out


def _vllm(q, k_cache, v_cache, table, seq_lens, query_start_loc) -> torch.Tensor:
    tokens, heads, dim = q.shape
    isa = "vec" if k_cache.shape[2] % 32 == 0 else "vec16"
    metadata = torch.ops._C.get_scheduler_metadata(len(seq_lens), heads, k_cache.shape[1], dim, seq_lens, BF16,
                                                   query_start_loc, True, -1, isa, True, None, "auto")
    out = torch.empty(tokens, heads, dim, dtype=BF16)
    torch.ops._C.cpu_attention_with_kv_cache(q, k_cache, v_cache, out, query_start_loc, seq_lens, 1 / math.sqrt(dim),
                                             True, None, -1, table, 0.0, metadata, None, None)
    return out


def _ours(q, k_cache, v_cache, table, seq_lens, query_start_loc) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=BF16)
    prefill_attention.prefill_attention(q, k_cache, v_cache, out, table, seq_lens, query_start_loc,
                                        1 / math.sqrt(q.shape[-1]))
    return out


CASES = [  # heads, kv heads, head_dim, block, (context, queries) per row
    (9, 3, 64, 64, [(128, 128)]),                            # SmolLM2, a whole prompt
    (9, 3, 64, 64, [(128, 128)] * 4),                        # four prompts in one step
    (9, 3, 64, 64, [(700, 200), (65, 1), (64, 64), (17, 17)]),  # chunks over cached prefixes, block edges
    (9, 3, 64, 64, [(1, 1), (33, 2), (129, 3)]),             # tiles of one to three queries
    (32, 8, 128, 32, [(300, 100), (40, 40)]),                # Llama-8B's heads, blocks of 32
    (14, 2, 64, 128, [(257, 150), (5, 5)]),                  # 7 query heads per KV head, blocks of 128
    (16, 1, 64, 64, [(90, 90)]),                             # 16 per KV head: tiles of 3 queries
    (4, 4, 96, 64, [(70, 31), (5, 5)]),                      # no grouping; head_dim 96
    (8, 2, 80, 64, [(77, 77)]),                              # head_dim 80 (a half vector of pairs)
    (8, 2, 112, 128, [(301, 129), (7, 7)]),                  # head_dim 112, blocks of 128, odd lengths
    (4, 1, 128, 128, [(255, 255)]),                          # the largest head_dim and block
    (48, 1, 64, 64, [(50, 50), (20, 0), (9, 9)]),            # 48 heads on one KV head (tiles of one query); a row with no queries
]


@pytest.mark.parametrize("heads, kv_heads, dim, block, chunks", CASES)
def test_the_kernel_is_as_close_to_float64_as_vllms(heads, kv_heads, dim, block, chunks):
    if kernel_here():
        pytest.skip(f"ttserve's prefill kernel is unavailable here: {kernel_here()}")
    assert prefill_attention.unavailable(BF16, heads, kv_heads, dim, block, "vec") == ""
    case = _case(heads, kv_heads, dim, block, chunks)
    reference = _reference(*case)
    ours = (_ours(*case).double() - reference).abs()
    vllms = (_vllm(*case).double() - reference).abs()
    scale = reference.abs().max().item()
    # bf16 output: within a few of its rounding steps, and no worse than vLLM's kernel by much,
    # at worst and on average (the probabilities are rounded to bfloat16 for their product)
    assert ours.max().item() <= 2 ** -6 * scale, (ours.max().item(), scale)
    assert ours.max().item() <= 2 * vllms.max().item() + 2 ** -9 * scale, (ours.max().item(), vllms.max().item())
    assert ours.mean().item() <= 1.5 * vllms.mean().item() + 2 ** -12 * scale, (ours.mean().item(), vllms.mean().item())


def test_a_rows_result_depends_on_neither_the_other_rows_nor_the_thread_count():
    if kernel_here():
        pytest.skip(kernel_here())
    chunks = [(300, 130), (20, 20), (64, 1), (65, 65)]
    q, k_cache, v_cache, table, seq_lens, starts = _case(9, 3, 64, 64, chunks, seed=1)
    together = _ours(q, k_cache, v_cache, table, seq_lens, starts)
    for r in range(len(chunks)):
        a, b = int(starts[r]), int(starts[r + 1])
        alone = _ours(q[a:b], k_cache, v_cache, table[r:r + 1].contiguous(), seq_lens[r:r + 1].contiguous(),
                      torch.tensor([0, b - a], dtype=torch.int32))
        assert torch.equal(alone, together[a:b])
    threads = torch.get_num_threads()
    try:
        for n in (1, 3 * threads):
            torch.set_num_threads(n)
            assert torch.equal(_ours(q, k_cache, v_cache, table, seq_lens, starts), together)
    finally:
        torch.set_num_threads(threads)


def _plan(query_lens: list[int], lens: list[int] | None = None, kv_split: bool = True,
          own_prefill: bool = True) -> cpu_kernels.Attention:
    rows, lens = len(query_lens), lens or [max(q, 100) for q in query_lens]
    width = max(-(-max(lens) // 64), 4)
    table = torch.arange(rows * width).reshape(rows, width)
    return cpu_kernels.Attention.plan(0, sum(query_lens), torch.zeros(sum(query_lens), dtype=torch.long),
                                      torch.tensor(query_lens), torch.tensor(lens), table, 9, 3, 64, 64, BF16,
                                      "vec", kv_split=kv_split, own_decode=True, own_prefill=own_prefill)


def test_a_step_plans_the_kernel_for_chunks_that_fill_the_threads_and_vllms_otherwise():
    if kernel_here():
        pytest.skip(kernel_here())
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            assert _plan([128] * n).kernel == "prefill"                         # ours
            assert _plan([128] * n, own_prefill=False).kernel == "vllm"         # the model said no
            assert _plan([128] * n, kv_split=False).kernel == "vllm"            # batch invariance: vLLM's always
            assert _plan([1] * 2 * n + [128]).kernel == "prefill"               # decodes beside a chunk
        # A few queries of a long row: 3 items (one tile per KV head) cannot give 2 threads two
        # each; vLLM's kernel splits the row's keys over its threads instead.
        torch.set_num_threads(2)
        assert _plan([5], lens=[4000]).kernel == "vllm"
        assert _plan([512], lens=[4000]).kernel == "prefill"  # a long row's whole chunk: 96 items
        # 12 items, but the 3 of the long row's one tile weigh 99% of the step: vLLM's splits them
        assert _plan([16, 40], lens=[8000, 40]).kernel == "vllm"
        torch.set_num_threads(1)
        assert _plan([5], lens=[4000]).kernel == "prefill"
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_says_which_shapes_it_refuses():
    if kernel_here():
        pytest.skip(kernel_here())
    assert "bfloat16 only" in prefill_attention.unavailable(torch.float16, 9, 3, 64, 64, "vec")
    assert "not amx's" in prefill_attention.unavailable(BF16, 9, 3, 64, 64, "amx")
    assert "at most 48 per KV head" in prefill_attention.unavailable(BF16, 98, 2, 64, 64, "vec")
    assert "head_dim 72" in prefill_attention.unavailable(BF16, 8, 2, 72, 64, "vec")
    assert "head_dim 256" in prefill_attention.unavailable(BF16, 8, 2, 256, 64, "vec")
    assert "block size 16" in prefill_attention.unavailable(BF16, 8, 2, 64, 16, "vec16")
    assert "block size 256" in prefill_attention.unavailable(BF16, 8, 2, 64, 256, "vec")


def test_the_off_switch_leaves_every_step_to_vllms_kernel():
    probe = ("import torch\n"
             "from ttserve.worker.backends.torch.models import prefill_attention\n"
             "print(prefill_attention.unavailable(torch.bfloat16, 9, 3, 64, 64, 'vec'))\n")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "TTSERVE_PREFILL_ATTENTION": "vllm"},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "TTSERVE_PREFILL_ATTENTION=vllm"


def test_smollm2_prefills_a_prompt_in_chunks_alike_on_either_kernel(smollm2, monkeypatch):
    """A real prompt of ~300 tokens prefilled whole and in chunks of 64 over the cached prefix,
    beside a short second prompt, once on each kernel: every chunk's last logits as close as two
    bf16 kernels get, and the same greedy token where the top two are not a near tie."""
    if kernel_here():
        pytest.skip(kernel_here())
    import json

    from transformers import AutoTokenizer

    from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM

    config = json.loads((smollm2 / "config.json").read_text())
    model = TorchLlamaForCausalLM.initialize_vllm_model(config, "cpu", 2, 1024, model_path=str(smollm2), dtype=BF16)
    text = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
            "combined movable metal type, oil-based ink and a screw press. ") * 6
    prompt = AutoTokenizer.from_pretrained(smollm2)(text)["input_ids"]
    short = prompt[:37]
    tokens = torch.zeros(2, len(prompt), dtype=torch.long)
    tokens[0], tokens[1, :len(short)] = torch.tensor(prompt), torch.tensor(short)
    table = torch.arange(2 * 8).reshape(2, 8)
    calls = []
    kernel = prefill_attention.prefill_attention
    monkeypatch.setattr(prefill_attention, "prefill_attention", lambda *a: calls.append(1) or kernel(*a))

    def run(own: bool, chunk: int) -> list[torch.Tensor]:
        kv = model.allocate_kv_cache((16, 3, 64, 64), BF16, config["num_hidden_layers"])
        assert model.own_prefill_attention  # the model's own verdict here
        model.own_prefill_attention = own
        out = []
        for start in range(0, len(prompt), chunk):
            end = min(start + chunk, len(prompt))
            rows = [0, 1] if start < len(short) else [0]  # the short prompt ends in the first chunk
            logits = model.prefill_forward(tokens[rows], table[rows], kv, [end, min(end, len(short))][:len(rows)],
                                           start_pos=[start] * len(rows))
            out.append(logits.reshape(len(rows), -1))
        return out

    for chunk in (len(prompt), 64):
        calls.clear()
        vllms = run(False, chunk)
        assert not calls
        ours = run(True, chunk)
        assert len(calls) == config["num_hidden_layers"] * -(-len(prompt) // chunk)  # every layer of every chunk
        for a, b in zip(ours, vllms):
            assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()
            top2 = b.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.1
            assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
