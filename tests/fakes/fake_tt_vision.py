"""What tt-metal's vision generators do with a prefill's images, shared by the fakes of
models/demos/qwen25_vl/tt/generator_vllm.py and models/demos/qwen3_vl/tt/generator_vllm.py.

As the real classes: per prefill user, pixel_values and image_grid_thw are None (a text-only
user) or lists with one entry per image; each grid is a (t, h, w) tensor of shape (3,); the
images' placeholder tokens are the user's `image_token_id` tokens, t*h*w/4 per image; start_pos
must be all 0 (no prefix caching); the result is (logits, rope_deltas), one delta per user. The
delta here is what mRoPE gives a row whose images are single frames: each image of grid (1, h, w)
takes max(h, w)/2 positions for its h*w/4 tokens.
"""
from __future__ import annotations

from typing import Any

import torch

MERGE = 2


def check_images(tokens: torch.Tensor, prompt_lens: Any, image_token_id: int, pixel_values: Any,
                 image_grid_thw: Any, start_pos: Any) -> list[int]:
    """Asserts what the real prefill_forward asserts; returns each user's rope delta."""
    assert start_pos is None or all(int(x) == 0 for x in start_pos), \
        f"Prefix caching is not supported for Qwen2_5_VL, got start_pos: {list(start_pos)}"
    deltas = []
    users = tokens.shape[0]
    pixel_values = pixel_values or [None] * users
    image_grid_thw = image_grid_thw or [None] * users
    for user in range(users):
        row = tokens[user, :int(prompt_lens[user])].tolist()
        placeholders = row.count(image_token_id)
        pixels, grids = pixel_values[user], image_grid_thw[user]
        if pixels is None:
            assert placeholders == 0, f"user {user} has {placeholders} image tokens and no pixel_values"
            deltas.append(0)
            continue
        assert grids is not None and len(grids) == len(pixels), "Expected image_grid_thw when pixel_values are provided."
        delta = 0
        for pv, g in zip(pixels, grids):
            assert torch.is_tensor(g) and g.ndim == 1 and g.numel() == 3, \
                f"Expected per-image image_grid_thw shape (3,), got {tuple(g.shape)!r}"
            t, h, w = (int(v) for v in g.tolist())
            assert pv.shape[0] == t * h * w, f"pixel_values has {pv.shape[0]} patches, the grid {t * h * w}"
            delta += max(h, w) // MERGE - t * h * w // (MERGE * MERGE)
        expected = sum(int(g.prod()) // (MERGE * MERGE) for g in grids)
        assert placeholders == expected, f"Image features and image tokens do not match: {placeholders} vs {expected}"
        deltas.append(delta)
    return deltas
