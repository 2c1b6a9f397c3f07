"""The gateway's graceful drain: on SIGTERM (or SIGINT) stop admitting, let in-flight requests
finish for up to `--shutdown-timeout` seconds, abort the rest, then let the server exit.

How it hooks into vLLM 0.32's serve_http (vllm/entrypoints/launchers/launcher.py): serve_http owns
SIGINT/SIGTERM (a loop signal handler; its uvicorn server is a NoSignalServer, which installs none
of its own). On the first signal it calls `engine_client.shutdown(timeout=vllm_config.
shutdown_timeout)` in an executor thread and only after that returns stops uvicorn. So for as long
as that call runs, the listener stays open and the app keeps serving: GatewayLLM.shutdown runs
`Drain.run` on the event loop for that window, and meanwhile new completions get 503
(GatewayShuttingDown), /health and /ready 503, while in-flight streams keep flowing. When it
returns, serve_http stops uvicorn, which closes the listener and waits for the open responses to be
written (bounded by uvicorn's timeout_graceful_shutdown).

Invariant: once `draining` is True it stays True; no request is admitted after it turns True, so
the number in flight only falls.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Protocol

from ttserve.gateway.metrics import DRAINING

log = logging.getLogger("ttserve.gateway.drain")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Drainable(Protocol):
    """What the drain needs from the engine side (GatewayLLM)."""

    def num_in_flight(self) -> int:
        """Requests admitted and not finished."""

    async def abort_in_flight(self) -> int:
        """End every in-flight request now with finish reason abort; returns how many."""


class Drain:
    """The gateway's drain state, shared by everything that admits or reports readiness."""

    def __init__(self) -> None:
        self.draining = False
        self._cut_short: asyncio.Event | None = None

    def begin(self) -> None:
        """Stop admitting; idempotent."""
        if not self.draining:
            self.draining = True
            DRAINING.set(1)

    def cut_short(self) -> None:
        """Abort what is in flight now instead of waiting out the timeout (a second signal)."""
        if self._cut_short is not None:
            self._cut_short.set()

    async def run(self, target: Drainable, timeout: float, *, poll_s: float = 0.05,
                  signals: tuple[signal.Signals, ...] = SIGNALS) -> int:
        """Drain `target`: stop admitting, wait until nothing is in flight or `timeout` seconds
        pass (or one of `signals` arrives again), then abort what is left; returns how many
        requests were aborted. Runs on the event loop that serves the requests."""
        loop = asyncio.get_running_loop()
        self.begin()
        self._cut_short = asyncio.Event()
        for sig in signals:  # replaces serve_http's handler, which ignores repeats
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.cut_short)
        start = time.monotonic()
        if (in_flight := target.num_in_flight()) and timeout > 0:
            log.info("draining: %d request(s) in flight, waiting up to %g s for them to finish "
                     "(a second SIGTERM or SIGINT aborts them now); new requests get 503", in_flight, timeout)
        while target.num_in_flight() and not self._cut_short.is_set():
            left = start + timeout - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._cut_short.wait(), min(poll_s, left))
        aborted = await target.abort_in_flight() if target.num_in_flight() else 0
        if aborted:
            log.warning("drained after %.1f s: aborted %d request(s) still in flight",
                        time.monotonic() - start, aborted)
        else:
            log.info("drained after %.1f s: no request in flight", time.monotonic() - start)
        return aborted
