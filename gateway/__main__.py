"""`python -m ttserve.gateway --control HOST:PORT [--port 8000] [--model PATH] ...`"""
import argparse
import logging
import os
import sys

from ttserve.gateway.config import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ttserve.gateway",
        description="OpenAI-compatible HTTP gateway: vLLM's frontend over a ttserve control plane")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: vLLM's imports (triton's nanobind bindings) report dozens of
    # "leaked" objects at exit, which is noise after a clean shutdown.
    os._exit(status)
