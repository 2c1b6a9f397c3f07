"""The gateway's Prometheus metrics and how `/metrics` serves them.

The gateway's `/metrics` serves a registry of its own (`REGISTRY`): the `ttserve_gateway_*`
metrics below plus the standard process and Python collectors. vLLM's `vllm:*` metrics are not
exported: Prometheus reserves `:` for recording rules and `promtool check metrics` refuses such
names, and the control plane exports the `ttserve_*` equivalents measured where the work happens
(docs/metrics.md). So they are not recorded either: GatewayLLM replaces vLLM's Prometheus stat
logger with one that records nothing (vLLM's log-stats lines come from its LoggingStatLogger, a
separate one), and serve_vllm_app drops vLLM's HTTP instrumentation middleware, which
RequestDurationMiddleware stands in for. `install` replaces the `/metrics` routes vLLM's
build_app added (an exact route and a `/metrics*` mount) with one of ours.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, GCCollector, Gauge,
                               Histogram, PlatformCollector, ProcessCollector, generate_latest)

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# prometheus_client appends `_total` to counter names when it exports them.
CONNECTED = Gauge("ttserve_gateway_control_plane_connected",
                  "1 while the gateway holds a session with the control plane", registry=REGISTRY)
SESSIONS_LOST = Counter("ttserve_gateway_control_plane_sessions_lost",
                        "Sessions with the control plane that broke (in-flight requests resume or fail)",
                        registry=REGISTRY)
RESUMPTIONS = Counter("ttserve_gateway_request_resumptions",
                      "Requests in flight on a lost session with the control plane, by outcome: resumed "
                      "(re-added with the tokens streamed so far, and admitted), failed (refused, or no "
                      "control plane ready within --control-migration-timeout)",
                      ["outcome"], registry=REGISTRY)
REFUSED = Counter("ttserve_gateway_refused_requests",
                  "Requests refused before generation: invalid (400) or unavailable (503)",
                  ["status"], registry=REGISTRY)
DRAINING = Gauge("ttserve_gateway_draining", "1 once SIGTERM arrived: admits nothing, finishes "
                 "what it holds", registry=REGISTRY)
REQUEST_DURATION = Histogram(
    "ttserve_gateway_request_duration_seconds",
    "HTTP request arrival to the response's last byte (for a stream, its end), by endpoint",
    ["endpoint"], registry=REGISTRY,
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320))

# By API key: the `key` label is the key's NAME (a keys-file `name:` or `key-N` by position),
# never the key; the operator's file bounds it. Series are created per key at start-up
# (gateway/rate_limits.py, KeyAccount).
KEY_REQUESTS = Counter("ttserve_gateway_key_requests",
                       "Generation requests each API key sent (those rate-limited included)",
                       ["key"], registry=REGISTRY)
KEY_TOKENS = Counter("ttserve_gateway_key_tokens",
                     "Tokens each API key's requests consumed: prompt (counted once the control plane "
                     "accepted the request) and generation (as they arrive)",
                     ["key", "kind"], registry=REGISTRY)
RATE_LIMITED = Counter("ttserve_gateway_rate_limited",
                       "Requests refused with 429 by their API key's rate limit, by limit (requests "
                       "or tokens per minute)", ["key", "limit"], registry=REGISTRY)

# Both statuses exist from the start so that rate() over them works before the first refusal.
for _status in ("400", "503"):
    REFUSED.labels(status=_status)

# The `endpoint` label: a fixed set, so no client-chosen path becomes a label value.
ENDPOINTS = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
OTHER_ENDPOINT = "other"
# Probes and scrapes are frequent and say nothing about serving latency.
UNTIMED_PATHS = frozenset({"/metrics", "/health", "/ready"})


def exposition() -> bytes:
    """The text exposition of REGISTRY (what GET /metrics returns)."""
    return generate_latest(REGISTRY)


def install(app: Any) -> None:
    """Serve REGISTRY on GET /metrics in place of vLLM's routes for `/metrics` and below it.

    `app` is the FastAPI app from vLLM's build_app."""
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def metrics(request: Request) -> Response:
        return Response(exposition(), media_type=CONTENT_TYPE_LATEST)

    # Routes without a path (FastAPI's lazy included routers) are kept as they are.
    routes = app.router.routes
    routes[:] = [r for r in routes if not str(getattr(r, "path", "")).startswith("/metrics")]
    routes.insert(0, Route("/metrics", metrics, methods=["GET"], name="ttserve_metrics"))


ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


class RequestDurationMiddleware:
    """Observes REQUEST_DURATION for every HTTP request but probes and scrapes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in UNTIMED_PATHS:
            await self.app(scope, receive, send)
            return
        endpoint = ENDPOINTS.get(path.rstrip("/") or "/", OTHER_ENDPOINT)
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_DURATION.labels(endpoint=endpoint).observe(time.perf_counter() - start)
