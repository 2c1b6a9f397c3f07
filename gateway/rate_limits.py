"""Per-key rate limits: requests per minute and tokens (prompt + generated) per minute.

Each API key has a `KeyAccount` (gateway/api_keys.py builds one per key): its name, a request
bucket and a token bucket, either absent when that limit is off. A bucket holds at most the
per-minute amount and refills continuously at amount/60 per second, so a key may burst up to a
minute's worth and then goes at the steady rate.

- Requests: ApiKeyMiddleware calls `KeyAccount.admit()` for every generation request (see
  `is_generation`) before anything else of the gateway sees it; one request takes 1 from the
  request bucket, and a bucket below 1 refuses it (HTTP 429).
- Tokens: a request's prompt length is known only after tokenization and its output only as it
  streams, so the token bucket cannot be charged up front. The rule: a new request is refused
  while the key's token bucket is empty or in debt (at or below 0); the engine client debits
  each request's prompt tokens once the control plane accepted it and its generated tokens as
  they arrive (`KeyAccount.count_tokens`), which may take the bucket below 0. So concurrent
  requests of one key may overshoot the limit by what they consume; the debt is paid back (at
  the steady rate) before the key's next request is admitted. With n > 1 each sequence counts
  its prompt, as the control plane runs each.

`CURRENT_KEY` holds the account of the key that sent the HTTP request being served (set by the
middleware; tasks spawned for the request copy it): the engine client reads it to name the
request's tenant to the control plane and to charge the key for its tokens. A context variable
because vLLM's serving layer stands between the two and carries nothing of the gateway's: it
calls `add_request_async` with vLLM's EngineCoreRequest alone, which has no field for a tenant.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

import contextvars
import math
import time
from dataclasses import dataclass
from typing import Callable

from ttserve.gateway.metrics import KEY_REQUESTS, KEY_TOKENS, RATE_LIMITED

Clock = Callable[[], float]

# POSTs that run no generation: not counted against a key's request rate (a client over its
# limit can still tokenize, render or cancel). Every other POST, and every websocket, counts,
# so a generation route vLLM adds later is limited by default.
NON_GENERATION_POSTS = frozenset({"/tokenize", "/detokenize", "/v1/messages/count_tokens",
                                  "/abort_requests", "/inference/v1/abort_requests"})
NON_GENERATION_SUFFIXES = ("/render", "/derender", "/cancel")


def is_generation(scope: dict, path: str) -> bool:
    """Whether a request counts against its key's request rate (any generation route:
    /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /invocations, ...)."""
    if scope["type"] == "websocket":
        return True
    if scope.get("method") != "POST":
        return False
    path = path.rstrip("/") or "/"
    return path not in NON_GENERATION_POSTS and not path.endswith(NON_GENERATION_SUFFIXES)


# Float rounding in the refill must not add a second to a wait that is whole.
_ROUNDING = 1e-9


class TokenBucket:
    """Holds at most `per_minute`, refilled continuously at per_minute/60 a second; starts full.
    `debit` may take it below 0 (a debt the refill pays back first)."""

    def __init__(self, per_minute: int, clock: Clock = time.monotonic) -> None:
        if per_minute < 1:
            raise ValueError(f"a bucket needs a positive amount per minute, got {per_minute}")
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # per second
        self._clock = clock
        self._level = self.capacity
        self._stamp = clock()

    @property
    def level(self) -> float:
        now = self._clock()
        if now > self._stamp:
            self._level = min(self.capacity, self._level + (now - self._stamp) * self.rate)
        self._stamp = max(self._stamp, now)
        return self._level

    def take(self, amount: float = 1.0) -> bool:
        """Take `amount` if the bucket holds it; False (nothing taken) if not."""
        if self.level < amount:
            return False
        self._level -= amount
        return True

    def debit(self, amount: float) -> None:
        """Take `amount` whatever the bucket holds (it may go below 0)."""
        self.level  # refill up to now first
        self._level -= amount

    def seconds_until(self, amount: float) -> int:
        """Whole seconds until the bucket holds at least `amount` (0: it does now)."""
        missing = amount - self.level
        return 0 if missing <= 0 else math.ceil(missing / self.rate - _ROUNDING)

    def seconds_until_positive(self) -> int:
        """Whole seconds until the bucket holds more than 0 (0: it does now)."""
        level = self.level
        return 0 if level > 0 else math.floor(-level / self.rate + _ROUNDING) + 1


@dataclass(frozen=True)
class Limits:
    """A key's limits; 0: that limit is off."""
    requests_per_minute: int = 0
    tokens_per_minute: int = 0

    def __bool__(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)

    def describe(self) -> str:
        parts = [f"{self.requests_per_minute} requests/min" if self.requests_per_minute else "",
                 f"{self.tokens_per_minute} tokens/min" if self.tokens_per_minute else ""]
        return ", ".join(p for p in parts if p) or "unlimited"


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: which limit (`requests` or `tokens`, OpenAI's error `type`),
    when to retry (whole seconds, at least 1) and the message for the client."""
    limit: str
    retry_after: int
    message: str


class KeyAccount:
    """One API key's name, limits and buckets; never the key."""

    def __init__(self, name: str, limits: Limits = Limits(), clock: Clock = time.monotonic) -> None:
        self.name = name
        self.limits = limits
        self.requests = TokenBucket(limits.requests_per_minute, clock) if limits.requests_per_minute else None
        self.tokens = TokenBucket(limits.tokens_per_minute, clock) if limits.tokens_per_minute else None
        # Every series exists from the start, so that rate() over them works before the first.
        KEY_REQUESTS.labels(key=name)
        for kind in ("prompt", "generation"):
            KEY_TOKENS.labels(key=name, kind=kind)
        for limit in ("requests", "tokens"):
            RATE_LIMITED.labels(key=name, limit=limit)

    def admit(self) -> Refusal | None:
        """Count one generation request of this key; None: it may go on, else why not. A refused
        request takes nothing from either bucket."""
        KEY_REQUESTS.labels(key=self.name).inc()
        refusal = None
        if self.requests is not None and self.requests.level < 1:
            wait = max(1, self.requests.seconds_until(1))
            refusal = Refusal("requests", wait, (
                f"Rate limit reached for API key '{self.name}' on requests per minute (RPM): limit "
                f"{self.limits.requests_per_minute}. Please try again in {wait}s."))
        elif self.tokens is not None and self.tokens.level <= 0:
            wait = max(1, self.tokens.seconds_until_positive())
            refusal = Refusal("tokens", wait, (
                f"Rate limit reached for API key '{self.name}' on tokens per minute (TPM, prompt and "
                f"generated tokens): limit {self.limits.tokens_per_minute}, used "
                f"{self.limits.tokens_per_minute - math.floor(self.tokens.level)}. "
                f"Please try again in {wait}s."))
        if refusal is not None:
            RATE_LIMITED.labels(key=self.name, limit=refusal.limit).inc()
            return refusal
        if self.requests is not None:
            self.requests.take(1)
        return None

    def count_tokens(self, n: int, kind: str) -> None:
        """`n` tokens of `kind` ("prompt" or "generation") this key's requests consumed."""
        if n <= 0:
            return
        KEY_TOKENS.labels(key=self.name, kind=kind).inc(n)
        if self.tokens is not None:
            self.tokens.debit(n)


# The key that sent the HTTP request being served; None without keys (or outside a request).
CURRENT_KEY: contextvars.ContextVar[KeyAccount | None] = contextvars.ContextVar(
    "ttserve_gateway_current_key", default=None)


def current_key() -> KeyAccount | None:
    return CURRENT_KEY.get()
