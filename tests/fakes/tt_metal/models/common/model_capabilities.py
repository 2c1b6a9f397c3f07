"""Mirrors tt-metal models/common/model_capabilities.py: the capability mixin whose
get_max_tokens_all_users is the fallback KV budget of every generator that states no other."""
from __future__ import annotations

FALLBACK_MAX_TOKENS_ALL_USERS = 131_072


class ModelCapabilitiesMixin:
    model_capabilities: dict = {}

    @classmethod
    def get_max_tokens_all_users(cls, **kwargs) -> int:
        return FALLBACK_MAX_TOKENS_ALL_USERS
