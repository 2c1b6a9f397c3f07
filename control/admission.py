"""Admission checks: refuse at once, with a message that says what is allowed, any request the
system cannot serve, so that nothing reaches the scheduler that could never finish.

Start-up caps max_model_len at one lane's KV capacity, so any request within max_model_len can
always run to completion once it is alone on its lane.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import images
from .request import Request, SamplingParams

# Top logprobs per sampled token: vLLM's max_logprobs default (the OpenAI API's limit).
MAX_LOGPROBS = 20


class AdmissionError(ValueError):
    """The request itself is wrong (HTTP 400)."""



@dataclass(slots=True, frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    supports_images: bool = False
    max_image_blocks: int = 0     # blocks one image may span (a prefill chunk holds it); 0 = any
    block_size: int = 1


def check_request(request: Request, unsupported: list[str], limits: Limits) -> None:
    """Raise AdmissionError for a request that cannot be served.

    `unsupported` names the options the request set to non-neutral values that this release
    does not apply: refusing beats silently ignoring them.
    """
    prompt_len = request.num_prompt_tokens
    if prompt_len == 0:
        raise AdmissionError("the prompt is empty: at least one prompt token is required")
    if prompt_len >= limits.max_model_len:
        raise AdmissionError(
            f"the prompt has {prompt_len} tokens, but this model's maximum context length is "
            f"{limits.max_model_len} tokens (prompt plus at least one generated token)")
    if request.sampling.max_tokens < 1:
        raise AdmissionError(f"max_tokens must be at least 1, got {request.sampling.max_tokens}")
    if prompt_len + request.sampling.max_tokens > limits.max_model_len:
        raise AdmissionError(
            f"the prompt has {prompt_len} tokens and max_tokens is {request.sampling.max_tokens}, "
            f"but this model's maximum context length is {limits.max_model_len} tokens: lower "
            f"max_tokens to at most {limits.max_model_len - prompt_len}")
    bad = [t for t in request.prompt_token_ids if t >= limits.vocab_size]
    if bad:
        raise AdmissionError(f"prompt token id {bad[0]} is out of range: the vocabulary has "
                             f"{limits.vocab_size} tokens (ids 0..{limits.vocab_size - 1})")
    if request.output_token_ids:
        check_resumption(request, limits.vocab_size)
    temperature, top_p, top_k = request.sampling.temperature, request.sampling.top_p, request.sampling.top_k
    if not (math.isfinite(temperature) and temperature >= 0):
        raise AdmissionError(f"temperature must be a finite number >= 0, got {temperature}")
    if not 0 < top_p <= 1:  # NaN fails it too
        raise AdmissionError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise AdmissionError(f"top_k must be -1 or 0 (off) or a positive count, got {top_k}")
    check_sampling(request.sampling, limits.vocab_size)
    if request.grammar_spec is not None and (problem := request.grammar_spec.problem()):
        raise AdmissionError(problem)
    if request.images:
        check_request_images(request, limits)
    if unsupported:
        raise AdmissionError(f"{', '.join(unsupported)}: not supported by this ttserve release "
                             "yet; remove it from the request")


def check_resumption(request: Request, vocab_size: int) -> None:
    """A resumed request's output so far (engine.proto Resumption) must be one this request could
    have produced and not ended on: fewer than max_tokens, in the vocabulary, no stop token at a
    place where it would have stopped the request."""
    sampling, output = request.sampling, request.output_token_ids
    if len(output) >= sampling.max_tokens:
        raise AdmissionError(f"the resumed request already has {len(output)} output tokens, and max_tokens is "
                             f"{sampling.max_tokens}: nothing is left to generate")
    for position, token in enumerate(output, start=1):
        if token >= vocab_size:
            raise AdmissionError(f"resumed output token id {token} is out of range: the vocabulary has "
                                 f"{vocab_size} tokens (ids 0..{vocab_size - 1})")
        stops = token in sampling.stop_token_ids or (not sampling.ignore_eos and token in sampling.eos_token_ids)
        if stops and position >= sampling.min_tokens:
            raise AdmissionError(f"resumed output token {position} (id {token}) is a stop token: the request "
                                 "ended there and cannot resume")


def check_request_images(request: Request, limits: Limits) -> None:
    if not limits.supports_images:
        raise AdmissionError(f"this model does not take images: the request has {len(request.images)}; "
                             "send text only, or serve a vision model")
    problem = images.check_images(request.images, request.num_prompt_tokens)
    if problem:
        raise AdmissionError(f"invalid image placeholders: {problem}")
    for first, last, spanned in images.clusters(request.images, limits.block_size):
        if limits.max_image_blocks and spanned > limits.max_image_blocks:
            what = f"image {first}" if first == last else f"images {first} to {last} (they share KV blocks)"
            tokens = request.images[last].end - request.images[first].offset
            raise AdmissionError(
                f"{what}: {tokens} placeholder tokens over {spanned} KV blocks of {limits.block_size}, more "
                f"than one prefill chunk holds ({limits.max_image_blocks} blocks; an image is never "
                f"split across chunks): send a smaller image, or raise --max-num-batched-tokens")


def check_sampling(s: SamplingParams, vocab_size: int) -> None:
    """The host-sampler options' ranges, as vLLM's SamplingParams checks them."""
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise AdmissionError(f"logprobs (top_logprobs) must be between 0 and {MAX_LOGPROBS}, "
                             f"got {s.logprobs}")
    if not 0 <= s.min_p <= 1:
        raise AdmissionError(f"min_p must be in [0, 1], got {s.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -2 <= value <= 2:
            raise AdmissionError(f"{name} must be in [-2, 2], got {value}")
    if not math.isfinite(s.repetition_penalty) or s.repetition_penalty <= 0:
        raise AdmissionError(f"repetition_penalty must be a finite number greater than zero, "
                             f"got {s.repetition_penalty}")
    if any(not math.isfinite(bias) for _, bias in s.logit_bias):
        raise AdmissionError("logit_bias values must be finite numbers")
    # stop and EOS ids too: before min_tokens the worker masks them out of the logits by index.
    for name, ids in (("logit_bias", [t for t, _ in s.logit_bias]),
                      ("allowed_token_ids", s.allowed_token_ids),
                      ("bad_words", [t for word in s.bad_words for t in word]),
                      ("stop_token_ids", sorted(s.stop_token_ids)),
                      ("eos_token_ids", sorted(s.eos_token_ids))):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise AdmissionError(f"{name} has token id {bad[0]}, out of range: the vocabulary has "
                                 f"{vocab_size} tokens (ids 0..{vocab_size - 1})")
