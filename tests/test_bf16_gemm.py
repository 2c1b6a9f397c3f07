"""ttserve's bfloat16 GEMM (worker/backends/torch/models/bf16_gemm.c): its results against a
float64 reference and against torch's own bf16 GEMM at decode and prefill row counts, the gated
MLP epilogues, a row's independence from the rest of its GEMM, where the models use it (and where
not: AMX, float16, odd widths, the off switch), that it keeps one copy of a weight, and SmolLM2's
decode on it against oneDNN's."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F

from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM, bf16_gemm
from ttserve.worker.backends.torch.models.linear import Linear, SwiGLU, rows_invariant

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(bf16_gemm.kernel_unavailable() != "",
                                reason=f"ttserve's GEMM cannot run here: {bf16_gemm.kernel_unavailable()}")


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float(((got.double() - exact).abs() / (exact.abs() + 1)).max())


@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (50, 64), (33, 34), (1, 2)])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gemm_is_as_close_to_float64_as_torchs_bf16_gemm(out_features, in_features, rows, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g).to(BF16)
    b = torch.randn(out_features, generator=g).to(BF16) if bias else None
    # rows of a wider tensor: the kernel reads a row stride, not a contiguous copy
    x = torch.randn(rows, in_features + 6, generator=g).to(BF16)[:, 3:3 + in_features]
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = bf16_gemm.GEMM(w, b)(x)
    assert got.shape == (rows, out_features) and got.dtype == BF16
    # both round the float32 sum to bfloat16 once (2^-9 relative); their sums' orders differ
    assert _relative_error(got, exact) <= max(1.5 * _relative_error(F.linear(x, w, b), exact), 2 ** -8)


def test_leading_dimensions_and_an_empty_batch_keep_their_shape():
    w = torch.randn(64, 32).to(BF16)
    gemm = bf16_gemm.GEMM(w)
    x = torch.randn(2, 3, 32).to(BF16)
    assert torch.equal(gemm(x), gemm(x.reshape(6, 32)).reshape(2, 3, 64))
    assert gemm(torch.empty(0, 32, dtype=BF16)).shape == (0, 64)


_ACT = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 1536), (30, 1536), (5, 48)])
def test_the_gated_epilogue_is_as_close_to_float64_as_torchs_three_ops(activation, rows, inter):
    """48: a width of whole half tiles that is not whole tiles."""
    g = torch.Generator().manual_seed(rows)
    gate, up = (torch.randn(inter, 576, generator=g).div(8).to(BF16) for _ in range(2))
    x = torch.randn(rows, 576, generator=g).to(BF16)
    act = _ACT[activation]
    exact = act(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    got = bf16_gemm.GEMM.gated(gate, up)(x, activation)
    assert got.shape == (rows, inter)
    torch_ops = act(F.linear(x, gate)) * F.linear(x, up)  # each op rounded to bfloat16
    assert _relative_error(got, exact) <= max(1.5 * _relative_error(torch_ops, exact), 2 ** -8)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_activations_keep_bfloat16_precision_across_their_range(activation):
    """Each output against float64 relative to itself, not to the output's scale: the tails
    (gelu at -4.5 is -1.4e-5) must not lose their digits to cancellation."""
    g = torch.linspace(-12, 12, 4801, dtype=torch.float64)  # gate values, exact in bf16 below
    gate = torch.diag(torch.ones(64)).to(BF16)  # x @ gate^T = x's first 64 inputs
    up = torch.zeros(64, 64, dtype=BF16)
    up[:, -1] = 1  # x @ up^T = x's last input, 1
    x = torch.zeros(len(g), 64, dtype=BF16)
    x[:, 0] = g.to(BF16)
    x[:, -1] = 1
    got = bf16_gemm.GEMM.gated(gate, up)(x, activation)[:, 0].double()
    v = x[:, 0].double()
    # gelu_tanh as v sigmoid(2z), z = sqrt(2/pi) (v + 0.044715 v^3): the same function as torch's
    # v/2 (1 + tanh(z)), whose 1 + tanh cancels even in float64 (at -7.125 it is 22% off)
    exact = (F.silu(v) if activation == "silu"
             else v * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (v + 0.044715 * v ** 3)))
    scale = exact.abs().clamp(min=1e-30)
    keep = exact.abs() > 1e-30
    assert float(((got - exact).abs() / scale)[keep].max()) <= 2 ** -7


def test_a_gated_gemm_needs_whole_half_tiles():
    with pytest.raises(ValueError, match="a multiple of 16"):
        bf16_gemm.GEMM.gated(torch.zeros(40, 64, dtype=BF16), torch.zeros(40, 64, dtype=BF16))


def test_a_rows_bits_do_not_depend_on_the_rest_of_its_gemm():
    """Every row count takes another register pass (1-12 rows, then blocks of 12): a row's sum
    is in one order in each."""
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in [(576, 1536), (49152 // 16, 576)]:
        w = torch.randn(out_features, in_features, generator=g).to(BF16)
        assert rows_invariant(bf16_gemm.GEMM(w), in_features, BF16, rows=40)
    gated = bf16_gemm.GEMM.gated(*(torch.randn(1536, 576, generator=g).to(BF16) for _ in range(2)))
    assert rows_invariant(gated, 576, BF16, rows=40)
    assert rows_invariant(lambda x: gated(x, "gelu_tanh"), 576, BF16, rows=40)


def test_a_prefill_spreads_its_row_blocks_over_threads_and_computes_the_same_bits():
    """576 outputs are 18 tiles: with more threads than that, (tile, row block) items spread a
    prefill's rows too; a row's bits are the same at any thread count."""
    g = torch.Generator().manual_seed(3)
    gemm = bf16_gemm.GEMM(torch.randn(576, 1536, generator=g).to(BF16))
    x = torch.randn(300, 1536, generator=g).to(BF16)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 24):
            torch.set_num_threads(count)
            results.append(gemm(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_threads_that_outnumber_the_cores_take_each_others_shares_and_compute_the_same_bits():
    """More threads than cores: threads are taken off their cores mid-share, and the others claim
    what is left of those shares (work_shares.h). Every item is computed once, as on one thread."""
    g = torch.Generator().manual_seed(4)
    gemm = bf16_gemm.GEMM(torch.randn(3072, 576, generator=g).to(BF16))
    inputs = [torch.randn(rows, 576, generator=g).to(BF16) for rows in (1, 5, 32)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [gemm(x) for x in inputs]
        torch.set_num_threads(3 * os.cpu_count())
        for _ in range(20):
            assert all(torch.equal(gemm(x), want) for x, want in zip(inputs, alone))
    finally:
        torch.set_num_threads(threads)


def test_the_gemm_refuses_a_weight_it_cannot_read():
    with pytest.raises(ValueError, match="a bfloat16 CPU weight"):
        bf16_gemm.GEMM(torch.zeros(40, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="an even width"):
        bf16_gemm.GEMM(torch.zeros(40, 33, dtype=BF16))
    with pytest.raises(ValueError, match=r"with a bias \(39,\)"):
        bf16_gemm.GEMM(torch.zeros(40, 32, dtype=BF16), torch.zeros(39, dtype=BF16))


def test_the_models_use_it_for_bfloat16_weights_with_an_even_width(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert bf16_gemm.unavailable(torch.zeros(4, 8, dtype=BF16)) == ""
    assert "bfloat16 on a CPU, not torch.float16" in bf16_gemm.unavailable(torch.zeros(4, 8, dtype=torch.float16))
    assert "odd number of inputs (7)" in bf16_gemm.unavailable(torch.zeros(4, 7, dtype=BF16))
    assert Linear(torch.randn(4, 7).to(BF16)).kind != "ttserve"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert "an AMX CPU, where oneDNN's AMX GEMMs serve" in bf16_gemm.unavailable(torch.zeros(4, 8, dtype=BF16))
    monkeypatch.setenv("TTSERVE_GEMM", "ttserve")
    assert bf16_gemm.unavailable(torch.zeros(4, 8, dtype=BF16)) == ""
    monkeypatch.setenv("TTSERVE_GEMM", "onednn")
    assert bf16_gemm.unavailable(torch.zeros(4, 8, dtype=BF16)) == "TTSERVE_GEMM=onednn"
    monkeypatch.setenv("TTSERVE_GEMM", "fast")
    with pytest.raises(ValueError, match="TTSERVE_GEMM='fast': onednn .* or ttserve"):
        bf16_gemm.unavailable(torch.zeros(4, 8, dtype=BF16))


def test_a_linear_layer_on_it_holds_one_copy_of_its_weight(monkeypatch):
    monkeypatch.setenv("TTSERVE_GEMM", "ttserve")
    w = torch.randn(64, 32).to(BF16)
    original = weakref.ref(w)
    layer = Linear(w)
    assert layer.kind == "ttserve"
    del w
    gc.collect()
    assert original() is None  # the packed tiles are the only copy
    assert layer.weight.packed.numel() == 64 * 32


def test_a_swiglu_on_it_is_one_gated_gemm_or_two_when_its_width_is_not_whole_half_tiles(monkeypatch):
    monkeypatch.setenv("TTSERVE_GEMM", "ttserve")
    g = torch.Generator().manual_seed(1)
    for inter, fused in [(64, True), (40, False)]:
        gate, up, down = (torch.randn(inter, 32, generator=g).to(BF16), torch.randn(inter, 32, generator=g).to(BF16),
                          torch.randn(32, inter, generator=g).to(BF16))
        mlp = SwiGLU(gate, up, down)
        assert mlp.kind == "ttserve" and (mlp.gate_up is not None) == fused
        x = torch.randn(3, 32, generator=g).to(BF16)
        exact = (F.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)) @ down.double().T
        torch_ops = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

        def error(got: torch.Tensor) -> float:  # of the output's scale: its sums cancel
            return float((got.double() - exact).abs().max() / exact.abs().max())

        assert error(mlp(x)) <= max(1.5 * error(torch_ops), 2 ** -8)


def test_the_off_switch_leaves_every_gemm_to_onednn():
    """In a fresh process (the switch is read as each weight loads): oneDNN's handler where
    vLLM's op library loads, else mkldnn's packed linear (also oneDNN)."""
    probe = ("import torch\n"
             "from ttserve.worker.backends.torch.models import cpu_kernels\n"
             "from ttserve.worker.backends.torch.models.linear import Linear\n"
             "w = torch.zeros(64, 32, dtype=torch.bfloat16)\n"
             "print(Linear(w).kind, 'onednn' if not cpu_kernels.gemm_unavailable(w) else 'packed')\n")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "TTSERVE_GEMM": "onednn"},
                         capture_output=True, text=True, timeout=120, check=True)
    kind, expected = out.stdout.split()
    assert kind == expected


def test_smollm2_decodes_a_prompt_alike_on_it_and_on_onednn(smollm2, monkeypatch):
    """Four rows continuing a real prompt, teacher-forced over 12 steps, every GEMM on ttserve's
    kernel and then on oneDNN's: logits as close as two bf16 GEMMs' roundings leave them, and the
    same greedy token wherever the top two logits are not a near tie."""
    from transformers import AutoTokenizer

    from ttserve.worker.backends.torch.models import cpu_kernels

    if cpu_kernels.gemm_unavailable(torch.zeros(64, 64, dtype=BF16)):
        pytest.skip("no oneDNN matmul here to compare with")
    config = json.loads((smollm2 / "config.json").read_text())
    prompt = AutoTokenizer.from_pretrained(smollm2)("The history of the printing press begins in")["input_ids"]
    rows, steps = 4, 12
    continuation = torch.randint(0, 49152, (steps + rows,), generator=torch.Generator().manual_seed(0))

    def run(gemm: str) -> torch.Tensor:
        monkeypatch.setenv("TTSERVE_GEMM", gemm)
        model = TorchLlamaForCausalLM.initialize_vllm_model(config, "cpu", rows, 256, model_path=str(smollm2),
                                                            dtype=BF16)
        assert (model.layers[0].qkv.kind == "ttserve") == (gemm == "ttserve")
        kv = model.allocate_kv_cache((rows * 4, 3, 16, 64), BF16, config["num_hidden_layers"])
        table = torch.arange(rows * 4).reshape(rows, 4)
        lens = [len(prompt) + r for r in range(rows)]
        tokens = torch.zeros(rows, max(lens), dtype=torch.long)
        for r in range(rows):
            tokens[r, :lens[r]] = torch.cat([torch.tensor(prompt), continuation[:r]])
        out = [model.prefill_forward(tokens, table, kv, prompt_lens=lens).reshape(rows, -1)]
        for step in range(steps):
            fed = continuation[torch.arange(rows) + step]
            out.append(model.decode_forward(fed[:, None], torch.tensor(lens) + step, table, kv).reshape(rows, -1))
        return torch.stack(out)

    ours, theirs = run("ttserve"), run("onednn")
    # Calibration on the 2-core EPYC: 0.69 at most and 0.117 on average over these logits (vLLM's
    # attention kernel with and without its KV split differs by 0.75 and 0.134 over similar ones).
    difference = (ours - theirs).abs()
    assert difference.max().item() < 1.5 and difference.mean().item() < 0.2
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.5
    assert clear.sum() > clear.numel() // 4
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


def test_after_a_kernel_brought_a_second_openmp_runtime_every_later_kernel_is_refused(monkeypatch):
    """The refused kernel's runtime stays mapped (a library cannot be unloaded), and the next
    kernel would bind to it without adding a mapping: the first refusal holds for every load."""
    from ttserve.worker.backends.torch.models import decode_attention, native_build

    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_second_runtime", "")
    torch_own, other = "/venv/torch/lib/libgomp.so.1", "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
    mapped = iter([{torch_own}])  # before the first load; ever after, both
    monkeypatch.setattr(native_build, "_gomp_libraries", lambda: next(mapped, {torch_own, other}))
    why = native_build.load(bf16_gemm.SOURCE)
    assert why == f"it would load a second OpenMP runtime beside torch's ({other})"
    assert native_build.load(decode_attention.SOURCE) == why
