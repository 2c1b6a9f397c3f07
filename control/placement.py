"""Where a new request runs: the least-loaded lane across all lane groups, for good.

Load score = waiting x 4 + running (waiting work weighs more: it has not started and will hold
its lane longest), ties to the lowest (worker, lane). With prefix caching, a lane that already
holds the request's prefix blocks wins among lanes within one waiting request of the best score:
a cache hit saves more than a slightly shorter queue.
"""
from __future__ import annotations

from dataclasses import dataclass

from .request import Request
from .scheduler import Scheduler

NEAR_EQUAL = 4  # one waiting request


@dataclass(slots=True)
class Candidate:
    worker: int
    index: int
    lane: Scheduler

    @property
    def score(self) -> int:
        return self.lane.num_waiting * 4 + len(self.lane.running)


def choose_lane(candidates: list[Candidate], request: Request) -> Candidate:
    """The candidate lane for `request`; candidates are in (worker, lane) order."""
    best = min(candidates, key=lambda c: c.score)
    caching = [c for c in candidates if c.lane.pool.enable_caching and c.score <= best.score + NEAR_EQUAL]
    if caching and request.num_tokens > caching[0].lane.pool.block_size:
        hashes = request.full_block_hashes(caching[0].lane.pool.block_size, request.num_tokens - 1)
        hits = [(c.lane.pool.lookup(hashes).num_blocks, -c.score) for c in caching]
        top = max(hits)
        if top[0] > 0:
            best = caching[hits.index(top)]
    return best
