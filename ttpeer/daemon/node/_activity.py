"""What this peer is doing for its jobs right now, for status and the ticker.

``Phases`` holds, per job, what this peer does before it can train it ("fetching the task
file", "loading the task..."): status shows it. ``Training`` holds the shards in training:
their progress (batches done, read by the ticker as ``Progress`` reports) and the ones the
machine cancelled (``Cancel``), which the training thread reads before every batch.
Neither reports anything itself: the effects (``_effects``) and the ticker do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import trio

from ttpeer.proto import Progress

Shard = tuple[str, int, int]  # (job, round, shard)


class Phases:
    def __init__(self) -> None:
        self.by_job: dict[str, str] = {}  # read by status

    def setter(self, job: str) -> Callable[[str], None]:
        """A callback that says ``job``'s phase (a dataset fetch names what it waits for)."""
        return lambda text: self.by_job.__setitem__(job, text)

    def clear(self, job: str) -> None:
        self.by_job.pop(job, None)

    @contextlib.contextmanager
    def during(self, job: str, what: str) -> Iterator[None]:
        """``job``'s phase is ``what`` while the block runs (unless a later one replaced it)."""
        self.by_job[job] = what
        try:
            yield
        finally:
            if self.by_job.get(job) == what:
                del self.by_job[job]


@dataclass
class ShardProgress:
    """Batches done in the shard in training: written by the training thread (one int),
    read on the trio thread, where the times are taken: no lock for a progress hint."""

    started: float  # trio time
    cancelled: Callable[[], bool]
    done: int = 0
    _asked: int = field(default=0, repr=False)

    def should_stop(self) -> bool:  # asked before every batch
        self.done = self._asked
        self._asked += 1
        return self.cancelled()

    def rate(self, now: float) -> float:
        elapsed = now - self.started
        return self.done / elapsed if self.done and elapsed > 0 else 0.0


class Training:
    def __init__(self) -> None:
        self.cancelled: set[Shard] = set()
        self.progress: dict[Shard, ShardProgress] = {}

    def cancel(self, job: str, rnd: int, shard: int) -> None:
        self.cancelled.add((job, rnd, shard))

    @contextlib.contextmanager
    def shard(self, key: Shard) -> Iterator[ShardProgress]:
        """``key`` trains while the block runs: a cancel from before it started is
        forgotten, one from while it runs stops it (``ShardProgress.should_stop``)."""
        self.cancelled.discard(key)
        progress = self.progress[key] = ShardProgress(trio.current_time(), lambda: key in self.cancelled)
        try:
            yield progress
        finally:
            self.progress.pop(key, None)
            self.cancelled.discard(key)

    def reports(self, now: float) -> list[Progress]:
        """The progress of each shard in training, ``now`` in trio time."""
        return [Progress(job, rnd, shard, p.done, p.rate(now)) for (job, rnd, shard), p in self.progress.items()]
