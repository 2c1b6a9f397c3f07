"""`ttserve up`: the whole stack on one host, each service its own process.

Every flag goes to the services that declare it (`--max-num-seqs` to the control plane,
`--backend` to the worker, `--api-key-file` to the gateway, `--host` and the `--ssl-*` flags to
all: the one certificate is each service's own, and must name the host the others call, 127.0.0.1
for a wildcard --host); a flag no service declares is refused. `--port` is the gateway's; the internal gRPC ports have their own flags.

Ctrl-C (SIGINT), SIGTERM or SIGHUP stops the services in reverse order, each draining first; a
second signal cuts short the drain of the service being stopped.

A service that exits on its own is restarted, as systemd's Restart=on-failure would (a worker's
requests wait and resume, see the control plane's --migration-limit), after 1, 2, 4, ... up to 30
seconds, the wait reset once it has run for a minute. One that exits with status 2 refused its
configuration, which a restart cannot fix: up stops the stack with that status. No service exits
2 for waiting on another: a gateway waiting for a warming worker answers /health (200) and
/ready (503) meanwhile, and up takes the stack as serving only once /ready says 200.

`--ready-timeout` bounds how long up waits for that (then it stops the stack and exits 1); its
default is the control plane's --warmup-timeout as given plus READY_MARGIN_S, so up never gives
up on a warmup the control plane still waits for. The gateway gets the same --ready-timeout.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ttserve.exit_status import CONFIG_REFUSED
from ttserve.protocol import host_port

log = logging.getLogger("ttserve.up")

# Start order; shutdown runs in reverse so no service outlives the one it depends on.
SERVICES = ("worker", "control", "gateway")
RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30)
STABLE_S = 60.0                        # a service up this long starts its backoff over
# Beyond the control plane's --warmup-timeout, up's default --ready-timeout: the worker's own start
# before its warmup (imports, opening a mesh) and the gateway's (vLLM's frontend).
READY_MARGIN_S = 300.0


def _service_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"ttserve {name}", add_help=False)
    importlib.import_module(f"ttserve.{name}.config").add_arguments(parser)
    return parser


def _kept(tokens: list[str], rest: list[str]) -> list[bool]:
    """Which of `tokens` remain in `rest`, an ordered subsequence of them."""
    mask, j = [], 0
    for token in tokens:
        kept = j < len(rest) and rest[j] == token
        mask.append(kept)
        if kept:
            j += 1
    return mask


def _consumed(parser: argparse.ArgumentParser, tokens: list[str]) -> list[bool]:
    """Which tokens the parser takes: the ones it does not return as unknown."""
    _, unknown = parser.parse_known_args(tokens)
    return [not kept for kept in _kept(tokens, unknown)]


def split_flags(argv: list[str]) -> tuple[argparse.Namespace, dict[str, list[str]]]:
    """up's own flags, and each service's share of the rest."""
    own = argparse.ArgumentParser(prog="ttserve up", description=__doc__)
    own.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway")
    own.add_argument("--control-port", type=int, default=50051)
    own.add_argument("--worker-port", type=int, default=50061)
    own.add_argument("--control-metrics-port", type=int, default=9401,
                     help="HTTP port of the control plane's /metrics, /health, /ready (0: none)")
    own.add_argument("--worker-metrics-port", type=int, default=9402,
                     help="HTTP port of the worker's /metrics, /health, /ready (0: none)")
    own.add_argument("--ready-timeout", type=float, default=None, metavar="SECONDS",
                     help="seconds to wait for the stack to serve (its /ready), then stop it and exit "
                          "1; also the gateway's --ready-timeout; 0: no limit (default: the control "
                          f"plane's --warmup-timeout + {READY_MARGIN_S:.0f})")
    args, rest = own.parse_known_args(argv)
    if any(t == "--metrics-port" or t.startswith("--metrics-port=") for t in rest):
        own.error("--metrics-port is ambiguous here: use --control-metrics-port and --worker-metrics-port")
    rest, dotted = _take_dotted(rest)
    masks = {name: _consumed(_service_parser(name), rest) for name in SERVICES}
    orphans = [t for i, t in enumerate(rest) if t.startswith("-") and not any(m[i] for m in masks.values())]
    if orphans:
        own.error(f"unrecognized flag(s) {' '.join(orphans)}: no service (gateway, control, worker) "
                  "declares them; see `ttserve gateway|control|worker --help`")
    shares = {name: [t for t, keep in zip(rest, mask) if keep] for name, mask in masks.items()}
    # The worker resolves --model (an embedded name or a folder); the gateway on the same host
    # reads the folder the control plane reports, so a name like `smollm2` never reaches it.
    shares["gateway"] = _without_flag(shares["gateway"], "--model")
    # vLLM's frontend parses --speculative-config too; it is the control plane's to act on.
    shares["gateway"] = _without_flag(shares["gateway"], "--speculative-config")
    host = _host(shares["gateway"])
    shares["worker"] += dotted + ["--port", str(args.worker_port),
                                  "--metrics-port", str(args.worker_metrics_port)]
    shares["control"] += ["--port", str(args.control_port), "--worker", f"0={host_port(host, args.worker_port)}",
                          "--metrics-port", str(args.control_metrics_port)]
    args.ready_timeout = _ready_timeout(args.ready_timeout, shares["control"])
    shares["gateway"] += ["--port", str(args.port), "--control", host_port(host, args.control_port),
                          "--ready-timeout", f"{args.ready_timeout:g}"]
    gateway = _service_parser("gateway").parse_known_args(shares["gateway"])[0]
    scheme = "https" if gateway.ssl_certfile else "http"
    args.url = f"{scheme}://{host_port(host, args.port)}"  # the gateway, as up checks it
    args.probe_tls = _probe_context(gateway) if gateway.ssl_certfile else None
    args.probe_key = _probe_key(gateway)
    return args, shares


def _ready_timeout(given: float | None, control: list[str]) -> float:
    """up's --ready-timeout: as given, else long enough for the slowest warmup the control plane
    waits for (its --warmup-timeout as passed)."""
    warmup = _service_parser("control").parse_known_args(control)[0].warmup_timeout
    if given is None:
        return warmup + READY_MARGIN_S
    if 0 < given < warmup:
        log.warning("--ready-timeout %g is below the control plane's --warmup-timeout %g: a warmup that "
                    "takes longer stops the stack", given, warmup)
    return given


def _probe_key(gateway: argparse.Namespace) -> str | None:
    """A key the gateway accepts, for up's own /ready probe; None: its API is open, or its key
    flags are refused (the gateway exits 2 on them, which stops up)."""
    from ttserve.gateway.api_keys import ApiKeyConfigError, configured_keys

    try:
        keys = configured_keys(gateway.api_key, gateway.api_key_file, os.environ)
    except ApiKeyConfigError:
        return None
    return keys[0] if keys else None


def _probe_context(gateway: argparse.Namespace) -> ssl.SSLContext:
    """How up reaches its own gateway's /ready over HTTPS: verified against --ssl-ca-certs when
    given (else unverified: up only asks its child whether it is up), presenting the certificate
    in case the gateway asks for client certificates."""
    context = ssl.create_default_context()
    try:
        if gateway.ssl_ca_certs:
            context.load_verify_locations(gateway.ssl_ca_certs)
        else:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if gateway.ssl_keyfile:
            context.load_cert_chain(gateway.ssl_certfile, gateway.ssl_keyfile)
    except (OSError, ssl.SSLError):
        pass  # the gateway refuses the same files at its start-up (exit 2), which stops up
    return context


def _take_dotted(tokens: list[str]) -> tuple[list[str], list[str]]:
    """The worker's dotted `--additional-config.tt.KEY VALUE` flags, taken out of `tokens`."""
    from ttserve.worker.planning.options import split_additional_config

    rest, _ = split_additional_config(tokens)
    return rest, [t for t, kept in zip(tokens, _kept(tokens, rest)) if not kept]


def _without_flag(tokens: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token == flag:
            skip = True
        elif not token.startswith(flag + "="):
            out.append(token)
    return out


def _host(tokens: list[str]) -> str:
    parsed, _ = _service_parser("gateway").parse_known_args(tokens)
    return "127.0.0.1" if parsed.host in ("0.0.0.0", "::", "") else parsed.host


def up(argv: list[str]) -> int:
    args, shares = split_flags(argv)
    procs: dict[str, subprocess.Popen] = {}
    stop_requested = False
    stopping: subprocess.Popen | None = None  # the service being stopped now

    def on_signal(*_: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        # A signal while up stops a service (a second Ctrl-C) reaches it as its own second
        # signal: it aborts what it still holds instead of waiting out its --shutdown-timeout.
        if stopping is not None and stopping.poll() is None:
            stopping.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    def start(name: str) -> subprocess.Popen:
        # A session of its own, out of the terminal's process group: Ctrl-C (or a hang-up)
        # reaches up alone, which stops the services one at a time in reverse order, the
        # gateway draining first. In the terminal's group each would get the signal at once,
        # and up's SIGTERM would be the gateway's second signal, which aborts its streams.
        # (start_new_session rather than 3.11's process_group=0: workers run Python 3.10.)
        return subprocess.Popen([sys.executable, "-m", f"ttserve.{name}", *shares[name]], start_new_session=True,
                                preexec_fn=_stop_with_parent)

    restarts = {name: 0 for name in SERVICES}
    started_at: dict[str, float] = {}
    restart_at: dict[str, float] = {}
    try:
        for name in SERVICES:
            procs[name], started_at[name] = start(name), time.monotonic()
        deadline, announced = time.monotonic() + (args.ready_timeout or float("inf")), False
        while not stop_requested:
            now = time.monotonic()
            for name, proc in procs.items():
                if name in restart_at:
                    if now >= restart_at[name]:
                        del restart_at[name]
                        procs[name], started_at[name] = start(name), now
                        log.info("%s restarted (restart %d)", name, restarts[name])
                    continue
                code = proc.poll()
                if code is None:
                    continue
                if code == CONFIG_REFUSED:
                    log.error("%s refused its configuration (exit code %d); stopping the stack", name, code)
                    return code
                if now - started_at[name] >= STABLE_S:
                    restarts[name] = 0
                delay = RESTART_BACKOFF_S[min(restarts[name], len(RESTART_BACKOFF_S) - 1)]
                restarts[name] += 1
                restart_at[name] = now + delay
                log.error("%s exited with code %d; restarting it in %d s", name, code, delay)
            if not announced:
                why_not = _not_serving(args.url, args.probe_tls, args.probe_key)
                if why_not is None:
                    log.info("ttserve is serving at %s/v1 (Ctrl-C stops it)", args.url)
                    announced = True
                elif time.monotonic() > deadline:
                    log.error("the stack did not serve within %g s (--ready-timeout): %s", args.ready_timeout, why_not)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        for name in reversed(SERVICES):
            proc = procs.get(name)
            if proc is not None and proc.poll() is None:
                stopping = proc
                proc.terminate()
                try:
                    # Each service drains first (up to its --shutdown-timeout, 30 s by default).
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM when up dies, however it dies (SIGKILL, OOM). Out of
    up's process group, a service would otherwise outlive it; a gateway then waits for its
    control plane forever. Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _not_serving(url: str, context: ssl.SSLContext | None = None, key: str | None = None) -> str | None:
    """None when the gateway serves, else why not. Asks /ready: a gateway still waiting for the
    control plane answers /health too."""
    request = urllib.request.Request(f"{url}/ready", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return None if response.status == 200 else f"/ready answered {response.status}"
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError, OSError):
            return f"/ready answered {e.code}"
    except OSError as e:
        return f"the gateway at {url} does not answer ({e})"
