"""The daemon's effects: one handler per effect type, in two tables, and one funnel for
what they report.

Theory of operation. The machine decides; the node executes. ``Effects.execute`` gives
each effect an id (its kind and a number, ``Train#17``) and runs the cheap ones at once on the
trio thread (``_INLINE``: persist a record, queue a message, mark a shard cancelled, start
fetching a round's slices or deltas ahead of its close, start writing a finished job's files), and
the long ones (``_TASKS``: prepare, train, publish a delta, reduce a slice, aggregate,
apply, fetch a state, publish a checkpoint) as tasks in the node's nursery, each inside
``_guarded``: the one runner, which feeds the machine every report the handler makes
(``_feed``) and judges its errors.

A task handler is an async generator of its reports, as dask's instructions return their
events; it never calls the machine. A generator, not a returned list, because a report
must reach the machine when it is made: ``DeltaEncoded`` frees the local model, so the
next shard trains while the delta uploads; ``Prepared`` comes before the look-ahead it
starts. An error of the tree says what it means (``StateMissing``, ``LocalWorkLost``,
``SliceMismatch``), and the runner reports that (``StateLost``, ``WorkLost``,
``SliceRefused``) before ``Failed``. Each report fed, and each line a handler logs
(``EffectLog``), carries the effect's id.

What it promises: a full disk stops the daemon (retrying would only fail again); a
task's own failure ends its job on this peer; an error of ttpeer's tree is reported
(``Failed``, after what it says) and the machine retries when it sees fit; any other
exception is a bug that costs its job, never the daemon. What is not an effect lives
beside: what this peer is doing for its jobs (phases, the shards in training) in
``_activity``, the slices or deltas a close reads (some fetched ahead) in ``_slices``
and ``_deltas``, the dataset
pieces a task reads in ``_taskdata``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import secrets
import shutil
from collections.abc import AsyncGenerator, Callable, MutableMapping
from typing import Any, cast

import trio

from ttpeer._chunked import run_matches
from ttpeer._trim import trim
from ttpeer.errors import DiskError, LocalWorkLost, StateMissing, TaskFailed, TtpeerError
from ttpeer.net import NetError, PoolTransport
from ttpeer.proto import (
    Aggregate,
    Aggregated,
    Applied,
    Apply,
    Broadcast,
    Cancel,
    CheckpointPublished,
    Declined,
    DeltaEncoded,
    DeltaPublished,
    Effect,
    Failed,
    FetchDeltas,
    Fetched,
    FetchSlices,
    FetchState,
    JobDone,
    JobFailed,
    JobSpec,
    PeerMachine,
    Persist,
    Prepared,
    PrepareJob,
    PublishCheckpoint,
    PublishDelta,
    Record,
    ReduceSlice,
    Report,
    Send,
    SliceReduced,
    SliceRefused,
    StateLost,
    TaskSignatureError,
    Train,
    Trained,
    WorkLost,
    describe_effect,
    job_ended,
    open_task,
)

from .._counters import Counters
from .._executor import Decline, Executor
from .._home import Home
from .._lifetime import Lifetime
from .._offload import in_order, off_span
from ..data._data import Datasets
from ..sealed._blobs import Blobs
from ..sealed._keys import PoolKeys, SealError
from ._activity import Phases, Training
from ._recordlog import RecordLog
from ._relays import Follower
from ._replay import ReplayGuard
from ._slices import SliceMismatch, Slices
from ._taskdata import TaskData

log = logging.getLogger("ttpeer.daemon")


class EffectLog(logging.LoggerAdapter[logging.Logger]):
    """The daemon's log, each line led by the id of the effect it is about (``[Train#17]``)."""

    def __init__(self, eff: Effect, number: int) -> None:
        super().__init__(log)
        self.id = f"{type(eff).__name__}#{number}"

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.id}] {msg}", kwargs


Reports = AsyncGenerator[Report, None]  # what a task handler yields, one report at a time


class Effects:
    """Executes ``machine``'s effects with ``executor`` (the model), ``blobs`` and ``data``
    (what they fetch and upload), ``life`` (the nursery tasks run in; a full disk halts
    it), ``records`` (the log a ``Persist`` appends to; ``relays`` follows a new list),
    ``keys`` and ``replay`` (sealing what goes into ``outbox``); ``transport`` counts the
    bytes a finished job's summary states, ``finished`` is told which jobs' final files
    were written here; ``process`` executes what the machine answers each report."""

    def __init__(self, machine: PeerMachine, executor: Executor, blobs: Blobs, data: Datasets, home: Home,
                 counters: Counters, life: Lifetime, *, records: RecordLog, relays: Follower, keys: PoolKeys,
                 replay: ReplayGuard, outbox: trio.MemorySendChannel[tuple[str | None, bytes]],
                 transport: PoolTransport, finished: dict[str, str], now: Callable[[], float],
                 process: Callable[[list[Effect]], None]) -> None:
        self._machine, self._executor, self._blobs, self._data, self._home = machine, executor, blobs, data, home
        self._counters, self._life, self._records, self._relays = counters, life, records, relays
        self._keys, self._replay, self._outbox, self._transport = keys, replay, outbox, transport
        self._now, self._process = now, process
        self._numbers = itertools.count(1)  # each effect's id: its kind and the next number
        self.training = Training()  # the shards in training, their progress and cancellations
        self.phases = Phases()  # what this peer does for a job before it can train it (status)
        self.slices = Slices(blobs)  # reduced slices as a close reads them, some fetched ahead
        self.task_data = TaskData(machine, executor, counters, data, self.phases)  # the dataset pieces a task reads
        self._job_done: dict[str, trio.Event] = {}
        self._released: set[str] = set()  # jobs whose executor state was freed (ended here)
        self.finished = finished  # job -> the state whose final files this peer wrote

    def done_event(self, job: str) -> trio.Event:
        return self._job_done.setdefault(job, trio.Event())

    def execute(self, eff: Effect) -> None:
        """Cheap effects run here and now; long ones (``_TASKS``) as tasks in the nursery,
        inside ``_guarded``, which feeds their reports to the machine."""
        assert self._life.running, "effects run only inside Node.run"
        elog = EffectLog(eff, next(self._numbers))
        if log.isEnabledFor(logging.DEBUG) and not isinstance(eff, (Broadcast, Send, Persist)):
            elog.debug("effect %s", describe_effect(eff))
        inline = _INLINE.get(type(eff))
        if inline is not None:
            inline(self, eff, elog)
        elif type(eff) in _TASKS:
            self._life.start_soon(self._guarded, eff, elog)
        else:
            raise TypeError(f"unknown effect {eff!r}")

    async def _guarded(self, eff: Effect, log: EffectLog) -> None:
        """Run ``eff``'s handler, feeding the machine each report it yields; the one place
        its errors are judged. A full disk stops the daemon (retrying would only fail
        again); the task's own failure ends the job here; an error of the tree is reported
        (``Failed``, after what it says: ``_corrections``), so the machine retries; anything
        else is a bug that costs the job, not the daemon."""
        try:
            async with contextlib.aclosing(_TASKS[type(eff)](self, eff, log)) as reports:
                async for report in reports:
                    self._feed(report, log)
        except DiskError as exc:
            self._life.halt(exc)
        except TaskFailed as exc:
            self.task_failed(_job_of(eff), exc.reason, log)
        except (NetError, SealError, TtpeerError) as exc:
            log.warning("failed: %s", exc)
            for report in [*_corrections(exc), Failed(eff)]:
                self._feed(report, log)
        except Exception as exc:  # noqa: BLE001 - the last resort: a bug fails the job, not the daemon
            self._bug(_job_of(eff), type(eff).__name__, exc, log)

    def _feed(self, report: Report, log: EffectLog) -> None:
        """The funnel: every report of an effect reaches the machine here, at once."""
        log.debug("reports %s", type(report).__name__)
        self._process(self._machine.report(report, self._now()))

    def queue(self, peer: str | None, payload: bytes, kind: bytes = b"P") -> None:
        """Seal a payload of ``kind`` (gossip; ``W``: a want) and queue it for ``peer`` (None: every peer)."""
        if self._keys.newest is None:
            return  # not a full member yet: gossip will resend once we are
        sealed = self._keys.seal_gossip(self._machine.me, self._replay.next_counter(), payload, kind)
        try:
            self._outbox.send_nowait((peer, sealed))
        except trio.WouldBlock:
            log.warning("outbox full; dropping a gossip payload (anti-entropy resends it)")

    def _persist(self, rec: Record) -> None:
        self._records.append(rec.raw)
        if rec.kind == "relays":  # the pool's relays moved: this peer follows (``_relays``)
            self._relays.follow(rec)

    def _on_fetch_slices(self, eff: FetchSlices, log: EffectLog) -> None:
        assert self._life.nursery is not None
        self.slices.start_ahead(eff, self._life.nursery, log)

    def _on_fetch_deltas(self, eff: FetchDeltas, log: EffectLog) -> None:
        assert self._life.nursery is not None
        self.slices.deltas_ahead.start(eff, self._life.nursery, log)

    def _on_job_done(self, eff: JobDone, log: EffectLog) -> None:
        assert self._life.running
        self.slices.forget_job(eff.job.id)
        self._life.start_soon(self._finish, eff.job, eff.state, log)

    async def _prepare(self, eff: PrepareJob, log: EffectLog) -> Reports:
        job = eff.job
        try:
            with self.phases.during(job.id, "fetching the task file"):
                task_file = (open_task(self._machine.pool, await self._blobs.get(job.task_blob))
                             if job.task_blob else None)
        except TaskSignatureError as exc:
            log.warning("refusing job %s: %s", job.id[:12], exc)
            yield Declined(job.id, str(exc), code="refused")
            return
        except (NetError, SealError) as exc:  # as ``Failed`` would, but saying which file and why
            why = f"could not fetch the file of task {job.task!r}: {exc}"
            log.warning("declining job %s: %s", job.id[:12], why)
            yield Declined(job.id, why)
            return
        if job.datasets:  # before the worker loads the task: it reads them
            try:
                await self._data.ensure(job, self.phases.setter(job.id))
            finally:
                self.phases.clear(job.id)
        with self.phases.during(job.id, "loading the task and its data, checking it fits"):
            decline = await self._executor.prepare(job, task_file)
        if isinstance(decline, str):
            decline = Decline(decline)
        if decline is not None:
            log.warning("declining job %s: %s", job.id[:12], decline.reason)
            yield Declined(job.id, decline.reason, decline.need, decline.have, decline.code)
        else:
            yield Prepared(job.id)
            if job.samples and self._life.running:  # the first shard's pieces
                rnd = self._machine.chain(job.record).round
                self._life.start_soon(self.task_data.look_ahead, job, rnd, log)

    async def _train(self, eff: Train, log: EffectLog) -> Reports:
        job = eff.job
        if self._life.running and job.samples:
            self._life.start_soon(self.task_data.look_ahead, job, eff.round + 1, log)
        with self.training.shard((job.id, eff.round, eff.shard)) as progress:
            samples = await self._executor.train(eff, progress.should_stop)
        seconds = trio.current_time() - progress.started
        stats = self._counters.job(job.id)
        stats.shards_trained += 1 if samples else 0
        stats.train_seconds += seconds
        batches = samples // job.batch_size
        yield Trained(job.id, eff.round, eff.shard, samples, batches, seconds)

    async def _publish_delta(self, eff: PublishDelta, log: EffectLog) -> Reports:
        job, rnd, base, shards = eff.job, eff.round, eff.base, eff.shards
        data, metrics = await self._executor.delta(eff)
        # The local model is free: the next shard trains while this delta uploads.
        yield DeltaEncoded(job, rnd, base, shards)
        blob = await self._blobs.upload_delta(data, cut=data[:4] == b"TTD2")
        if blob is None:
            yield Failed(eff)
            return
        stats = self._counters.job(job.id)
        stats.fp32_bytes += int(metrics.pop("fp32_bytes", 0))
        stats.wire_bytes += len(data)
        chunks = metrics.pop("chunks", None)
        yield DeltaPublished(job, rnd, base, shards, eff.samples, blob, len(data), metrics,
                             None if chunks is None else int(chunks))

    async def _reduce_slice(self, eff: ReduceSlice, log: EffectLog) -> Reports:
        if eff.sample and eff.against is not None and await self._sample_slice(eff, eff.against, log):
            yield SliceReduced(eff, eff.against["sha256"], eff.against["size"], None)
            return
        async with self._blobs.deltas(eff.job, eff.contribs, (eff.first, eff.stop)) as deltas:
            data = await self._executor.reduce_slice(eff.job, deltas, eff.first, eff.stop, rnd=eff.round)
        trim()
        sha = hashlib.sha256(data).hexdigest()
        blob: str | None = None
        if eff.against is None or eff.against["sha256"] != sha:
            if eff.against is not None:
                log.warning("slice %d of round %d (job %s) by %s did not reproduce here; publishing this "
                            "peer's own", eff.slice, eff.round, eff.job.id[:12], eff.against.author[:12])
            blob = await self._blobs.put(data)
        # Kept for the close that uses it (a check that reproduced ``against`` holds its bytes).
        kept = blob if blob is not None or eff.against is None else eff.against["blob"]
        if kept is not None:
            self._blobs.keep_slice(kept, data)
        yield SliceReduced(eff, sha, len(data), blob)

    async def _sample_slice(self, eff: ReduceSlice, rec: Record, log: EffectLog) -> bool:
        """A spot check of the result ``rec`` on one chunk of its slice, drawn here from this
        peer's own randomness (its author cannot foresee which): that chunk of every
        contribution is fetched and reduced, and the result downloaded (``Slices.result``;
        every peer needs it for the close, so it is kept). True when the chunk is the result's (its hash is
        signed, nothing uploaded); False when the whole slice is to be reduced. A result
        that does not hash as ``rec`` says raises ``SliceMismatch`` (refused: made again at once)."""
        chunk = eff.first + secrets.randbelow(eff.stop - eff.first)
        values = eff.job.chunk
        assert values is not None  # only a sliced job has slices

        async def alone() -> bytes:
            async with self._blobs.deltas(eff.job, eff.contribs, (chunk, chunk + 1)) as deltas:
                return await self._executor.reduce_slice(eff.job, deltas, chunk, chunk + 1, rnd=eff.round)

        data, part = await in_order([lambda: self.slices.result(rec), alone], limit=2)
        stats = self._counters.job(eff.job.id)
        try:
            same = await off_span(len(data), run_matches, data, part, (chunk - eff.first) * values)
        except ValueError as exc:
            log.warning("slice %d of round %d (job %s) by %s cannot be compared on chunk %d (%s); reducing "
                        "the whole slice", eff.slice, eff.round, eff.job.id[:12], rec.author[:12], chunk, exc)
            same = False
        if not same:
            stats.sample_misses += 1
            log.warning("chunk %d of slice %d of round %d (job %s) by %s did not reproduce here; reducing the "
                        "whole slice", chunk, eff.slice, eff.round, eff.job.id[:12], rec.author[:12])
            return False
        stats.samples += 1
        self._blobs.keep_slice(rec["blob"], data)
        return True

    async def _aggregate(self, eff: Aggregate, log: EffectLog) -> Reports:
        async with self.slices.close_inputs(eff.job, eff.contribs, eff.slices) as deltas:
            state, metrics = await self._executor.aggregate(eff.job, eff.base, deltas, rnd=eff.round,
                                                                 sliced=bool(eff.slices), outer=eff.outer)
        trim()  # the blobs this close fetched: back to the system
        weights = tuple(cast("list[int]", metrics.pop("weights", None) or ()))  # an ensemble puts its vote there
        yield Aggregated(eff.job, eff.round, eff.base, tuple(c.id for c in eff.contribs), state, metrics,
                         tuple(s.id for s in eff.slices), weights, eff.outer)

    async def _apply(self, eff: Apply, log: EffectLog) -> Reports:
        job, close = eff.job, eff.close
        async with self.slices.close_inputs(job, eff.contribs, eff.slices) as deltas:
            ok = await self._executor.apply(job, close["base"], deltas, close["state"], rnd=close["round"],
                                                 sliced=bool(eff.slices), outer=eff.outer)
        trim()
        if not ok:
            log.warning("round %d of job %s did not reproduce state %s here; fetching a checkpoint instead",
                        close["round"], job.id[:12], close["state"][:19])
        yield Applied(close["state"], ok)

    async def _fetch_state(self, eff: FetchState, log: EffectLog) -> Reports:
        job, state = eff.job, eff.state
        what = "the initial state" if state == job.init else "the latest checkpoint"
        with (self.phases.during(job.id, f"fetching {what}"),
              self._blobs.work_files(job.id, "fetch") as (sealed, plain)):
            # The initial state this peer submitted is here already (it is checked all the same).
            if not await self._blobs.take_state(state, plain):
                await self._blobs.get_file(eff.blob, sealed, plain, uploaders=self._uploaders(job, eff.blob))
            ok = await self._executor.import_state(job, state, plain)
        yield Fetched(state, ok)

    def _uploaders(self, job: JobSpec, blob: str) -> list[str]:
        """Who uploaded the state blob ``blob`` of ``job`` (the submitter, or the checkpoints'
        authors): the members that may serve it directly."""
        if blob == job.init_blob:
            return [job.record.author]
        return sorted({r.author for r in self._machine.records.of_job(job.id, "ckpt") if r["blob"] == blob})

    async def _publish_checkpoint(self, eff: PublishCheckpoint, log: EffectLog) -> Reports:
        # File to file, a piece at a time: a model-sized state is never in the daemon's
        # memory (it was, three times over: bytes, sealed, in transport).
        with self._blobs.work_files(eff.job.id, "checkpoint") as (plain, sealed):
            # A held state is a file in the home, the bytes a checkpoint carries: copied from
            # there, it needs no worker (the job may have finished here long ago: an ask).
            try:
                await trio.to_thread.run_sync(shutil.copyfile, self._home.state_file(eff.job.id, eff.state), plain)
            except FileNotFoundError:
                await self._executor.export_state(eff.job, eff.state, plain)
            size = plain.stat().st_size
            blob = await self._blobs.put_file(plain, sealed)
        yield CheckpointPublished(eff.job, eff.round, eff.state, blob, size)

    def task_failed(self, job: JobSpec, reason: str, log: EffectLog) -> None:
        log.error("job %s failed on this peer: %s", job.id[:12], reason)
        self._feed(JobFailed(job.id, reason), log)
        self.release(job.id)

    def release(self, job: str) -> None:
        """The job ended here: the executor frees its model and worker processes."""
        if job not in self._released and self._life.running:
            self._released.add(job)
            self.slices.forget_job(job)
            self._life.start_soon(self._executor.release, job)

    def release_ended(self) -> None:
        """Jobs the pool ended (cancelled, failed everywhere) hold nothing here any more."""
        rs = self._machine.records
        for job in rs.jobs():
            if job.id not in self._released and job_ended(rs, job) is not None:
                self.release(job.id)

    def _bug(self, job: JobSpec, what: str, exc: Exception, log: EffectLog) -> None:
        """An exception outside the error tree escaped ``what``: log its traceback once and
        end the job on this peer, so a bug costs one job, never the daemon."""
        log.error("%s of job %s raised %s: a bug in ttpeer or an executor; the job ends on this peer "
                  "(please report this traceback)", what, job.id[:12], type(exc).__name__, exc_info=exc)
        self.task_failed(job, f"internal error: {type(exc).__name__}: {exc} (a bug; see this peer's log)", log)

    async def _finish(self, job: JobSpec, state: str, log: EffectLog) -> None:
        try:
            await self._write_final(job, state, log)
        except DiskError as exc:
            self._life.halt(exc)
        except TaskFailed as exc:
            self.task_failed(job, exc.reason, log)
        except Exception as exc:  # noqa: BLE001 - as in _guarded: the job, not the daemon
            self._bug(job, "writing the final model", exc, log)

    async def _write_final(self, job: JobSpec, state: str, log: EffectLog) -> None:
        chain = self._machine.chain(job.record)
        metrics = dict(chain.closes[-1]["metrics"]) if chain.closes else {}
        stats = self._counters.job(job.id)
        summary = {"job": job.id, "task": job.task, "state": state, "rounds": chain.round,
                   "eval": metrics, "compression_ratio": stats.ratio(),
                   "weights": list(chain.closes[-1].body.get("weights", ())) if chain.closes else [],
                   "bytes_sent": self._transport.bytes_sent, "bytes_received": self._transport.bytes_received}
        await self._executor.finish(job, state, summary)
        self.finished[job.id] = state  # status says "done" from here: the final files exist
        self.done_event(job.id).set()
        log.info("job %s done: state %s", job.id[:12], state)


def _corrections(exc: Exception) -> list[Report]:
    """What an error of the tree tells the machine before ``Failed``: a state not held
    here (so it recomputes or fetches it), shards' work lost (so it trains them again), a
    slice that does not hash as its record says (so it is made again)."""
    said: list[Report] = []
    if isinstance(exc, StateMissing):
        said.append(StateLost(exc.state))
    if isinstance(exc, LocalWorkLost):
        said.append(WorkLost(exc.job))
    if isinstance(exc, SliceMismatch):
        said.append(SliceRefused(exc.record))
    return said


def _job_of(eff: Effect) -> JobSpec:
    """The job of an effect that ``_guarded`` runs (each of them names one)."""
    job = getattr(eff, "job", None)
    if not isinstance(job, JobSpec):
        raise TypeError(f"{type(eff).__name__} names no job")
    return job


# The handler of each effect, given the effect and its log: inline ones run at once on the
# trio thread, task ones in the node's nursery under ``Effects._guarded``, which feeds the
# machine the reports they yield and judges their errors.
_INLINE: dict[type, Callable[[Effects, Any, EffectLog], None]] = {
    Persist: lambda fx, eff, _log: fx._persist(eff.record),
    Broadcast: lambda fx, eff, _log: fx.queue(None, eff.payload),
    Send: lambda fx, eff, _log: fx.queue(eff.peer, eff.payload),
    Cancel: lambda fx, eff, _log: fx.training.cancel(eff.job, eff.round, eff.shard),
    FetchSlices: Effects._on_fetch_slices,
    FetchDeltas: Effects._on_fetch_deltas,
    JobDone: Effects._on_job_done,
}
_TASKS: dict[type, Callable[[Effects, Any, EffectLog], Reports]] = {
    PrepareJob: Effects._prepare,
    Train: Effects._train,
    PublishDelta: Effects._publish_delta,
    ReduceSlice: Effects._reduce_slice,
    Aggregate: Effects._aggregate,
    Apply: Effects._apply,
    FetchState: Effects._fetch_state,
    PublishCheckpoint: Effects._publish_checkpoint,
}
