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
(no early exit; the matching index is summed up, not branched on), so neither a key's length nor
its position leaks through timing.

Where keys come from (`load_api_keys`): `--api-key KEY...` and `--api-key-file PATH` together;
VLLM_API_KEY only when neither flag is given, as in vLLM, where the flag takes precedence over
the variable. A keys-file line is `[NAME:] KEY [rpm=N] [tpm=N]` (`#` comments, blank lines
skipped): NAME ([A-Za-z0-9_.-]+, unique) is what metrics, logs and the control plane (the
request's tenant) call the key; a key without one is `key-N`, N its position among all keys
(flags first), never anything of the key itself. rpm/tpm are the key's requests and tokens per
minute (gateway/rate_limits.py; 0: unlimited); a key that sets neither gets the gateway's
--key-requests-per-minute / --key-tokens-per-minute.

On a match the middleware puts the key's name in the ASGI scope (`scope["state"]["api_key_name"]`,
Starlette's `request.state.api_key_name`) and its KeyAccount in rate_limits.CURRENT_KEY, and, with
`rate_limit`, refuses a generation request over the key's limits with 429 before the app sees it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

from ttserve.gateway.rate_limits import CURRENT_KEY, Clock, KeyAccount, Limits, Refusal, is_generation

ENV_VAR = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
# scope["state"][KEY_NAME_STATE]: the name of the key that sent the request.
KEY_NAME_STATE = "api_key_name"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
FORMAT = "[NAME:] KEY [rpm=N] [tpm=N]"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ApiKeyConfigError(ValueError):
    """The key flags cannot be used as given; the message names the flag (and the file's line)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class KeyEntry:
    """One configured key, in the open (only while loading). `name` None: named by position;
    `limits` None: the gateway's defaults; `where`: the flag (and line) it came from."""
    key: str
    name: str | None = None
    limits: Limits | None = None
    where: str = "--api-key"


class ApiKeys:
    """The accepted keys, held only as digests, each with its name and rate limits (KeyAccount)."""

    def __init__(self, keys: Iterable[str | KeyEntry], default_limits: Limits = Limits(),
                 clock: Clock = time.monotonic) -> None:
        entries = [KeyEntry(k) if isinstance(k, str) else k for k in keys]
        self._digests = [_digest(e.key) for e in entries]
        assert all(e.key for e in entries), "empty keys are refused by load_api_keys"
        self.accounts = [KeyAccount(e.name or f"key-{i}", default_limits if e.limits is None else e.limits, clock)
                         for i, e in enumerate(entries, 1)]
        assert len({a.name for a in self.accounts}) == len(self.accounts), "check_entries makes names unique"

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def match(self, presented: str) -> KeyAccount | None:
        """The account of the key `presented` is, or None. Constant time over the keys: every
        digest is compared, and the index is summed, not branched on (keys are unique)."""
        candidate = _digest(presented)
        found = 0
        for i, digest in enumerate(self._digests, 1):
            found += i * hmac.compare_digest(candidate, digest)
        return self.accounts[found - 1] if found else None

    def accepts(self, presented: str) -> bool:
        return self.match(presented) is not None

    def describe(self) -> str:
        """For the start-up log line: how many keys, and how many rate-limited."""
        limited = sum(1 for a in self.accounts if a.limits)
        return f"{len(self)} key(s){f', {limited} rate-limited' if limited else ''}"


def _count(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def parse_key_line(line: str, where: str) -> KeyEntry:
    """One keys-file line, `[NAME:] KEY [rpm=N] [tpm=N]`. The messages never quote the key."""
    words = line.split()
    name = None
    if words[0].endswith(":"):
        name = words.pop(0)[:-1]
        if not NAME_PATTERN.fullmatch(name):
            raise ApiKeyConfigError(f"{where}: a key's name (before ':') may hold only letters, digits, "
                                    f"'_', '.' and '-' (the line is {FORMAT})")
        if not words:
            raise ApiKeyConfigError(f"{where}: the name {name!r} has no key after it ({FORMAT})")
    key, settings = words[0], words[1:]
    if name is not None and name == key:
        raise ApiKeyConfigError(f"{where}: a key's name must not be the key: the name shows in metrics and logs")
    values: dict[str, int] = {}
    for position, word in enumerate(settings, 1):
        setting, _, value = word.partition("=")
        count = _count(value)
        if setting not in ("rpm", "tpm") or count is None:
            raise ApiKeyConfigError(
                f"{where}: word {position} after the key is not rpm=N or tpm=N with N a whole number "
                f"0 or more (the line is {FORMAT}; a key holds no spaces)")
        if setting in values:
            raise ApiKeyConfigError(f"{where}: {setting}= is given twice")
        values[setting] = count
    limits = None
    if values:
        limits = Limits(requests_per_minute=values.get("rpm", 0), tokens_per_minute=values.get("tpm", 0))
    return KeyEntry(key, name, limits, where)


def read_key_file(path: str) -> list[KeyEntry]:
    """One key a line (`[NAME:] KEY [rpm=N] [tpm=N]`); blank lines and lines starting with # are
    skipped."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyConfigError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    entries = [parse_key_line(line, f"--api-key-file {path} line {number}")
               for number, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.lstrip().startswith("#")]
    if not entries:
        raise ApiKeyConfigError(f"--api-key-file {path}: holds no key (one key a line)")
    return entries


def check_entries(entries: Sequence[KeyEntry]) -> None:
    """Every key once, every name (given or `key-N`) once, and no name that is a key."""
    by_digest: dict[bytes, KeyEntry] = {}
    by_name: dict[str, KeyEntry] = {}
    for position, entry in enumerate(entries, 1):
        digest = _digest(entry.key)
        if digest in by_digest:
            raise ApiKeyConfigError(f"{entry.where}: the same key as {by_digest[digest].where}: "
                                    "give each key once (with one name and one set of limits)")
        by_digest[digest] = entry
        name = entry.name or f"key-{position}"
        if name in by_name:
            derived = "" if entry.name and by_name[name].name else (
                " (a key without a name is key-N, N its position among all keys, flags first)")
            raise ApiKeyConfigError(f"{entry.where}: the name {name!r} is also {by_name[name].where}'s{derived}")
        by_name[name] = entry
    keys = {e.key for e in entries}
    for entry in entries:
        if entry.name is not None and entry.name in keys:
            raise ApiKeyConfigError(f"{entry.where}: a key's name must not be a key: the name shows in "
                                    "metrics and logs")


def configured_entries(flag_keys: Sequence[str] | None, key_file: str | None,
                       environ: Mapping[str, str] = os.environ) -> list[KeyEntry]:
    """The keys the flags and the environment give, in the open, checked; empty: the API is open."""
    flags = list(flag_keys or [])
    if any(not k.strip() for k in flags):
        raise ApiKeyConfigError("--api-key: an empty key would accept an empty Authorization header")
    entries = [KeyEntry(k, where=f"--api-key (key {i})") for i, k in enumerate(flags, 1)]
    if key_file:
        entries += read_key_file(key_file)
    if not entries and environ.get(ENV_VAR, "").strip():
        entries = [KeyEntry(environ[ENV_VAR].strip(), where=ENV_VAR)]
    check_entries(entries)
    return entries


def configured_keys(flag_keys: Sequence[str] | None, key_file: str | None,
                    environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys the flags and the environment give, in the open (for a client of the gateway's
    own, like `ttserve up`'s probe); empty: the API is open."""
    return [e.key for e in configured_entries(flag_keys, key_file, environ)]


def load_api_keys(flag_keys: Sequence[str] | None, key_file: str | None,
                  environ: Mapping[str, str] = os.environ, *,
                  default_limits: Limits = Limits()) -> ApiKeys:
    """The gateway's keys; empty ApiKeys: the API is open (loopback, or --insecure).
    `default_limits`: for keys that set no rpm/tpm (--key-requests-per-minute,
    --key-tokens-per-minute); refused without keys, which they would not limit."""
    entries = configured_entries(flag_keys, key_file, environ)
    if default_limits and not entries:
        raise ApiKeyConfigError("--key-requests-per-minute/--key-tokens-per-minute limit each API key, and "
                                "none is configured (--api-key-file, --api-key or VLLM_API_KEY)")
    return ApiKeys(entries, default_limits)


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
    valid key on any path but the open ones; a websocket is closed before it is accepted. With
    `rate_limit`, a generation request over its key's limits gets 429 (OpenAI's shape, type
    `requests` or `tokens`, code `rate_limit_exceeded`, Retry-After in whole seconds)."""

    def __init__(self, app: Callable, keys: ApiKeys, public_metrics: bool = False,
                 rate_limit: bool = False) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS | ({METRICS_PATH} if public_metrics else set())
        self.rate_limit = rate_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys:
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in self.open_paths or _preflight(scope):
            return await self.app(scope, receive, send)
        presented = _bearer(scope)
        account = self.keys.match(presented) if presented is not None else None
        if account is not None:
            scope.setdefault("state", {})[KEY_NAME_STATE] = account.name
            if self.rate_limit and is_generation(scope, path):
                refusal = account.admit()
                if refusal is not None:
                    return await _refuse(scope, send, refusal)
            token = CURRENT_KEY.set(account)
            try:
                return await self.app(scope, receive, send)
            finally:
                CURRENT_KEY.reset(token)
        message = ("this gateway requires an API key: send 'Authorization: Bearer KEY'"
                   if presented is None else "the API key sent is not valid for this gateway")
        if scope["type"] == "websocket":
            # Closing before accept makes the server answer the upgrade with 403.
            await send({"type": "websocket.close", "code": 1008, "reason": message})
            return
        await _send_error(send, 401, {"message": message, "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"},
                          [(b"www-authenticate", b"Bearer")])


async def _refuse(scope: Scope, send: Send, refusal: Refusal) -> None:
    if scope["type"] == "websocket":
        # 1013: try again later (the upgrade is answered with 403, as for a missing key).
        await send({"type": "websocket.close", "code": 1013, "reason": refusal.message[:120]})
        return
    await _send_error(send, 429, {"message": refusal.message, "type": refusal.limit, "param": None,
                                  "code": "rate_limit_exceeded"},
                      [(b"retry-after", str(refusal.retry_after).encode())])


async def _send_error(send: Send, status: int, error: dict[str, Any],
                      headers: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
