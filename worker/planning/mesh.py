"""Which mesh a worker opens: `MESH_DEVICE` presets and "(r,c)" grids, `TT_VISIBLE_DEVICES`,
and the default fabric for each kind of mesh.

Pure Python: nothing here imports ttnn, so every mistake in these settings is refused before a
device is touched. The device count comes from the caller (what ttnn reports on this host).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

WORMHOLE, BLACKHOLE = "wormhole", "blackhole"

# The 32-chip Galaxy systems are opened as (8, 4), as the vLLM plugin's worker does.
GALAXY_GRID = (8, 4)

# name -> (rows, cols, arch, is_galaxy); arch None: the host's. The plugin's parse_mesh_grid maps
# TG to the Galaxy grid with no architecture check, and its README runs Qwen3-32B on a Blackhole
# Galaxy with MESH_DEVICE=TG: TG names the 32-chip Galaxy of either architecture.
PRESETS: dict[str, tuple[int, int, str | None, bool]] = {
    "N150": (1, 1, WORMHOLE, False),
    "N300": (1, 2, WORMHOLE, False),
    "N150x4": (1, 4, WORMHOLE, False),
    "T3K": (1, 8, WORMHOLE, False),
    "TG": (*GALAXY_GRID, None, True),
    "P100": (1, 1, BLACKHOLE, False),
    "P150": (1, 1, BLACKHOLE, False),
    "P150x2": (1, 2, BLACKHOLE, False),
    "P150x4": (1, 4, BLACKHOLE, False),
    "P150x8": (1, 8, BLACKHOLE, False),
    "P300": (1, 2, BLACKHOLE, False),
    "P300x2": (1, 4, BLACKHOLE, False),
    "BH-Galaxy": (*GALAXY_GRID, BLACKHOLE, True),
}

# Every ttnn.FabricConfig member of ttnn 0.81.1.
FABRIC_CONFIGS = ("DISABLED", "FABRIC_1D", "FABRIC_1D_RING", "FABRIC_1D_NEIGHBOR_EXCHANGE",
                  "FABRIC_2D", "FABRIC_2D_TORUS_X", "FABRIC_2D_TORUS_Y", "FABRIC_2D_TORUS_XY",
                  "CUSTOM")

_GRID = re.compile(r"^\s*[(\[]\s*(\d+)\s*,\s*(\d+)\s*[)\]]\s*$")


class MeshError(ValueError):
    """MESH_DEVICE or TT_VISIBLE_DEVICES names a mesh this host cannot open."""


@dataclass(frozen=True, slots=True)
class MeshSpec:
    name: str          # the preset, the "(r,c)" grid as written, or "(1,N)" when unset
    rows: int
    cols: int
    arch: str          # "wormhole" | "blackhole"
    is_galaxy: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def num_devices(self) -> int:
        return self.rows * self.cols


def normalize_arch(arch: str | None) -> str | None:
    """ttnn's arch names ("wormhole_b0", "blackhole", "invalid") -> "wormhole" | "blackhole" | None."""
    if not arch:
        return None
    arch = arch.lower()
    if arch.startswith("wormhole"):
        return WORMHOLE
    if arch.startswith("blackhole"):
        return BLACKHOLE
    return None


def parse_visible_devices(value: str | None) -> list[int] | None:
    """`TT_VISIBLE_DEVICES` as device ids; None when unset or empty."""
    if value is None or not value.strip():
        return None
    ids: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise MeshError(f"TT_VISIBLE_DEVICES={value!r}: {part!r} is not a device id; "
                            "expected a comma-separated list of non-negative integers, e.g. 0,1")
        if int(part) in ids:
            raise MeshError(f"TT_VISIBLE_DEVICES={value!r} names device {part} twice")
        ids.append(int(part))
    return ids


def resolve_mesh(mesh_device: str | None, num_devices: int, *, arch: str | None = None,
                 is_galaxy: bool | None = None, visible_devices: list[int] | None = None) -> MeshSpec:
    """The mesh to open, checked against the `num_devices` this host makes available.

    `arch` and `is_galaxy` are what the host reports (ttnn's arch name and cluster type); a preset
    carries its own arch and must agree with `arch` when given, except TG, which takes the host's.
    For TG, a grid or an unset MESH_DEVICE the arch defaults to wormhole and a 32-chip grid counts
    as a Galaxy.
    """
    host_arch = normalize_arch(arch)
    if mesh_device is None or not mesh_device.strip():
        if num_devices < 1:
            raise MeshError("no Tenstorrent devices are available" + _visible_note(visible_devices))
        spec = MeshSpec(f"(1,{num_devices})", 1, num_devices, host_arch or WORMHOLE,
                        bool(is_galaxy) if is_galaxy is not None else num_devices == 32)
    elif mesh_device in PRESETS:
        rows, cols, preset_arch, galaxy = PRESETS[mesh_device]
        if preset_arch is None:
            preset_arch = host_arch or WORMHOLE
        elif host_arch is not None and host_arch != preset_arch:
            raise MeshError(f"MESH_DEVICE={mesh_device} is a {preset_arch.title()} mesh, but this host's "
                            f"chips are {host_arch.title()}")
        spec = MeshSpec(mesh_device, rows, cols, preset_arch, galaxy)
    else:
        match = _GRID.match(mesh_device)
        if match is None:
            raise MeshError(_unknown_mesh(mesh_device))
        rows, cols = int(match.group(1)), int(match.group(2))
        if rows < 1 or cols < 1:
            raise MeshError(f"MESH_DEVICE={mesh_device!r}: rows and columns must be at least 1")
        galaxy = is_galaxy if is_galaxy is not None else rows * cols == 32
        spec = MeshSpec(mesh_device.strip(), rows, cols, host_arch or WORMHOLE, galaxy)
    if spec.num_devices > num_devices:
        raise MeshError(f"MESH_DEVICE={spec.name} needs {spec.num_devices} devices "
                        f"({spec.rows}x{spec.cols}) but this host has only {num_devices} available"
                        + _visible_note(visible_devices))
    return spec


def mesh_from_env(environ: Mapping[str, str], num_devices: int, *, arch: str | None = None,
                  is_galaxy: bool | None = None) -> MeshSpec:
    """`resolve_mesh` with MESH_DEVICE and TT_VISIBLE_DEVICES read from `environ`.

    `num_devices` is the count ttnn reports, which already honours TT_VISIBLE_DEVICES (the chip
    driver reads it itself; an n300 card is two chips behind one visible id).
    """
    visible = parse_visible_devices(environ.get("TT_VISIBLE_DEVICES"))
    return resolve_mesh(environ.get("MESH_DEVICE"), num_devices, arch=arch, is_galaxy=is_galaxy,
                        visible_devices=visible)


def default_fabric(spec: MeshSpec, cluster: str | None = None) -> str | None:
    """The fabric a mesh runs with when the user names none (None: no fabric).

    As the plugin's worker.py (get_fabric_config) chooses it: from the host's cluster type
    (ttnn.cluster.get_cluster_type()), not the mesh's shape, so a T3K-shaped submesh on a Galaxy
    host still gets the Galaxy's ring. Only ClusterType.GALAXY (the 6U Wormhole Galaxy) gets the
    ring and BLACKHOLE_GALAXY the 2D torus; every other cluster, the 4U Galaxy (ClusterType.TG,
    whose links tt-metal's Galaxy models run as a line) included, gets FABRIC_1D. Without a
    cluster type (a plan made off the hardware) the mesh's own kind stands in for it, a Wormhole
    Galaxy mesh as the 6U GALAXY.
    """
    if spec.num_devices == 1:
        return None
    if cluster is None:
        cluster = ("BLACKHOLE_GALAXY" if spec.arch == BLACKHOLE else "GALAXY") if spec.is_galaxy else ""
    if cluster == "BLACKHOLE_GALAXY":
        return "FABRIC_2D_TORUS_XY"
    if cluster == "GALAXY":
        return "FABRIC_1D_RING"
    return "FABRIC_1D"


def fabric_for(spec: MeshSpec, requested: str | None, cluster: str | None = None) -> str | None:
    """The fabric to set before opening `spec`: the user's choice, else the cluster's default.

    A single device never gets a fabric, whatever was asked; "DISABLED" means no fabric.
    """
    if spec.num_devices == 1:
        return None
    if requested is None:
        return default_fabric(spec, cluster)
    if requested not in FABRIC_CONFIGS:
        raise MeshError(f"fabric_config {requested!r} is not a ttnn fabric; choose one of "
                        f"{', '.join(FABRIC_CONFIGS)}")
    return None if requested == "DISABLED" else requested


def _unknown_mesh(name: str) -> str:
    hint = next((p for p in PRESETS if p.casefold() == name.strip().casefold()), None)
    did_you_mean = f" (did you mean {hint}?)" if hint else ""
    return (f"MESH_DEVICE={name!r} is not a mesh{did_you_mean}; use one of "
            f"{', '.join(PRESETS)}, or a grid such as (2,4)")


def _visible_note(visible: list[int] | None) -> str:
    if visible is None:
        return ""
    return f" (TT_VISIBLE_DEVICES={','.join(map(str, visible))})"
