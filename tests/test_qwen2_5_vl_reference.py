"""The torch reference Qwen2.5-VL (worker/backends/torch/models/qwen2_5_vl.py) against transformers' generate
on the same tiny random-weight checkpoint and images, through the generator contract.

The oracle is greedy decoding: the tokens must be identical. Both sides compute in float32 and
see the same processor outputs (the gateway's images-only processor), so only summation order
differs (SDPA vs eager attention, per-image vs batched vision tower).
"""
from __future__ import annotations

import pytest
import torch

from ttserve.worker.backends.torch.models.qwen2_5_vl import TorchQwen2_5_VLForConditionalGeneration
from ttserve.worker.runner import ModelRunner

from conftest import sample_image as make_image

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread(single_torch_thread):
    """Memory-bound on a CPU, as the text models (conftest.single_torch_thread)."""


@pytest.fixture(scope="module")
def model(tiny_vlm) -> TorchQwen2_5_VLForConditionalGeneration:
    config = ModelRunner.read_config(tiny_vlm)
    return TorchQwen2_5_VLForConditionalGeneration.initialize_vllm_model(
        config, torch.device("cpu"), max_batch_size=2, max_seq_len=1024, tt_data_parallel=2,
        model_path=str(tiny_vlm))


def new_cache(model, blocks: int = 48) -> list:
    s = model.shape
    return model.allocate_kv_cache((blocks, s.num_kv_heads, BLOCK, s.head_dim), torch.float32, s.num_layers)


def processed(processor, parts: list) -> dict:
    """The processor's outputs for one user turn of text and images (in order)."""
    content = [{"type": "image"} if not isinstance(p, str) else {"type": "text", "text": p} for p in parts]
    text = processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    images = [p for p in parts if not isinstance(p, str)]
    return processor(text=[text], images=images or None, return_tensors="pt", return_mm_token_type_ids=True)


def hf_greedy(hf_model, inputs: dict, n: int) -> list[int]:
    out = hf_model.generate(**inputs, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def per_image(inputs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """pixel_values split per image (as vLLM's processor hands one item per image) and grids."""
    grids = inputs.get("image_grid_thw")
    if grids is None:
        return [], []
    sizes = grids.prod(-1).tolist()
    return list(inputs["pixel_values"].split(sizes)), list(grids)


def ours_greedy(model, kv, prompt: list[int], pixels, grids, n: int, row: int = 0,
                chunks: list[int] | None = None) -> list[int]:
    """Greedy decoding through the contract: prefill (in chunks ending at `chunks`), then
    decode one token per step; each image's pixels go with the chunk that covers it."""
    table = torch.zeros(2 * 2, 64, dtype=torch.int32)
    table[row, :] = torch.arange(64, dtype=torch.int32) % 48
    image_token = model.image_token_id
    where = [i for i, t in enumerate(prompt) if t == image_token]
    offsets, used = [], 0
    for g in grids:
        offsets.append(where[used])
        used += int(g.prod()) // 4
    ends = (chunks or []) + [len(prompt)]
    start, logits, delta = 0, None, 0
    for end in ends:
        mine = [k for k, off in enumerate(offsets) if off < end]
        pv = [pixels[k] if offsets[k] >= start else None for k in mine]
        gr = [grids[k] for k in mine]
        out, deltas = model.prefill_forward(
            torch.tensor([prompt[:end]]), table[[row]], kv, prompt_lens=[end], start_pos=[start],
            empty_slots=[row], pixel_values=[pv if mine else None], image_grid_thw=[gr if mine else None])
        start, logits, delta = end, out, int(deltas[0])
    tokens = [int(logits.reshape(-1, logits.shape[-1])[0].argmax())]
    deltas_all = [0] * 4
    deltas_all[row] = delta
    for i in range(n - 1):
        feed = torch.zeros(4, 1, dtype=torch.long)
        pos = torch.full((4,), -1, dtype=torch.long)
        feed[row, 0], pos[row] = tokens[-1], len(prompt) + i
        out = model.decode_forward(feed, pos, table, kv, rope_deltas_all_users=deltas_all if i == 0 else None)
        tokens.append(int(out.reshape(4, -1)[row].argmax()))
    return tokens


CASES = {
    "one-image": lambda: [make_image(84, 56, 1), "Describe the image."],
    "two-images-interleaved": lambda: ["First", make_image(56, 56, 2), "then", make_image(112, 84, 3), "compare."],
    "text-only": lambda: ["Just text, on a vision model."],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_identical_to_transformers_generate(model, hf_tiny_vlm, case):
    processor, hf = hf_tiny_vlm
    inputs = processed(processor, CASES[case]())
    expected = hf_greedy(hf, inputs, 12)
    pixels, grids = per_image(inputs)
    ours = ours_greedy(model, new_cache(model), inputs["input_ids"][0].tolist(), pixels, grids, 12, row=0)
    assert ours == expected


def test_the_oracle_sees_the_image(hf_tiny_vlm):
    """Another image of the same size changes transformers' answer: the equality above is not
    reached by ignoring the pixels."""
    processor, hf = hf_tiny_vlm
    answers = {tuple(hf_greedy(hf, processed(processor, [make_image(84, 56, seed), "Describe the image."]), 12))
               for seed in (1, 7)}
    assert len(answers) == 2


def test_chunked_prefill_in_another_lane_gives_the_same_tokens(model, hf_tiny_vlm):
    """Chunks that end between images (block-aligned), on a row of the second lane."""
    processor, hf = hf_tiny_vlm
    inputs = processed(processor, CASES["two-images-interleaved"]())
    prompt = inputs["input_ids"][0].tolist()
    pixels, grids = per_image(inputs)
    expected = hf_greedy(hf, inputs, 8)
    first = prompt.index(model.image_token_id)
    second_start = first + int(grids[0].prod()) // 4
    cut = [c for c in range(BLOCK, len(prompt), BLOCK)
           if not any(o < c < o + int(g.prod()) // 4 for o, g in zip([first, prompt.index(model.image_token_id, second_start)], grids))]
    assert cut, "the prompt must allow a chunk boundary outside its images"
    ours = ours_greedy(model, new_cache(model), prompt, pixels, grids, 8, row=3, chunks=cut[:2])
    assert ours == expected


def test_a_chunk_that_splits_an_image_is_refused(model, hf_tiny_vlm):
    processor, _ = hf_tiny_vlm
    inputs = processed(processor, CASES["one-image"]())
    prompt = inputs["input_ids"][0].tolist()
    pixels, grids = per_image(inputs)
    first = prompt.index(model.image_token_id)
    with pytest.raises(ValueError, match="split an image"):
        model.prefill_forward(torch.tensor([prompt[:first + 2]]), torch.zeros(1, 64, dtype=torch.int32),
                              new_cache(model), prompt_lens=[first + 2], start_pos=[0], empty_slots=[0],
                              pixel_values=[pixels], image_grid_thw=[grids])


def test_ttserve_model_prepare_tiny_vlm_builds_the_same_checkpoint_as_the_tests(tmp_path, smollm2, tiny_vlm):
    import hashlib
    import json
    import subprocess
    import sys

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / smollm2.name).symlink_to(smollm2)  # the tokenizer it reuses, prepared
    done = subprocess.run([sys.executable, "-m", "ttserve.cli", "model", "prepare", "tiny-vlm",
                           "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "models" / "tiny-vlm-Qwen2.5-VL"
    assert done.stdout.strip().splitlines()[-1] == str(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert (folder / ".ttserve-prepared").is_file() and (folder / "preprocessor_config.json").is_file()

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert digest(folder) == digest(tiny_vlm), "same seed, same weights"


def test_in_bf16_it_runs_plain_torch_not_the_cpu_kernels(tiny_vlm, hf_tiny_vlm):
    """The CPU kernels' path (16-bit reference models) embeds tokens and rotates at sequence
    positions itself; a vision model feeds image embeddings and mRoPE positions, so it keeps the
    plain cache and forward, and still answers."""
    config = ModelRunner.read_config(tiny_vlm)
    bf16 = TorchQwen2_5_VLForConditionalGeneration.initialize_vllm_model(
        config, torch.device("cpu"), max_batch_size=2, max_seq_len=1024, tt_data_parallel=2,
        model_path=str(tiny_vlm), dtype=torch.bfloat16)
    s = bf16.shape
    kv = bf16.allocate_kv_cache((48, s.num_kv_heads, BLOCK, s.head_dim), torch.bfloat16, s.num_layers)
    assert bf16.kernel_isa == ""
    inputs = processed(hf_tiny_vlm[0], CASES["one-image"]())
    pixels, grids = per_image(inputs)
    tokens = ours_greedy(bf16, kv, inputs["input_ids"][0].tolist(), [p.to(torch.bfloat16) for p in pixels],
                         grids, 4)
    assert len(tokens) == 4 and all(0 <= t < s.vocab_size for t in tokens)
