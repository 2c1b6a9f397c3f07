"""Chained block hashes: a block's identity is its tokens plus everything before it.

hash(block i) = hash((hash(block i-1), tokens of block i)); the chain starts from the cache
salt, so tenants with different salts never share blocks. Python's 64-bit tuple hash is used:
a collision between two distinct prefixes has probability ~2^-64 per pair, the same trade vLLM's
default (non-cryptographic) mode makes.
"""
from __future__ import annotations

from .request import Request


def extend_block_hashes(request: Request, block_size: int, num_tokens: int) -> list[int]:
    """Hashes of the request's full blocks within its first num_tokens tokens, extending (and
    returning) request.block_hashes; only blocks not hashed before are hashed."""
    hashes = request.block_hashes
    full = num_tokens // block_size
    if len(hashes) < full:
        parent = hashes[-1] if hashes else hash(("ttserve-prefix", request.cache_salt))
        for i in range(len(hashes), full):
            parent = hash((parent, _tokens(request, i * block_size, (i + 1) * block_size)))
            hashes.append(parent)
    return hashes


def _tokens(request: Request, start: int, end: int) -> tuple[int, ...]:
    """request.all_token_ids[start:end] without copying the whole sequence (this runs for every
    block that fills, in the step loop)."""
    prompt = request.prompt_token_ids
    if end <= len(prompt):
        return tuple(prompt[start:end])
    outputs = request.output_token_ids
    if start >= len(prompt):
        return tuple(outputs[start - len(prompt):end - len(prompt)])
    return tuple(prompt[start:]) + tuple(outputs[:end - len(prompt)])
