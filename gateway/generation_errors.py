"""The control plane's reason for a request it failed, carried to the HTTP client.

vLLM's serving layer answers finish reason "error" with GenerationError("Internal server error")
(vllm/entrypoints/generate/base/serving.py, `GenerateBaseServing._raise_if_error`), in a 200
stream or as a 500: the reason (a lost worker past --migration-limit, a grammar that does not
compile, a request the worker refused) would be lost. The gateway records the control plane's
message per engine request id as the failure arrives, and `_raise_if_error` raises it instead:
a GenerationError (HTTP 500) for a fault of the serving side, a VLLMValidationError (HTTP 400)
where the control plane said the request itself cannot be served (RequestOutput.invalid_request).
vLLM calls it with the API request id, which prefixes the engine request ids of its choices.
"""
from __future__ import annotations

from collections import OrderedDict

# Bounded: a failure whose HTTP request went away is never looked up.
MAX_RECORDED = 4096
_reasons: OrderedDict[str, tuple[str, bool]] = OrderedDict()


def record(engine_request_id: str, message: str, invalid: bool = False) -> None:
    """`invalid`: the request itself cannot be served (a 400, not a 500)."""
    _reasons[engine_request_id] = (message, invalid)
    while len(_reasons) > MAX_RECORDED:
        _reasons.popitem(last=False)


def take(api_request_id: str) -> tuple[str, bool] | None:
    """The recorded (reason, invalid) of a failed choice of `api_request_id` (removed), if any."""
    for key in list(_reasons):
        if key == api_request_id or key.startswith(api_request_id + "-"):
            return _reasons.pop(key)
    return None


def install() -> None:
    """Make vLLM's serving layer report the recorded reason (idempotent)."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError, VLLMValidationError

    if getattr(GenerateBaseServing._raise_if_error, "ttserve", False):
        return
    original = GenerateBaseServing._raise_if_error

    def raise_if_error(self, finish_reason: str | None, request_id: str) -> None:
        if finish_reason == "error":
            recorded = take(request_id)
            if recorded:
                reason, invalid = recorded
                raise VLLMValidationError(reason) if invalid else GenerationError(reason)
        original(self, finish_reason, request_id)

    raise_if_error.ttserve = True  # type: ignore[attr-defined]
    GenerateBaseServing._raise_if_error = raise_if_error
