"""A lane group of one lane, the unit production steps a single-lane worker with (control/lanes.py),
with the lane's queues, pool and slots readable through it, so tests of one lane's scheduling
drive the same loop as production."""
from __future__ import annotations

from typing import Any

from ttserve.control.lanes import LaneGroup
from ttserve.control.phase import PhasePolicy
from ttserve.control.scheduler import Scheduler


class LaneOfOne(LaneGroup):
    def __init__(self, lane: Scheduler, policy: PhasePolicy | None = None) -> None:
        super().__init__([lane], policy)

    @property
    def lane(self) -> Scheduler:
        return self.lanes[0]

    def __getattr__(self, name: str) -> Any:  # add, finish, pool, running, waiting, ...
        return getattr(self.lanes[0], name)
