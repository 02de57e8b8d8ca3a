"""The dataset pieces a job's task reads: fetched when a call misses them, and ahead of need.

Theory of operation. ``fetch_missing`` is the executor's ``on_missing``: a task call that
read pieces not here (``DatasetMissing``, raised before it did anything) waits while they
are fetched, then is made again. While the job prepares, status says what it waits for
(``Phases``); once it trains, the wait is counted (``data_waits``). ``look_ahead`` runs
beside a ``dataset_samples`` job (once prepared, and while each shard trains): it asks the
worker which pieces each shard of a round reads, tells the machine which shards' data is
here (it claims those first), and prefetches this peer's share. A look-ahead is only a
hint: its failure costs the prefetch, and nothing is reported.
"""

from __future__ import annotations

import logging

import trio

from ttpeer.errors import TtpeerError
from ttpeer.net import NetError
from ttpeer.proto import DatasetMissing, JobSpec, PeerMachine

from .._counters import Counters
from .._executor import Executor
from ..data._data import Datasets
from ._activity import Phases

log = logging.getLogger("ttpeer.daemon")


class TaskData:
    """Fetches the pieces ``executor``'s tasks read through ``data``, as ``machine``'s
    plan places them; ``phases`` says what a preparing job waits for, ``counters`` the
    waits of a training one."""

    def __init__(self, machine: PeerMachine, executor: Executor, counters: Counters, data: Datasets,
                 phases: Phases) -> None:
        self._machine, self._executor, self._counters, self._data = machine, executor, counters, data
        self._phases = phases

    async def fetch_missing(self, job: JobSpec, exc: DatasetMissing) -> None:
        """The task read pieces of a dataset that are not here (``DatasetMissing`` with
        pieces, raised before it did anything), or a whole dataset of its job: fetch them,
        so its call can be made again."""
        phase = self._phases.setter(job.id)
        if not exc.pieces:  # the whole dataset (a task reading it with dataset_path too)
            dataset = job.datasets.get(exc.name)
            if dataset is None:
                raise exc
            await self._data.fetch(dataset, exc.name, phase, job.record)
            return
        log.info("job %s: fetching %d pieces of dataset %s for the task", job.id[:12], len(exc.pieces), exc.name)
        if job.id in self._phases.by_job:  # still preparing: status says what it waits for
            await self._data.fetch(exc.dataset, exc.name, phase, job.record, pieces=exc.pieces)
            return
        began = trio.current_time()
        await self._data.fetch(exc.dataset, exc.name, lambda _t: None, job.record, pieces=exc.pieces,
                                    within=float(job.lease))
        waited = trio.current_time() - began
        stats = self._counters.job(job.id)
        stats.data_waits += 1
        stats.data_wait_s += waited
        if stats.first_data_wait_s is None:
            stats.first_data_wait_s = waited

    async def look_ahead(self, job: JobSpec, rnd: int, log: logging.LoggerAdapter[logging.Logger]) -> None:
        """``_look_ahead``, whose failure is logged (``log``: the effect's that started it)."""
        try:
            await self._look_ahead(job, rnd, log)
        except (TtpeerError, NetError) as exc:  # only a hint: a failure costs the prefetch
            log.info("job %s: looking ahead for round %d failed: %s", job.id[:12], rnd, exc)

    async def _look_ahead(self, job: JobSpec, rnd: int, log: logging.LoggerAdapter[logging.Logger]) -> None:
        """For a ``dataset_samples`` job, once prepared and while each shard trains: which
        pieces each shard of round ``rnd`` reads (the chain's round, then the next). Tell
        the machine which shards' data is here (it claims those first), and prefetch the
        pieces of this peer's share of the round (``PeerMachine.share``)."""
        if not job.samples or not job.mode.shards_split_data:
            return
        plan = self._machine.plan(job.record)
        if not plan.has_round(rnd):
            return
        shards = list(range(job.shards))
        try:
            found = await self._executor.pieces(job, rnd, shards, plan.inner_steps(rnd), plan.first_step(rnd))
        except TtpeerError as exc:
            log.debug("job %s: no look-ahead for round %d: %s", job.id[:12], rnd, exc)
            return
        if not found:
            return
        missing = {int(s): list(m) for s, m in found["missing"].items()}
        # This peer's share of the round: the shards the others leave to it first. Their
        # pieces are prefetched, so its claims there find them here (and say so).
        share = self._machine.share(job.id, rnd, len(shards))
        self._machine.prefer(job.id, rnd, {s: 0 if s in share else len(m) for s, m in missing.items()})
        self._data.prefetch(found["dataset"], found["name"],
                                 sorted({*found.get("test", ()), *(k for s in share for k in missing.get(s, ()))}))
