"""`ttserve check [flags of ttserve up]`: the preflight an operator runs before a long warmup.

It splits the flags as `ttserve up` does, validates each service's share as that service would
at start-up, and prints the worker's plan (worker/planning/preflight.py: backend, mesh and fabric,
model class, lanes and `tt_data_parallel`, KV budget, the environment the model reads, the `tt`
options and what they switch on) with every problem found, the control plane's judgement of that
worker among them (control/serving_plan.py: what it would ask the worker to warm up for). Nothing
opens a device or reads a weight; chips are only counted (a child process, as the worker's
start-up does). Exit status 1 when anything would stop start-up, 0 otherwise; missing chips on
this host are a warning.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections import Counter
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ttserve.control.engine_config import EngineConfig
    from ttserve.control.wire import WorkerDescription
    from ttserve.worker.planning.preflight import WorkerPlan

log = logging.getLogger("ttserve.check")


def check(argv: list[str], out: TextIO | None = None) -> int:
    """The report goes to `out`, by default sys.stdout as it is at the call (not at import: a
    caller that redirects sys.stdout gets the report)."""
    from ttserve.up import split_flags
    from ttserve.worker.planning.preflight import Serving, plan_worker

    out = sys.stdout if out is None else out
    up_args, shares = split_flags(argv)
    worker = _parse("worker", shares["worker"])
    control = _parse("control", shares["control"])
    gateway = _parse("gateway", shares["gateway"])
    problems: list[tuple[bool, str]] = []

    from ttserve.control.config import ConfigError, engine_config
    config = None
    try:
        config = engine_config(control)
    except ConfigError as e:
        problems.append((True, f"control plane: {e}"))
    problems += _security_problems(worker, gateway)
    ports = Counter(p for p in (up_args.port, up_args.control_port, up_args.worker_port,
                                up_args.control_metrics_port, up_args.worker_metrics_port) if p)
    problems += [(True, f"port {port} is given to {n} services") for port, n in ports.items() if n > 1]

    from ttserve.batched_tokens import default_batched_tokens

    serving = Serving(data_parallel_size=control.data_parallel_size, max_num_seqs=control.max_num_seqs,
                      max_model_len=max(control.max_model_len, 0), enable_prefix_caching=control.enable_prefix_caching,
                      max_num_batched_tokens=control.max_num_batched_tokens or 0)
    plan = plan_worker(worker, serving=serving, need_hardware=False)
    # What the control plane will ask for: the flag, else its default for the worker's device.
    batched = control.max_num_batched_tokens or default_batched_tokens(plan.backend, str(worker.device))
    problems += [(p.fatal, f"worker: {p.text}") for p in plan.problems]
    if plan.model_path is not None:
        described = _description(plan, config.workers[0].address if config and config.workers else "",
                                 str(worker.device) if plan.backend == "torch" else "")
        max_model_len, judged = _serving_problems(config, described)
        problems += judged
        plan.lines.append(_speculation_line(config, described))
        # The longest chunk the scheduler plans (serving_plan: at least a block).
        chunk = max(batched, plan.block_size)
        plan.lines += _kv_budget_lines(described, max_model_len, chunk, control.max_num_seqs)
        problems += [(True, f"gateway: {p}") for p in _gateway_problems(gateway, str(plan.model_path), max_model_len)]

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


def _description(plan: WorkerPlan, address: str, device: str) -> WorkerDescription:
    """The worker as it would describe itself before warmup (worker/server.py's Describe), made
    from its plan (`device`: a torch worker's, "" else): what the control plane's serving plan reads."""
    from ttserve.control.wire import WorkerDescription
    from ttserve.worker.planning.registry import mixture_of_experts

    config = plan.hf_config
    known = plan.model_cls is not None
    caps = dict(getattr(plan.model_cls, "model_capabilities", None) or {}) if known else {}
    architectures = config.get("architectures") or [""]
    return WorkerDescription(
        address=address or "(the worker)", backend=plan.backend, device=device, model_path=str(plan.model_path),
        architecture=plan.architecture or architectures[0], vocab_size=int(config.get("vocab_size") or 0),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)), eos_token_ids=[],
        # A class not importable here is not judged on what it declares (as the worker's plan).
        supports_chunked_prefill=caps.get("supports_chunked_prefill", not known),
        supports_prefix_caching=caps.get("supports_prefix_caching", not known),
        single_execute_lanes=plan.lanes_in_process,
        mixture_of_experts=mixture_of_experts(config),
        num_blocks_per_lane=plan.num_blocks_per_lane, block_size=plan.block_size, kv_windows=plan.kv_windows or (0,),
        # The torch backend verifies drafts with the class's verify_forward; no tt-metal class has one.
        supports_speculative_decoding=plan.backend == "torch" and callable(getattr(plan.model_cls, "verify_forward", None)))


def _speculation_line(config: EngineConfig | None, d: WorkerDescription) -> str:
    """Whether decode steps will verify n-gram drafts, and why not."""
    spec = config.speculative if config is not None else None
    if spec is None:
        state = "off (no --speculative-config)"
    elif not d.supports_speculative_decoding:
        why = ("ttserve does not drive the TT plugin's speculative contract (supports_spec_decode, spec_plan, "
               "decode_forward over [B, 1 + K]) yet" if d.backend == "ttnn" else "no verify_forward")
        state = (f"off: {d.architecture} on the {d.backend} backend cannot verify draft tokens ({why}); "
                 f"--speculative-config ({spec.describe()}) is ignored")
    else:
        state = f"on: {spec.describe()}; decode steps are not pipelined"
    return f"{'speculation:':<14}{state}"


def _kv_budget_lines(d: WorkerDescription, max_model_len: int, chunk: int, max_num_seqs: int) -> list[str]:
    """Each KV group's share of a lane's blocks (where the plan knows them: the torch backend):
    what one max_model_len sequence holds in it, and how many such sequences the lane holds."""
    from ttserve.control.serving_plan import lane_capacity, sequence_blocks

    if not d.num_blocks_per_lane:
        return []
    capacity = lane_capacity(d, chunk)
    length = min(max_model_len, capacity) or d.block_size
    per_group = sequence_blocks(d.kv_windows, d.block_size, length, chunk)
    lines = [f"{'kv budget:':<14}one {length}-token sequence holds {sum(per_group)} of the lane's "
             f"{d.num_blocks_per_lane} blocks; {d.num_blocks_per_lane // max(sum(per_group), 1)} such sequences fit "
             f"(--max-num-seqs {max_num_seqs}); one alone may reach {capacity} tokens"]
    if len(d.kv_windows) > 1:
        lines += [f"{'':<14}group {g} ({f'window {w}' if w else 'full attention'}): {blocks} blocks"
                  for g, (w, blocks) in enumerate(zip(d.kv_windows, per_group))]
    return lines


def _serving_problems(config: EngineConfig | None,
                      described: WorkerDescription) -> tuple[int, list[tuple[bool, str]]]:
    """What the control plane would ask this worker to warm up for (serving_plan.plan_warmup):
    the max_model_len the gateway is given, and the control plane's refusal or warnings. Where
    the control plane refuses its flags or the worker, the gateway is checked against the
    model's own limit."""
    from ttserve.control.serving_plan import IncompatibleWorker, plan_warmup

    if config is None:
        return described.max_position_embeddings, []
    try:
        asked = plan_warmup(config, described, len(config.workers))
    except IncompatibleWorker as e:
        return described.max_position_embeddings, [(True, f"control plane: {e}")]
    return asked.max_model_len, [(False, f"control plane: {note.text}") for note in asked.notes]


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
