"""Memory and step sizes under oversized image payloads (issue 22 items 1 and 6).

A prefill step that gathered several large image requests could pass the 64 MiB gRPC message
limit and fail the worker. The control plane caps one step's image payload at 48 MiB over all
lanes (control/images.py PayloadBudget) and bounds the bytes its live requests hold with
--max-held-bytes (control/queue_bounds.py). This run shows both on real processes: the torch
worker on the tiny random-weight Qwen2.5-VL checkpoint (worker/planning/tiny_vlm.py, --dtype float32) and a
control plane, driven through engine.proto.

Phase 1 (payload budget): N concurrent requests, each with one image whose pixel_values are
~20 MiB (float32 [h*w, 1176], grid [1, h, w]; h*w/4 placeholder tokens), with
--max-num-batched-tokens 8192 so that by tokens all of them would fit one prefill step.
Phase 2 (held bytes): a new control plane with --max-held-bytes 100000000; requests are sent one
after another until one is refused.

How the figures are read:
  rss       VmRSS of each service's /proc/PID/status, sampled every 50 ms from a thread: the
            baseline (median of --settle-seconds, 1 s, idle after warmup, before any image), the
            peak while the requests run, and `after` (the median of the --settle-seconds after the
            last finished). `kernel peak` is VmHWM, reset through /proc/PID/clear_refs at the
            baseline (blank where the kernel refuses).
  steps     the real step messages: the control plane talks to its worker through a
            byte-forwarding gRPC proxy in this process (a tap on the Device service) that records
            each StepBatch's serialized size and its images, and forwards the bytes untouched.
            Cross-checked with ttserve_steps_total{kind="prefill"} of the control plane and
            ttserve_device_steps_total{kind="prefill"} of the worker (before/after deltas).
  health    every admitted request finishes with FINISH_REASON_LENGTH;
            ttserve_step_failures_total == 0 and every ttserve_request_migrations_total == 0.

The exit status is 1 if an admitted request did not finish with length, a step failed, a
request migrated, a step message passed 64 MiB, or phase 2 refused nothing.

    python benchmarks/payload_memory.py [--requests 6] [--image-mib 20] [--settle-seconds 1] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from stack import Service, Stack, control_ready, free_port, get, samples, start_worker, wait_until  # noqa: E402

from ttserve.control_client import ControlClient  # noqa: E402
from ttserve.protocol import CALL_METADATA  # noqa: E402
from ttserve.v1 import device_pb2, engine_pb2, multimodal_pb2  # noqa: E402

MIB = 1 << 20
GRPC_LIMIT = 64 << 20            # ttserve/protocol.py MESSAGE_LIMITS
PATCH_FEATURES = 3 * 2 * 14 * 14  # channels x temporal x patch x patch: 1176
MERGE = 2
WORKER_FLAGS = ("--dtype", "float32", "--block-size", "16")
CONTROL_FLAGS = ("--max-num-seqs", "8", "--max-num-batched-tokens", "8192", "--max-model-len", "2048")
HELD_BYTES_LIMIT = 100_000_000
FINISH = engine_pb2.FinishReason


# ---- processes' memory ------------------------------------------------------------------------
def _status(pid: int, key: str) -> float | None:
    """A kB field of /proc/PID/status in MiB (None once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_hwm(pid: int) -> bool:
    """Reset the kernel's peak RSS (VmHWM) of a process this user owns."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RssSampler:
    """VmRSS of some processes every `period` s on a thread; `peak()` since the last `reset()`."""

    def __init__(self, pids: dict[str, int], period: float = 0.05) -> None:
        self.pids, self.period = pids, period
        self._peak = {name: 0.0 for name in pids}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for name, pid in self.pids.items():
                rss = _status(pid, "VmRSS")
                if rss is not None:
                    with self._lock:
                        self._peak[name] = max(self._peak[name], rss)

    def reset(self) -> None:
        with self._lock:
            self._peak = {name: 0.0 for name in self.pids}

    def peak(self) -> dict[str, float]:
        with self._lock:
            return dict(self._peak)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def settled_rss(pids: dict[str, int], seconds: float = 1.0) -> dict[str, float]:
    """The median VmRSS of each process over `seconds` of sampling."""
    samples: dict[str, list[float]] = {name: [] for name in pids}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name, pid in pids.items():
            rss = _status(pid, "VmRSS")
            if rss is not None:
                samples[name].append(rss)
        time.sleep(0.05)
    return {name: statistics.median(v) if v else math.nan for name, v in samples.items()}


# ---- the step tap: a byte-forwarding proxy of the Device service ------------------------------
class StepTap:
    """Listens on its own port, forwards every Device call to `upstream` byte for byte (metadata,
    the step stream's accept, statuses), and records each StepBatch: its serialized size, kind,
    images and image bytes. The control plane's --worker points here instead of at the worker."""

    # Larger than the services' 64 MiB: the tap must see (and pass on, for the worker to judge)
    # whatever the control plane sends.
    OPTIONS = (("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20))

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.steps: list[dict] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self._error = e
            self._started.set()

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        channel = grpc.aio.insecure_channel(self.upstream, options=self.OPTIONS)
        describe = channel.unary_unary("/ttserve.v1.Device/Describe")
        warmup = channel.unary_stream("/ttserve.v1.Device/Warmup")
        step = channel.stream_stream("/ttserve.v1.Device/Step")

        def timeout(context) -> float | None:
            remaining = context.time_remaining()
            return None if remaining is None or remaining > 1e8 else remaining

        async def on_describe(raw: bytes, context) -> bytes:
            try:
                return await describe(raw, metadata=CALL_METADATA, timeout=timeout(context))
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details())

        async def on_warmup(raw: bytes, context):
            try:
                async for message in warmup(raw, metadata=CALL_METADATA, timeout=timeout(context)):
                    yield message
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details())

        async def on_step(requests, context):
            async def forward():
                async for raw in requests:
                    self._record(raw)
                    yield raw

            call = step(forward(), metadata=CALL_METADATA)
            try:
                await context.send_initial_metadata(tuple(await call.initial_metadata()))
                async for raw in call:
                    yield raw
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    await context.abort(code, await call.details())
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details())
            finally:
                call.cancel()

        server = grpc.aio.server(options=self.OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ttserve.v1.Device", {
            "Describe": grpc.unary_unary_rpc_method_handler(on_describe),
            "Warmup": grpc.unary_stream_rpc_method_handler(on_warmup),
            "Step": grpc.stream_stream_rpc_method_handler(on_step),
        }),))
        server.add_insecure_port(self.address)
        await server.start()
        self._started.set()
        await self._stopped.wait()
        await server.stop(grace=1)
        await channel.close()

    def _record(self, raw: bytes) -> None:
        batch = device_pb2.StepBatch.FromString(raw)
        images = [m for chunk in batch.prefill for m in chunk.mm_inputs]
        with self._lock:
            self.steps.append({"bytes": len(raw), "kind": device_pb2.StepKind.Name(batch.kind),
                               "images": len(images), "image_bytes": sum(m.ByteSize() for m in images),
                               "chunks": len(batch.prefill)})

    def since(self, start: int) -> list[dict]:
        with self._lock:
            return list(self.steps[start:])

    def count(self) -> int:
        with self._lock:
            return len(self.steps)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)


# ---- the stack ---------------------------------------------------------------------------------
class TappedStack:
    """One tiny-vlm worker, the step tap in front of it, and a control plane on the tap."""

    def __init__(self, tmp: Path, model: Path, control_flags: tuple[str, ...]) -> None:
        worker_port, worker_metrics = free_port(), free_port()
        control_port, control_metrics = free_port(), free_port()
        self.worker = start_worker(tmp, str(model), worker_port, "--metrics-port", str(worker_metrics),
                                   *WORKER_FLAGS)
        self.stack = Stack(services=[self.worker], control_address=f"127.0.0.1:{control_port}",
                           worker_address=f"127.0.0.1:{worker_port}",
                           control_metrics_url=f"http://127.0.0.1:{control_metrics}",
                           worker_metrics_urls=[f"http://127.0.0.1:{worker_metrics}"])
        self.tap = StepTap(self.stack.worker_address)
        self.control = Service("control", ["ttserve.control", "--port", str(control_port), "--metrics-port",
                                           str(control_metrics), "--worker", f"0={self.tap.address}",
                                           *control_flags], tmp / f"control-{control_port}.log").start()
        self.stack.services.append(self.control)
        try:
            wait_until(lambda: control_ready(self.stack.control_address), 600, "the control plane to be ready",
                       self.stack)
        except BaseException:
            self.close()
            raise
        self.pids = {"control": self.control.proc.pid, "worker": self.worker.proc.pid}

    def metrics(self) -> tuple[str, str]:
        return (get(f"{self.stack.control_metrics_url}/metrics")[1],
                get(f"{self.stack.worker_metrics_urls[0]}/metrics")[1])

    def close(self) -> None:
        self.stack.stop()
        self.tap.close()


def total(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels` (0 when none)."""
    return sum(samples(metrics_text, name, **labels))


def by_label(metrics_text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)\{(.*)\} (\S+)$", line)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            out[found.get(label, "")] = out.get(label, 0.0) + float(match.group(3))
    return out


# ---- the requests --------------------------------------------------------------------------------
def image_grid(target_mib: float) -> tuple[int, int]:
    """(h, w) in patches, square, a multiple of 2 * MERGE (whole attention windows of merged
    tokens), with h * w * 1176 float32 closest to `target_mib`."""
    side = math.sqrt(target_mib * MIB / (PATCH_FEATURES * 4))
    step = 2 * MERGE
    h = w = max(step, round(side / step) * step)
    return h, w


class RequestFactory:
    def __init__(self, model: Path, target_mib: float, max_tokens: int) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        config = json.loads((model / "config.json").read_text())
        self.image_token = int(config["image_token_id"])
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.h, self.w = image_grid(target_mib)
        self.placeholders = self.h * self.w // (MERGE * MERGE)
        self.max_tokens = max_tokens

    def prompt(self, i: int) -> tuple[list[int], int]:
        """The chat template's prompt with its one image placeholder expanded to h*w/4 tokens,
        and the placeholders' offset."""
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Describe picture {i}."}]}],
            add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if ids.count(self.image_token) != 1:
            raise RuntimeError(f"the chat template wrote {ids.count(self.image_token)} image placeholders, not 1")
        offset = ids.index(self.image_token)
        return ids[:offset] + [self.image_token] * self.placeholders + ids[offset + 1:], offset

    def make(self, request_id: str, seed: int) -> engine_pb2.AddRequest:
        prompt, offset = self.prompt(seed)
        patches = self.h * self.w
        pixels = np.random.default_rng(seed).standard_normal((patches, PATCH_FEATURES), dtype=np.float32)
        data = {"pixel_values": multimodal_pb2.Tensor(dtype="float32", shape=[patches, PATCH_FEATURES],
                                                      data=pixels.tobytes()),
                "image_grid_thw": multimodal_pb2.Tensor(dtype="int64", shape=[3],
                                                        data=np.array([1, self.h, self.w], np.int64).tobytes())}
        image = multimodal_pb2.MultiModalInput(modality="image", hash=f"{request_id}-{seed}", offset=offset,
                                               length=self.placeholders, data=data)
        return engine_pb2.AddRequest(request_id=request_id, prompt_token_ids=prompt, eos_token_ids=[self.eos],
                                     sampling=engine_pb2.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
                                     mm_inputs=[image])


class Tracker:
    """Admission verdicts and finishes of the requests on one session."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client
        self.verdicts: dict[str, engine_pb2.Admission] = {}
        self.finished: dict[str, tuple[int, str, int]] = {}  # id -> (finish reason, error, tokens)
        self._tokens: dict[str, int] = {}

    def pump(self, until, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out waiting for the control plane")
            try:
                message = self.client.next(timeout=min(left, 5))
            except Exception as e:  # queue.Empty: keep waiting until the deadline
                if isinstance(e, ConnectionError):
                    raise
                continue
            if message.HasField("admission"):
                self.verdicts[message.admission.request_id] = message.admission
                continue
            for out in message.outputs.outputs:
                self._tokens[out.request_id] = self._tokens.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finish_reason:
                    self.finished[out.request_id] = (out.finish_reason, out.error, self._tokens[out.request_id])

    def admitted(self) -> list[str]:
        return [rid for rid, a in self.verdicts.items() if a.verdict == engine_pb2.Admission.VERDICT_ACCEPTED]

    def refused(self) -> list[engine_pb2.Admission]:
        return [a for a in self.verdicts.values() if a.verdict != engine_pb2.Admission.VERDICT_ACCEPTED]


# ---- the phases ----------------------------------------------------------------------------------
def baseline(stack: TappedStack, settle_s: float) -> tuple[dict[str, float], bool]:
    rss = settled_rss(stack.pids, settle_s)
    hwm = all(reset_hwm(pid) for pid in stack.pids.values())
    return rss, hwm


def health(control_text: str) -> dict:
    return {"step_failures": total(control_text, "ttserve_step_failures_total"),
            "migrated": by_label(control_text, "ttserve_request_migrations_total", "outcome"),
            "isolations": by_label(control_text, "ttserve_request_isolations_total", "outcome")}


def memory(stack: TappedStack, base: dict[str, float], peak: dict[str, float], hwm: bool,
           after: dict[str, float]) -> dict:
    return {name: {"baseline_mib": round(base[name], 1), "peak_mib": round(peak[name], 1),
                   "kernel_peak_mib": round(_status(pid, "VmHWM") or math.nan, 1) if hwm else None,
                   "after_mib": round(after[name], 1), "growth_mib": round(peak[name] - base[name], 1)}
            for name, pid in stack.pids.items()}


def step_figures(steps: list[dict], control_before: str, control_after: str, worker_before: str,
                 worker_after: str) -> dict:
    prefill = [s for s in steps if s["kind"] == "STEP_KIND_PREFILL"]
    with_images = [s for s in prefill if s["images"]]
    return {
        "prefill_steps_tapped": len(prefill),
        "prefill_steps_control_metric": total(control_after, "ttserve_steps_total", kind="prefill")
        - total(control_before, "ttserve_steps_total", kind="prefill"),
        "prefill_steps_worker_metric": total(worker_after, "ttserve_device_steps_total", kind="prefill")
        - total(worker_before, "ttserve_device_steps_total", kind="prefill"),
        "steps_tapped": len(steps),
        "images_per_step": [s["images"] for s in with_images],
        "largest_step_mib": round(max((s["bytes"] for s in steps), default=0) / MIB, 2),
        "largest_step_image_mib": round(max((s["image_bytes"] for s in steps), default=0) / MIB, 2),
        "steps_over_48_mib_of_images": sum(s["image_bytes"] > 48 * MIB for s in steps),
        "steps_over_64_mib": sum(s["bytes"] > GRPC_LIMIT for s in steps),
    }


@dataclass
class Run:
    """One phase's stack, samplers and client, with the figures read before any request."""
    stack: "TappedStack"
    sampler: "RssSampler"
    client: ControlClient
    tracker: "Tracker"
    base: dict
    hwm: dict
    control_before: str
    worker_before: str
    first_step: int
    settle_s: float


@contextlib.contextmanager
def measured(tmp: Path, model: Path, control_flags: tuple[str, ...], settle_s: float) -> Iterator[Run]:
    """A tapped stack with an RSS sampler and a client, its baseline taken; closed on the way out."""
    stack = TappedStack(tmp, model, control_flags)
    sampler = RssSampler(stack.pids)
    client = ControlClient(stack.stack.control_address)
    try:
        base, hwm = baseline(stack, settle_s)
        control_before, worker_before = stack.metrics()
        first_step = stack.tap.count()
        sampler.reset()
        yield Run(stack, sampler, client, Tracker(client), base, hwm, control_before, worker_before, first_step,
                  settle_s)
    finally:
        client.close()
        sampler.close()
        stack.close()


def phase_budget(tmp: Path, model: Path, factory: RequestFactory, n: int, rounds: int, settle_s: float) -> dict:
    """`rounds` rounds of N concurrent image requests on one stack with the default
    --max-held-bytes; each round starts once the previous one has finished."""
    with measured(tmp, model, CONTROL_FLAGS, settle_s) as run:
        stack, sampler, client, tracker = run.stack, run.sampler, run.client, run.tracker
        per_round, started = [], time.perf_counter()
        for r in range(rounds):
            round_peak = RssSampler(stack.pids)
            requests = [factory.make(f"big-{r}-{i}", seed=1000 * r + i) for i in range(n)]
            ids = {add.request_id for add in requests}
            for add in requests:
                client.add_request(add)
            del requests
            tracker.pump(lambda: ids <= set(tracker.verdicts) and set(tracker.admitted()) <= set(tracker.finished),
                         900)
            peak_r = round_peak.peak()
            round_peak.close()
            after_r = settled_rss(stack.pids, run.settle_s)
            per_round.append({name: {"peak_mib": round(peak_r[name], 1), "after_mib": round(after_r[name], 1)}
                              for name in stack.pids})
        wall = time.perf_counter() - started
        # Each round's own sampler may catch a spike that this one's 50 ms samples missed.
        peak = {name: max(v, *(r[name]["peak_mib"] for r in per_round)) for name, v in sampler.peak().items()}
        after = settled_rss(stack.pids, run.settle_s)
        control_after, worker_after = stack.metrics()
        steps = stack.tap.since(run.first_step)
        report = {
            "requests": n * rounds, "rounds": rounds, "admitted": len(tracker.admitted()),
            "refused": [a.message for a in tracker.refused()],
            "finished_length": sum(r[0] == FINISH.FINISH_REASON_LENGTH for r in tracker.finished.values()),
            "not_length": {rid: (FINISH.Name(r[0]), r[1]) for rid, r in tracker.finished.items()
                           if r[0] != FINISH.FINISH_REASON_LENGTH},
            "wall_s": round(wall, 1),
            "rss": memory(stack, run.base, peak, run.hwm, after),
            "rss_per_round": per_round,
            "steps": step_figures(steps, run.control_before, control_after, run.worker_before, worker_after),
            "health": health(control_after),
        }
    return report


def phase_held_bytes(tmp: Path, model: Path, factory: RequestFactory, limit: int, cap: int,
                     settle_s: float) -> dict:
    """Requests sent one after another (each once the previous one's verdict is in) until the
    control plane refuses one, on a stack with --max-held-bytes `limit`."""
    with measured(tmp, model, (*CONTROL_FLAGS, "--max-held-bytes", str(limit)), settle_s) as run:
        stack, sampler, client, tracker = run.stack, run.sampler, run.client, run.tracker
        sent, size = [], 0
        for i in range(cap):
            add = factory.make(f"held-{i}", seed=100 + i)
            size = add.ByteSize()
            client.add_request(add)
            sent.append(add.request_id)
            del add
            tracker.pump(lambda: sent[-1] in tracker.verdicts, 120)
            if tracker.refused():
                break
        at_refusal = {"finished_before_refusal": len(tracker.finished)}
        tracker.pump(lambda: set(tracker.admitted()) <= set(tracker.finished), 900)
        peak = sampler.peak()
        after = settled_rss(stack.pids, run.settle_s)
        control_after, worker_after = stack.metrics()
        steps = stack.tap.since(run.first_step)
        refusals = tracker.refused()
        report = {
            "max_held_bytes": limit, "request_mib": round(size / MIB, 2), "sent": len(sent),
            "admitted": len(tracker.admitted()), "refused": len(refusals),
            "refusal": (f"{engine_pb2.Admission.Verdict.Name(refusals[0].verdict)}: {refusals[0].message}"
                        if refusals else None),
            **at_refusal,
            "finished_length": sum(r[0] == FINISH.FINISH_REASON_LENGTH for r in tracker.finished.values()),
            "not_length": {rid: (FINISH.Name(r[0]), r[1]) for rid, r in tracker.finished.items()
                           if r[0] != FINISH.FINISH_REASON_LENGTH},
            "requests_refused_metric": by_label(control_after, "ttserve_requests_refused_total", "reason"),
            "rss": memory(stack, run.base, peak, run.hwm, after),
            "steps": step_figures(steps, run.control_before, control_after, run.worker_before, worker_after),
            "health": health(control_after),
        }
    return report


# ---- the report --------------------------------------------------------------------------------
def problems(name: str, phase: dict) -> list[str]:
    out = []
    if phase["finished_length"] != phase["admitted"] or phase["not_length"]:
        out.append(f"{name}: {phase['admitted']} admitted, {phase['finished_length']} finished with length; "
                   f"others: {phase['not_length']}")
    if phase["health"]["step_failures"]:
        out.append(f"{name}: {phase['health']['step_failures']:g} steps failed")
    if any(phase["health"]["migrated"].values()):
        out.append(f"{name}: requests migrated {phase['health']['migrated']}")
    if phase["steps"]["steps_over_64_mib"]:
        out.append(f"{name}: {phase['steps']['steps_over_64_mib']} step messages over 64 MiB")
    return out


def table(budget: dict, held: dict) -> str:
    rows = [("figure", "phase 1: payload budget", "phase 2: held bytes")]
    for proc in ("control", "worker"):
        for key, label in (("baseline_mib", "baseline RSS"), ("peak_mib", "peak RSS (50 ms samples)"),
                           ("kernel_peak_mib", "peak RSS (VmHWM)"), ("after_mib", "RSS after")):
            rows.append((f"{proc} {label}, MiB", str(budget["rss"][proc][key]), str(held["rss"][proc][key])))
    for i, r in enumerate(budget["rss_per_round"]):
        rows.append((f"round {i + 1}: control / worker peak, MiB",
                     f"{r['control']['peak_mib']} / {r['worker']['peak_mib']}", ""))
        rows.append((f"round {i + 1}: control / worker after, MiB",
                     f"{r['control']['after_mib']} / {r['worker']['after_mib']}", ""))
    rows += [
        ("requests sent", str(budget["requests"]), str(held["sent"])),
        ("admitted", str(budget["admitted"]), str(held["admitted"])),
        ("refused", str(len(budget["refused"])), str(held["refused"])),
        ("finished with length", str(budget["finished_length"]), str(held["finished_length"])),
        ("prefill steps (tap / control / worker)",
         *(f"{p['steps']['prefill_steps_tapped']} / {p['steps']['prefill_steps_control_metric']:g} / "
           f"{p['steps']['prefill_steps_worker_metric']:g}" for p in (budget, held))),
        ("images per prefill step", *(" ".join(map(str, p["steps"]["images_per_step"])) for p in (budget, held))),
        ("largest step message, MiB", str(budget["steps"]["largest_step_mib"]), str(held["steps"]["largest_step_mib"])),
        ("largest step's images, MiB", str(budget["steps"]["largest_step_image_mib"]),
         str(held["steps"]["largest_step_image_mib"])),
        ("step failures", f"{budget['health']['step_failures']:g}", f"{held['health']['step_failures']:g}"),
        ("migrations", str(int(sum(budget["health"]["migrated"].values()))),
         str(int(sum(held["health"]["migrated"].values())))),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6, help="concurrent image requests of phase 1")
    parser.add_argument("--image-mib", type=float, default=20.0, help="pixel_values per image, MiB")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-held-bytes", type=int, default=HELD_BYTES_LIMIT, help="phase 2's control plane")
    parser.add_argument("--rounds", type=int, default=3,
                        help="phase 1 rounds on one stack (RSS after each: growth across rounds is a leak)")
    parser.add_argument("--settle-seconds", type=float, default=1.0,
                        help="idle sampling of each baseline and `after` RSS (the median of 50 ms samples)")
    parser.add_argument("--quick", action="store_true", help="CI: 3 requests in phase 1, 2 rounds, 0.5 s settles")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds, args.settle_seconds = 3, 2, 0.5

    from ttserve.worker.planning.model_prepare import prepare
    from ttserve.worker.planning.tiny_vlm import build

    with tempfile.TemporaryDirectory(prefix="payload-memory-") as scratch:
        tmp = Path(scratch)
        model = tmp / "tiny-vlm-Qwen2.5-VL"
        build(model, prepare("smollm2"))
        factory = RequestFactory(model, args.image_mib, args.max_tokens)
        print(f"image: grid [1, {factory.h}, {factory.w}], pixel_values "
              f"{factory.h * factory.w * PATCH_FEATURES * 4 / MIB:.2f} MiB, {factory.placeholders} placeholder "
              f"tokens; prompt {len(factory.prompt(0)[0])} tokens", flush=True)
        budget = phase_budget(tmp, model, factory, args.requests, args.rounds, args.settle_seconds)
        cap = max(4, 3 * math.ceil(args.max_held_bytes / (factory.h * factory.w * PATCH_FEATURES * 4)))
        held = phase_held_bytes(tmp, model, factory, args.max_held_bytes, cap, args.settle_seconds)
        found = problems("phase 1", budget) + problems("phase 2", held)
        if not held["refused"]:
            found.append(f"phase 2: nothing refused in {held['sent']} requests under --max-held-bytes "
                         f"{args.max_held_bytes}")
        logs = {"control": [], "worker": []}
        if found:
            for log in sorted(tmp.glob("*.log")):
                logs["control" if log.name.startswith("control") else "worker"].append(
                    log.read_text(errors="replace")[-3000:])

    print(json.dumps({"phase_1_payload_budget": budget, "phase_2_held_bytes": held, "problems": found}, indent=2))
    print()
    print(table(budget, held))
    if found:
        for name, texts in logs.items():
            for text in texts:
                print(f"--- {name} log (tail) ---\n{text}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
