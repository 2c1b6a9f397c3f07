"""A request's images as the control plane sees them: placeholder ranges of its prompt, each
with a content hash, and an opaque payload it forwards to the worker.

The rules that make images schedulable like prompt tokens:

* A chunk never splits an image. An intermediate prefill chunk ends on a block boundary that is
  not inside any image's placeholders (`chunk_end`); a prefix-cache hit is cut back so that the
  computation never resumes inside an image either (`usable_hit_blocks`). The worker computes an
  image's embeddings in the one chunk that covers it (vLLM's disable_chunked_mm_input).
* So that a chunk boundary always exists, every image must fit a chunk together with the
  blocks its ends share with text and with images next to it (images that share a block form
  one cluster, computed in one chunk): a cluster spans at most `max_blocks` blocks
  (`clusters`, checked at admission).
* Prefix-cache keys of the blocks an image's placeholders touch include its hash (and where in
  the block it starts), so the same image hits and another image of the same size misses
  (`block_extras`), as vLLM's mm extra keys do.
* Each image is sent to the worker once per device state, with the chunk that covers it
  (`Request.num_sent_images` counts them; eviction resets it).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ImageInput:
    hash: str
    offset: int                 # first placeholder token in the prompt
    length: int                 # placeholder tokens
    # The MultiModalInput message as the client sent it (tensors included), forwarded to the
    # worker untouched: the control plane never reads the tensors.
    payload: object = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def check_images(images: Sequence[ImageInput], num_prompt_tokens: int) -> str | None:
    """Why these images cannot belong to this prompt (a message for the user), or None."""
    previous_end = 0
    for i, image in enumerate(images):
        if image.length < 1:
            return f"image {i} has no placeholder tokens"
        if image.offset < previous_end:
            return f"image {i} at {image.offset} overlaps or precedes the image before it (order by offset)"
        if image.end > num_prompt_tokens:
            return (f"image {i}'s placeholders [{image.offset}, {image.end}) reach past the prompt's "
                    f"{num_prompt_tokens} tokens")
        if not image.hash:
            return f"image {i} has no content hash"
        previous_end = image.end
    return None


def clusters(images: Sequence[ImageInput], block_size: int) -> list[tuple[int, int, int]]:
    """(first image index, last image index, blocks spanned) of each run of images whose
    placeholders share blocks: a chunk can end between two clusters, never inside one."""
    out: list[tuple[int, int, int]] = []
    for i, image in enumerate(images):
        first, last = image.offset // block_size, (image.end - 1) // block_size
        if out and (images[out[-1][1]].end - 1) // block_size >= first:
            start = images[out[-1][0]].offset // block_size
            out[-1] = (out[-1][0], i, last - start + 1)
        else:
            out.append((i, i, last - first + 1))
    return out


def max_blocks(chunk_limit: int, block_size: int) -> int:
    """The most blocks one image may span so that a chunk starting at the block of its first
    placeholder can always take all of it (the chunk's own limit, in whole blocks)."""
    return chunk_limit // block_size


def chunk_end(images: Sequence[ImageInput], start: int, end: int, block_size: int) -> int:
    """`end` (a block boundary past `start`) moved back until it cuts no image: to the start of
    the block holding the placeholders of the image it would cut. May return `start` or less:
    no chunk can start here within the limit (the caller waits)."""
    moved = True
    while moved and end > start:
        moved = False
        for image in images:
            if image.offset < end < image.end:
                end = image.offset // block_size * block_size
                moved = True
    return end


def usable_hit_blocks(images: Sequence[ImageInput], hit_blocks: int, block_size: int) -> int:
    """Full cached blocks a request may take so that its computation resumes outside every
    image: a hit ending inside an image is cut back to the block where that image starts."""
    return chunk_end(images, 0, hit_blocks * block_size, block_size) // block_size


def block_extras(images: Sequence[ImageInput], block_index: int, block_size: int) -> tuple:
    """What block `block_index` hashes beyond its tokens: (hash, offset within the block) of each
    image whose placeholders touch it (empty for text-only blocks)."""
    lo, hi = block_index * block_size, (block_index + 1) * block_size
    return tuple((image.hash, image.offset - lo) for image in images if image.offset < hi and image.end > lo)


# The image bytes one step may carry to the worker, over all its lanes: the step goes as one gRPC
# message of at most 64 MiB (ttserve/protocol.py), which token ids and the rest of the batch share.
# One request alone may exceed it up to its own 63 MiB bound (admission), so a step's first
# payload always goes and later ones wait for a step of their own.
STEP_PAYLOAD_BYTES = 48 << 20


@dataclass(slots=True)
class PayloadBudget:
    """What is left of STEP_PAYLOAD_BYTES while one step is planned, shared by its lanes."""
    used: int = 0
    limit: int = STEP_PAYLOAD_BYTES

    def fits(self, images: Sequence[ImageInput]) -> bool:
        """These images may join the step: it carries none yet, or they stay within the limit."""
        return not self.used or self.used + _size(images) <= self.limit

    def take(self, images: Sequence[ImageInput]) -> bool:
        """Count these images in if they fit (`fits`); False: they wait for a later step."""
        size = _size(images)
        if self.used and self.used + size > self.limit:
            return False
        self.used += size
        return True


def _size(images: Sequence[ImageInput]) -> int:
    # The payload is the client's MultiModalInput message; a test's stand-in without ByteSize
    # weighs nothing.
    return sum(i.payload.ByteSize() for i in images if hasattr(i.payload, "ByteSize"))


def unsent(images: Sequence[ImageInput], num_sent: int, end: int) -> list[ImageInput]:
    """The images after the first `num_sent` that start before `end`: what a chunk ending at
    `end` must carry (images are sent in prompt order, once per device state)."""
    out = []
    for image in images[num_sent:]:
        if image.offset >= end:
            break
        out.append(image)
    return out
