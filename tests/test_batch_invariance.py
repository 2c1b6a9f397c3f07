"""Batch invariance (the worker's --batch-invariant): on vLLM CPU's kernels in bf16, a row's
bits do not depend on what else its step computes. The GEMMs (reductions sliced at
linear.SPLIT_K), the attention (no KV split), and the SmolLM2 reference model through the contract:
a verify row's logits are the single-token decodes' bits, a row alone is the row in a batch, and a
re-prefill (a migrated request's) computes the KV its decodes wrote. Where it cannot hold, the
plan refuses the flag before anything loads."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from ttserve.worker import config as worker_config
from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM, bf16_gemm, cpu_kernels
from ttserve.worker.backends.torch.models.linear import SPLIT_K, BatchInvarianceError, Linear, rows_invariant
from ttserve.worker.planning.preflight import plan_worker

BF16 = torch.bfloat16


def plan(*argv: str):
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    return plan_worker(worker_config.parse_args(parser, list(argv)), {}, need_hardware=False)


@pytest.mark.parametrize("width", [576, SPLIT_K + 64, 1536, 4096])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("gemm", ["onednn", "ttserve"])
def test_a_batch_invariant_linear_gives_each_row_its_bits_alone_at_any_row_count(width, bias, gemm, monkeypatch):
    """On oneDNN (sliced reductions) and on ttserve's GEMM (one order per row as it is)."""
    if gemm == "ttserve" and bf16_gemm.kernel_unavailable():
        pytest.skip(bf16_gemm.kernel_unavailable())
    monkeypatch.setenv("TTSERVE_GEMM", gemm)
    g = torch.Generator().manual_seed(width)
    w = (torch.randn(192, width, generator=g) * 0.05).to(BF16)
    b = torch.randn(192, generator=g).to(BF16) if bias else None
    linear = Linear(w, b, batch_invariant=True)
    assert linear.kind == gemm
    x = torch.randn(300, width, generator=g).to(BF16)
    alone = torch.cat([linear(x[r:r + 1]) for r in range(x.shape[0])])
    for rows in (2, 5, 16, 17, 40, 300):
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows
    # ... and it is still the product: within bf16 rounding of the float32 one (two slices add
    # one more bf16 rounding than a single GEMM).
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert (alone.float() - exact).abs().max() <= 0.02 * exact.abs().max()
    assert rows_invariant(linear, width, BF16)


def test_the_load_time_check_catches_a_gemm_whose_rows_depend_on_the_batch():
    w = torch.randn(8, 16).to(BF16)

    def by_batch(x: torch.Tensor) -> torch.Tensor:  # what a row-count-dependent kernel does
        return F.linear(x, w) + (x.shape[0] > 1) * 2.0 ** -6

    assert not rows_invariant(by_batch, 16, BF16)


def test_a_batch_invariant_linear_refuses_a_weight_the_onednn_matmul_cannot_hold():
    with pytest.raises(BatchInvarianceError, match="oneDNN matmul"):
        Linear(torch.randn(8, 16), batch_invariant=True)  # float32


def test_attention_without_kv_split_gives_each_query_its_decode_bits():
    # A 1000-token context over two threads: with the KV split on, a lone decode row is split over
    # both and merged, while the same query among others is not (other bits); off, every query
    # row is one thread's, whatever shares the step.
    assert cpu_kernels.unavailable(torch.device("cpu"), BF16, 64, 64, None) == ""
    heads, kv_heads, head_dim, block = 9, 3, 64, 64
    isa = cpu_kernels.isa(BF16, block, head_dim)
    (k_cache, v_cache), = cpu_kernels.allocate(1, 1, 24, kv_heads, block, head_dim, BF16)[0]
    g = torch.Generator().manual_seed(0)
    context, n = 1000, 5
    keys = torch.randn(context + n, kv_heads, head_dim, generator=g).to(BF16)
    values = torch.randn(context + n, kv_heads, head_dim, generator=g).to(BF16)
    queries = torch.randn(n, heads, head_dim, generator=g).to(BF16)
    table = torch.arange(20).reshape(1, 20)

    def attend(first: int, count: int, query_lens: list[int], seq_lens: list[int], rows: int) -> torch.Tensor:
        pos = torch.arange(first, first + count)
        step = cpu_kernels.Attention.plan(0, count, table[0, pos // block] * block + pos % block,
                                          torch.tensor(query_lens), torch.tensor(seq_lens), table.expand(rows, -1),
                                          heads, kv_heads, head_dim, block, BF16, isa, kv_split=False)
        out = torch.empty(count, heads, head_dim, dtype=BF16)
        q = queries[first - context:first - context + count] if first >= context else torch.zeros(count, heads, head_dim, dtype=BF16)
        step(q, keys[first:first + count], values[first:first + count], k_cache, v_cache, out)
        return out

    attend(0, context, [context], [context], 1)  # the context's K/V into the cache
    decodes = torch.cat([attend(context + j, 1, [1], [context + j + 1], 1) for j in range(n)])
    assert torch.equal(attend(context, n, [n], [context + n], 1), decodes)  # one causal verify row
    assert torch.equal(attend(context, n, [1] * n, list(range(context + 1, context + n + 1)), n), decodes)


@pytest.fixture(scope="module")
def invariant_smollm2(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    return TorchLlamaForCausalLM.initialize_vllm_model(config, "cpu", 4, 1024, model_path=str(smollm2),
                                                       dtype=BF16, batch_invariant=True)


def test_smollm2_verify_rows_batches_and_re_prefills_are_the_decodes_bits(invariant_smollm2):
    model = invariant_smollm2
    g = torch.Generator().manual_seed(1)
    length, k = 300, 5
    tokens = torch.randint(0, 49152, (1, length + k), generator=g)
    table = torch.arange(8).reshape(1, 8)
    kv = model.allocate_kv_cache((40, 3, 64, 64), BF16, 30)
    model.prefill_forward(tokens[:, :length], table, kv, [length])
    decodes = torch.stack([model.decode_forward(tokens[:, length + j:length + j + 1], torch.tensor([length + j]),
                                                table, kv)[0, 0] for j in range(k)])
    verify = model.verify_forward(tokens[:, length:], [length], table, kv, [k])[0]
    assert torch.equal(verify, decodes)

    # The first decode again, beside three other rows of other lengths.
    tables = torch.arange(32).reshape(4, 8)
    kv4 = model.allocate_kv_cache((40, 3, 64, 64), BF16, 30)
    lengths = [length, length - 50, length - 100, length - 7]
    model.prefill_forward(tokens[:, :length].expand(4, -1).contiguous(), tables, kv4, lengths)
    batch = model.decode_forward(tokens[:, length:length + 1].expand(4, -1).contiguous(), torch.tensor(lengths),
                                 tables, kv4)
    assert torch.equal(batch[0, 0], decodes[0])

    # A re-prefill of the prompt and the decoded tokens (a migrated request) ends in the last
    # decode's logits: the K/V it recomputes are the bits the decodes wrote.
    kv_again = model.allocate_kv_cache((40, 3, 64, 64), BF16, 30)
    again = model.prefill_forward(tokens, table, kv_again, [length + k])
    assert torch.equal(again[0, 0], decodes[-1])


def test_a_per_layer_kv_cache_is_refused_under_batch_invariance(invariant_smollm2):
    with pytest.raises(BatchInvarianceError, match="per-layer"):
        invariant_smollm2.allocate_kv_cache_per_layer([((40, 3, 64, 64), BF16, 0)] * 30)


def test_the_plan_says_batch_invariance_where_it_holds_and_refuses_it_elsewhere(smollm2, tiny_gemma3):
    ok = plan("--backend", "torch", "--model", str(smollm2), "--dtype", "bfloat16", "--batch-invariant")
    assert not ok.fatal and any("batch-invariant" in line for line in ok.lines), ok.lines
    for argv, why in [(("--dtype", "float32"), "float32 runs the plain torch path"),
                      (("--backend", "sim"), "the sim backend"),
                      (("--block-size", "24"), "block size 24"),
                      (("--model", str(tiny_gemma3)), "TorchGemma3ForCausalLM: the kernels compute")]:
        refused = plan("--backend", "torch", "--model", str(smollm2), "--dtype", "bfloat16", *argv,
                       "--batch-invariant")
        assert refused.fatal and why in refused.fatal[-1] and "--batch-invariant" in refused.fatal[-1], refused.fatal


def test_vllms_environment_switch_turns_it_on(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    assert worker_config.parse_args(parser, []).batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    assert not worker_config.parse_args(parser, []).batch_invariant
