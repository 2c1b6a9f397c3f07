"""Gateway command line: `python -m ttserve.gateway --control HOST:PORT[,HOST:PORT...] ...`.

Flag names follow `vllm serve`'s. Importing this module is cheap (no vLLM); `run` imports it.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import sys

from ttserve.gateway.body_limit import DEFAULT_MAX_REQUEST_BYTES
from ttserve.gateway.control_channel import control_targets
from ttserve.gateway.header_limit import DEFAULT_MAX_HEADER_BYTES
from ttserve.gateway.media_limits import DEFAULT_MAX_IMAGE_PIXELS
from ttserve.logs import setup_logging
from ttserve.tracing import add_arguments as add_tracing_arguments

DEFAULT_CONTROL = "127.0.0.1:50051"


def _seconds(text: str, kind: type[int] | type[float] = int) -> int | float:
    """A non-negative number of seconds, whole unless `kind` is float (vLLM's --shutdown-timeout
    is an int)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'whole ' if kind is int else ''}seconds, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


_wait_bound = functools.partial(_seconds, kind=float)  # a wait's bound in seconds; 0: none


def _whole(text: str, minimum: int, meaning: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {minimum}{meaning} or more, got {value}")
    return value


_positive = functools.partial(_whole, minimum=1)
# A rate per minute; 0: unlimited.
_per_minute = functools.partial(_whole, minimum=0, meaning=" (unlimited)")


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR network (a bare address is its /32 or /128)."""
    try:
        return ipaddress.ip_network(text)
    except ValueError as e:  # "... has host bits set", "does not appear to be an IPv4 or IPv6 network"
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s)")
    parser.add_argument("--control", type=control_targets, default=DEFAULT_CONTROL,
                        metavar="HOST:PORT[,HOST:PORT...]",
                        help="the control plane's gRPC address, or several, comma-separated: the gateway "
                             "uses the first that is ready and, when it is lost, fails over to the next "
                             "ready one, resuming the requests in flight there (default %(default)s)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="local model folder for config.json and tokenizer files; no weights "
                             "are read (default: the control plane's model_path, which must then "
                             "exist on this host)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) in the API (default: the model folder's basename)")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require one of these keys as 'Authorization: Bearer KEY' on every "
                             "route but /health; better --api-key-file or VLLM_API_KEY (read when "
                             "neither flag is given), since a flag shows in every process listing")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="a file of API keys, one a line (# comments), added to --api-key's: "
                             "'[NAME:] KEY [rpm=N] [tpm=N]', NAME what metrics and the control plane "
                             "call the key (default key-N by position), rpm/tpm its rate limits")
    parser.add_argument("--key-requests-per-minute", type=_per_minute, default=0, metavar="N",
                        help="each API key that sets no rpm=/tpm= in --api-key-file may send N "
                             "generation requests a minute (a token bucket: bursts up to N); more "
                             "get 429 with Retry-After (default 0: unlimited)")
    parser.add_argument("--key-tokens-per-minute", type=_per_minute, default=0, metavar="N",
                        help="likewise for prompt + generated tokens: a key's new request is refused "
                             "(429) while its bucket of N tokens, refilled over a minute, is used up; "
                             "tokens are charged once known, so a bucket can go into debt (default 0: "
                             "unlimited)")
    parser.add_argument("--public-metrics", action="store_true",
                        help="serve /metrics without an API key (for a scraper that sends none)")
    parser.add_argument("--ssl-certfile", default=None, metavar="PEM",
                        help="serve HTTPS with this certificate (chain), which is also presented "
                             "to the control plane")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the key of --ssl-certfile")
    parser.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                        help="the CA the control plane's certificate is verified against (the "
                             "call is TLS exactly when this is set); for HTTP clients too with "
                             "--vllm-args='--ssl-cert-reqs 2'")
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening on a non-loopback address without HTTPS and an API "
                             "key (refused otherwise)")
    parser.add_argument("--ready-timeout", type=_wait_bound, default=0.0, metavar="SECONDS",
                        help="how long to wait, from the control plane's first answer, for it to report "
                             "ready (a worker warmed up); past it the gateway exits with status 1 for its "
                             "supervisor to restart it. Meanwhile /health answers 200 and every other route "
                             "503 saying why (default 0: wait without limit)")
    parser.add_argument("--connect-timeout", type=_wait_bound, default=0.0, metavar="SECONDS",
                        help="how long to try reaching the control plane at start-up; past it the gateway "
                             "exits with status 1 (default 0: try without limit)")
    parser.add_argument("--control-migration-limit", type=functools.partial(_whole, minimum=0), default=3,
                        metavar="N",
                        help="when the session with the control plane breaks, each request in flight is "
                             "re-added to it once it is back, as a resumption (prompt + the tokens already "
                             "streamed), at most N times; 0: such requests fail (default %(default)d)")
    parser.add_argument("--control-migration-timeout", type=_wait_bound, default=120.0, metavar="SECONDS",
                        help="how long a request waits for its control plane to be back and ready before "
                             "it fails; 0: at once (default %(default)g)")
    parser.add_argument("--shutdown-timeout", type=_seconds, default=30, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long in-flight requests may take to finish "
                             "before they are aborted; new requests get 503 meanwhile, and a "
                             "second signal aborts at once; 0 aborts at once (default %(default)d)")
    parser.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                        default=True, help="report usage.prompt_tokens_details.cached_tokens "
                                           "(default on)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer folder, if not the model folder")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow custom code in the model folder (config/tokenizer)")
    parser.add_argument("--chat-template", default=None, help="chat template file or string")
    parser.add_argument("--tool-call-parser", default=None, help="vLLM tool call parser name")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model choose tool calls (needs --tool-call-parser)")
    parser.add_argument("--reasoning-parser", default=None, help="vLLM reasoning parser name")
    parser.add_argument("--enable-log-requests", action="store_true", help="log every request")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic throughput log lines")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per HTTP request")
    parser.add_argument("--limit-images-per-prompt", type=int, default=8, metavar="N",
                        help="vision models: the most images one request may carry (vLLM's "
                             "--limit-mm-per-prompt image count; videos are not served) (default %(default)d)")
    parser.add_argument("--max-request-bytes", type=_positive, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                        help="the largest HTTP request body; a larger one is refused with 413 before "
                             "it is parsed (default %(default)d, 64 MiB)")
    parser.add_argument("--max-header-bytes", type=_positive, default=DEFAULT_MAX_HEADER_BYTES, metavar="N",
                        help="the largest HTTP request head (request line and headers); a larger one "
                             "is refused with 431 as it arrives (default %(default)d, 64 KiB)")
    parser.add_argument("--max-image-pixels", type=_positive, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                        help="vision models: an image whose width x height exceeds N is refused (HTTP "
                             "400) before it is decoded (default %(default)d, 4096 x 4096)")
    parser.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="DOMAIN",
                        help="vision models: fetch http(s) image URLs from these hosts only; without "
                             "it, images come as data URLs and http(s) image URLs are refused")
    parser.add_argument("--allowed-media-networks", nargs="+", type=_network, default=[], metavar="CIDR",
                        help="vision models: image URLs may also reach addresses in these networks "
                             "(e.g. 10.0.0.0/8); without it only public addresses: a URL whose host "
                             "is or resolves to a loopback, private, link-local (cloud metadata), "
                             "CGNAT, multicast or reserved address is refused (HTTP 400), also from "
                             "an allowed domain (gateway/media_fetch_guard.py)")
    add_tracing_arguments(parser)  # --otlp-traces-endpoint; --collect-detailed-traces is the control plane's
    parser.add_argument("--vllm-args", default="", metavar="'FLAGS'",
                        help="further `vllm serve` frontend flags, as one quoted string, e.g. "
                             "--vllm-args='--chat-template-content-format openai'")


def resolve_security(args: argparse.Namespace) -> None:
    """Read the keys and certificates once, before anything slow: `args.api_keys` (ApiKeys) and
    `args.tls` (ttserve.tls.Tls, for the control-plane call). Raises ConfigRefused (exit 2)."""
    from ttserve.gateway.api_keys import ApiKeyConfigError, load_api_keys
    from ttserve.gateway.rate_limits import Limits
    from ttserve.gateway.server import ConfigRefused
    from ttserve.tls import TlsConfigError, check_exposure, load_tls

    try:
        limits = Limits(getattr(args, "key_requests_per_minute", 0), getattr(args, "key_tokens_per_minute", 0))
        args.api_keys = load_api_keys(args.api_key, args.api_key_file, default_limits=limits)
        args.tls = load_tls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
        check_exposure(args.host, args.tls.serves_tls and bool(args.api_keys), args.insecure,
                       "the gateway's HTTP API", "HTTPS (--ssl-certfile, --ssl-keyfile) and an API key "
                       "(--api-key-file or VLLM_API_KEY)")
    except (ApiKeyConfigError, TlsConfigError) as e:
        raise ConfigRefused(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """Start the gateway and serve until SIGINT/SIGTERM; returns the exit status: 0 after a
    signal, 2 for refused flags or files (argparse's status too), 1 for anything a restart or
    the control plane could fix (gateway/server.py)."""
    setup_logging()  # a no-op under `ttserve gateway`, which has set it up already
    from ttserve.malloc_arenas import cap_malloc_arenas
    cap_malloc_arenas()  # before vLLM's, the tokenizers' and gRPC's threads start
    from ttserve.gateway.server import StartupError, serve

    try:
        import uvloop  # vLLM's own event loop; grpc.aio runs on it too
        run_loop = uvloop.run
    except ImportError:
        run_loop = asyncio.run
    try:
        resolve_security(args)
        return run_loop(serve(args))
    except StartupError as e:
        print(f"ttserve gateway: error: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        return 0
