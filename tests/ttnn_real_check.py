"""Runs worker/backends/ttnn/mesh_device.py against the real ttnn wheel, in a Python that has it
(3.10/3.12).

    <ttnn-python> tests/ttnn_real_check.py <repo-root>

ttserve is not installed in that Python, and its other modules need torch, so this maps only the
package folders (ttserve/ -> ttserve, worker/ -> ttserve.worker) without running their
__init__ files (the worker's subpackages have nothing in theirs); mesh_device imports nothing but
planning's mesh and options from ttserve. The last line printed is one JSON object, prefixed with
RESULT, for tests/test_ttnn_backend.py to read.
"""
from __future__ import annotations

import importlib
import json
import sys
import time
import types
from pathlib import Path

REQUIRED_NAMES = [
    "set_fabric_config", "FabricConfig", "FabricReliabilityMode", "open_mesh_device", "MeshShape",
    "DispatchCoreConfig", "DispatchCoreAxis", "close_mesh_device", "begin_trace_capture",
    "end_trace_capture", "execute_trace", "release_trace", "event_synchronize", "record_event",
    "GetNumAvailableDevices", "get_arch_name", "cluster", "ReadDeviceProfiler",
]


def main(repo: Path) -> dict:
    for name, folder in (("ttserve", "ttserve"), ("ttserve.worker", "worker")):
        package = types.ModuleType(name)
        package.__path__ = [str(repo / folder)]
        sys.modules[name] = package
    backend = importlib.import_module("ttserve.worker.backends.ttnn.mesh_device")
    mesh = importlib.import_module("ttserve.worker.planning.mesh")
    options = importlib.import_module("ttserve.worker.planning.options")
    import ttnn

    result: dict = {"ttnn_version": getattr(ttnn, "__version__", None),
                    "missing_names": [n for n in REQUIRED_NAMES if not hasattr(ttnn, n)],
                    "fabric_members": list(ttnn.FabricConfig.__members__),
                    "reliability_members": list(ttnn.FabricReliabilityMode.__members__),
                    "axis_members": list(ttnn.DispatchCoreAxis.__members__),
                    "reliability_allowed": _allowed(options, "fabric_reliability_mode"),
                    "fabric_allowed": list(mesh.FABRIC_CONFIGS)}
    result["probe"] = _timed(backend.probe)
    result["probe_ttnn"] = _timed(lambda: backend.probe(device_dir=None))
    result["require"] = _timed(lambda: backend.require_chips(device_dir=None))
    n150, t3k = mesh.resolve_mesh("N150", 1), mesh.resolve_mesh("T3K", 8)
    result["open_n150"] = _timed(lambda: backend.open_mesh(n150, {}))
    result["open_t3k"] = _timed(lambda: backend.open_mesh(t3k, {"trace_mode": "all"}))
    result["open_axis"] = _timed(lambda: backend.open_mesh(n150, {"dispatch_core_axis": "col"}))
    return result


def _allowed(options, key: str) -> list[str]:
    try:
        options.TT_OPTIONS[key]("k", "?not-a-value?")
    except options.OptionError as e:
        return str(e).split("choose one of ")[1].split(", ")
    return []


def _timed(call) -> dict:
    started = time.perf_counter()
    try:
        value = call()
        outcome = {"value": value if isinstance(value, (list, tuple, str, bool, int)) else repr(value)}
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        outcome = {"error": type(e).__name__, "message": str(e)}
    outcome["seconds"] = round(time.perf_counter() - started, 3)
    return outcome


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
