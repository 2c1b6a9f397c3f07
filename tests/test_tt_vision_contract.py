"""tt-metal's vision classes through the ttnn path, on fakes that mirror the real files
(tests/fakes/tt_metal/models/demos/qwen25_vl, qwen3_vl, tt_transformers' Gemma3, Mllama and
Mistral3): images reach prefill_forward as the TT plugin's model runner passes them
(pixel_values and image_grid_thw per prefill user, None for a text-only one), mRoPE classes
return rope_deltas and get them back by row at every decode, and the classes whose prefill
takes its images in another form (Mllama's cross-attention prefill, Mistral3's `images`) are
refused before a device opens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ttserve.worker.backends.ttnn.backend import TtnnBackend
from ttserve.worker.batch import DecodeItem, ImageInput, NewRequest, PrefillChunk, StepBatch
from ttserve.worker.planning.mesh import resolve_mesh
from ttserve.worker.runner import DeviceOptions, ModelRunner

from test_tt_contract import chips, tt_metal, warm, worker_args  # noqa: F401 - fixtures

IMAGE = 60          # the fakes' image token
PATCH_ROW = 3 * 2 * 14 * 14


def vision_checkpoint(root: Path, arch: str) -> Path:
    folder = root / arch
    folder.mkdir(parents=True)
    text = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "qwen2_5_vl", "image_token_id": IMAGE, "eos_token_id": 2,
        "vision_config": {"depth": 1, "hidden_size": 32, "spatial_merge_size": 2}, "text_config": text}))
    return folder


def runner_for(model_dir: Path, cls_path: str, max_num_seqs: int = 2, **tt) -> tuple[ModelRunner, object]:
    import importlib
    module, _, name = cls_path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    from models.tt_transformers.tt.generator import TTNN
    backend = TtnnBackend(resolve_mesh("N150", 1), tt, env={"HF_MODEL": str(model_dir)}, ttnn=TTNN)
    runner = ModelRunner(model_dir, cls, name, backend, torch.bfloat16, block_size=32, kv_cache_bytes=0,
                         options=DeviceOptions(tt, backend_traces=True, kv_tokens_per_lane=4096))
    warm(runner, max_num_seqs=max_num_seqs, max_model_len=256)
    return runner, TTNN


def image(offset: int, h: int = 4, w: int = 4) -> ImageInput:
    grid = torch.tensor([1, h, w])
    return ImageInput(f"img-{offset}", offset, h * w // 4,
                      {"pixel_values": torch.randn(h * w, PATCH_ROW), "image_grid_thw": grid})


def greedy(rid: str, row: int) -> NewRequest:
    return NewRequest(rid, 0, row, 0.0, 1.0, 0, None)


QWEN25 = "models.demos.qwen25_vl.tt.generator_vllm:Qwen2_5_VLForConditionalGeneration"
QWEN3 = "models.demos.qwen3_vl.tt.generator_vllm:Qwen3VLForConditionalGeneration"


def test_qwen2_5_vl_gets_each_users_images_and_its_rope_deltas_back_by_row(tt_metal, tmp_path):
    runner, ttnn = runner_for(vision_checkpoint(tmp_path, "Qwen2_5_VLForConditionalGeneration"), QWEN25,
                              sample_on_device_mode="all")
    with_image = [5, 6, IMAGE, IMAGE, IMAGE, IMAGE, 7, 8, IMAGE, IMAGE, IMAGE, IMAGE, 9]
    images = [image(2), image(8)]
    pixels = [img.data["pixel_values"] for img in images]
    result = runner.execute(StepBatch(1, "prefill", new_requests=[greedy("text", 0), greedy("pic", 1)], prefill=[
        PrefillChunk("text", [5, 6, 7], 0, [3], True),
        PrefillChunk("pic", with_image, 0, [4], True, images=images)]))
    assert set(result.tokens) == {"text", "pic"} and not result.refused
    [call] = ttnn.recorder.only("model.vision_prefill")
    assert call["pixel_values"][0] is None and call["image_grid_thw"][0] is None
    assert [pv is sent for pv, sent in zip(call["pixel_values"][1], pixels)] == [True, True]
    assert [g.tolist() for g in call["image_grid_thw"][1]] == [[1, 4, 4]] * 2
    # Each (1, 4, 4) image: 4 tokens over max(2, 2) = 2 positions, so the row's delta is -4.
    assert call["rope_deltas"] == [0, -4]
    runner.execute(StepBatch(2, "decode", decode=[DecodeItem("text", result.tokens["text"], 3, []),
                                                  DecodeItem("pic", result.tokens["pic"], len(with_image), [])]))
    assert ttnn.recorder.only("model.rope_deltas")[-1]["rope_deltas"] == [0, -4]
    # Prefill is sampled on the host (the real class drops sampling_params and returns logits);
    # decode on the device, as asked.
    assert call["sampling_params"] is None
    assert ttnn.recorder.only("model.decode_forward")[-1]["sampling_params"] is not None


def test_qwen2_5_vl_rope_deltas_follow_the_rows_when_requests_come_and_go(tt_metal, tmp_path):
    runner, ttnn = runner_for(vision_checkpoint(tmp_path, "Qwen2_5_VLForConditionalGeneration"), QWEN25)
    prompt = [5, IMAGE, IMAGE, IMAGE, IMAGE, 6]
    a = runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 1)],
                                 prefill=[PrefillChunk("a", prompt, 0, [3], True, images=[image(1)])]))
    b = runner.execute(StepBatch(2, "prefill", new_requests=[greedy("b", 0)],
                                 prefill=[PrefillChunk("b", [5, 6], 0, [4], True)]))
    runner.execute(StepBatch(3, "decode", decode=[DecodeItem("a", a.tokens["a"], 6, []),
                                                  DecodeItem("b", b.tokens["b"], 2, [])]))
    assert ttnn.recorder.only("model.rope_deltas")[-1]["rope_deltas"] == [0, -2]
    runner.execute(StepBatch(4, "decode", released_ids=["a"], decode=[DecodeItem("b", 9, 3, [])]))
    assert ttnn.recorder.only("model.rope_deltas")[-1]["rope_deltas"] == [0, 0]


def test_qwen3_vl_prefills_one_user_per_step(tt_metal, tmp_path):
    """Qwen3-VL reads only its first user's entry to decide whether a batch has images: the
    worker tells the control plane to send one prefill row per step."""
    runner, _ = runner_for(vision_checkpoint(tmp_path, "Qwen3VLForConditionalGeneration"), QWEN3)
    assert runner.max_prefill_batch_size == 1
    qwen25, _ = runner_for(vision_checkpoint(tmp_path / "b", "Qwen2_5_VLForConditionalGeneration"), QWEN25)
    assert qwen25.max_prefill_batch_size == 2


def test_qwen3_vl_decodes_sampled_on_the_host_without_reset_batch(tt_metal, tmp_path):
    """tt-metal's Qwen3-VL decode_forward(*args, **kwargs) forwards to a decode that takes no
    reset_batch: a host-sampled decode (it declares no device sampling) is sent none, also when
    requests come and go."""
    runner, ttnn = runner_for(vision_checkpoint(tmp_path, "Qwen3VLForConditionalGeneration"), QWEN3)
    a = runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)], prefill=[
        PrefillChunk("a", [5, IMAGE, IMAGE, IMAGE, IMAGE, 6], 0, [3], True, images=[image(1)])]))
    d = runner.execute(StepBatch(2, "decode", decode=[DecodeItem("a", a.tokens["a"], 6, [])]))
    b = runner.execute(StepBatch(3, "prefill", new_requests=[greedy("b", 1)],
                                 prefill=[PrefillChunk("b", [5, 6], 0, [4], True)]))
    runner.execute(StepBatch(4, "decode", decode=[DecodeItem("a", d.tokens["a"], 7, []),
                                                  DecodeItem("b", b.tokens["b"], 2, [])]))
    runner.execute(StepBatch(5, "decode", released_ids=["a"], decode=[DecodeItem("b", 9, 3, [])]))
    calls = ttnn.recorder.only("model.decode_forward")
    assert len(calls) == 3 and all(c["sampling_params"] is None and c["reset_batch"] is None for c in calls)
    # and the fake refuses reset_batch, as the real class's forwarded call does
    with pytest.raises(TypeError, match="reset_batch"):
        runner.model.decode_forward(tokens=torch.zeros(2, 1, dtype=torch.long), start_pos=torch.tensor([3, -1]),
                                    page_table=torch.zeros(2, 1, dtype=torch.int32), kv_cache=None,
                                    reset_batch=True)


GEMMA3 = "models.tt_transformers.tt.generator_vllm:Gemma3ForConditionalGeneration"


def gemma3_checkpoint(tmp_path: Path, monkeypatch) -> Path:
    folder = vision_checkpoint(tmp_path, "Gemma3ForConditionalGeneration")
    monkeypatch.setenv("HF_MODEL", str(folder))  # tt_transformers' ModelArgs reads it
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].pop("rope_parameters")  # Gemma 3: no mRoPE
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gemma3_is_served_as_tt_metals_hybrid_attention_class(tt_metal, tmp_path, monkeypatch):
    """tt-metal's Gemma3 (the version with HybridAttentionForCausalLM): hybrid KV cache groups off,
    per-layer KV allocation, async decode and device sampling declared."""
    from models.tt_transformers.tt.generator_vllm import Gemma3ForConditionalGeneration, HybridAttentionForCausalLM
    assert issubclass(Gemma3ForConditionalGeneration, HybridAttentionForCausalLM)
    assert Gemma3ForConditionalGeneration._HYBRID_KV_CACHE_GROUPS_ENABLED is False
    runner, ttnn = runner_for(gemma3_checkpoint(tmp_path, monkeypatch), GEMMA3, sample_on_device_mode="all")
    assert runner.async_decode and runner.backend.resident_tokens
    [allocated] = ttnn.recorder.only("model.allocate_kv_cache_per_layer")
    assert [tensor for _, _, tensor in allocated["specs"]] == [0, 1]  # a buffer per layer, one page table
    first = runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)],
                                     prefill=[PrefillChunk("a", [5, 6, 7], 0, [3], True)]))
    runner.execute(StepBatch(2, "decode", decode=[DecodeItem("a", first.tokens["a"], 3, [])]))
    call = ttnn.recorder.only("model.decode_forward")[-1]
    assert call["sampling_params"] is not None and call["reset_batch"] is True


def test_gemma3_gets_pixel_values_per_user(tt_metal, tmp_path, monkeypatch):
    runner, ttnn = runner_for(gemma3_checkpoint(tmp_path, monkeypatch), GEMMA3)
    assert not runner.uses_mrope
    sent = image(1)
    pixels = sent.data["pixel_values"].clone()  # the worker drops them once they are in the KV cache
    runner.execute(StepBatch(1, "prefill", new_requests=[greedy("pic", 0)], prefill=[
        PrefillChunk("pic", [5, IMAGE, IMAGE, IMAGE, IMAGE, 6], 0, [3], True, images=[sent])]))
    [call] = ttnn.recorder.only("model.vision_prefill")
    assert len(call["pixel_values"]) == 1 and len(call["pixel_values"][0]) == 1
    assert torch.equal(call["pixel_values"][0][0], pixels)
    # tt-metal's Gemma3 (a HybridAttentionForCausalLM) passes image_grid_thw on with the pixels
    assert [g.tolist() for g in call["image_grid_thw"][0]] == [[1, 4, 4]]


@pytest.mark.parametrize("arch, why", [
    ("MllamaForConditionalGeneration", "takes PIL images and a cross-attention page table"),
    ("Mistral3ForConditionalGeneration", "reads its images from prefill_forward's `images`")])
def test_vision_classes_that_take_other_images_are_refused_before_the_device_opens(tt_metal, tmp_path, arch, why):
    from ttserve.worker.planning.preflight import plan_worker
    folder = vision_checkpoint(tmp_path, arch)
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(folder)), {"HF_MODEL": str(folder)},
                       probe=lambda: chips())
    assert any(why in p and "serve a model that takes pixel_values" in p for p in plan.fatal), plan.problems


def test_mistral3_is_decoder_only_and_drops_the_pixel_values_the_plugin_sends(tt_metal, monkeypatch):
    """Why Mistral3 stays refused: its prefill reads only `images`, never pixel_values."""
    from fakes.fake_ttnn import FakeMesh
    from models.tt_transformers.tt.generator import TTNN
    from models.tt_transformers.tt.generator_vllm import Mistral3ForConditionalGeneration
    model = Mistral3ForConditionalGeneration.initialize_vllm_model(None, FakeMesh(TTNN.recorder, "mesh", 1), 1)
    model.prefill_forward(tokens=torch.tensor([[5, IMAGE, IMAGE, 6]]), page_table=torch.tensor([[1]]),
                          kv_cache=None, prompt_lens=[4], pixel_values=[[torch.randn(16, PATCH_ROW)]],
                          image_grid_thw=[[torch.tensor([1, 4, 4])]])
    assert TTNN.recorder.only("model.mistral3_prefill")[-1] == {"pixel_values": None,
                                                                "dropped": ["image_grid_thw", "pixel_values"]}


def test_the_worker_keeps_only_the_grid_of_an_image_in_the_kv_cache(tt_metal, tmp_path):
    runner, _ = runner_for(vision_checkpoint(tmp_path, "Qwen2_5_VLForConditionalGeneration"), QWEN25)
    runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)], prefill=[
        PrefillChunk("a", [5, IMAGE, IMAGE, IMAGE, IMAGE, 6], 0, [3], True, images=[image(1)])]))
    [kept] = runner._requests["a"].images
    assert set(kept.data) == {"image_grid_thw"} and kept.data["image_grid_thw"].tolist() == [1, 4, 4]


def test_the_plan_says_a_vision_checkpoint_takes_images(tiny_vlm):
    from ttserve.worker.planning.preflight import plan_worker
    plan = plan_worker(worker_args("--backend", "torch", "--model", str(tiny_vlm)), {}, probe=lambda: chips())
    assert not plan.fatal and any("images" in line and "pixel_values" in line for line in plan.lines), plan.lines
