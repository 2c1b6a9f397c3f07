"""The worker's device thread (worker/server.py): every model call runs on one thread.

OpenMP keeps a thread team per calling thread; when model calls hop between threads (asyncio's
default pool), each hop's team spins on the cores the next call needs, and a CPU decode step
takes ~1.7x as long. Concurrent calls must therefore queue on one thread, never the loop's."""
from __future__ import annotations

import asyncio
import threading

from ttserve.worker.server import DeviceService


class _Runner:
    architecture = "LlamaForCausalLM"


def test_model_calls_run_on_one_thread_that_is_not_the_event_loops():
    service = DeviceService(_Runner(), "torch", "cpu")

    async def calls() -> set[int]:
        # Concurrent: asyncio.to_thread would spread these over several pool threads.
        return set(await asyncio.gather(*(service._on_device(threading.get_ident) for _ in range(16))))

    threads = asyncio.run(calls()) | asyncio.run(calls())
    assert len(threads) == 1
    assert threading.get_ident() not in threads
