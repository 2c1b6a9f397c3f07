"""The control plane's connection to one device worker: describe, warm up, step."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from ttserve.protocol import CALL_METADATA, CHANNEL_OPTIONS, check_peer_version
from ttserve.tls import PLAINTEXT, Tls, handshake_hint, open_channel
from ttserve.v1 import device_pb2_grpc

from .lanes import GroupPlan
from .wire import (StepOutcome, WarmupProgress, WorkerDescription, describe_request_pb, description_from_pb,
                   empty_step_batch_to_pb, probe_answer_pb, step_batch_to_pb, step_result_from_pb, warmup_progress_from_pb,
                   warmup_request_to_pb)

__all__ = ["StepFailed", "WarmupProgress", "WorkerError", "WorkerHeldElsewhere", "WorkerLink"]

log = logging.getLogger(__name__)

# Above the worker's wait for the control plane holding its stream (worker/server.py TAKEOVER_WAIT_S).
STREAM_ACCEPT_TIMEOUT_S = 60.0


class WorkerError(RuntimeError):
    """The worker failed or went away; the message names it and says why."""


class WorkerHeldElsewhere(WorkerError):
    """The worker serves another live control plane (it answered the worker's probes): this one
    is a standby for it, and asks again."""


class StepFailed(WorkerError):
    """The worker reported that a step failed inside the model (StepResult.error). It dropped its
    device state and the stream goes on. `error`: the model's exception, as the worker gave it."""

    def __init__(self, message: str, error: str) -> None:
        super().__init__(message)
        self.error = error


class WorkerLink:
    def __init__(self, address: str, tls: Tls = PLAINTEXT) -> None:
        self.address = address
        self._tls = tls
        self._channel = open_channel(address, tls, CHANNEL_OPTIONS)
        self._stub = device_pb2_grpc.DeviceStub(self._channel)
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._next_step_id = 1
        # The step stream's messages, read by one task as they come: results (or the error that
        # ended the stream) for `receive`; the worker's drain notice, which may come while no
        # step is in flight, sets `drain_notice`.
        self._results: asyncio.Queue[StepOutcome | WorkerError] = asyncio.Queue()
        self._reader: asyncio.Future | None = None
        self.drain_notice = asyncio.Event()
        # Steps and probe answers are written from two tasks (the step loop, the reader); gRPC
        # takes one write at a time on a call.
        self._write_lock = asyncio.Lock()
        self._answer: asyncio.Future | None = None  # the probe answer being written

    async def describe(self, timeout: float = 10.0) -> WorkerDescription:
        try:
            d = await self._stub.Describe(describe_request_pb(), metadata=CALL_METADATA, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise WorkerError(f"worker at {self.address} is unreachable: {e.details()}"
                              f"{handshake_hint(e.details(), self._tls)}") from e
        described = description_from_pb(d, self.address)
        check_peer_version(described.protocol_version, f"the worker at {self.address}")
        return described

    async def warmup(self, num_lanes: int, max_num_seqs: int, max_model_len: int,
                     max_num_batched_tokens: int, timeout: float) -> AsyncIterator[WarmupProgress]:
        """Warm the worker up for this configuration, yielding its progress; the last item
        carries the warm worker's description. The whole call is bounded by `timeout`
        (--warmup-timeout)."""
        request = warmup_request_to_pb(num_lanes, max_num_seqs, max_model_len, max_num_batched_tokens)
        started = time.monotonic()
        try:
            async for message in self._stub.Warmup(request, metadata=CALL_METADATA, timeout=timeout):
                progress = warmup_progress_from_pb(message, self.address)
                log.info("worker %s warmup: %s %d/%d %s", self.address, progress.phase,
                         progress.completed, progress.total, progress.detail)
                if progress.done:
                    log.info("worker %s warm after %.1f s", self.address, time.monotonic() - started)
                yield progress
                if progress.done:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise WorkerError(f"worker at {self.address} did not finish warmup within "
                                  f"--warmup-timeout {timeout:g} s") from e
            raise WorkerError(f"worker at {self.address} failed warmup: {e.code().name}: {e.details()}") from e
        raise WorkerError(f"worker at {self.address} ended warmup without reporting done")

    async def open(self, timeout: float = STREAM_ACCEPT_TIMEOUT_S) -> None:
        """Open the ordered step stream; device state of requests lives as long as it does.
        Returns once the worker has taken it (its initial metadata: it holds the stream and has
        reset its device state); raises WorkerError when it refuses or does not within `timeout`."""
        self._stream = stream = self._stub.Step(metadata=CALL_METADATA)
        self._next_step_id = 1
        self._results = asyncio.Queue()
        self.drain_notice.clear()
        try:
            await asyncio.wait_for(stream.initial_metadata(), timeout)
        except asyncio.TimeoutError:
            stream.cancel()
            raise WorkerError(f"worker at {self.address} did not take the step stream within "
                              f"{timeout:g} s") from None
        except grpc.aio.AioRpcError as e:
            raise self._refusal(e.code(), e.details()) from e
        if stream.done() and await stream.code() != grpc.StatusCode.OK:
            raise self._refusal(await stream.code(), await stream.details())
        self._reader = asyncio.ensure_future(self._read(stream))

    def _refusal(self, code: grpc.StatusCode, details: str) -> WorkerError:
        held = code == grpc.StatusCode.RESOURCE_EXHAUSTED  # worker/server.py: another live control plane
        return (WorkerHeldElsewhere if held else WorkerError)(
            f"worker at {self.address} refused the step stream: {code.name}: {details}")

    async def _read(self, stream: grpc.aio.StreamStreamCall) -> None:
        try:
            while (message := await stream.read()) is not grpc.aio.EOF:
                result = step_result_from_pb(message)
                if result.draining:
                    log.info("worker %s is shutting down: its requests move", self.address)
                    self.drain_notice.set()
                elif result.probe:  # another control plane asks for the worker: this one is alive
                    log.debug("worker %s: another control plane asks for its step stream; this one keeps it",
                              self.address)
                    # Written by a task of its own: this reader keeps reading while a step's write
                    # waits on flow control (the worker may be writing a large result meanwhile).
                    if self._answer is None or self._answer.done():
                        self._answer = asyncio.ensure_future(self._answer_probe(stream))
                else:
                    self._results.put_nowait(result)
            self._results.put_nowait(WorkerError(f"worker at {self.address} closed the step stream"))
        except grpc.aio.AioRpcError as e:
            self._results.put_nowait(WorkerError(f"worker at {self.address} failed: {e.details()}"))
        except Exception as e:  # noqa: BLE001 - the step loop waits on these results: it learns of any fault
            self._results.put_nowait(WorkerError(f"the step stream with the worker at {self.address} failed: "
                                                 f"{type(e).__name__}: {e}"))

    async def _answer_probe(self, stream: grpc.aio.StreamStreamCall) -> None:
        try:
            async with self._write_lock:
                await stream.write(probe_answer_pb())
        except Exception as e:  # noqa: BLE001 - the stream's end reaches the reader
            log.debug("worker %s: probe answer not sent: %s", self.address, e)

    async def ended(self) -> str:
        """Resolves when the step stream ends on its own (the worker died or went away); lets an
        idle control plane notice a lost worker before the next request needs it."""
        assert self._stream is not None
        code = await self._stream.code()
        return f"worker at {self.address} went away ({code.name}: {await self._stream.details()})"

    async def send(self, plan: GroupPlan | None, max_num_seqs: int, async_readback: bool = False) -> None:
        """Send a step (None: an empty flush, which makes the worker return any result it holds)."""
        assert self._stream is not None, "open() the step stream first"
        step_id = self._next_step_id
        self._next_step_id += 1
        batch = (empty_step_batch_to_pb(step_id) if plan is None else
                 step_batch_to_pb(step_id, plan.kind, plan.lanes, max_num_seqs, async_readback))
        stream = self._stream  # receive() may drop it while this waits for the lock
        try:
            async with self._write_lock:
                await stream.write(batch)
        except grpc.aio.AioRpcError as e:
            self._stream = None
            raise WorkerError(f"worker at {self.address} failed: {e.details()}") from e
        except asyncio.InvalidStateError:  # the worker ended the call (e.g. it serves another control plane now)
            self._stream = None
            raise WorkerError(f"worker at {self.address} ended the step stream: {(await stream.code()).name}: "
                              f"{await stream.details()}") from None

    async def receive(self) -> StepOutcome:
        """The next step result, in the order the steps were sent."""
        assert self._stream is not None, "open() the step stream first"
        result = await self._results.get()
        if isinstance(result, WorkerError):
            self._stream = None
            raise result
        if result.error:
            raise StepFailed(f"worker at {self.address} failed step {result.step_id}: {result.error}", result.error)
        return result

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._answer is not None:
            self._answer.cancel()
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        await self._channel.close()
