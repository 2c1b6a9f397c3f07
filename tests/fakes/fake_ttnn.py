"""A recording stand-in for the parts of the `ttnn` module (0.81.1 names; tt-metal's ttnn/ package,
as its wheel installs it) the worker uses.

Every call lands in one shared `Recorder`, together with the fake model's calls, so a test can
assert the order across both. `fail` makes a named call raise, as a chipless or broken host does.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Recorder:
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def add(self, name: str, **details: Any) -> None:
        self.calls.append((name, details))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def only(self, name: str) -> list[dict[str, Any]]:
        return [details for n, details in self.calls if n == name]


class FabricConfig(enum.Enum):
    DISABLED = 0
    FABRIC_1D = 1
    FABRIC_1D_RING = 2
    FABRIC_1D_NEIGHBOR_EXCHANGE = 3
    FABRIC_2D = 4
    FABRIC_2D_TORUS_XY = 5
    FABRIC_2D_TORUS_X = 6
    FABRIC_2D_TORUS_Y = 7
    CUSTOM = 8


class FabricReliabilityMode(enum.Enum):
    STRICT_INIT = 0
    RELAXED_INIT = 1
    DYNAMIC_RECONFIG = 2


class DispatchCoreAxis(enum.Enum):
    ROW = 0
    COL = 1


@dataclass(frozen=True)
class MeshShape:
    rows: int
    cols: int


class FakeMesh:
    def __init__(self, recorder: Recorder, name: str, num_devices: int, submeshes: int = 0,
                 shape: tuple[int, int] | None = None) -> None:
        self.recorder, self.name, self._num_devices = recorder, name, num_devices
        self.shape = shape or (1, num_devices)  # ttnn.MeshDevice.shape: (rows, cols), indexable
        self._submeshes = [FakeMesh(recorder, f"{name}/{i}", num_devices // max(submeshes, 1))
                           for i in range(submeshes)]

    def get_num_devices(self) -> int:
        return self._num_devices

    def get_submeshes(self) -> list[FakeMesh]:
        return list(self._submeshes)

    def __repr__(self) -> str:
        return f"FakeMesh({self.name})"


@dataclass(frozen=True)
class FakeEvent:
    number: int


class FakeTtnn:
    """Looks like the `ttnn` module to the worker."""

    __version__ = "0.81.1-fake"
    FabricConfig = FabricConfig
    FabricReliabilityMode = FabricReliabilityMode
    DispatchCoreAxis = DispatchCoreAxis
    MeshShape = MeshShape

    def __init__(self, recorder: Recorder | None = None, *, submeshes: int = 0,
                 fail: dict[str, BaseException] | None = None) -> None:
        self.recorder = recorder or Recorder()
        self.submeshes = submeshes
        self.fail = dict(fail or {})
        self._events = 0
        outer = self

        class DispatchCoreConfig:
            def __init__(self, type: Any = None, axis: Any = None) -> None:
                outer._record("DispatchCoreConfig", axis=axis)
                self.axis = axis

        self.DispatchCoreConfig = DispatchCoreConfig

    def _record(self, name: str, **details: Any) -> None:
        self.recorder.add(f"ttnn.{name}", **details)
        if name in self.fail:
            raise self.fail[name]

    def set_fabric_config(self, config: FabricConfig,
                          reliability_mode: FabricReliabilityMode = FabricReliabilityMode.STRICT_INIT,
                          **_: Any) -> None:
        self._record("set_fabric_config", config=config, reliability_mode=reliability_mode)

    def open_mesh_device(self, mesh_shape: MeshShape | None = None, **kwargs: Any) -> FakeMesh:
        self._record("open_mesh_device", mesh_shape=mesh_shape, **kwargs)
        return FakeMesh(self.recorder, "mesh", mesh_shape.rows * mesh_shape.cols, self.submeshes,
                        (mesh_shape.rows, mesh_shape.cols))

    def close_mesh_device(self, mesh: FakeMesh) -> None:
        self._record("close_mesh_device", mesh=mesh.name)

    def ReadDeviceProfiler(self, mesh: FakeMesh) -> None:  # noqa: N802 (ttnn's name)
        self._record("ReadDeviceProfiler", mesh=mesh.name)

    def record_event(self, mesh: FakeMesh, cq_id: int = 0) -> FakeEvent:
        self._events += 1
        self._record("record_event", event=self._events)
        return FakeEvent(self._events)

    def event_synchronize(self, event: FakeEvent) -> None:
        self._record("event_synchronize", event=event.number)

    def GetNumAvailableDevices(self) -> int:  # noqa: N802 (ttnn's name)
        self._record("GetNumAvailableDevices")
        return 8
