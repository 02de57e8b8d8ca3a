"""Where this peer's time goes, per job: the data behind utilization, the report's
time split and per-peer throughput.

Theory of operation. ``TimedExecutor`` and ``TimedTransport`` wrap the executor and
the transport the node drives (the node does not know); every executor call is
compute (``train`` separately: time in inner steps), every blob transfer is
communication, charged to the job the executor last worked on (a peer works on
one job at a time). Each contribution this peer publishes carries, in its
``metrics``, the split of the interval since its previous contribution (or since
the job started here):

    train_s        seconds in inner steps            compute_s  other torch work (delta, outer step, eval)
    comm_s         seconds moving blobs               idle_s     wall_s - the three above (at least 0)
    wall_s         the interval                       samples_per_s  samples / train_s
    compression    fp32 bytes / wire bytes of the delta
    train_loss     (from the executor) the mean loss of the inner steps since the last one

Training and transfers may overlap (a peer uploads while it trains the next
round), so idle is clamped at zero. The delta's upload happens after its
contribution's numbers are taken, so it counts in the next interval. Times are
trio's monotonic clock: no wall clock is read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ttpeer.proto import DatasetMissing, JobSpec, Outer, PublishDelta, Train

from .._executor import Decline, Deltas, Executor


@dataclass
class JobUsage:
    started: float
    train_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    samples: int = 0
    finished: float | None = None
    # totals when the last contribution was published
    mark_at: float = 0.0
    mark: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def wall(self, now: float) -> float:
        return (self.finished if self.finished is not None else now) - self.started

    def utilization(self, now: float) -> float | None:
        wall = self.wall(now)
        return round(min(1.0, self.train_s / wall), 4) if wall > 0 else None

    def interval(self, now: float, samples: int) -> dict[str, float]:
        """Metrics for a contribution of ``samples``: the split since the last one."""
        train = self.train_s - self.mark[0]
        compute = self.compute_s - self.mark[1]
        comm = self.comm_s - self.mark[2]
        wall = now - (self.mark_at or self.started)
        self.mark_at, self.mark = now, (self.train_s, self.compute_s, self.comm_s)
        out = {"train_s": train, "compute_s": compute, "comm_s": comm, "wall_s": wall,
               "idle_s": max(0.0, wall - train - compute - comm)}
        if train > 0 and samples:
            out["samples_per_s"] = samples / train
        return {k: round(v, 4) for k, v in out.items()}


class Usage:
    def __init__(self, clock: Callable[[], float] = trio.current_time) -> None:
        self.clock = clock
        self.jobs: dict[str, JobUsage] = {}
        self.current: str | None = None

    def job(self, job: str) -> JobUsage:
        self.current = job
        if job not in self.jobs:
            self.jobs[job] = JobUsage(self.clock())
        return self.jobs[job]

    def add(self, job: str | None, kind: str, seconds: float) -> None:
        if job is None:
            return
        ju = self.job(job)
        setattr(ju, kind, getattr(ju, kind) + seconds)


class TimedExecutor:
    """An ``Executor`` that times the one it wraps and adds the split to each delta's metrics."""

    def __init__(self, inner: Executor, usage: Usage) -> None:
        self.inner = inner
        self.usage = usage

    async def _timed(self, job: str, kind: str, call: Any) -> Any:
        self.usage.job(job)
        began = self.usage.clock()
        try:
            return await call
        finally:
            self.usage.add(job, kind, self.usage.clock() - began)

    async def new_job(self, spec: dict[str, Any], task_file: bytes | None) -> tuple[dict[str, Any], bytes | Path]:
        return await self.inner.new_job(spec, task_file)

    @property
    def on_missing(self) -> Callable[[JobSpec, DatasetMissing], Awaitable[None]] | None:
        """The inner executor's fetcher of missing dataset pieces."""
        return self.inner.on_missing

    @on_missing.setter
    def on_missing(self, fetch: Callable[[JobSpec, DatasetMissing], Awaitable[None]] | None) -> None:
        self.inner.on_missing = fetch

    async def pieces(self, job: JobSpec, rnd: int, shards: list[int], inner_steps: int,
                     first: int) -> dict[str, Any]:
        return await self.inner.pieces(job, rnd, shards, inner_steps, first)

    async def prepare(self, job: JobSpec, task_file: bytes | None) -> Decline | str | None:
        return await self._timed(job.id, "compute_s", self.inner.prepare(job, task_file))

    async def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        samples = await self._timed(eff.job.id, "train_s", self.inner.train(eff, should_stop))
        self.usage.job(eff.job.id).samples += samples
        return samples

    async def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        data, metrics = await self._timed(eff.job.id, "compute_s", self.inner.delta(eff))
        out = dict(metrics)
        out.update(self.usage.job(eff.job.id).interval(self.usage.clock(), eff.samples))
        if data and metrics.get("fp32_bytes"):
            out["compression"] = round(float(metrics["fp32_bytes"]) / len(data), 3)
        return data, out

    async def reduce_slice(self, job: JobSpec, deltas: Deltas, first: int, stop: int, *, rnd: int) -> bytes:
        return await self._timed(job.id, "compute_s", self.inner.reduce_slice(job, deltas, first, stop, rnd=rnd))

    async def aggregate(self, job: JobSpec, base: str, deltas: Deltas, *, rnd: int,
                        sliced: bool = False, outer: Outer | None = None) -> tuple[str, dict[str, float]]:
        return await self._timed(job.id, "compute_s",
                                 self.inner.aggregate(job, base, deltas, rnd=rnd, sliced=sliced, outer=outer))

    async def apply(self, job: JobSpec, base: str, deltas: Deltas, expect: str, *, rnd: int,
                    sliced: bool = False, outer: Outer | None = None) -> bool:
        return await self._timed(job.id, "compute_s",
                                 self.inner.apply(job, base, deltas, expect, rnd=rnd, sliced=sliced, outer=outer))

    async def export_state(self, job: JobSpec, state: str, out: Path) -> None:
        return await self._timed(job.id, "compute_s", self.inner.export_state(job, state, out))

    async def import_state(self, job: JobSpec, state: str, data: bytes | Path) -> bool:
        return await self._timed(job.id, "compute_s", self.inner.import_state(job, state, data))

    def held_states(self, job: str) -> set[str]:
        return self.inner.held_states(job)

    async def finish(self, job: JobSpec, state: str, metrics: dict[str, Any]) -> None:
        await self.inner.finish(job, state, metrics)
        self.usage.job(job.id).finished = self.usage.clock()

    async def release(self, job: str) -> None:
        await self.inner.release(job)


class TimedTransport:
    """A ``Transport`` that charges blob transfers to the job in progress; everything
    else passes through untouched (``bytes_sent``, ``recv``, ...)."""

    def __init__(self, inner: Any, usage: Usage) -> None:
        self._inner = inner
        self._usage = usage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def put_blob(self, data: bytes) -> str:
        job, began = self._usage.current, self._usage.clock()
        try:
            return await self._inner.put_blob(data)
        finally:
            self._usage.add(job, "comm_s", self._usage.clock() - began)

    async def put_blob_file(self, path: Path) -> str:
        job, began = self._usage.current, self._usage.clock()
        try:
            return await self._inner.put_blob_file(path)
        finally:
            self._usage.add(job, "comm_s", self._usage.clock() - began)

    async def get_blob_file(self, blob: str, path: Path, *, max_size: int) -> None:
        job, began = self._usage.current, self._usage.clock()
        try:
            await self._inner.get_blob_file(blob, path, max_size=max_size)
        finally:
            self._usage.add(job, "comm_s", self._usage.clock() - began)

    async def get_blob_range(self, blob: str, start: int, stop: int) -> bytes:
        job, began = self._usage.current, self._usage.clock()
        try:
            return await self._inner.get_blob_range(blob, start, stop)
        finally:
            self._usage.add(job, "comm_s", self._usage.clock() - began)

    async def get_blob(self, blob: str, *, max_size: int) -> bytes:
        job, began = self._usage.current, self._usage.clock()
        try:
            return await self._inner.get_blob(blob, max_size=max_size)
        finally:
            self._usage.add(job, "comm_s", self._usage.clock() - began)
