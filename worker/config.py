"""Worker flags (names follow vLLM's), backend choice and start-up."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping

from ttserve.tls import Tls, TlsConfigError, grpc_server_tls
from ttserve.exit_status import CONFIG_REFUSED
from ttserve.malloc_arenas import cap_malloc_arenas
from ttserve.tls import add_arguments as add_tls_arguments
from ttserve.tracing import Tracer, TracingUnavailable
from ttserve.tracing import add_arguments as add_tracing_arguments

from .backends.torch.dtype import DTYPE_CHOICES, resolve_dtype

log = logging.getLogger("ttserve.worker")


# Iterations an OpenMP thread spins at the end of a parallel region before it sleeps (run()).
SPIN_COUNT = 10_000


def cpu_threads(env: Mapping[str, str] = os.environ) -> int:
    """OMP_NUM_THREADS when it is set to a positive count (as torch itself honours it), else one
    intra-op thread per core this process may run on: torch's default counts every core of the
    host, and a worker pinned (taskset, cgroup cpuset) to fewer would oversubscribe them."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1



class ConfigRefused(RuntimeError):
    """The worker cannot start as configured; one line says why."""




def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("device worker")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=50061, help="gRPC port of device.proto")
    g.add_argument("--model", default="smollm2",
                   help="a local Hugging Face folder, or an embedded model name (smollm2)")
    g.add_argument("--backend", default="auto", choices=("auto", "torch", "ttnn", "sim"),
                   help="auto: ttnn when it imports and chips are present, else torch")
    g.add_argument("--device", default="cpu", help="torch device of the torch backend (cpu, cuda)")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights, activations and KV dtype of the torch backend (auto: bfloat16 on "
                        "a CPU with native bf16 or a bf16 GPU, float16 on other GPUs, else float32)")
    g.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    g.add_argument("--batch-invariant", action="store_true",
                   default=os.environ.get("VLLM_BATCH_INVARIANT") == "1",
                   help="every request's logits the same bits whatever shares its steps (batch "
                        "size, order, speculative decoding's verify rows), as vLLM's "
                        "VLLM_BATCH_INVARIANT=1 (which also turns it on): torch backend on a CPU "
                        "in bf16/fp16 with vLLM CPU's kernels; costs 0-8%% per decode step")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                   help="KV cache budget over all lanes, bytes")
    g.add_argument("--additional-config", default=None,
                   help='device options, e.g. \'{"tt": {"trace_mode": "all"}}\'')
    g.add_argument("--num-threads", type=int, default=0, metavar="N",
                   help="torch CPU threads for the model (0: OMP_NUM_THREADS if set, else one per "
                        "core this process may run on, os.sched_getaffinity); give each of several workers on one host its "
                        "share of the cores")
    g.add_argument("--metrics-port", type=int, default=9402,
                   help="HTTP port of /metrics, /health and /ready on --metrics-host (0: none)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDRESS",
                   help="address of the --metrics-port server, which takes no key: loopback by "
                        "default, whatever --host is; 0.0.0.0 where Prometheus or a health probe "
                        "reaches it from another host or container (keep it off public networks)")
    g.add_argument("--shutdown-timeout", type=int, default=30, metavar="SECONDS",
                   help="on SIGTERM, how long the control plane may go on stepping before the "
                        "worker stops")
    g.add_argument("--sim-profile", default="galaxy-llama-3.3-70b",
                   help="step-time profile of --backend sim (see ttserve.worker.backends.sim.model.PROFILES)")
    add_tls_arguments(g, role="nobody (a worker calls no service)")
    add_tracing_arguments(g)
    g.add_argument("--control-identity", default=None, metavar="NAME",
                   help="with mutual TLS: the name (certificate CN or SAN) the control plane's "
                        "certificate must carry; Warmup and Step from any other certificate are "
                        "refused, so a gateway holding a certificate of the same CA cannot drive "
                        "the device (default: any certificate --ssl-ca-certs signed)")


def worker_tls(args: argparse.Namespace) -> Tls:
    """The worker's TLS, refused (ConfigRefused) as start-up refuses every bad flag."""
    try:
        tls = grpc_server_tls(args, "worker")
    except TlsConfigError as e:
        raise ConfigRefused(str(e)) from None
    if args.control_identity and not tls.mutual:
        raise ConfigRefused("--control-identity needs mutual TLS (--ssl-certfile, --ssl-keyfile and "
                            "--ssl-ca-certs): without client certificates there is no identity to check")
    return tls


def build_service(args: argparse.Namespace, control_identity: str | None = None):
    """The worker as the plan says (worker/planning/preflight.py): every check `ttserve check` makes runs
    here first, and any problem that would stop start-up stops it now, before a device opens."""
    from .planning.preflight import plan_worker

    plan = plan_worker(args)
    if plan.model_path is None and not plan.fatal:
        # An embedded model not converted yet: the plan left its model checks to start-up. Convert
        # it now (the one step that writes the cache), then plan again with the folder there.
        from .planning.model_prepare import ModelPrepareError, resolve_model

        try:
            resolve_model(args.model)
        except ModelPrepareError as e:
            raise ConfigRefused(str(e)) from None
        plan = plan_worker(args)
    for warning in plan.warnings:
        log.warning("%s", warning)
    if plan.fatal:
        for problem in plan.fatal[:-1]:
            log.error("%s", problem)
        raise ConfigRefused(plan.fatal[-1])
    try:
        tracer = Tracer.otlp(args.otlp_traces_endpoint, "worker")
    except TracingUnavailable as e:
        raise ConfigRefused(str(e)) from None
    # After the plan: a refusal that needs no torch (flags, files, a missing ttnn) comes without
    # loading it (~2 CPU-s of imports).
    import torch

    from .backends.sim.model import PROFILES, SimModel
    from .backends.torch.backend import TorchBackend
    from .runner import DeviceOptions, ModelRunner
    from .server import DeviceService

    threads = args.num_threads or cpu_threads()
    torch.set_num_threads(threads)
    options, model_cls, device = plan.options, plan.model_cls, torch.device(args.device)
    # torch traces decode as a CUDA graph on CUDA (unless tt.trace_mode is "none"); on a CPU
    # only when tt.trace_mode asks, running the trace's static shapes eagerly (every row,
    # the whole page table: slower than computing live rows, meant to check that path).
    device_options = DeviceOptions(options, backend_traces=device.type == "cuda" or "trace_mode" in options,
                                   traced_kinds=frozenset({"decode"}))
    device_name = str(device)
    dtype, dtype_why = resolve_dtype(args.dtype, device)
    if plan.backend == "sim":
        profile = PROFILES[args.sim_profile]
        model_cls = SimModel.for_profile(profile)
        device_name = f"sim {profile.name} ({profile.description})"
        device_options = DeviceOptions(options, backend_traces=True, kv_tokens_per_lane=profile.kv_tokens_per_lane)
    elif plan.backend == "ttnn":
        device_name = f"mesh {plan.mesh.name} {plan.mesh.shape}"
        device_options = DeviceOptions(options, backend_traces=True)
    if plan.backend == "ttnn":
        from .backends.ttnn.backend import TtnnBackend

        backend = TtnnBackend(plan.mesh, options, variant=plan.entry.variant, cluster=plan.chips.cluster)
    else:  # the reference models and the sim's
        backend = TorchBackend(device, dtype, device_options.traced, batch_invariant=args.batch_invariant)
    waits = (f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}" if os.environ.get("OMP_WAIT_POLICY")
             else f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}")  # how threads wait (run())
    log.info("backend %s (%s); model %s (%s) on %s; dtype %s (%s); %d CPU threads (%s); tt options %s",
             plan.backend, plan.backend_reason, plan.model_path, plan.architecture, device_name,
             str(dtype).removeprefix("torch."), dtype_why, threads, waits, options or "none")
    runner = ModelRunner(plan.model_path, model_cls, plan.architecture, backend, dtype,
                         args.block_size, args.kv_cache_memory_bytes, device_options)
    return DeviceService(runner, plan.backend, device_name, control_identity=control_identity, tracer=tracer)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """argparse plus the dotted `--additional-config.tt.KEY VALUE` form, which argparse cannot
    declare (the keys are open-ended)."""
    from .planning.options import OptionError, split_additional_config

    try:
        rest, dotted = split_additional_config(sys.argv[1:] if argv is None else argv)
    except OptionError as e:
        parser.error(str(e))
    args = parser.parse_args(rest)
    args.additional_config_dotted = dotted
    return args


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the exit status: 0 after the signal's drain, 2 when the flags
    or files are refused (argparse's status too: a restart cannot help, systemd's
    RestartPreventExitStatus=2), 1 for anything a restart may fix (its port taken, a crash)."""
    # Before torch loads libgomp: an OpenMP thread that finishes a parallel region spins for
    # GOMP_SPINCOUNT iterations before it sleeps. A decode step is ~360 small parallel regions
    # (5 GEMMs, attention, norms, RoPE per layer), one right after another, and waking a
    # sleeping thread costs tens of us on a VM: sleeping at once (PASSIVE) made a 32-row SmolLM2
    # step 47 -> 72 ms on 2 cores. Spinning long costs the most when another process keeps one
    # of the cores busy, as each barrier waits out the peer's time slices (32 rows beside a
    # busy-looping process: 72-79 ms passive, 85 ms at 2,000, 155 ms at 10,000, 199 ms at
    # 20,000, 491 ms at libgomp's default 300,000). Under `ttserve up` driven by `vllm bench
    # serve` (benchmarks/vs_vllm.py), 10,000 with every thread in every step served c=8/32 at
    # 283/540 tok/s, against 178/385 passive with decodes of <= 8 rows on one thread (the
    # setting before). An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    cap_malloc_arenas()  # before torch's and gRPC's threads start
    try:
        tls = worker_tls(args)  # before the model loads: a bad certificate path fails in a second
        service = build_service(args, args.control_identity)
    except ConfigRefused as e:
        log.error("%s", e)
        return CONFIG_REFUSED
    return asyncio.run(_serve(service, args, tls))


async def _serve(service, args: argparse.Namespace, tls: Tls) -> int:
    """Serve until SIGTERM/SIGINT, then drain: refuse new streams, let the control plane finish
    its steps (up to --shutdown-timeout), and exit 0."""
    from ttserve.grpc_service import run_service
    from ttserve.ops_http import OpsEndpoints

    from .server import serve

    endpoints = OpsEndpoints(service.metrics.registry,
                             health=lambda: (not service.draining, "the worker is shutting down"),
                             ready=lambda: (service.ready, service.not_ready_reason))
    try:
        ok = await run_service(serve(service, args.host, args.port, tls), (args.metrics_host, args.metrics_port),
                               endpoints, "worker", lambda: service.drain(args.shutdown_timeout))
    finally:
        service.runner.close()  # the model and its traces first, then the mesh and its fabric
        service.tracing.tracer.shutdown()  # the last steps' spans
    return 0 if ok else 1
