"""ttserve: LLM serving for Tenstorrent meshes, split into gateway, control plane and workers."""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("ttserve")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+src"
