"""device.proto service: Describe, Warmup progress, and the ordered step stream."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import grpc

from ttserve.grpc_service import GrpcService, start_server
from ttserve.tls import PLAINTEXT, Tls, peer_names
from ttserve.tracing import Tracer
from ttserve.v1 import device_pb2, device_pb2_grpc

from .batch import Description
from .metrics import WorkerMetrics
from .runner import ModelRunner
from .step_trace import StepTracing
from .wire import (batch_from_pb, config_from_pb, description_to_pb, draining_to_pb, probe_to_pb, progress_to_pb,
                   result_to_pb, step_error_to_pb, warm_to_pb)

log = logging.getLogger(__name__)

# How long a new step stream waits for the one it would replace. A control plane that dies on a
# live host ends its stream at once (the kernel resets the connection). One whose host vanished
# leaves it open until server keepalive (ttserve/protocol.py: ~30 s) ends it; the new stream does
# not wait for that: it probes the old one (StepResult.probe), and a stream that sends nothing
# within PROBE_TIMEOUT_S of the probe is ended for it. A stream that answers belongs to another
# live control plane, which keeps the worker: it is probed every PROBE_INTERVAL_S while it
# answers (it may vanish meanwhile: found within PROBE_INTERVAL_S + PROBE_TIMEOUT_S) and the new
# stream is refused after TAKEOVER_WAIT_S (its control plane retries: a standby). A probe costs
# the holder one small message each way.
TAKEOVER_WAIT_S = 40.0
PROBE_TIMEOUT_S = 5.0
PROBE_INTERVAL_S = 5.0
TAKEOVER_POLL_S = 0.25
STREAM_ACCEPTED = (("ttserve-step-stream", "accepted"),)
PROBE = object()  # _batches_until_drained: send the control plane a probe here


class DeviceService(device_pb2_grpc.DeviceServicer):
    def __init__(self, runner: ModelRunner, backend: str, device: str,
                 control_identity: str | None = None, tracer: Tracer | None = None) -> None:
        self.runner = runner
        self.tracing = StepTracing(tracer or Tracer.off())
        # With mutual TLS every caller holds a certificate of the worker's CA; Warmup and Step
        # (which configure and drive the device) also need this name in it, so that only the
        # control plane, not a gateway of the same CA, can take the device. None: any caller
        # the transport admitted.
        self.control_identity = control_identity
        self.backend = backend
        self.device = device
        self.metrics = WorkerMetrics(backend, device, runner.architecture)
        # One step stream at a time: device state and the KV cache belong to one control plane.
        self._stream_lock = asyncio.Lock()
        # The stream holding the lock: its handler's task (ended when it is replaced), when it
        # was last heard from (any batch or probe answer), and a probe another stream asks for.
        self._stream_task: asyncio.Task | None = None
        self._stream_heard = 0.0
        self._probe_wanted = asyncio.Event()
        self._probe_sent_at = 0.0
        self._replaced: asyncio.Task | None = None  # the holder _take_stream ended, once
        self._warmup_lock = asyncio.Lock()
        self.draining = False
        self._drain_notice = asyncio.Event()  # set with `draining`: the step stream tells its control plane
        self._stepping = False            # a model call is executing on the device thread
        # Every model call (warmup, launch, finish) runs on this one thread. OpenMP keeps a
        # thread team per calling thread: spread over asyncio's default pool, each pool thread
        # that ever ran a step owns a team whose threads spin after every parallel region on the
        # cores the current step needs (measured: a 23 ms SmolLM2 decode took 41 ms in the worker).
        self._device_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")

    async def _on_device(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._device_thread, self._run, fn, *args)

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        # On the device thread. `_stepping` follows the device, not the RPC that asked: a step
        # stream cancelled by its control plane (a stall) leaves its step running to the end.
        self._stepping = True
        try:
            return fn(*args)
        finally:
            self._stepping = False

    @property
    def ready(self) -> bool:
        return self.runner.config is not None and not self.draining

    @property
    def not_ready_reason(self) -> str:
        if self.draining:
            return "the worker is shutting down"
        return "" if self.runner.config is not None else "not warmed up (the control plane starts warmup)"

    async def drain(self, timeout_s: float) -> None:
        """Refuse new streams, tell the control plane on the step stream (it moves this worker's
        requests to others, taking the results of the steps in flight, and closes the stream),
        then wait up to `timeout_s` for the stream to close. A step already on the device always
        finishes before this returns."""
        self.draining = True
        self._drain_notice.set()
        self.metrics.draining.set(1)
        deadline = time.monotonic() + timeout_s
        while self._stream_lock.locked() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._stream_lock.locked():
            log.warning("draining: the control plane still held the step stream after %g s "
                        "(--shutdown-timeout)", timeout_s)
        while self._stepping:  # the device step in progress runs to its end
            await asyncio.sleep(0.01)
        log.info("drained")

    def description(self) -> Description:
        r = self.runner
        d = Description(
            backend=self.backend, device=self.device, model_path=str(r.model_path), architecture=r.architecture,
            vocab_size=r.vocab_size, max_position_embeddings=r.max_position_embeddings,
            capabilities=r.capabilities, lanes_in_process=r.lanes_in_process, eos_token_ids=r.eos_token_ids,
            ready=r.config is not None, async_decode=r.async_decode, mixture_of_experts=r.is_mixture_of_experts,
            mrope=r.uses_mrope, supports_images=r.supports_images,
            image_token_id=r.image_token_id if r.supports_images else 0,
            dtype=str(r.dtype).removeprefix("torch."), draining=self.draining,
            supports_speculative_decoding=r.supports_speculative_decoding)
        if r.config is not None and r.layout is not None:
            d.config = r.config
            d.num_blocks_per_lane = r.layout.num_blocks_per_lane
            d.block_size = r.layout.block_size
            d.prefill_buckets = r.prefill_buckets
            d.max_prefill_batch_size = r.max_prefill_batch_size
            groups = r.layout.kv_groups
            if groups.hybrid:
                d.kv_groups = list(zip(groups.windows, groups.layers))
        return d

    def _log_summary(self, warmup_s: float) -> None:
        r, config, layout = self.runner, self.runner.config, self.runner.layout
        traced = [kind for kind in ("prefill", "decode") if r.options.traced(kind)]
        log.info("worker ready after %.1f s of warmup: model %s (%s), backend %s on %s; %d lane(s) x %d "
                 "seqs, max_model_len %d; %d KV blocks x %d tokens per lane; traced: %s (prefill "
                 "lengths %s); sampling on device: %s; async decode %s", warmup_s, r.model_path,
                 r.architecture, self.backend, self.device, config.num_lanes, config.max_num_seqs,
                 config.max_model_len, layout.num_blocks_per_lane, layout.block_size,
                 ", ".join(traced) or "none", r.prefill_buckets or "any", r.options.tt.get(
                     "sample_on_device_mode", "off") if r.capabilities.get("supports_sample_on_device")
                 else "unsupported", "on" if r.async_decode else "off")

    async def Describe(self, request: device_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> device_pb2.DeviceDescription:
        return description_to_pb(self.description())

    async def _refuse_unless_control_plane(self, context: grpc.aio.ServicerContext, call: str) -> None:
        if self.control_identity is None:
            return
        names = peer_names(context)
        if self.control_identity not in names:
            log.warning("refused %s from %s: its certificate names %s, not %r", call, context.peer(),
                        ", ".join(names) or "nothing", self.control_identity)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"this worker takes {call} only from its control plane, whose certificate "
                                f"names {self.control_identity!r} (--control-identity); the caller's "
                                f"certificate names {', '.join(names) or 'nothing'}")

    async def Warmup(self, request: device_pb2.WarmupRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[device_pb2.WarmupProgress]:
        await self._refuse_unless_control_plane(context, "Warmup")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        config = config_from_pb(request)
        if config.max_num_seqs < 1 or config.max_model_len < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_num_seqs and max_model_len must be positive, got {config}")
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[device_pb2.WarmupProgress] = asyncio.Queue()

        def progress(phase: str, completed: int, total: int, detail: str) -> None:
            log.info("warmup %s %d/%d %s", phase, completed, total, detail)
            self.metrics.warmup(phase, completed, total)
            loop.call_soon_threadsafe(updates.put_nowait, progress_to_pb(phase, completed, total, detail))

        started = time.monotonic()
        async with self._warmup_lock:
            warm_already = self.runner.config is not None
            if self._stepping:
                # A step of an earlier stream (one its control plane gave up on as stalled) still
                # holds the device; warmup queues behind it on the device thread.
                yield progress_to_pb("wait", 0, 1, "a step of an earlier step stream is still running on the device")
            task = asyncio.create_task(self._on_device(self.runner.warmup, config, progress))
            while not task.done() or not updates.empty():
                getter = asyncio.create_task(updates.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
            try:
                task.result()
            except ValueError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        self.metrics.ready.set(1)
        self.metrics.warmup_progress.set(1)
        if self.runner.layout is not None and not warm_already:
            self.metrics.kv_blocks.set(self.runner.layout.num_blocks_per_lane)
            self._log_summary(time.monotonic() - started)
        yield warm_to_pb(self.description())

    async def Step(self, batches: AsyncIterator[device_pb2.StepBatch], context: grpc.aio.ServicerContext) -> None:
        # Results go out through context.write, not as an async generator's yields: every write
        # is an await in this coroutine, so a stream ended for a new control plane (cancelled by
        # _take_stream, also while a write waits on a peer that reads nothing) runs its finally
        # and releases the stream at once, and its control plane, if it still listens, hears why.
        await self._refuse_unless_control_plane(context, "Step")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if not await self._take_stream(context.peer()):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this worker serves another control plane's step stream, which answered "
                                f"its probes for {TAKEOVER_WAIT_S:g} s (one control plane per worker)")
        me = self._stream_task = asyncio.current_task()
        self._stream_heard = time.monotonic()
        self._probe_wanted.clear()
        replaced = False
        try:
            if self.draining:  # it began while this stream waited for the lock
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
            # On the device thread: behind any step an earlier, cancelled stream left running.
            await self._on_device(self.runner.reset)
            self.tracing.dropped()  # step ids start again with each stream
            # The control plane counts this worker as serving once it sees these (WorkerLink.open).
            await context.send_initial_metadata(STREAM_ACCEPTED)
            async for pb in self._batches_until_drained(batches):
                if pb is None:
                    log.info("telling the control plane this worker shuts down")
                    await context.write(draining_to_pb())
                    continue
                if pb is PROBE:
                    self._probe_sent_at = time.monotonic()
                    await context.write(probe_to_pb())
                    continue
                received = time.perf_counter()
                self.tracing.received(pb)
                batch = batch_from_pb(pb)
                held = self.runner.unanswered()  # a pipelined decode the next launch returns
                try:
                    # The runner holds a pipelined decode until the next batch is launched.
                    results = await self._on_device(self.runner.step, batch, received)
                except Exception as e:  # noqa: BLE001 - one step's fault, not the stream's
                    # The step's inputs may be what failed (one request's), not the device: the
                    # device state is dropped as at a new stream and the stream goes on; the
                    # control plane recomputes its requests and isolates the failed step's.
                    log.exception("step %d failed; dropping all device state and serving on", batch.step_id)
                    await self._on_device(self.runner.reset)
                    # One result per step sent, in order: a decode held on the device (whose
                    # readback may be what raised) fails with this one.
                    for step_id in [*held, batch.step_id]:
                        await context.write(step_error_to_pb(step_id, f"{type(e).__name__}: {e}"))
                    self.tracing.dropped()
                    continue
                for result in results:
                    self.metrics.step(result.kind, result)
                    await context.write(result_to_pb(result))
                    self.tracing.sent(result)
        except asyncio.CancelledError:
            if self._replaced is not me:
                raise
            replaced = True
        finally:
            self._stream_task = None
            self._stream_lock.release()
        if replaced:  # a control plane that was only frozen learns it lost the worker
            await context.abort(grpc.StatusCode.ABORTED,
                                f"this worker now serves another control plane: this one sent nothing for "
                                f"{PROBE_TIMEOUT_S:g} s after a probe")

    async def _take_stream(self, peer: str) -> bool:
        """Acquire the step stream for a new stream: at once when none is held; else when the
        holder ends, or when it leaves a probe unanswered for PROBE_TIMEOUT_S after it went out
        (its control plane is gone: its stream is ended). A holder in a device step sends the
        probe when the step ends. False after TAKEOVER_WAIT_S of a holder that answers (a probe
        still unanswered then is waited out first: the holder may be the one that is gone)."""
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        acquire = asyncio.ensure_future(self._stream_lock.acquire())
        asked, next_probe = 0.0, 0.0
        try:
            while not acquire.done():
                now, sent, holder = time.monotonic(), self._probe_sent_at, self._stream_task
                unanswered = asked > 0 and sent >= asked and self._stream_heard < sent
                # A probe out at the deadline is waited for, at most its timeout: later contenders'
                # probes must not keep this one waiting.
                if now >= deadline and (not unanswered or now >= deadline + PROBE_TIMEOUT_S + TAKEOVER_POLL_S):
                    break
                if holder is not None and holder is not self._replaced and unanswered \
                        and now - sent >= PROBE_TIMEOUT_S:
                    log.warning("the control plane holding the step stream sent nothing for %g s after a probe: "
                                "it is gone; its stream ends and %s takes the worker", PROBE_TIMEOUT_S, peer)
                    self._replaced = holder
                    holder.cancel()
                elif now >= next_probe and not unanswered:
                    asked, next_probe = now, now + PROBE_INTERVAL_S
                    self._probe_wanted.set()
                await asyncio.wait({acquire}, timeout=TAKEOVER_POLL_S)
        except BaseException:
            if not acquire.cancel():  # acquired meanwhile
                self._stream_lock.release()
            raise
        if acquire.done():
            return True
        acquire.cancel()
        return False

    async def _batches_until_drained(self, batches: AsyncIterator[device_pb2.StepBatch]
                                     ) -> AsyncIterator[device_pb2.StepBatch | None | object]:
        """The stream's batches, with one None where the drain began (the notice goes out as
        soon as SIGTERM arrives, also while the control plane sends nothing) and PROBE where
        another stream asked for a probe. Probe answers are taken here, not passed on; every
        message received marks the stream as heard from."""
        incoming = batches.__aiter__()
        notice = asyncio.ensure_future(self._drain_notice.wait())
        probe = asyncio.ensure_future(self._probe_wanted.wait())
        pending: asyncio.Future | None = None
        told = False
        try:
            while True:
                if notice.done() and not told:
                    told = True
                    yield None
                if probe.done():
                    self._probe_wanted.clear()
                    probe = asyncio.ensure_future(self._probe_wanted.wait())
                    yield PROBE
                if pending is None:
                    pending = asyncio.ensure_future(incoming.__anext__())
                await asyncio.wait({pending, probe} if told else {pending, notice, probe},
                                   return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    continue  # a notice or a probe: yielded at the top
                try:
                    batch = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                self._stream_heard = time.monotonic()
                if batch.probe_answer:
                    continue
                yield batch
        finally:
            notice.cancel()
            probe.cancel()
            if pending is not None:
                pending.cancel()


async def serve(service: DeviceService, host: str, port: int, tls: Tls = PLAINTEXT) -> GrpcService:
    def register(server: grpc.aio.Server) -> None:
        device_pb2_grpc.add_DeviceServicer_to_server(service, server)

    return await start_server(host, port, register,
                              [device_pb2.DESCRIPTOR.services_by_name["Device"].full_name], "worker", tls)
