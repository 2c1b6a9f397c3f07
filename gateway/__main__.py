"""`python -m ttserve.gateway --control HOST:PORT [--port 8000] [--model PATH] ...`"""
import argparse
import logging
import os
import sys
from typing import NoReturn

from ttserve.gateway.config import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ttserve.gateway",
        description="OpenAI-compatible HTTP gateway: vLLM's frontend over a ttserve control plane")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def exit_without_teardown(status: int) -> NoReturn:
    """Flush logs and output, then exit skipping interpreter teardown: vLLM's imports (triton's
    nanobind bindings) report dozens of "leaked" objects at exit, which is noise after a clean
    shutdown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_without_teardown(main())
