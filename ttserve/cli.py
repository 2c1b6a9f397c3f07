"""The `ttserve` command: run one service, all of them (`up`), or prepare a model."""
from __future__ import annotations

import argparse
import sys

from .logs import setup_logging

USAGE = """ttserve COMMAND [flags]

commands:
  up        gateway, control plane and worker on this host (default: SmolLM2 on the CPU)
  check     the preflight: `ttserve check [flags of up]` validates every service's flags and
            prints the worker's plan (mesh, model class, lanes, KV budget) without opening a device
  gateway   the OpenAI-compatible HTTP API
  control   the control plane (scheduler, KV blocks, admission)
  worker    a device worker
  model     prepare an embedded model: ttserve model prepare smollm2

exit status of gateway, control, worker and up: 0 stopped by SIGTERM/SIGINT; 2 flags or files
refused (a restart cannot help); 1 anything else a restart or a peer may fix (a peer still
unreachable or not ready past a --*-timeout, a busy port, a crash)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    setup_logging()
    if command == "up":
        from .up import up
        return up(rest)
    if command == "check":
        from .check import check
        return check(rest)
    if command == "model":
        return _model(rest)
    if command == "gateway":
        from ttserve.gateway.__main__ import exit_without_teardown, main as gateway_main
        exit_without_teardown(gateway_main(rest))
    services = {"control": "ttserve.control.config", "worker": "ttserve.worker.config"}
    if command not in services:
        print(f"ttserve: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    import importlib
    module = importlib.import_module(services[command])
    parser = argparse.ArgumentParser(prog=f"ttserve {command}")
    module.add_arguments(parser)
    parse = getattr(module, "parse_args", None)  # a service with flags argparse cannot declare
    return module.run(parse(parser, rest) if parse else parser.parse_args(rest))


def _model(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ttserve model")
    sub = parser.add_subparsers(dest="action", required=True)
    prepare = sub.add_parser("prepare", help="convert an embedded model into a Hugging Face folder")
    prepare.add_argument("name", help="embedded model name: smollm2, tiny-vlm (a tiny random-weight "
                                      "Qwen2.5-VL for tests) or tiny-gemma3 (a tiny random-weight Gemma 3, "
                                      "sliding-window and global layers, for tests)")
    prepare.add_argument("--cache-dir", default=None, help="default $TTSERVE_CACHE_DIR or ~/.cache/ttserve")
    args = parser.parse_args(argv)
    from pathlib import Path

    from ttserve.worker.planning.model_prepare import ModelPrepareError, prepare as prepare_model
    try:
        path = prepare_model(args.name, Path(args.cache_dir) if args.cache_dir else None)
    except ModelPrepareError as e:
        print(f"ttserve model prepare: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
