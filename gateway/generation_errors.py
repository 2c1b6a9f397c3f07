"""The control plane's reason for a request it failed, carried to the HTTP client.

vLLM's serving layer answers finish reason "error" with GenerationError("Internal server error")
in a 200 stream or as a 500: the reason (a lost worker past --migration-limit, a grammar that
does not compile, a request the worker refused) would be lost. So the gateway's engine client
(GrpcEngineCoreClient) records the control plane's message per engine request id in its
`FailureReasons` as the failure arrives, and vLLM's serving layer, patched to ask its engine
client (gateway/vllm_patches.py, `report_failure_reasons`), raises the recorded reason instead:
a GenerationError (HTTP 500) for a fault of the serving side, a VLLMValidationError (HTTP 400)
where the control plane said the request itself cannot be served (RequestOutput.invalid_request).
vLLM asks with the API request id, which prefixes the engine request ids of its choices.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

from collections import OrderedDict

# Bounded: a failure whose HTTP request went away is never looked up.
MAX_RECORDED = 4096


class FailureReasons:
    """The control plane's message for each failed request, by engine request id, until vLLM's
    serving layer asks for it (`error_for`, once). Holds at most `limit`, the oldest dropped
    first. Owned by one GrpcEngineCoreClient; used on the event loop only."""

    def __init__(self, limit: int = MAX_RECORDED) -> None:
        self.limit = limit
        self._reasons: OrderedDict[str, tuple[str, bool]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reasons)

    def record(self, engine_request_id: str, message: str, invalid: bool = False) -> None:
        """`invalid`: the request itself cannot be served (a 400, not a 500)."""
        self._reasons[engine_request_id] = (message, invalid)
        while len(self._reasons) > self.limit:
            self._reasons.popitem(last=False)

    def take(self, api_request_id: str) -> tuple[str, bool] | None:
        """The recorded (reason, invalid) of a failed choice of `api_request_id` (removed), if any."""
        for key in list(self._reasons):
            if key == api_request_id or key.startswith(api_request_id + "-"):
                return self._reasons.pop(key)
        return None

    def error_for(self, api_request_id: str) -> Exception | None:
        """The exception vLLM's serving layer raises for a failed choice of `api_request_id`, or
        None when none was recorded (vLLM's own "Internal server error" then)."""
        recorded = self.take(api_request_id)
        if recorded is None:
            return None
        from vllm.exceptions import GenerationError, VLLMValidationError

        reason, invalid = recorded
        return VLLMValidationError(reason) if invalid else GenerationError(reason)
