"""Control-plane flags (names follow vLLM's) and start-up."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from ttserve.exit_status import CONFIG_REFUSED
from ttserve.tls import TlsConfigError, grpc_server_tls
from ttserve.tls import add_arguments as add_tls_arguments
from ttserve.tracing import Tracer, TracingUnavailable, detailed_modules
from ttserve.tracing import add_arguments as add_tracing_arguments

from .engine import Engine
from .engine_config import EngineConfig
from .metrics import ControlMetrics
from .request_trace import RequestTracing
from .queue_bounds import DEFAULT_MAX_HELD_BYTES, DEFAULT_TENANT_SHARE, QueueBounds
from .speculation import SpeculativeConfigError, parse_speculative_config
from .worker_set import WorkerSetError, WorkerSpec, combine, follow_file, parse_entry, parse_file

log = logging.getLogger("ttserve.control")


class ConfigError(ValueError):
    """A flag value the control plane refuses at start-up."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("control plane")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=50051, help="gRPC port of engine.proto")
    g.add_argument("--worker", action="append", default=None, metavar="[NAME=]HOST:PORT",
                   help="a device worker, repeatable: each worker's lanes join the pool. NAME (default "
                        "HOST:PORT) labels its metrics; HOST may be a DNS name, resolved again on every "
                        "reconnect (default 127.0.0.1:50061 unless --workers-file is given)")
    g.add_argument("--workers-file", default=None, metavar="PATH",
                   help="more workers, one [NAME=]HOST:PORT a line (# comments), read again on SIGHUP "
                        "and whenever the file changes: workers listed join while serving, workers "
                        "no longer listed are drained (their requests move to the others) and dropped")
    g.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once, per lane")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill tokens per step; longer prompts are prefilled in chunks (default: 1024 "
                        "for a worker computing on a CPU, 2048 otherwise)")
    g.add_argument("--max-model-len", type=int, default=0,
                   help="longest sequence (prompt + output); default (0) the model's own limit, "
                        "lowered with a warning to what one lane's KV cache holds; -1: fit one "
                        "request to a lane's whole KV cache")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse KV blocks of shared prompt prefixes (if the model supports it)")
    g.add_argument("--max-consecutive-prefill-steps", type=int, default=None,
                   help="prefill steps in a row while decodes wait: bounds the stall of streaming "
                        "requests during bursts of long prompts (default: 2048 prefill tokens' worth "
                        "of steps, at least 2; benchmarks/phase_policy.py, 512-token steps against "
                        "unbounded: 2 cut the worst stall 15x for +5.5%% burst TTFT, 4 7.8x for +2.4%%)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="pipeline decode steps (two in flight) when the worker supports async "
                        "decode; default: whenever it does")
    g.add_argument("--speculative-config", default="", metavar="JSON",
                   help="speculative decoding, as vLLM spells it: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": K, \"prompt_lookup_min\": a, \"prompt_lookup_max\": b}': "
                        "each decode row carries up to K tokens proposed from the request's own prompt "
                        "and output (the n-gram of a..b tokens ending it, where it occurred before), "
                        "verified by the worker in the same step; greedy output is unchanged, sampled "
                        "output keeps its distribution (rejection sampling)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="lanes (data-parallel KV caches) per worker; --max-num-seqs is per lane")
    g.add_argument("--tokenizer", default="", metavar="PATH",
                   help="the model's tokenizer.json (or its folder), read to enforce structured "
                        "outputs; default: the folder of the model the first worker serves")
    g.add_argument("--metrics-port", type=int, default=9401,
                   help="HTTP port of /metrics, /health and /ready on --metrics-host (0: none)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDRESS",
                   help="address of the --metrics-port server, which takes no key: loopback by "
                        "default, whatever --host is; 0.0.0.0 where Prometheus or a health probe "
                        "reaches it from another host or container (keep it off public networks)")
    g.add_argument("--vllm-metric-names", action=argparse.BooleanOptionalAction, default=False,
                   help="also serve, on /metrics, each series that has a vLLM counterpart under vLLM's "
                        "name and labels (vllm:X{model_name, engine}; docs/metrics.md), so vLLM's Grafana "
                        "dashboard and scrapers read it unchanged; Prometheus reserves ':' for recording "
                        "rules (promtool check metrics refuses it), hence off by default")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API, as given to the gateway: the first is the "
                        "model_name label of --vllm-metric-names (default: the model folder's name, the "
                        "gateway's default; `ttserve up` gives this flag to both)")
    g.add_argument("--shutdown-timeout", type=int, default=30, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may run before they are aborted")
    g.add_argument("--stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a worker holding a step this long without a result is stalled: it is "
                        "treated as lost (its requests migrate, see --migration-limit) and taken back "
                        "once it answers again")
    g.add_argument("--warmup-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="how long one warmup of a worker may take (weights, KV cache, compiles and "
                        "trace captures) before the control plane gives up and reconnects")
    g.add_argument("--max-num-queued-reqs", type=int, default=1024, metavar="N",
                   help="requests waiting (over all lanes and workers) beyond which new ones are refused "
                        "with RESOURCE_EXHAUSTED (HTTP 503 with Retry-After): bounds memory and queueing "
                        "time under a burst")
    g.add_argument("--max-held-bytes", type=int, default=DEFAULT_MAX_HELD_BYTES, metavar="BYTES",
                   help="bytes of prompts and images the live requests may hold here (each counted at "
                        "its request's wire size) beyond which new ones are refused like an overload "
                        "(default 4 GiB)")
    g.add_argument("--tenant-queue-share", type=float, default=DEFAULT_TENANT_SHARE, metavar="FRACTION",
                   help="of --max-num-queued-reqs and of --max-held-bytes, what one tenant (the gateway's "
                        "name for an API key) may take; its requests past it are refused (HTTP 503 with "
                        "Retry-After) while other tenants are still admitted; 1: no per-tenant bound")
    g.add_argument("--migration-limit", type=int, default=3, metavar="N",
                   help="when a worker is lost, its requests move to another ready worker (or to it "
                        "once it is back) and recompute from prompt + the tokens they have, at most N "
                        "times each; 0: they fail with the worker")
    g.add_argument("--migration-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="how long a migrating request waits for a ready worker before it fails")
    add_tls_arguments(g, role="the workers")
    add_tracing_arguments(g, detailed=True)
    g.add_argument("--tensor-parallel-size", type=int, default=1, help=argparse.SUPPRESS)
    g.add_argument("--pipeline-parallel-size", type=int, default=1, help=argparse.SUPPRESS)


def flagged_workers(args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    return tuple(parse_entry(entry) for entry in args.worker or ())


def initial_workers(args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    """--worker's workers and those the --workers-file lists at start-up (which must be readable:
    a file that cannot be read at start is a configuration error, later it only keeps the set)."""
    flagged = list(flagged_workers(args))
    if args.workers_file:
        try:
            listed = parse_file(Path(args.workers_file))
        except OSError as e:
            raise WorkerSetError(f"--workers-file {args.workers_file}: cannot read it ({e.strerror or e})") from None
        return combine(flagged + listed)
    return combine(flagged or [parse_entry("127.0.0.1:50061")])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, flag) != 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not supported: "
                              "parallelism on Tenstorrent lives in the mesh; set MESH_DEVICE on the worker")
    if args.max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be a positive per-lane count, got {args.max_num_seqs}")
    if args.max_model_len < -1:
        raise ConfigError(f"--max-model-len must be a token count, 0 (the model's own limit) or -1 (fit "
                          f"to the KV cache), got {args.max_model_len}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ConfigError(f"--max-num-batched-tokens must be positive, got {args.max_num_batched_tokens}")
    if args.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be a positive number of lanes per worker, "
                          f"got {args.data_parallel_size}")
    try:
        workers = initial_workers(args)
    except WorkerSetError as e:
        raise ConfigError(str(e)) from None
    if args.stall_timeout <= 0:
        raise ConfigError(f"--stall-timeout must be positive seconds, got {args.stall_timeout}")
    if args.warmup_timeout <= 0:
        raise ConfigError(f"--warmup-timeout must be positive seconds, got {args.warmup_timeout}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
    if not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be a port number (0: none), got {args.metrics_port}")
    if args.max_num_queued_reqs < 1:
        raise ConfigError(f"--max-num-queued-reqs must be a positive count, got {args.max_num_queued_reqs}")
    if args.max_held_bytes < 1:
        raise ConfigError(f"--max-held-bytes must be a positive number of bytes, got {args.max_held_bytes}")
    if not 0 < args.tenant_queue_share <= 1:  # NaN fails it too
        raise ConfigError(f"--tenant-queue-share must be a fraction in (0, 1], got {args.tenant_queue_share}")
    if args.migration_limit < 0 or args.migration_timeout <= 0:
        raise ConfigError(f"--migration-limit must be 0 or more and --migration-timeout positive seconds, got "
                          f"{args.migration_limit} and {args.migration_timeout}")
    if args.max_consecutive_prefill_steps is not None and args.max_consecutive_prefill_steps < 1:
        raise ConfigError("--max-consecutive-prefill-steps must be at least 1, got "
                          f"{args.max_consecutive_prefill_steps}")
    try:
        tls = grpc_server_tls(args, "control plane")
    except TlsConfigError as e:
        raise ConfigError(str(e)) from None
    try:
        speculative = parse_speculative_config(args.speculative_config)
    except SpeculativeConfigError as e:
        raise ConfigError(str(e)) from None
    return EngineConfig(workers=workers, workers_file=args.workers_file or "", tls=tls, max_num_seqs=args.max_num_seqs,
                        data_parallel_size=args.data_parallel_size,
                        max_num_batched_tokens=args.max_num_batched_tokens or 0,
                        max_model_len=args.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching,
                        async_scheduling=args.async_scheduling,
                        max_consecutive_prefills=args.max_consecutive_prefill_steps or 0,
                        tokenizer=args.tokenizer, stall_timeout_s=args.stall_timeout,
                        warmup_timeout_s=args.warmup_timeout,
                        queue=QueueBounds(args.max_num_queued_reqs, args.max_held_bytes, args.tenant_queue_share),
                        migration_limit=args.migration_limit, migration_timeout_s=args.migration_timeout,
                        speculative=speculative)


def run(args: argparse.Namespace) -> int:
    try:
        config = engine_config(args)
        tracing = request_tracing(args)
    except (ConfigError, TracingUnavailable) as e:
        log.error("%s", e)
        return CONFIG_REFUSED
    try:
        return asyncio.run(_serve(config, args, tracing))
    finally:
        tracing.tracer.shutdown()  # the last requests' spans, exported before the process exits


def request_tracing(args: argparse.Namespace) -> RequestTracing:
    """--otlp-traces-endpoint and --collect-detailed-traces (vLLM's spellings) as the engine's
    request tracing; TracingUnavailable without the OpenTelemetry SDK."""
    try:
        modules = detailed_modules(args.collect_detailed_traces)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if modules and not args.otlp_traces_endpoint:
        raise ConfigError("--collect-detailed-traces needs --otlp-traces-endpoint (where the traces go)")
    tracer = Tracer.otlp(args.otlp_traces_endpoint, "control")
    # vLLM's "model" (forward timings) and "worker" both mean the worker's step spans here,
    # which carry the model's time of the step.
    return RequestTracing(tracer, worker_steps=bool(modules))


async def _serve(config: EngineConfig, args: argparse.Namespace, tracing: RequestTracing) -> int:
    """Serve until SIGTERM/SIGINT, then drain: refuse new requests, finish (or after
    --shutdown-timeout abort) the ones held, and exit 0."""
    from ttserve.grpc_service import run_service
    from ttserve.ops_http import OpsEndpoints

    from .server import serve

    metrics = ControlMetrics(args.vllm_metric_names, args.served_model_name[0] if args.served_model_name else "")
    engine = Engine(config, metrics, tracing=tracing)

    async def drain() -> None:
        await engine.drain(args.shutdown_timeout)
        engine.close_sessions()

    endpoints = OpsEndpoints(engine.metrics.registry,
                             health=lambda: (not engine.draining, "the control plane is shutting down"),
                             ready=lambda: (engine.ready, engine.not_ready_reason))
    runner = asyncio.create_task(engine.run())
    reread = asyncio.Event()
    # SIGHUP re-reads --workers-file (systemd's ExecReload); without one there is nothing to
    # reload, which is said rather than the default of dying.
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reread.set if config.workers_file else lambda: log.info(
        "SIGHUP: nothing to reload (SIGHUP re-reads --workers-file, and none is given)"))
    follower = asyncio.create_task(follow_file(
        Path(config.workers_file), flagged_workers(args), config.workers,
        engine.set_workers, reread)) if config.workers_file else None
    try:
        if not await run_service(serve(engine, args.host, args.port, config.tls), (args.metrics_host, args.metrics_port),
                                 endpoints, "control plane", drain, engine.fatal):
            return 1
    finally:
        runner.cancel()
        if follower is not None:
            follower.cancel()
    if engine.fatal.done():
        log.error("%s", engine.fatal.result())
        return 1
    return 0
