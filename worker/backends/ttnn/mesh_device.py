"""The chips and the mesh for the ttnn backend: is there anything to run on (`probe_chips`, in a
child process bounded in time), and the mesh's life: `open_mesh` sets the fabric before the mesh
opens; `close_mesh` closes the submeshes, then the mesh, then resets the fabric. ttnn's multi-line
errors become one-line errors of a specific type (`device_errors`).

ttnn is imported only when a device is used: this module loads on any host, and its names are
those of ttnn 0.81.1. It imports neither torch nor other ttserve modules than planning's mesh and
options, so a ttnn-only environment (tests/ttnn_real_check.py) runs the start-up checks.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ...planning.mesh import MeshError, MeshSpec, fabric_for, parse_visible_devices
from ...planning.options import DEFAULT_TRACE_REGION_SIZE, trace_flags

log = logging.getLogger(__name__)

DEVICE_DIR = "/dev/tenstorrent"   # the kernel driver's nodes, one per PCIe device id
PROBE_TIMEOUT_S = 60.0            # a Galaxy's cluster discovery takes seconds, a hung chip forever
GALAXY_CLUSTERS = ("GALAXY", "TG", "BLACKHOLE_GALAXY")


class TtnnUnavailable(RuntimeError):
    """ttnn cannot run here (not importable, or no chips); the message is one line."""


class DeviceError(RuntimeError):
    """A ttnn call failed; the message says which and why, in one line."""


class MeshOpenError(DeviceError):
    """The mesh did not open (a busy or unhealthy chip, a bad device parameter)."""


class TraceRegionError(DeviceError):
    """A trace needs more room than tt.trace_region_size gives it."""


# ---- is there anything to run on? ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChipProbe:
    ok: bool
    reason: str                 # why not, or what was found
    num_devices: int = 0        # what ttnn reports (already narrowed by TT_VISIBLE_DEVICES)
    arch: str | None = None     # ttnn's arch name, e.g. "wormhole_b0", "blackhole"
    is_galaxy: bool = False
    cluster: str | None = None  # ttnn.cluster.get_cluster_type().name, e.g. "GALAXY", "T3K", "N300"


_PROBE_MARK = "TTSERVE_PROBE "
_PROBE_SCRIPT = f"""
import json
def answer(**fields):
    print({_PROBE_MARK!r} + json.dumps(fields), flush=True)
try:
    import ttnn
except Exception as e:
    answer(error="import ttnn failed: " + type(e).__name__ + ": " + str(e))
    raise SystemExit(0)
try:
    n = int(ttnn.GetNumAvailableDevices())
    arch = str(ttnn.get_arch_name())
    cluster = ttnn.cluster.get_cluster_type().name
except Exception as e:
    answer(error=str(e))
else:
    answer(num_devices=n, arch=arch, cluster=cluster)
"""


def probe(timeout_s: float = PROBE_TIMEOUT_S, device_dir: str | None = DEVICE_DIR) -> tuple[bool, str]:
    """Whether ttnn imports and sees chips here, and why not. Never hangs: see `probe_chips`."""
    found = probe_chips(timeout_s, device_dir)
    return found.ok, found.reason


def probe_chips(timeout_s: float = PROBE_TIMEOUT_S, device_dir: str | None = DEVICE_DIR) -> ChipProbe:
    """What ttnn sees on this host, asked in a child process that is killed after `timeout_s`.

    Cheap checks first: without a ttnn module or without driver device nodes under `device_dir`
    (None skips that check) the answer comes without starting anything. The child process keeps
    a hung chip or driver from hanging the worker, and keeps ttnn's cluster state out of it.
    """
    if importlib.util.find_spec("ttnn") is None:
        return ChipProbe(False, f"ttnn is not installed for this Python "
                                f"({sys.version_info.major}.{sys.version_info.minor}); "
                                "ttnn wheels exist for Python 3.10 and 3.12")
    if device_dir is not None and not os.environ.get("TT_METAL_SIMULATOR"):
        refusal = _device_nodes_refusal(device_dir)
        if refusal:
            return ChipProbe(False, refusal)
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return ChipProbe(False, f"ttnn did not answer within {timeout_s:.0f} s: a chip or its driver "
                                "may be hung (tt-smi -r resets the chips)")
    answer = next((json.loads(line[len(_PROBE_MARK):]) for line in reversed(done.stdout.splitlines())
                   if line.startswith(_PROBE_MARK)), None)
    if answer is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return ChipProbe(False, f"the ttnn probe exited with status {done.returncode}: {tail}")
    if "error" in answer:
        return ChipProbe(False, _chips_problem(answer["error"]))
    if answer["num_devices"] < 1:
        return ChipProbe(False, "no Tenstorrent chips detected on this host (ttnn counts 0 devices)")
    return ChipProbe(True, f"{answer['num_devices']} {answer['arch']} chip(s), cluster {answer['cluster']}",
                     answer["num_devices"], answer["arch"], answer["cluster"] in GALAXY_CLUSTERS,
                     answer["cluster"])


def require_chips(timeout_s: float = PROBE_TIMEOUT_S, device_dir: str | None = DEVICE_DIR) -> ChipProbe:
    """`probe_chips`, raising the one-line start-up failure when there is nothing to run on."""
    found = probe_chips(timeout_s, device_dir)
    if not found.ok:
        raise TtnnUnavailable(unavailable_message(found.reason))
    return found


def unavailable_message(reason: str) -> str:
    return f"ttnn backend: {reason}; use --backend torch or sim"


def _device_nodes_refusal(device_dir: str) -> str | None:
    try:
        nodes = sorted(int(n) for n in os.listdir(device_dir) if n.isdigit())
    except OSError:
        nodes = []
    if not nodes:
        return f"no Tenstorrent chips detected on this host (no devices under {device_dir})"
    try:
        visible = parse_visible_devices(os.environ.get("TT_VISIBLE_DEVICES"))
    except MeshError as e:
        return str(e)
    missing = sorted(set(visible or []) - set(nodes))
    if missing:
        return (f"TT_VISIBLE_DEVICES names device(s) {','.join(map(str, missing))}, but this host has "
                f"{','.join(map(str, nodes))} under {device_dir}")
    return None


def _chips_problem(error: str) -> str:
    detail = one_line(error)
    if "no chips detected" in error.lower():
        return f"no Tenstorrent chips detected on this host (ttnn: {detail})"
    return f"ttnn cannot use the chips on this host ({detail})"


def one_line(error: BaseException | str) -> str:
    """The line of a tt-metal error that says what went wrong (TT_FATAL puts it after "info:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if "info:" in lines and lines.index("info:") + 1 < len(lines):
        return lines[lines.index("info:") + 1]
    return lines[0] if lines else type(error).__name__


# ---- the mesh --------------------------------------------------------------------------------

def device_params(options: Mapping[str, Any]) -> dict[str, int]:
    """`open_mesh_device` keyword arguments from the tt options.

    The trace region is reserved only when some step kind is traced (default 50,000,000 bytes).
    """
    params = {}
    if trace_flags(options).any:
        params["trace_region_size"] = int(options.get("trace_region_size", DEFAULT_TRACE_REGION_SIZE))
    for key in ("worker_l1_size", "l1_small_size"):
        if key in options:
            params[key] = int(options[key])
    return params


def open_mesh(spec: MeshSpec, options: Mapping[str, Any], *, ttnn: Any = None, cluster: str | None = None) -> Any:
    """Opens `spec` as one ttnn mesh device; the fabric (by default the host `cluster`'s) is
    configured before the mesh opens."""
    t = load_ttnn(ttnn)
    requested = options.get("fabric_config")
    fabric = fabric_for(spec, requested, cluster)
    if requested not in (None, "DISABLED") and fabric is None:
        log.warning("tt.fabric_config=%s ignored: %s is a single device", requested, spec.name)
    if fabric:
        reliability = options.get("fabric_reliability_mode", "STRICT_INIT")
        log.info("fabric %s (%s) for mesh %s", fabric, reliability, spec.name)
        with device_errors(f"setting fabric {fabric}", MeshOpenError):
            t.set_fabric_config(_member(t, "FabricConfig", fabric, "fabric_config"),
                                _member(t, "FabricReliabilityMode", reliability, "fabric_reliability_mode"))
    try:
        kwargs: dict[str, Any] = device_params(options)
        axis = options.get("dispatch_core_axis")
        with device_errors(f"opening mesh {spec.name} ({spec.rows}x{spec.cols})", MeshOpenError):
            if axis:
                # 0.81.1 builds the dispatch config against the cluster: after the fabric is set.
                kwargs["dispatch_core_config"] = t.DispatchCoreConfig(
                    axis=t.DispatchCoreAxis.COL if axis == "col" else t.DispatchCoreAxis.ROW)
            mesh = t.open_mesh_device(t.MeshShape(spec.rows, spec.cols), **kwargs)
    except BaseException:
        if fabric:
            _reset_fabric_quietly(t)
        raise
    log.info("opened mesh %s (%dx%d): %s", spec.name, spec.rows, spec.cols,
             ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "default device parameters")
    return mesh


def close_mesh(mesh: Any, *, reset_fabric: bool | None = None, ttnn: Any = None) -> None:
    """Closes submeshes, then the mesh, then resets the fabric (by default when multi-device)."""
    t = load_ttnn(ttnn)
    if reset_fabric is None:
        reset_fabric = mesh.get_num_devices() > 1
    if hasattr(t, "ReadDeviceProfiler"):
        t.ReadDeviceProfiler(mesh)   # flushes device profiling; a no-op in builds without it
    for submesh in mesh.get_submeshes():
        t.close_mesh_device(submesh)
    t.close_mesh_device(mesh)
    if reset_fabric:
        t.set_fabric_config(t.FabricConfig.DISABLED)


def _reset_fabric_quietly(t: Any) -> None:
    try:
        t.set_fabric_config(t.FabricConfig.DISABLED)
    except Exception as e:  # the original failure is the one to report
        log.debug("fabric reset after a failed open also failed: %s", one_line(e))


def _member(t: Any, enum: str, name: str, option: str) -> Any:
    try:
        return getattr(getattr(t, enum), name)
    except AttributeError:
        raise MeshOpenError(f"tt.{option} = {name!r} is not a ttnn.{enum} member in ttnn "
                            f"{_ttnn_version()}") from None


def _ttnn_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ttnn")
    except PackageNotFoundError:
        return "(version unknown)"


@contextmanager
def device_errors(doing: str, error: type[DeviceError] = DeviceError) -> Iterator[None]:
    """Turns ttnn's multi-line RuntimeErrors into one-line errors of a specific type."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, (TtnnUnavailable, DeviceError)):
            raise
        text = str(e)
        if "no chips detected" in text.lower():
            raise TtnnUnavailable(unavailable_message(_chips_problem(text))) from None
        trace = _TRACE_REGION.search(text)
        if trace:
            need, have = int(trace.group(1)), int(trace.group(2))
            raise TraceRegionError(
                f"{doing}: a trace needs {need:,} bytes but the trace region holds {have:,}; "
                f"set --additional-config.tt.trace_region_size {need} or more") from None
        raise error(f"{doing}: {one_line(e)}") from e


_TRACE_REGION = re.compile(r"trace buffers of size (\d+)B.*?only (\d+)B is allocated for trace region",
                           re.S)


def load_ttnn(module: Any) -> Any:
    """The given ttnn module (tests pass a fake), else the real one (a sys.modules patch works)."""
    if module is not None:
        return module
    try:
        return importlib.import_module("ttnn")
    except ImportError as e:
        raise TtnnUnavailable(unavailable_message(f"ttnn is not importable ({e})")) from None
