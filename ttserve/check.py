"""`ttserve check [flags of ttserve up]`: the preflight an operator runs before a long warmup.

It splits the flags as `ttserve up` does, validates each service's share as that service would
at start-up, and prints the worker's plan (worker/preflight.py: backend, mesh and fabric, model
class, lanes and `tt_data_parallel`, KV budget, the environment the model reads, the `tt`
options and what they switch on) with every problem found. Nothing opens a device or reads a
weight; chips are only counted (a child process, as the worker's start-up does). Exit status 1
when anything would stop start-up, 0 otherwise; missing chips on this host are a warning.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections import Counter
from typing import TextIO

log = logging.getLogger("ttserve.check")


def check(argv: list[str], out: TextIO = sys.stdout) -> int:
    from ttserve.up import split_flags
    from ttserve.worker.preflight import Serving, plan_worker

    up_args, shares = split_flags(argv)
    worker = _parse("worker", shares["worker"])
    control = _parse("control", shares["control"])
    gateway = _parse("gateway", shares["gateway"])
    problems: list[tuple[bool, str]] = []

    from ttserve.control.config import ConfigError, engine_config
    try:
        engine_config(control)
    except ConfigError as e:
        problems.append((True, f"control plane: {e}"))
    problems += _security_problems(worker, gateway)
    ports = Counter(p for p in (up_args.port, up_args.control_port, up_args.worker_port,
                                up_args.control_metrics_port, up_args.worker_metrics_port) if p)
    problems += [(True, f"port {port} is given to {n} services") for port, n in ports.items() if n > 1]

    serving = Serving(data_parallel_size=control.data_parallel_size, max_num_seqs=control.max_num_seqs,
                      max_model_len=max(control.max_model_len, 0), enable_prefix_caching=control.enable_prefix_caching)
    plan = plan_worker(worker, serving=serving, need_hardware=False)
    problems += [(p.fatal, f"worker: {p.text}") for p in plan.problems]
    if plan.model_path is not None:
        problems += [(True, f"gateway: {p}") for p in _gateway_problems(gateway, str(plan.model_path),
                                                                     max(control.max_model_len, 0) or int(
                                                                         plan.hf_config.get("max_position_embeddings", 2048)))]

    print("ttserve check: the plan (no device opened, no weights read)", file=out)
    for line in plan.lines:
        print(f"  {line}", file=out)
    for fatal, text in problems:
        print(f"{'error' if fatal else 'warning'}: {text}", file=out)
    errors = sum(fatal for fatal, _ in problems)
    if errors:
        print(f"ttserve check: {errors} problem(s) would stop start-up", file=out)
        return 1
    verified = "" if plan.hardware_verified or plan.backend != "ttnn" else " (plan not verified against hardware)"
    print(f"ttserve check: nothing found that would stop start-up{verified}", file=out)
    return 0


def _parse(service: str, tokens: list[str]) -> argparse.Namespace:
    module = importlib.import_module(f"ttserve.{service}.config")
    parser = argparse.ArgumentParser(prog=f"ttserve check ({service})")
    module.add_arguments(parser)
    parse = getattr(module, "parse_args", None)
    return parse(parser, tokens) if parse else parser.parse_args(tokens)


def _security_problems(worker: argparse.Namespace, gateway: argparse.Namespace) -> list[tuple[bool, str]]:
    """Certificates, keys and exposure, as the worker's and the gateway's start-up check them
    (the control plane's: engine_config)."""
    from ttserve.gateway.config import resolve_security
    from ttserve.gateway.server import StartupError
    from ttserve.worker.config import ConfigRefused, worker_tls

    problems = []
    try:
        worker_tls(worker)
    except ConfigRefused as e:
        problems.append((True, f"worker: {e}"))
    try:
        resolve_security(gateway)
    except StartupError as e:
        problems.append((True, f"gateway: {e}"))
    return problems


def _gateway_problems(args: argparse.Namespace, model: str, max_model_len: int) -> list[str]:
    """The gateway's vLLM frontend arguments, as its start-up builds and validates them."""
    import importlib.util
    if importlib.util.find_spec("vllm") is None:  # a worker-only host: checked where it runs
        log.info("gateway flags not checked here: vLLM is not installed")
        return []
    from ttserve.gateway import server, vllm_compat
    from ttserve.v1 import engine_pb2
    logging.getLogger("vllm").setLevel(logging.ERROR)  # its import-time notes are not the plan
    try:
        vllm_compat.prepare()
        vllm_args = server.parse_vllm_args(server.vllm_argv(args, args.model or model,
                                                            engine_pb2.ModelInfo(max_model_len=max_model_len)))
        server.check_vllm_server_args(vllm_args)
    except server.StartupError as e:
        return [str(e)]
    return []
