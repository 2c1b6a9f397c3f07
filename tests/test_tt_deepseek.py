"""DeepSeek V3 on the ttnn path: ModelRunner driven through TtnnBackend on the fake of tt-metal's
models/demos/deepseek_v3/tt/generator_vllm.py (tests/fakes/tt_metal), with a tiny checkpoint.

Two things differ from the tt_transformers classes, as tt-metal's generator and the TT vLLM plugin
have them:
- the KV cache is MLA's: one latent head of kv_lora_rank + qk_rope_head_dim per token and layer
  (the plugin sizes it through vLLM's get_num_kv_heads = 1 / get_head_size; mla1d.py create_state
  builds (blocks, 1, block_size, kvpe_dim)), not K and V over num_key_value_heads;
- a host-sampled prefill returns logits of every position [B, S, V] (each row cut to its prompt
  and padded by repeating its last real row), of which the plugin samples tt_out[rows, -1, :].
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from fakes.fake_tt_model import next_token

from ttserve.worker.backends.torch.backend import TorchBackend
from ttserve.worker.backends.ttnn.backend import TtnnBackend
from ttserve.worker.batch import DecodeItem, NewRequest, PrefillChunk, ServingConfig, StepBatch
from ttserve.worker.planning.mesh import resolve_mesh
from ttserve.worker.runner import DeviceOptions, ModelRunner

TREE = Path(__file__).parent / "fakes" / "tt_metal"
TARGET = "models.demos.deepseek_v3.tt.generator_vllm:DeepseekV3ForCausalLM"
VOCAB = 64
BLOCK = 16
LAYERS = 2
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 32, 16
LATENT = KV_LORA_RANK + QK_ROPE_HEAD_DIM
# N300: two chips, and DeepSeek's tt_data_parallel is the mesh's device count, so rows come in 2s.
CONFIG = ServingConfig(num_lanes=1, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=256)


@pytest.fixture
def tt_metal(monkeypatch):
    """tt-metal's models/ tree (the fake) importable for one test, imported afresh; the checkpoint
    variables the worker sets (DEEPSEEK_V3_HF_MODEL, DEEPSEEK_V3_CACHE) unset again after."""
    def loaded() -> set[str]:
        return {m for m in sys.modules if m == "models" or m.startswith("models.")}

    for name in loaded():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(TREE))
    for var in ("DEEPSEEK_V3_HF_MODEL", "DEEPSEEK_V3_CACHE"):
        monkeypatch.setenv(var, "placeholder")
        monkeypatch.delenv(var)
    yield
    for name in loaded():
        del sys.modules[name]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A tiny DeepSeek V3 config.json. The folder is named for the checkpoint the real class
    states a KV budget for (get_max_tokens_all_users refuses any other)."""
    folder = tmp_path / "DeepSeek-R1-0528-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": VOCAB,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": LAYERS, "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": 48,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 4096, "eos_token_id": 2}))
    return folder


def deepseek_runner(model_dir: Path, **tt) -> tuple[ModelRunner, object]:
    import importlib
    module, _, name = TARGET.partition(":")
    cls = getattr(importlib.import_module(module), name)
    from models.tt_transformers.tt.generator import TTNN  # the fake tree's recording ttnn
    backend = TtnnBackend(resolve_mesh("N300", 2), tt, ttnn=TTNN)
    runner = ModelRunner(model_dir, cls, "DeepseekV3ForCausalLM", backend, torch.bfloat16, block_size=BLOCK,
                         kv_cache_bytes=0, options=DeviceOptions(tt, backend_traces=True))
    runner.warmup(CONFIG, lambda *_: None)
    return runner, TTNN


def test_the_mla_cache_is_one_latent_head_per_token_and_the_budget_counts_one_latent(tt_metal, model_dir):
    runner, ttnn = deepseek_runner(model_dir)
    [init] = ttnn.recorder.only("model.initialize_vllm_model")
    assert (init["tt_data_parallel"], init["max_batch_size"]) == (2, 2)
    [kv] = ttnn.recorder.only("model.allocate_kv_cache")
    # budget: max_model_len x max_num_seqs (the class's) + a block per row; at most what 2 x 256 needs
    blocks = 2 * 256 // BLOCK
    # + block 0, which takes the model's padding (TtnnBackend.null_block)
    assert (kv["kv_cache_shape"], kv["num_layers"]) == ((blocks + 1, 1, BLOCK, LATENT), LAYERS)
    assert (runner.layout.num_kv_heads, runner.layout.head_dim) == (1, LATENT)

    # Sized by bytes (a backend with no budget of its own): one latent per token and layer, not K and V.
    bytes_per_block = LAYERS * BLOCK * LATENT * 2  # bfloat16
    by_bytes = ModelRunner(model_dir, type(runner.model), "DeepseekV3ForCausalLM",
                           TorchBackend(torch.device("cpu"), torch.bfloat16, lambda kind: False), torch.bfloat16,
                           block_size=BLOCK, kv_cache_bytes=10 * bytes_per_block)
    assert by_bytes.kv_layout(CONFIG).num_blocks_per_lane == 10


def test_a_host_sampled_prefill_takes_each_rows_last_position(tt_metal, model_dir):
    runner, ttnn = deepseek_runner(model_dir)
    prompts = {"long": [1, 5, 9, 13, 17], "short": [2, 4, 6]}
    blocks = {"long": [3], "short": [7]}
    ttnn.recorder.calls.clear()
    result = runner.execute(StepBatch(1, "prefill", new_requests=[
        NewRequest(rid, 0, row, 0.0, 1.0, 0, None) for row, rid in enumerate(prompts)], prefill=[
        PrefillChunk(rid, ids, 0, blocks[rid], True) for rid, ids in prompts.items()]))
    [call] = ttnn.recorder.only("model.prefill_forward")
    assert call["sampling_params"] is None and call["prompt_lens"] == [5, 3] and call["empty_slots"] == [0, 1]
    assert not result.sampled_on_device
    expected = {rid: next_token(ids[-1], len(ids) - 1, VOCAB) for rid, ids in prompts.items()}
    assert result.tokens == expected and all(0 <= t < VOCAB for t in result.tokens.values())


def test_a_decode_reads_back_without_process_decode_output_host(tt_metal, model_dir):
    """DeepSeek V3's class has no process_decode_output_host: its decode output is already a host
    tensor ([B, 1, V] logits here), used as it is, as the plugin's finalize_decode does."""
    runner, ttnn = deepseek_runner(model_dir)
    assert not hasattr(type(runner.model), "process_decode_output_host")
    prompt = [1, 5, 9]
    first = runner.execute(StepBatch(1, "prefill", new_requests=[NewRequest("r", 0, 0, 0.0, 1.0, 0, None)],
                                     prefill=[PrefillChunk("r", prompt, 0, [3], True)])).tokens["r"]
    token, position = first, len(prompt)
    for step in range(2, 5):
        result = runner.execute(StepBatch(step, "decode", decode=[DecodeItem("r", token, position, [])]))
        assert result.tokens["r"] == next_token(token, position, VOCAB)
        token, position = result.tokens["r"], position + 1
    assert ttnn.recorder.only("model.read_decode_output")


def test_the_converted_weights_go_to_a_named_cache_not_the_working_directory(tmp_path):
    """DeepseekGenerator._prepare_weight_configs (tt-metal deepseek_v3/tt/generator.py, index id
    54245576761) writes into DEEPSEEK_V3_CACHE, else into ./generated/deepseek_v3 of the worker's
    working directory: the worker names a cache unless the operator has."""
    from ttserve.worker.backends.ttnn.tt_models import ModelFamily, checkpoint_environment

    family = ModelFamily("DeepseekV3ForCausalLM", "models.demos.deepseek_v3.tt.generator_vllm", None)
    model = tmp_path / "DeepSeek-R1-0528"
    planned = checkpoint_environment(family, model, {"TT_CACHE_PATH": "/var/cache/tt"})
    assert planned.to_set == {"DEEPSEEK_V3_HF_MODEL": str(model),
                              "DEEPSEEK_V3_CACHE": "/var/cache/tt/deepseek_v3/DeepSeek-R1-0528"}
    assert "DEEPSEEK_V3_CACHE" not in checkpoint_environment(family, model, {"DEEPSEEK_V3_CACHE": "/x"}).to_set
