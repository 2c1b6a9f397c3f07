"""The torch reference Gemma 3 (worker/backends/torch/models/gemma3.py) against transformers on the
tiny random-weight checkpoint (worker/planning/tiny_gemma3.py: a 16-token window, layers local,
local, global twice, final-logit softcapping, random (1 + w) norms).

The oracle is transformers' Gemma3ForCausalLM in float32 with eager attention. Greedy decoding
through the worker's ModelRunner must give transformers' generate token for token, on prompts
whose prompt and output run far past the window (40 + 40 tokens), chunked across it and with
several rows decoding together; and the logits at every position of a sequence four windows long
must agree within the float32 tolerance of tests/test_reference_model.py (summation order only:
a wrong mask edge, RoPE base or norm moves them by far more).
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import assert_logits_close

from ttserve.worker.backends.torch.backend import TorchBackend
from ttserve.worker.backends.torch.models import REFERENCE_ARCHITECTURES, TorchGemma3ForCausalLM
from ttserve.worker.backends.torch.models.gemma3 import Gemma3Shape
from ttserve.worker.backends.torch.models.llama import CheckpointError
from ttserve.worker.batch import DecodeItem, GroupBlocks, NewRequest, PrefillChunk, ServingConfig, StepBatch
from ttserve.worker.planning.tiny_gemma3 import LAYER_TYPES, SLIDING_WINDOW
from ttserve.worker.runner import DeviceOptions, ModelRunner

REL_TOL = 1e-4
BLOCK = 16
NEW_TOKENS = 40
TEXT = ("The history of the Roman Empire began when the city of Rome, founded on seven hills by the twins "
        "Romulus and Remus, grew from a small village into the capital of an empire that spanned three "
        "continents and lasted for more than a thousand years, until its last emperor was deposed.")




@pytest.fixture(scope="module", autouse=True)
def one_torch_thread(single_torch_thread):
    """Memory-bound on a CPU, as the text models (conftest.single_torch_thread)."""


@pytest.fixture(scope="module")
def config(tiny_gemma3) -> dict:
    return ModelRunner.read_config(tiny_gemma3)


@pytest.fixture(scope="module")
def hf(hf_tiny_gemma3):
    return hf_tiny_gemma3


@pytest.fixture(scope="module")
def prompts(hf) -> dict[str, list[int]]:
    ids = hf[0](TEXT)["input_ids"]
    assert len(ids) >= 47
    return {"a": ids[:40], "b": ids[3:37], "c": ids[1:48]}


@pytest.fixture(scope="module")
def expected(hf, prompts) -> dict[str, list[int]]:
    out = {}
    for rid, ids in prompts.items():
        with torch.no_grad():
            g = hf[1].generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out[rid] = g[0, len(ids):].tolist()
    # No answer ends early: all 40 tokens are compared, and they are not one token repeated.
    assert all(len(o) == NEW_TOKENS and len(set(o)) > 10 for o in out.values()), out
    return out


def test_the_checkpoint_is_hybrid_and_sets_every_gemma3_term(config):
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert tuple(config["layer_types"]) == LAYER_TYPES and config["sliding_window"] == SLIDING_WINDOW
    assert config["query_pre_attn_scalar"] != config["head_dim"]
    # Both set: the final cap applies; the attention cap is ignored by transformers' Gemma 3 (and
    # vLLM's), so the logits tests below show the reference model ignores it too (applied, it
    # would move these logits by ~30%).
    assert config["final_logit_softcapping"] and config["attn_logit_softcapping"]
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] != \
        config["rope_parameters"]["full_attention"]["rope_theta"]
    assert config["max_position_embeddings"] >= 512 and config["tie_word_embeddings"]
    assert REFERENCE_ARCHITECTURES["Gemma3ForCausalLM"] is TorchGemma3ForCausalLM


# --- greedy decoding through the runner --------------------------------------------------------

def make_runner(folder, **tt) -> ModelRunner:
    """Two lanes of two rows, float32, 16-token blocks; with tt options, the decode traced (static
    shapes) and sampling on the device."""
    traced = bool(tt)
    options = DeviceOptions(tt, backend_traces=traced, traced_kinds=frozenset({"decode"}))
    r = ModelRunner(folder, TorchGemma3ForCausalLM, "Gemma3ForCausalLM",
                    TorchBackend(torch.device("cpu"), torch.float32, options.traced), torch.float32,
                    block_size=BLOCK, kv_cache_bytes=64 << 20, options=options)
    r.warmup(ServingConfig(num_lanes=2, max_num_seqs=2, max_model_len=512, max_num_batched_tokens=256),
             lambda *_: None)
    return r


# Rows 0 and 1 share lane 0; row 3 is lane 1 and uses the same lane-local block ids as row 0.
# Blocks are interleaved and out of order. Request b's prompt comes in three chunks that end at 12,
# 24 and 34: chunks shorter than the window, whose keys fall in and out of it.
ROWS = {"a": 0, "b": 1, "c": 3}
BLOCKS = {"a": [0, 2, 4, 6, 8, 10], "b": [9, 7, 5, 3, 1, 11], "c": [1, 0, 3, 2, 5, 4]}
B_CUTS = [12, 24]
# Gemma 3 serves hybrid KV cache groups (worker/kv_groups.py): full attention [2, 5] (BLOCKS), then
# the sliding groups [0, 1] and [3, 4], each with block ids of its own (BLOCKS shifted past the
# others'); a sliding group's blocks wholly before the window are skipped (their entries zeroed).
GROUP_SHIFTS = (12, 24)


def groups(new_block_ids: list[int], start: int) -> list[GroupBlocks]:
    skipped = max(0, (start - SLIDING_WINDOW + 1) // BLOCK)
    return [GroupBlocks([b + shift for b in new_block_ids], skipped) for shift in GROUP_SHIFTS]


def runner_greedy(r: ModelRunner, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    news = [NewRequest(rid, row // 2, row, 0.0, 1.0, 0, None) for rid, row in ROWS.items()]
    b = prompts["b"]
    bounds = [0, *B_CUTS, len(b)]
    steps = [[PrefillChunk("a", prompts["a"], 0, BLOCKS["a"], True, groups=groups(BLOCKS["a"], 0)),
              PrefillChunk("b", b[:bounds[1]], 0, BLOCKS["b"], False, groups=groups(BLOCKS["b"], 0)),
              PrefillChunk("c", prompts["c"], 0, BLOCKS["c"], True, groups=groups(BLOCKS["c"], 0))]]
    steps += [[PrefillChunk("b", b[lo:hi], lo, [], hi == len(b), groups=groups([], lo))]
              for lo, hi in zip(bounds[1:], bounds[2:])]
    out: dict[str, list[int]] = {}
    for i, chunks in enumerate(steps):
        result = r.execute(StepBatch(1 + i, "prefill", new_requests=news if i == 0 else [], prefill=chunks))
        out.update({rid: [t] for rid, t in result.tokens.items()})
    assert set(out) == set(ROWS)
    for step in range(NEW_TOKENS - 1):
        items = [DecodeItem(rid, out[rid][-1], len(prompts[rid]) + step, [],
                            groups=groups([], len(prompts[rid]) + step)) for rid in ROWS]
        result = r.execute(StepBatch(10 + step, "decode", decode=items))
        for rid, t in result.tokens.items():
            out[rid].append(t)
    return out


@pytest.mark.parametrize("tt", [{}, {"trace_mode": "all", "sample_on_device_mode": "all"}],
                         ids=["eager-host-sampling", "traced-decode-device-sampling"])
def test_greedy_tokens_through_the_runner_are_transformers_generate(tiny_gemma3, prompts, expected, tt):
    assert all(len(p) + NEW_TOKENS > 4 * SLIDING_WINDOW for p in prompts.values())
    r = make_runner(tiny_gemma3, **tt)
    static = []
    if tt:
        assert r.options.traced("decode")
        static_decode = r.model._static_decode
        r.model._static_decode = lambda *args: static.append(1) or static_decode(*args)
    # Every forward pages layer by layer: one table per KV group, shared by the group's layers.
    distinct = []
    forward = r.model._forward
    r.model._forward = lambda step, kv: distinct.append(len({id(p) for p in step.paging})) or forward(step, kv)
    assert runner_greedy(r, prompts) == expected
    assert len(static) == (NEW_TOKENS - 1 if tt else 0)
    assert set(distinct) == {3}


# --- logits at every position ------------------------------------------------------------------

def new_cache(model: TorchGemma3ForCausalLM, blocks: int = 24) -> list:
    s = model.shape
    return model.allocate_kv_cache((blocks, s.num_kv_heads, BLOCK, s.head_dim), model.dtype, s.num_layers)


def load(folder, config: dict, dtype: torch.dtype = torch.float32, lanes: int = 1,
         device: torch.device = torch.device("cpu")) -> TorchGemma3ForCausalLM:
    return TorchGemma3ForCausalLM.initialize_vllm_model(config, device, max_batch_size=2, max_seq_len=256,
                                                        tt_data_parallel=lanes, model_path=str(folder), dtype=dtype)


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("trace", [False, True], ids=["live-rows", "traced-static-shapes"])
def test_logits_match_transformers_at_every_position(tiny_gemma3, config, hf, trace):
    """Two rows, 64 and 50 random tokens: a 20-token prefill chunk (past the window), then one
    decode step per position, each compared with transformers' forward of the whole sequence."""
    model = load(tiny_gemma3, config)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.shape.vocab_size, (n,), generator=g).tolist() for n in (64, 50)]
    refs = [hf_logits(hf[1], s) for s in seqs]
    kv = new_cache(model)
    table = torch.full((2, 16), -1, dtype=torch.int32)
    table[0, :4], table[1, :4] = torch.tensor([3, 0, 5, 7]), torch.tensor([1, 6, 2, 4])
    first = 20
    logits = model.prefill_forward(torch.tensor([s[:first] for s in seqs]), table, kv,
                                   prompt_lens=[first, first], empty_slots=[0, 1])
    for i in range(2):
        assert_logits_close(logits[i, 0], refs[i][first - 1])
    for pos in range(first, 64):
        live = [i for i in range(2) if pos < len(seqs[i])]
        tokens = torch.tensor([[seqs[i][pos] if i in live else 0] for i in range(2)])
        start = torch.tensor([pos if i in live else -1 for i in range(2)])
        out = model.decode_forward(tokens, start, table, kv, enable_trace=trace)
        for i in live:
            assert_logits_close(out[i, 0], refs[i][pos])


def test_the_window_masks_the_local_layers(tiny_gemma3, config):
    """The same checkpoint with the window widened past the sequence (every layer then sees the
    whole context, and transformers agrees): a prompt within the window gives the same logits, one
    past it other logits, by far more than the tolerance."""
    windowed, wide = load(tiny_gemma3, config), load(tiny_gemma3, {**config, "sliding_window": 4096})
    hf_wide = transformers.Gemma3ForCausalLM.from_pretrained(
        tiny_gemma3, dtype=torch.float32, attn_implementation="eager", sliding_window=4096).eval()
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(0, windowed.shape.vocab_size, (48,), generator=g).tolist()
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)

    def last(model, n):
        return model.prefill_forward(torch.tensor([seq[:n]]), table, new_cache(model), prompt_lens=[n])[0, 0]

    torch.testing.assert_close(last(windowed, SLIDING_WINDOW), last(wide, SLIDING_WINDOW), rtol=0, atol=1e-6)
    differ = float((last(windowed, 48) - last(wide, 48)).abs().max())
    assert differ > 100 * REL_TOL * float(last(windowed, 48).abs().max()), differ
    assert_logits_close(last(wide, 48), hf_logits(hf_wide, seq)[-1])


def test_static_decode_reads_nothing_back_so_a_cuda_graph_can_capture_it(tiny_gemma3, config):
    """As tests/test_reference_model.py checks for Llama: on the meta device any read back to the
    host raises; Gemma's forward in the static decode runs through."""
    meta = torch.device("meta")
    model = load(tiny_gemma3, config, lanes=2, device=meta)
    kv = new_cache(model)
    tokens, pos = torch.zeros(4, 1, dtype=torch.long, device=meta), torch.zeros(4, dtype=torch.long, device=meta)
    with torch.inference_mode():
        logits = model._forward(model._static_step(tokens, pos, torch.zeros(4, 16, dtype=torch.long, device=meta),
                                                   kv), kv)
    assert logits.shape == (4, model.shape.vocab_size) and logits.device == meta


def test_in_bf16_it_runs_plain_torch_and_tracks_transformers_bf16(tiny_gemma3, config, hf):
    """16 bits on a CPU: no vLLM kernels (they compute Llama's norms), the plain forward, with the
    norms in float32 as transformers'. Measured: ours is 1.8% of the logits' scale from
    transformers' bf16, which is itself 2.7% from its float32; a norm without its 1 or a
    missing scale moves them by tens of percent."""
    model = load(tiny_gemma3, config, dtype=torch.bfloat16)
    kv = new_cache(model)
    assert model.kernel_isa == "" and kv[0][0][0].dtype == torch.bfloat16
    hf_bf16 = transformers.Gemma3ForCausalLM.from_pretrained(
        tiny_gemma3, dtype=torch.bfloat16, attn_implementation="eager").eval()
    seq = hf[0](TEXT)["input_ids"][:40]
    ours = model.prefill_forward(torch.tensor([seq]), torch.tensor([[0, 1, 2]], dtype=torch.int32), kv,
                                 prompt_lens=[40])[0, 0]
    ref = hf_logits(hf_bf16, seq)[-1].float()
    assert float((ours - ref).abs().max()) <= 0.05 * float(ref.abs().max())


# --- config forms --------------------------------------------------------------------------------

def test_a_transformers_4_config_reads_as_the_transformers_5_one(config):
    """Before transformers 5: rope_theta (global) with rope_scaling, rope_local_base_freq, and
    sliding_window_pattern instead of layer_types."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    full = config["rope_parameters"]["full_attention"]
    old.update(rope_theta=full["rope_theta"], rope_scaling={"rope_type": "linear", "factor": full["factor"]},
               rope_local_base_freq=config["rope_parameters"]["sliding_attention"]["rope_theta"],
               sliding_window_pattern=3)
    new_shape, old_shape = Gemma3Shape.from_config(config), Gemma3Shape.from_config(old)
    assert old_shape == new_shape
    assert new_shape.local_rope_layers == new_shape.sliding_layers == (True, True, False) * 2
    assert (new_shape.rope_theta, new_shape.rope_scaling["factor"], new_shape.local_rope_theta) == (1e6, 8.0, 1e4)
    default = Gemma3Shape.from_config({k: v for k, v in old.items() if k != "sliding_window_pattern"})
    assert default.sliding_layers == (True,) * 5 + (False,)  # transformers' default: every 6th global


@pytest.mark.parametrize("change, match", [({"hidden_activation": "silu"}, "hidden_activation"),
                                           ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
                                           ({"use_bidirectional_attention": True}, "bidirectional")])
def test_configs_it_cannot_serve_are_refused(config, change, match):
    with pytest.raises(CheckpointError, match=match):
        Gemma3Shape.from_config({**config, **change})


def test_ttserve_model_prepare_tiny_gemma3_builds_the_same_checkpoint_as_the_tests(tmp_path, smollm2, tiny_gemma3):
    import hashlib
    import subprocess
    import sys

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / smollm2.name).symlink_to(smollm2)  # the tokenizer it reuses, prepared
    done = subprocess.run([sys.executable, "-m", "ttserve.cli", "model", "prepare", "tiny-gemma3",
                           "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "models" / "tiny-gemma3"
    assert done.stdout.strip().splitlines()[-1] == str(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert json.loads((folder / ".ttserve-prepared").read_text())["built"] == "tiny-gemma3"

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert digest(folder) == digest(tiny_gemma3), "same seed, same weights"
