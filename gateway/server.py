"""Gateway start-up: find the control plane, build vLLM's config without a device, and serve
vLLM's own OpenAI app (build_app + init_app_state + serve_http) on a GatewayLLM.

Order matters for start-up time and for clear failures: the HTTP port is bound first (a busy
port fails at once), then the control plane is contacted (and its protocol version checked)
while vLLM's import runs on a thread. A control plane that is unreachable or not ready is waited
for, as long as --connect-timeout / --ready-timeout allow (0, the default: without limit), while
gateway/waiting.py answers on the port (/health 200, everything else 503 saying why).

Exit statuses (StartupError.status): 2 (ConfigRefused) only when the gateway's own flags or
files are refused, which no restart can fix; 1 for anything a restart or a peer could fix (a
control plane unreachable, not ready, of another protocol version; a busy port); 0 after a
SIGTERM/SIGINT, also one that arrives while waiting.
"""
from __future__ import annotations

import argparse
import json
import asyncio
import logging
import shlex
import signal
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable, NoReturn

import grpc

from ttserve.gateway.control_channel import ControlPlane, ControlPlanes
from ttserve.gateway import header_limit, media_limits
from ttserve.gateway.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from ttserve.gateway.readiness import describe_workers
from ttserve.gateway.waiting import BACKLOG, WaitingResponder, http_ssl_context
from ttserve.protocol import CALL_METADATA, host_port
from ttserve.exit_status import CONFIG_REFUSED
from ttserve.tls import PLAINTEXT
from ttserve.v1 import engine_pb2

log = logging.getLogger("ttserve.gateway")



class StartupError(RuntimeError):
    """The gateway cannot start; the message is the one line the user sees. Exit status 1: a
    restart, or a peer, may fix it (the supervisor restarts the gateway)."""
    status = 1


class ConfigRefused(StartupError):
    """The gateway's own flags or files are refused: only other ones can fix it."""
    status = CONFIG_REFUSED


# ---- the control plane ---------------------------------------------------------------------
LOG_EVERY_S = 10.0
POLL_S = 0.5


async def wait_for_control_plane(planes: ControlPlanes, connect_timeout: float, ready_timeout: float,
                                 show: Callable[[str], Awaitable[None]]) -> ControlPlane:
    """The first listed control plane that reports ready. Until one does, `show` gets why not
    (first when the first answer is not "ready"), and a line is logged every LOG_EVERY_S.

    `connect_timeout` bounds the time until a first answer from any of them, `ready_timeout` the
    time from it to ready (a control plane lost meanwhile is waited for within the same bound);
    0: no bound. Past either, or when every one refuses this gateway's protocol version:
    StartupError (exit 1, for the supervisor to restart the gateway)."""
    start = time.monotonic()
    contacted: set[str] = set()  # the control planes that answered
    refused: set[str] = set()    # ... and refused this gateway (logged once)
    first_contact: float | None = None
    last_log = start - LOG_EVERY_S  # the first wait is logged at once
    while True:
        bound, since = (connect_timeout, start) if first_contact is None else (ready_timeout, first_contact)
        remaining = bound - (time.monotonic() - since) if bound > 0 else 5.0
        answers = await planes.ask(timeout=max(0.5, min(5.0, remaining)))
        # Another protocol version is a peer problem (1), but not one waiting can end: only
        # deploying one release on both sides does. Exiting makes it a visible restart loop
        # (systemctl status, CrashLoopBackOff) that picks up the fixed peer by itself, where a
        # gateway waiting on would look merely slow. With several listed, only when every one
        # refuses (a rolling upgrade may have reached some first).
        if all(a.refused for a in answers):
            raise StartupError("; ".join(a.why for a in answers))
        for answer in answers:
            if answer.refused and answer.plane.target not in refused:
                refused.add(answer.plane.target)
                log.error("%s", answer.why)
            if answer.info is not None and answer.plane.target not in contacted:
                contacted.add(answer.plane.target)
                first_contact = first_contact or time.monotonic()
                log.info("control plane at %s: ttserve %s, protocol %d, %s", answer.plane.target,
                         answer.info.version, answer.info.protocol_version, describe_workers(answer.info))
        chosen = next((a for a in answers if a.ready), None)
        if chosen is not None:
            if time.monotonic() - start > 1:
                log.info("control plane at %s is ready after %.0f s", chosen.plane.target,
                         time.monotonic() - start)
            return chosen.plane
        why = "; ".join(a.describe(named=len(answers) > 1) for a in answers)
        subject = planes.describe()
        now = time.monotonic()
        if first_contact is None and connect_timeout > 0 and now - start >= connect_timeout:
            raise StartupError(f"{subject} is {why} after {connect_timeout:g} s; see --connect-timeout"
                               if len(answers) == 1 else f"none of {subject} answered within {connect_timeout:g} s: "
                               f"{why}; see --connect-timeout")
        if first_contact is not None and ready_timeout > 0 and now - first_contact >= ready_timeout:
            raise StartupError(f"{subject} did not become ready within {ready_timeout:g} s: {why}; "
                               "see --ready-timeout")
        await show(f"waiting for {subject}: {why}")
        if now - last_log >= LOG_EVERY_S:
            log.info("waiting for %s (%.0f s): %s", subject, now - start, why)
            last_log = now
        await asyncio.sleep(POLL_S)


async def fetch_model_info(plane: ControlPlane) -> engine_pb2.ModelInfo:
    try:
        return await plane.stub.GetModelInfo(engine_pb2.ModelInfoRequest(), metadata=CALL_METADATA, timeout=10)
    except grpc.aio.AioRpcError as e:
        raise StartupError(f"control plane at {plane.target} did not describe its model: "
                           f"{e.code().name}: {e.details()}") from None


def resolve_model_folder(args: argparse.Namespace, model_info: engine_pb2.ModelInfo) -> str:
    """The folder whose config and tokenizer the gateway loads (no weights are read).

    Without --model, a reported folder this host lacks is the gateway's configuration to fix
    (it needs --model), not its peer's: refused (2)."""
    if args.model:
        return args.model
    path = model_info.model_path
    if not path:
        raise ConfigRefused("the control plane reports no model_path; pass --model with the "
                            "model's folder (config.json and tokenizer files)")
    if not Path(path).is_dir():
        raise ConfigRefused(f"the control plane serves {path}, which is not a folder on this host; "
                            "pass --model with a local copy of its config.json and tokenizer files")
    return path


# ---- vLLM ----------------------------------------------------------------------------------
def vllm_argv(args: argparse.Namespace, model: str, model_info: engine_pb2.ModelInfo) -> list[str]:
    """The `vllm serve` command line equivalent to this gateway's flags."""
    names = args.served_model_name or [Path(model.rstrip("/")).name or model]
    argv = ["--model", model, "--served-model-name", *names,
            "--max-model-len", str(model_info.max_model_len),
            "--host", args.host, "--port", str(args.port),
            "--uvicorn-log-level", args.uvicorn_log_level,
            # serve_http hands it to GatewayLLM.shutdown on SIGTERM: the drain's timeout.
            "--shutdown-timeout", str(args.shutdown_timeout)]
    # The API keys are not vLLM's to check (gateway/api_keys.py guards every route, vLLM's
    # middleware only /v1); the certificate serves HTTPS through vLLM's serve_http.
    for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        if getattr(args, flag, None):
            argv += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    if args.enable_prompt_tokens_details:
        argv.append("--enable-prompt-tokens-details")
    if getattr(args, "otlp_traces_endpoint", None):
        # vLLM's AsyncLLM sets up the process's TracerProvider from it, and its serving layer
        # then carries each request's trace headers (gateway/http_tracing.py).
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    for flag in ("tokenizer", "chat_template", "tool_call_parser", "reasoning_parser"):
        if getattr(args, flag):
            argv += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    for flag in ("enable_auto_tool_choice", "trust_remote_code", "enable_log_requests",
                 "disable_log_stats", "disable_uvicorn_access_log"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    # Structured outputs: the frontend validates with llguidance (the library the control plane
    # enforces with); JSON is compact so greedy decoding cannot loop on whitespace, and schema
    # objects take only their listed properties, as vLLM's default xgrammar backend enforces
    # (tool-call schemas rely on it). A --structured-outputs-config in --vllm-args comes later
    # and wins.
    argv += ["--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true, '
             '"disable_additional_properties": true}']
    if model_info.supports_images:
        argv += vision_argv(args)
        if model_info.dtype:
            # vLLM casts the processor's floating outputs (pixel_values) to its model dtype:
            # the worker's, so the pixels arrive as the model computes them.
            argv += ["--dtype", model_info.dtype]
    return argv + shlex.split(args.vllm_args or "")


# Stands in for "no host": vLLM fetches from any host unless given a list, and names the list
# in its refusal ("The URL must be from one of the allowed domains: [...]").
NO_MEDIA_FETCHING = "http-image-urls-are-disabled-see-allowed-media-domains.invalid"


def vision_argv(args: argparse.Namespace) -> list[str]:
    """vLLM's multimodal flags for a vision model behind the control plane.

    Every image must reach the engine with its tensors: vLLM's processor cache would send a
    repeated image as a reference to an engine-side copy the control plane does not keep, so it
    is off. vLLM 0.32 can leave rescaling and normalization to the model's device code
    (mm_device_do_normalize, on by default for Qwen2-VL/2.5-VL): the workers' models (tt-metal's
    and the torch reference) take pixel_values as transformers' processor gives them, normalized,
    so the processor does it. Images only, up to --limit-images-per-prompt; http(s) image URLs
    only from --allowed-media-domains."""
    limits = json.dumps({"image": args.limit_images_per_prompt})
    return ["--mm-processor-cache-gb", "0", "--limit-mm-per-prompt", limits, "--no-mm-device-do-normalize",
            "--allowed-media-domains", *(args.allowed_media_domains or [NO_MEDIA_FETCHING])]


def patch_vllm(args: argparse.Namespace) -> None:
    """Every change the gateway makes to vLLM (gateway/vllm_patches.py). Refused (2) on a vLLM
    other than the one the patches are written for: only installing that one fixes it."""
    from ttserve.gateway import vllm_patches

    try:
        vllm_patches.apply(args.allowed_media_networks)
    except vllm_patches.UnsupportedVllm as e:
        raise ConfigRefused(str(e)) from None


def preload_vllm() -> None:
    """Import vLLM's frontend (most of the start-up time) while the control plane gets ready.

    Failures are left for the main thread's own imports to raise."""
    try:
        from ttserve.gateway import vllm_compat

        vllm_compat.prepare()
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.entrypoints.launchers.api_server.app_state  # noqa: F401
        import vllm.entrypoints.launchers.app  # noqa: F401
        import vllm.entrypoints.launchers.cli_args  # noqa: F401

        import ttserve.gateway.engine_client  # noqa: F401
    except Exception:
        log.debug("preloading vLLM failed", exc_info=True)


def parse_vllm_args(argv: list[str]) -> argparse.Namespace:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def refuse(message: str) -> NoReturn:  # instead of argparse's usage text and exit
        raise ConfigRefused(f"vLLM rejected its arguments ({message}): {shlex.join(argv)}")

    parser = make_arg_parser(FlexibleArgumentParser(prog="ttserve gateway (vLLM frontend)"))
    parser.error = refuse  # type: ignore[method-assign]
    vllm_args = parser.parse_args(argv)
    try:
        validate_parsed_serve_args(vllm_args)
    except (TypeError, ValueError) as e:
        raise ConfigRefused(f"vLLM rejected its arguments: {e}") from None
    # Options whose work happens in the engine, which ttserve's control plane and devices do
    # not do: refused rather than silently ignored.
    if getattr(vllm_args, "speculative_config", None):
        raise ConfigRefused("--speculative-config belongs to the control plane, which proposes and verifies "
                            "the drafts: pass it to `ttserve control` (`ttserve up` passes it there)")
    if getattr(vllm_args, "enable_lora", False):
        raise ConfigRefused("LoRA (--enable-lora) is not supported on this backend")
    if (getattr(vllm_args, "max_logprobs", 0) or 0) > MAX_LOGPROBS:
        # Tenstorrent devices compute at most the top 32; the API's ceiling is 20.
        log.warning("--max-logprobs %d clamped to %d", vllm_args.max_logprobs, MAX_LOGPROBS)
        vllm_args.max_logprobs = MAX_LOGPROBS
    return vllm_args


MAX_LOGPROBS = 20


def build_vllm_config(vllm_args: argparse.Namespace, model_info: engine_pb2.ModelInfo):
    """vLLM's config for the frontend alone, with the limits the control plane reported.
    Refused (2) when vLLM cannot build it: the model folder, or the flags, are the gateway's.

    vLLM's engine handshake (MPClient._apply_ready_response) would copy max_model_len, block
    size and the number of KV blocks from the engine into the frontend's config; the control
    plane's ModelInfo stands in for it.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        config = AsyncEngineArgs.from_cli_args(vllm_args).create_engine_config()
    except Exception as e:
        detail = " ".join(str(e).split())
        raise ConfigRefused(f"cannot build vLLM's config for {vllm_args.model}: "
                            f"{type(e).__name__}: {detail[:400]}") from None
    cache = config.cache_config
    cache.block_size = model_info.block_size or cache.block_size
    cache.num_gpu_blocks = model_info.num_blocks or None
    # The smaller of the two, as vLLM's handshake does: --vllm-args may set a lower one.
    config.model_config.max_model_len = min(config.model_config.max_model_len, model_info.max_model_len)
    return config


def prepare_tracing(vllm_args: argparse.Namespace) -> None:
    """With --otlp-traces-endpoint: refused (2) without the OpenTelemetry packages vLLM's tracing
    imports (vLLM would refuse too, with a traceback), and the service named ttserve-gateway
    before vLLM builds its TracerProvider (gateway/http_tracing.py)."""
    from ttserve.gateway.http_tracing import prepare
    from ttserve.tracing import TracingUnavailable

    try:
        prepare(vllm_args.otlp_traces_endpoint)
    except TracingUnavailable as e:
        raise ConfigRefused(str(e)) from None


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound first so that a busy port fails before anything slow runs (as
    vLLM's create_server_socket), and listening from then on: a client connecting before
    anything answers waits in its queue instead of being refused (see gateway/waiting.py).

    Exit status 1, not 2, when it cannot: a port held by a process that is exiting, or an address
    not yet up at boot, is there after a restart (the control plane and worker likewise)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host_port(host, port)}: {e.strerror or e}") from None
    return sock


def check_vllm_server_args(vllm_args: argparse.Namespace) -> None:
    """What vLLM's setup_server checks and logs, minus creating the socket."""
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.entrypoints.serve.utils.api_utils import log_non_default_args
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.system_utils import set_ulimit

    log_non_default_args(vllm_args)
    if vllm_args.tool_parser_plugin and len(vllm_args.tool_parser_plugin) > 3:
        ToolParserManager.import_tool_parser(vllm_args.tool_parser_plugin)
    if vllm_args.reasoning_parser_plugin and len(vllm_args.reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(vllm_args.reasoning_parser_plugin)
    try:
        validate_api_server_args(vllm_args)
    except KeyError as e:  # an unknown tool or reasoning parser name
        raise ConfigRefused(str(e.args[0]) if e.args else str(e)) from None
    set_ulimit()


async def discover(args: argparse.Namespace,
                   show: Callable[[str], Awaitable[None]]) -> tuple[str, engine_pb2.ModelInfo, str]:
    """Contact the control planes, wait until one is ready; the model folder, its limits and the
    address of the control plane that described them."""
    planes = ControlPlanes(args.control, getattr(args, "tls", PLAINTEXT))
    try:
        plane = await wait_for_control_plane(planes, args.connect_timeout, args.ready_timeout, show)
        model_info = await fetch_model_info(plane)
    finally:
        await planes.close()
    model = resolve_model_folder(args, model_info)
    log.info("model %s (%s): max_model_len %d, %d blocks x %d tokens, %d lane(s) x %d seqs",
             model, model_info.architecture, model_info.max_model_len, model_info.num_blocks,
             model_info.block_size, model_info.num_lanes, model_info.max_num_seqs)
    return model, model_info, plane.target


def stop_on_signal() -> None:
    """Until serve_http installs its own handlers: SIGTERM or SIGINT cancels start-up, which
    then exits 0 (a supervisor stopping a waiting gateway is no failure)."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)


async def serve(args: argparse.Namespace) -> int:
    """Run the gateway until SIGINT/SIGTERM; raises StartupError if it cannot start."""
    started = time.monotonic()
    try:
        context = http_ssl_context(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.vllm_args)
    except (OSError, ssl.SSLError) as e:  # resolve_security read them a moment ago
        raise ConfigRefused(f"--ssl-certfile {args.ssl_certfile}: {e}") from None
    media_limits.apply(args.max_image_pixels)  # before the preload imports vLLM
    sock = bind_http_socket(args.host, args.port)
    stop_on_signal()
    waiting = WaitingResponder(sock, args.api_keys, public_metrics=args.public_metrics, ssl_context=context)
    preload = threading.Thread(target=preload_vllm, name="ttserve-preload-vllm", daemon=True)
    preload.start()
    try:
        model, model_info, ready_target = await discover(args, waiting.show)
        waiting.message = f"starting vLLM's frontend for {model} (the control plane at {ready_target} is ready)"
        # No vLLM import may run on this thread before the preload ends (import lock order).
        await asyncio.to_thread(preload.join)
        patch_vllm(args)  # before vLLM builds its config (it reads the model registry then)
        vllm_args = parse_vllm_args(vllm_argv(args, model, model_info))
        prepare_tracing(vllm_args)
        vllm_config = build_vllm_config(vllm_args, model_info)
        check_vllm_server_args(vllm_args)
        await serve_vllm_app(args, vllm_args, vllm_config, model_info, sock, started, waiting.close)
    except asyncio.CancelledError:
        log.info("stopped before serving (SIGTERM/SIGINT)")
    finally:
        await waiting.close()
        sock.close()
    return 0


RESPONSES_FLUSH_S = 5
# The control plane was ready a moment ago: its session is a matter of seconds.
SESSION_TIMEOUT_S = 10.0

# Routes of vLLM's app that no request can succeed on behind the control plane (each answered
# every request with an error, found by the OpenAPI fuzzer, tests/test_e2e_gateway_fuzz.py):
# elastic expert-parallel scaling is the engine's, the structured decision API needs a model
# hook, generative scoring needs prompt logprobs. Not exposed, so a client gets 404 and the
# schema does not advertise them.
UNSERVED_ROUTES = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep", "/v1/systemone", "/generative_scoring"})


def remove_unserved_routes(app) -> None:
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in UNSERVED_ROUTES]
    app.openapi_schema = None  # rebuilt from the routes left


def install_middleware(app, api_keys=None, public_metrics: bool = False,
                       max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tracer=None) -> None:
    """The gateway's middleware outermost on vLLM's app, and two of vLLM's out: its HTTP
    instrumentation records into prometheus_client's default registry, which the gateway never
    exports, on every request and streamed chunk (RequestDurationMiddleware stands in for it);
    its AuthenticationMiddleware (installed when VLLM_API_KEY is set) guards /v1 only, and
    ApiKeyMiddleware, when `api_keys` holds any, guards every route and holds each key to its
    rate limits (a 429 before the request is read). With a `tracer` that is on
    (--otlp-traces-endpoint), TracingMiddleware is outermost of all, so that every answer, a
    401 or 413 too, carries its trace id; off, it is not installed at all."""
    from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware
    from starlette.middleware import Middleware
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from ttserve.gateway.api_keys import ApiKeyMiddleware
    from ttserve.gateway.errors import RefusalStatusMiddleware
    from ttserve.gateway.metrics import RequestDurationMiddleware

    app.user_middleware[:] = [m for m in app.user_middleware
                              if m.cls not in (PrometheusInstrumentatorMiddleware, AuthenticationMiddleware)]
    app.user_middleware.insert(0, Middleware(RefusalStatusMiddleware))
    app.user_middleware.insert(0, Middleware(RequestDurationMiddleware))
    # Inside the key check: a client without a key never gets its body read at all.
    app.user_middleware.insert(0, Middleware(BodyLimitMiddleware, limit=max_request_bytes))
    if api_keys:
        app.user_middleware.insert(0, Middleware(ApiKeyMiddleware, keys=api_keys, public_metrics=public_metrics,
                                                 rate_limit=True))
    # build_app has already built the middleware stack (SageMaker bootstrap), so
    # add_middleware() is refused: rebuild it, as that bootstrap does.
    app.middleware_stack = app.build_middleware_stack()
    if tracer is not None and tracer.enabled:
        # Around the built stack, not in user_middleware: Starlette puts its ServerErrorMiddleware
        # (which runs vLLM's handler for any Exception, the 500s) outside every user middleware,
        # and those answers need their trace id most.
        from ttserve.gateway.http_tracing import TracingMiddleware
        app.middleware_stack = TracingMiddleware(app.middleware_stack, tracer=tracer)


async def serve_vllm_app(args: argparse.Namespace, vllm_args: argparse.Namespace, vllm_config,
                         model_info: engine_pb2.ModelInfo, sock: socket.socket, started: float,
                         before_serving: Callable[[], Awaitable[None]]) -> None:
    """vLLM's OpenAI app on a GatewayLLM, served by vLLM's serve_http, until shutdown;
    `before_serving` runs last before serve_http accepts on `sock` (the waiting responder's
    handover)."""
    from vllm import envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
    from vllm.version import __version__ as vllm_version

    from ttserve.gateway import metrics, readiness
    from ttserve.gateway.engine_client import GatewayLLM, GrpcEngineCoreClient
    from ttserve.gateway.errors import quiet_refusal_tracebacks
    from ttserve.gateway.http_tracing import gateway_tracer
    from ttserve.tracing import Tracer, TracingUnavailable

    llm = None
    tracer = Tracer.off()
    try:
        core_client = GrpcEngineCoreClient(args.control, tls=args.tls, model=model_info,
                                           resume_limit=args.control_migration_limit,
                                           resume_timeout_s=args.control_migration_timeout)
        llm = GatewayLLM(vllm_config, core_client, log_stats=not vllm_args.disable_log_stats,
                         log_requests=vllm_args.enable_log_requests)
        try:
            tracer = gateway_tracer(vllm_args.otlp_traces_endpoint)  # on the provider GatewayLLM set up
        except TracingUnavailable as e:
            raise ConfigRefused(str(e)) from None
        if not await core_client.wait_connected(timeout=SESSION_TIMEOUT_S):
            log.warning("%s; serving anyway, requests get 503 until it is back",
                        core_client.unreachable_message)
        supported_tasks = await llm.get_supported_tasks()
        root_level = logging.getLogger().level
        app = build_app(vllm_args, supported_tasks, vllm_config.model_config)
        # Importing model_hosting_container_standards (SageMaker routes) sets the root logger to
        # ERROR; vLLM restores handler levels only, which silences every non-vLLM logger.
        logging.getLogger().setLevel(root_level)
        remove_unserved_routes(app)
        install_middleware(app, args.api_keys, args.public_metrics, args.max_request_bytes, tracer)
        metrics.install(app)
        readiness.install(app, readiness.ReadinessProbe(core_client, llm.drain))
        await init_app_state(llm, app.state, vllm_args, supported_tasks)
        quiet_refusal_tracebacks()
        # After the drain, how long uvicorn waits for open responses to be written (the aborted
        # streams' last chunks, slow readers) before it cancels them.
        uvicorn_kwargs: dict = {"timeout_graceful_shutdown": RESPONSES_FLUSH_S,
                                "http": header_limit.protocol(args.max_header_bytes)}
        if (log_config := get_uvicorn_log_config(vllm_args)) is not None:
            uvicorn_kwargs["log_config"] = log_config
        scheme = "https" if vllm_args.ssl_keyfile and vllm_args.ssl_certfile else "http"
        log.info("serving %s on %s://%s for %s (%s; API %s; vLLM %s frontend; "
                 "started in %.1f s)", ", ".join(vllm_args.served_model_name), scheme,
                 host_port(args.host, args.port), core_client.planes.describe(), "TLS" if args.tls.calls_tls else "plaintext",
                 f"key required ({args.api_keys.describe()})" if args.api_keys else "open (no API key)",
                 vllm_version, time.monotonic() - started)
        await before_serving()
        shutdown_task = await serve_http(
            app, sock=sock, enable_ssl_refresh=vllm_args.enable_ssl_refresh,
            host=vllm_args.host, port=vllm_args.port, log_level=vllm_args.uvicorn_log_level,
            access_log=not vllm_args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=vllm_args.ssl_keyfile, ssl_certfile=vllm_args.ssl_certfile,
            ssl_ca_certs=vllm_args.ssl_ca_certs, ssl_cert_reqs=vllm_args.ssl_cert_reqs,
            ssl_ciphers=vllm_args.ssl_ciphers,
            h11_max_incomplete_event_size=min(vllm_args.h11_max_incomplete_event_size, args.max_header_bytes),
            h11_max_header_count=vllm_args.h11_max_header_count, **uvicorn_kwargs)
        await shutdown_task
    finally:
        if llm is not None:
            llm.shutdown()
        # The last requests' spans leave before the process does (the gateway exits with
        # os._exit, past vLLM's atexit flush).
        tracer.shutdown()
