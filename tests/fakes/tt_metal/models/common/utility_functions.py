"""Mirrors tt-metal models/common/utility_functions.py: `is_wormhole_b0`, which the real
get_max_tokens_all_users reads (it asks ttnn for the arch; the fake mesh is Wormhole)."""
from __future__ import annotations


def is_wormhole_b0() -> bool:
    return True
