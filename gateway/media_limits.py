"""What one client's images may cost the gateway, set in vLLM's environment before vLLM reads it.

- Pixels per image (`--max-image-pixels`): vLLM reads an image's header, compares width x height
  with VLLM_MAX_IMAGE_PIXELS and refuses it (HTTP 400) before decoding a pixel. vLLM's default,
  179 MP, lets a ~500 KB PNG decode to ~500 MB of RGB, and a request carries up to
  --limit-images-per-prompt of them, decoded in parallel: one client could exhaust the gateway.
- Redirects: never followed. --allowed-media-domains is checked on the URL the client gave; a
  redirect from an allowed host would reach any address unchecked (VLLM_MEDIA_URL_ALLOW_REDIRECTS
  defaults to on).
"""
from __future__ import annotations

import os

# 4096 x 4096: above what the vision processors served here resize to (Qwen2.5-VL's default
# max_pixels is 12.8 MP), and 48 MiB as decoded RGB.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # --max-image-pixels


def apply(max_image_pixels: int) -> None:
    """Before vLLM is imported (its envs module may cache what it reads)."""
    os.environ["VLLM_MAX_IMAGE_PIXELS"] = str(max_image_pixels)
    os.environ["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
