"""API keys on every HTTP route of the gateway but the open ones.

vLLM's own AuthenticationMiddleware guards only paths under /v1, which leaves /tokenize,
/detokenize, /invocations, /metrics, /ready (it names worker addresses), /docs and the OpenAPI
schema open. `ApiKeyMiddleware` replaces it, outermost on the app: with keys configured every
request needs `Authorization: Bearer KEY` with one of them, except

- `/health` (liveness; says only whether the gateway is up), and
- `/metrics` when the operator passes --public-metrics (for a Prometheus that sends no key;
  Prometheus can send one with `authorization: {credentials_file: ...}` instead), and
- CORS preflights (OPTIONS with Origin and Access-Control-Request-Method), which carry no
  credentials by the browser's rules and are answered by vLLM's CORS middleware alone. Without
  Origin that middleware is no preflight's answer: the OPTIONS would reach the routes (405 on a
  route, 404 elsewhere), which enumerates them; so it needs the key.

Unknown paths get 401 as well, so an unauthenticated client learns nothing about which routes
exist. Keys are compared as SHA-256 digests with hmac.compare_digest against every configured key
(no early exit), so neither a key's length nor its position leaks through timing.

Where keys come from (`load_api_keys`): `--api-key KEY...` and `--api-key-file PATH` (one key a
line, `#` comments) together; VLLM_API_KEY only when neither flag is given, as in vLLM, where
the flag takes precedence over the variable.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

ENV_VAR = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ApiKeyConfigError(ValueError):
    """The key flags cannot be used as given; the message names the flag."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The accepted keys, held only as digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]
        assert all(self._digests), "empty keys are refused by load_api_keys"

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, presented: str) -> bool:
        """Constant time over the keys: every digest is compared, whatever matched."""
        candidate = _digest(presented)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        return matched


def read_key_file(path: str) -> list[str]:
    """One key a line; blank lines and lines starting with # are skipped."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyConfigError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ApiKeyConfigError(f"--api-key-file {path}: holds no key (one key a line)")
    return keys


def configured_keys(flag_keys: Sequence[str] | None, key_file: str | None,
                    environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys the flags and the environment give, in the open (for a client of the gateway's
    own, like `ttserve up`'s probe); empty: the API is open."""
    keys = list(flag_keys or [])
    if any(not k.strip() for k in keys):
        raise ApiKeyConfigError("--api-key: an empty key would accept an empty Authorization header")
    if key_file:
        keys += read_key_file(key_file)
    if not keys and environ.get(ENV_VAR, "").strip():
        keys = [environ[ENV_VAR].strip()]
    return keys


def load_api_keys(flag_keys: Sequence[str] | None, key_file: str | None,
                  environ: Mapping[str, str] = os.environ) -> ApiKeys:
    """The gateway's keys; empty ApiKeys: the API is open (loopback, or --insecure)."""
    return ApiKeys(configured_keys(flag_keys, key_file, environ))


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _preflight(scope: Scope) -> bool:
    names = {name for name, _ in scope.get("headers") or ()}
    return scope.get("method") == "OPTIONS" and {b"origin", b"access-control-request-method"} <= names


class ApiKeyMiddleware:
    """Pure ASGI: 401 (OpenAI's error shape, WWW-Authenticate: Bearer) for a request without a
    valid key on any path but the open ones; a websocket is closed before it is accepted."""

    def __init__(self, app: Callable, keys: ApiKeys, public_metrics: bool = False) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS | ({METRICS_PATH} if public_metrics else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys:
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in self.open_paths or _preflight(scope):
            return await self.app(scope, receive, send)
        presented = _bearer(scope)
        if presented is not None and self.keys.accepts(presented):
            return await self.app(scope, receive, send)
        message = ("this gateway requires an API key: send 'Authorization: Bearer KEY'"
                   if presented is None else "the API key sent is not valid for this gateway")
        if scope["type"] == "websocket":
            # Closing before accept makes the server answer the upgrade with 403.
            await send({"type": "websocket.close", "code": 1008, "reason": message})
            return
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
