"""Stopping rules on token ids, with vLLM's check_stop semantics."""
from __future__ import annotations

from .request import FinishReason, Request


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Whether the request's last sampled token ends it; returns (reason, stop token id).

    min_tokens holds back EOS and stop token ids, never max_tokens or max_model_len.
    """
    sampling = request.sampling
    num_output = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if num_output >= sampling.min_tokens:
        if not sampling.ignore_eos and last in sampling.eos_token_ids:
            return FinishReason.STOP, None
        if last in sampling.stop_token_ids:
            return FinishReason.STOP, last
    if num_output >= sampling.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None
