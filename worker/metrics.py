"""The worker's Prometheus metrics (catalog: docs/metrics.md): what the device did, as the
device saw it. Recorded from the step threads; prometheus_client metrics are thread-safe."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .batch import StepResult

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(self, backend: str, device: str, architecture: str) -> None:
        self.registry = r = CollectorRegistry()
        Gauge("ttserve_device_info", "What this worker runs (always 1).",
              ["backend", "device", "architecture"], registry=r).labels(backend, device, architecture).set(1)
        self.ready = Gauge("ttserve_device_ready", "1 once warmup has finished.", registry=r)
        self.warmup_progress = Gauge("ttserve_device_warmup_progress",
                                     "Completed / total of the current warmup phase, 0-1.", registry=r)
        self.warmup_shapes = Counter("ttserve_device_warmup_shapes",
                                     "Warmup shapes done, by phase (compile, capture).", ["phase"],
                                     registry=r)
        self.step_seconds = Histogram("ttserve_device_step_seconds",
                                      "A step's device time, launch to sampled tokens on the host.",
                                      ["kind"], buckets=STEP_BUCKETS, registry=r)
        self.steps = Counter("ttserve_device_steps", "Steps run, traced or eager.",
                             ["kind", "execution"], registry=r)
        self.sampling = Counter("ttserve_device_sampling_batches",
                                "Batches sampled on the device or on the host.", ["path"], registry=r)
        self.kv_blocks = Gauge("ttserve_device_kv_cache_blocks", "KV blocks per lane this worker holds.",
                               registry=r)
        self.draining = Gauge("ttserve_device_draining", "1 once SIGTERM arrived.", registry=r)

    def warmup(self, phase: str, completed: int, total: int) -> None:
        if total:
            self.warmup_progress.set(completed / total)
        if phase in ("compile", "capture") and completed:
            self.warmup_shapes.labels(phase).inc()

    def step(self, kind: str, result: StepResult) -> None:
        self.steps.labels(kind, "traced" if result.traced else "eager").inc()
        self.step_seconds.labels(kind).observe(result.total_s)
        if kind != "empty":
            self.sampling.labels("device" if result.sampled_on_device else "host").inc()
