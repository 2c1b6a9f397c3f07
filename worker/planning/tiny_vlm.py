"""Builds `tiny-vlm`: a tiny random-weight Qwen2.5-VL checkpoint, offline and deterministic.

No small real vision-language model installs from the package registries, so the vision path is
tested on a checkpoint built here with transformers' own config and model classes (random
weights from a fixed seed, float32 safetensors) and a processor that transformers and vLLM load
as they load Qwen/Qwen2.5-VL-*: `preprocessor_config.json` naming the PIL image processor
(torchvision-free), the tokenizer of the embedded SmolLM2 with Qwen2-VL's vision tokens added,
and a ChatML template that writes `<|vision_start|><|image_pad|><|vision_end|>` for each image
part. Every image is resized into [MIN_PIXELS, MAX_PIXELS], so it becomes 4 to 64 placeholder
tokens: small enough for CPU tests, large enough for several blocks and chunks.

The same seed, shapes and transformers version give the same weights: tests and
`ttserve model prepare tiny-vlm` make the same model.
"""
from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
SEED = 1234
PATCH = 14           # ViT patch side, pixels
MERGE = 2            # the merger joins MERGE x MERGE patches into one LLM token
MIN_PIXELS = (PATCH * MERGE) ** 2 * 4      # 2 x 2 tokens at least
MAX_PIXELS = (PATCH * MERGE) ** 2 * 64     # 8 x 8 tokens at most
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# ChatML as SmolLM2 writes it, with Qwen2-VL's rule for content parts: each image (an "image" or
# "image_url" part, as vLLM's renderer passes them) becomes one vision block, text is copied.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build(out: Path, tokenizer_source: Path) -> None:
    """Writes the tiny checkpoint into `out` (config, safetensors, tokenizer, processor files).

    `tokenizer_source` is a Hugging Face folder whose tokenizer is reused (the prepared SmolLM2:
    a real BPE vocabulary, so prompts tokenize as a real model's do)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_source)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # transformers' Qwen2-VL processor reads these attributes off the tokenizer.
    tokenizer.image_token, tokenizer.video_token = "<|image_pad|>", "<|video_pad|>"
    tokenizer.chat_template = CHAT_TEMPLATE

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
            pad_token_id=eos,
            # head_dim 16: 8 rotary frequencies, split over (temporal, height, width).
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2,
            # Windows of 2 x 2 merged tokens: a 4 x 4 image has four, so window and full
            # attention (block 1) differ and both are exercised.
            window_size=PATCH * MERGE * 2, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    config.architectures = [ARCHITECTURE]
    torch.manual_seed(SEED)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    # transformers initializes norms to 1 and biases to 0; random ones exercise every term.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name or "ln_q" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name or "ln_q" in name
                            else 0.1 * torch.randn_like(param))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)

    image_processor = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    image_processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _finish_tokenizer_config(out, ids)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _check(out, config.image_token_id)


def _finish_tokenizer_config(out: Path, ids: dict[str, int]) -> None:
    """The processor files as the Qwen2.5-VL releases ship them: the processor class, the
    template inline too (older readers), the image token named (transformers' processor reads
    it), and the PIL image processor (no torchvision at either end)."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
                  processor_class="Qwen2_5_VLProcessor", image_token="<|image_pad|>",
                  video_token="<|video_pad|>")
    config.pop("is_local", None)
    config.pop("local_files_only", None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    pre = out / "preprocessor_config.json"
    processor = json.loads(pre.read_text())
    processor.update(processor_class="Qwen2_5_VLProcessor", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    pre.write_text(json.dumps(processor, indent=2) + "\n")


def _check(out: Path, image_token_id: int) -> None:
    """The folder loads back: the template writes one placeholder per image, and the image
    processor turns a 56 x 56 image into a 4 x 4 patch grid (4 placeholder tokens)."""
    import numpy as np
    import transformers
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    grid = Qwen2VLImageProcessorPil.from_pretrained(out)(
        images=[Image.fromarray(np.zeros((56, 56, 3), dtype=np.uint8))], return_tensors="pt")["image_grid_thw"]
    if ids.count(image_token_id) != 1 or grid.tolist() != [[1, 4, 4]]:
        raise RuntimeError(f"tiny-vlm check failed: template placeholders {ids.count(image_token_id)}, "
                           f"grid {grid.tolist()}")
