"""Chained block hashes: a block's identity is its tokens plus everything before it.

hash(block i) = hash((hash(block i-1), tokens of block i)); the chain starts from the cache
salt, so tenants with different salts never share blocks. A block that holds image placeholders
carries (image hash, offset) pairs after its token ids (images.block_extras): equal placeholder
tokens of different images hash apart. Python's 64-bit tuple hash is used:
a collision between two distinct prefixes has probability ~2^-64 per pair, the same trade vLLM's
default (non-cryptographic) mode makes.
"""
from __future__ import annotations

from collections.abc import Iterable

SEED = "ttserve-prefix"


def chain_hashes(parent: int | None, cache_salt: str, blocks: Iterable[tuple[int, ...]]) -> list[int]:
    """The chained hashes of `blocks` (each a full block's tokens) following the block hashed
    `parent` (None: they start the sequence). Pure: the caller keeps the chain."""
    if parent is None:
        parent = hash((SEED, cache_salt))
    hashes = []
    for tokens in blocks:
        parent = hash((parent, tokens))
        hashes.append(parent)
    return hashes
