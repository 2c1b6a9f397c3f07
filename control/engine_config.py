"""The control plane's flags as the engine reads them. What it serves with, once a worker has
described itself, is decided from these in one place: control/serving_plan.py."""
from __future__ import annotations

from dataclasses import dataclass

from ttserve.tls import PLAINTEXT, Tls

from .queue_bounds import QueueBounds
from .speculation import SpeculativeConfig
from .worker_set import WorkerSpec


@dataclass(slots=True, frozen=True)
class EngineConfig:
    workers: tuple[WorkerSpec, ...]   # at start-up; --workers-file may change the set later
    workers_file: str = ""            # re-read on SIGHUP and when it changes ("" = none)
    max_num_seqs: int = 32            # per lane
    max_num_batched_tokens: int = 0   # 0: the worker's device's default (ttserve/batched_tokens.py)
    max_model_len: int = 0            # 0 = the model's own limit, capped by KV capacity; -1 = a lane's KV
    data_parallel_size: int = 1       # lanes per worker
    enable_prefix_caching: bool = False
    max_consecutive_prefills: int = 0  # 0: from the prefill budget (control/phase.py default_streak)
    async_scheduling: bool | None = None  # None: whenever the worker supports async decode
    reconnect_interval_s: float = 1.0
    tokenizer: str = ""               # for grammars; "" = the first worker's model folder
    stall_timeout_s: float = 60.0     # a step in flight this long without a result: stalled, lost
    warmup_timeout_s: float = 1800.0  # one Warmup call, end to end
    queue: QueueBounds = QueueBounds()  # what waiting and held requests may take (queue_bounds.py)
    migration_limit: int = 3          # times a request may move off a lost worker
    migration_timeout_s: float = 120.0  # how long a migrating request may wait for a ready worker
    tls: Tls = PLAINTEXT              # served to clients and presented to workers (ttserve/tls.py)
    speculative: SpeculativeConfig | None = None  # --speculative-config (control/speculation.py)
