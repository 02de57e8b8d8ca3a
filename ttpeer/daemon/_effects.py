"""The daemon's effects: one handler per effect type, in two tables.

Theory of operation. The machine decides; the node executes. ``Effects.execute`` runs
the cheap effects at once on the trio thread (``_INLINE``: persist a record, queue a
message, mark a shard cancelled, start fetching a round's slices ahead of its close,
start writing a finished job's files), and the long ones (``_TASKS``: prepare, train,
publish a delta, reduce a slice, aggregate, apply, fetch a state, publish a checkpoint) as
tasks in the node's nursery, each inside ``_guarded``, the one boundary that judges
their errors, and each reporting its result back into the machine.

What it promises: a full disk stops the daemon (retrying would only fail again); a
task's own failure ends its job on this peer; an error of ttpeer's tree is reported
(``Failed``, after ``StateLost``/``WorkLost`` when it says so) and the machine retries
when it sees fit; any other exception is a bug that costs its job, never the daemon.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import trio

from ttpeer._chunked import run_matches
from ttpeer._trim import trim
from ttpeer.errors import DiskError, LocalWorkLost, StateMissing, TaskFailed, TtpeerError
from ttpeer.net import NetError
from ttpeer.proto import (
    Aggregate,
    Aggregated,
    Applied,
    Apply,
    Broadcast,
    Cancel,
    CheckpointPublished,
    DatasetMissing,
    Declined,
    DeltaEncoded,
    DeltaPublished,
    Effect,
    Failed,
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

from ._counters import Counters
from ._data import Datasets
from ._executor import Decline, Deltas, Executor
from ._home import Home, PoolConfig
from ._keys import RANGES_AT_ONCE, Blobs, PoolKeys, SealError, in_order, off_span
from ._recordlog import RecordLog
from ._relays import Follower
from ._replay import ReplayGuard

log = logging.getLogger("ttpeer.daemon")


class SliceMismatch(TtpeerError):
    """A reduced slice's blob does not hash or size as its record says."""


class Host(Protocol):
    """What the effects use of the running node (``_node.Node`` is one)."""

    machine: PeerMachine
    me: str
    cfg: PoolConfig
    home: Home
    executor: Executor
    log: RecordLog
    replay: ReplayGuard
    keys: PoolKeys
    blobs: Blobs
    counters: Counters
    data: Datasets
    relays: Follower
    nursery: trio.Nursery | None
    outbox_send: trio.MemorySendChannel[tuple[str | None, bytes]]

    @property
    def pool_key(self) -> bytes | None: ...
    @property
    def bytes_sent(self) -> int: ...
    @property
    def bytes_received(self) -> int: ...
    def now(self) -> float: ...
    def process(self, effects: list[Effect], *, wake: bool = True) -> None: ...
    def disk_full(self, exc: DiskError) -> None: ...


@dataclass
class _Progress:
    """Batches done in the shard in training: written by the training thread (one int),
    read on the trio thread, where the times are taken: no lock for a progress hint."""

    started: float  # trio time
    done: int = 0

    def stopper(self, cancelled: Callable[[], bool]) -> Callable[[], bool]:
        calls = 0

        def should_stop() -> bool:  # asked before every batch
            nonlocal calls
            self.done = max(0, calls)
            calls += 1
            return cancelled()

        return should_stop

    def rate(self, now: float) -> float:
        elapsed = now - self.started
        return self.done / elapsed if self.done and elapsed > 0 else 0.0


class Effects:
    def __init__(self, node: Host) -> None:
        self._node = node
        self.cancelled: set[tuple[str, int, int]] = set()
        self.progress: dict[tuple[str, int, int], _Progress] = {}  # the shard in training
        self._job_done: dict[str, trio.Event] = {}
        self._released: set[str] = set()  # jobs whose executor state was freed (ended here)
        self.finished: dict[str, str] = {}  # job -> the state whose final files this peer wrote
        # job -> what this peer is doing before it can train it ("loading the task"...), for status
        self.phases: dict[str, str] = {}
        # Reduced slices fetched ahead of their close (``FetchSlices``), of one round at a
        # time: blob -> plaintext, and the fetches still under way (an Apply waits for them).
        self._ahead: dict[str, bytes] = {}
        self._ahead_round: tuple[str, int] | None = None
        self._ahead_pending: dict[str, trio.Event] = {}
        self.slices_ahead_used = 0  # slices a close applied that had come ahead of it (tests)

    def done_event(self, job: str) -> trio.Event:
        return self._job_done.setdefault(job, trio.Event())

    def execute(self, eff: Effect) -> None:
        """Cheap effects run here and now; long ones (``_TASKS``) as tasks in the nursery,
        inside ``_guarded``, that report back into the machine when done."""
        assert self._node.nursery is not None, "effects run only inside Node.run"
        if log.isEnabledFor(logging.DEBUG) and not isinstance(eff, (Broadcast, Send, Persist)):
            log.debug("effect %s", describe_effect(eff))
        inline = _INLINE.get(type(eff))
        if inline is not None:
            inline(self, eff)
        elif type(eff) in _TASKS:
            self._node.nursery.start_soon(self._guarded, eff)
        else:
            raise TypeError(f"unknown effect {eff!r}")

    async def _guarded(self, eff: Effect) -> None:
        """Run ``eff``'s handler; the one place its errors are judged. A full disk stops the
        daemon (retrying would only fail again); the task's own failure ends the job here;
        an error of the tree is reported (``Failed``, after ``StateLost``/``WorkLost`` when
        that is what it says), so the machine retries; anything else is a bug that costs
        the job, not the daemon."""
        try:
            await _TASKS[type(eff)](self, eff)
        except DiskError as exc:
            self._node.disk_full(exc)
        except TaskFailed as exc:
            self.task_failed(_job_of(eff), exc.reason)
        except (NetError, SealError, TtpeerError) as exc:
            log.warning("%s failed: %s", type(eff).__name__, exc)
            if isinstance(exc, StateMissing):  # so the machine recomputes or fetches it
                self._report(StateLost(exc.state))
            if isinstance(exc, LocalWorkLost):  # so the machine trains those shards again
                self._report(WorkLost(exc.job))
            self._report(Failed(eff))
        except Exception as exc:  # noqa: BLE001 - the last resort: a bug fails the job, not the daemon
            self._bug(_job_of(eff), type(eff).__name__, exc)

    def _report(self, result: Any) -> None:
        self._node.process(self._node.machine.report(result, self._node.now()))

    def queue(self, peer: str | None, payload: bytes, kind: bytes = b"P") -> None:
        """Seal a payload of ``kind`` (gossip; ``W``: a want) and queue it for ``peer`` (None: every peer)."""
        if self._node.pool_key is None:
            return  # not a full member yet: gossip will resend once we are
        sealed = self._node.keys.seal_gossip(self._node.me, self._node.replay.next_counter(), payload, kind)
        try:
            self._node.outbox_send.send_nowait((peer, sealed))
        except trio.WouldBlock:
            log.warning("outbox full; dropping a gossip payload (anti-entropy resends it)")

    def _persist(self, rec: Record) -> None:
        self._node.log.append(rec.raw)
        if rec.kind == "relays":  # the pool's relays moved: this peer follows (``_relays``)
            self._node.relays.follow(rec)

    def _on_cancel(self, eff: Cancel) -> None:
        self.cancelled.add((eff.job, eff.round, eff.shard))

    def _on_job_done(self, eff: JobDone) -> None:
        assert self._node.nursery is not None
        if self._ahead_round is not None and self._ahead_round[0] == eff.job.id:
            # Slices of its last round that no close read: not needed now, nor those still
            # on their way (``_fetch_ahead`` keeps only its round's).
            self._ahead.clear()
            self._ahead_round = None
        self._node.nursery.start_soon(self._finish, eff.job, eff.state)

    async def _prepare(self, eff: PrepareJob) -> None:
        job = eff.job
        try:
            with self._phase(job.id, "fetching the task file"):
                task_file = (open_task(self._node.cfg.pool, await self._node.blobs.get(job["task_blob"]))
                             if job["task_blob"] else None)
        except TaskSignatureError as exc:
            log.warning("refusing job %s: %s", job.id[:12], exc)
            self._report(Declined(job.id, str(exc), code="refused"))
            return
        if job.body.get("datasets"):  # before the worker loads the task: it reads them
            try:
                await self._node.data.ensure(job, lambda text: self.phases.__setitem__(job.id, text))
            finally:
                self.phases.pop(job.id, None)
        with self._phase(job.id, "loading the task and its data, checking it fits"):
            decline = await self._node.executor.prepare(job, task_file)
        if isinstance(decline, str):
            decline = Decline(decline)
        if decline is not None:
            log.warning("declining job %s: %s", job.id[:12], decline.reason)
            self._report(Declined(job.id, decline.reason, decline.need, decline.have, decline.code))
        else:
            self._report(Prepared(job.id))
            if job.body.get("samples") and self._node.nursery is not None:  # the first shard's pieces
                self._node.nursery.start_soon(self._guarded_look_ahead, job, self._node.machine.chain(job).round)

    async def fetch_missing(self, job: Record, exc: DatasetMissing) -> None:
        """The task read pieces of a dataset that are not here (``DatasetMissing`` with
        pieces, raised before it did anything), or a whole dataset of its job: fetch them,
        so its call can be made again."""
        if not exc.pieces:  # the whole dataset (a task reading it with dataset_path too)
            dataset = (job.body.get("datasets") or {}).get(exc.name)
            if dataset is None:
                raise exc
            await self._node.data.fetch(dataset, exc.name, lambda t: self.phases.__setitem__(job.id, t), job)
            return
        log.info("job %s: fetching %d pieces of dataset %s for the task", job.id[:12], len(exc.pieces), exc.name)
        if job.id in self.phases:  # still preparing: status says what it waits for
            await self._node.data.fetch(exc.dataset, exc.name, lambda t: self.phases.__setitem__(job.id, t), job,
                                        pieces=exc.pieces)
            return
        began = trio.current_time()
        await self._node.data.fetch(exc.dataset, exc.name, lambda _t: None, job, pieces=exc.pieces,
                                    within=float(job["lease"]))
        waited = trio.current_time() - began
        stats = self._node.counters.job(job.id)
        stats.data_waits += 1
        stats.data_wait_s += waited
        if stats.first_data_wait_s is None:
            stats.first_data_wait_s = waited

    async def _look_ahead(self, job: Record, rnd: int) -> None:
        """For a ``dataset_samples`` job, once prepared and while each shard trains: which
        pieces each shard of round ``rnd`` reads (the chain's round, then the next). Tell
        the machine which shards' data is here (it claims those first), and prefetch the
        pieces of this peer's share of the round (``PeerMachine.share``)."""
        if not job.body.get("samples") or job["mode"] == "ensemble":
            return
        plan = self._node.machine.plan(job)
        if not plan.has_round(rnd):
            return
        shards = list(range(job["shards"]))
        try:
            found = await self._node.executor.pieces(job, rnd, shards, plan.batches(rnd), plan.first_step(rnd))
        except TtpeerError as exc:
            log.debug("job %s: no look-ahead for round %d: %s", job.id[:12], rnd, exc)
            return
        if not found:
            return
        missing = {int(s): list(m) for s, m in found["missing"].items()}
        # This peer's share of the round: the shards the others leave to it first. Their
        # pieces are prefetched, so its claims there find them here (and say so).
        share = self._node.machine.share(job.id, rnd, len(shards))
        self._node.machine.prefer(job.id, rnd, {s: 0 if s in share else len(m) for s, m in missing.items()})
        self._node.data.prefetch(found["dataset"], found["name"],
                                 sorted({*found.get("test", ()), *(k for s in share for k in missing.get(s, ()))}))

    async def _train(self, eff: Train) -> None:
        job, key = eff.job, (eff.job.id, eff.round, eff.shard)
        self.cancelled.discard(key)
        if self._node.nursery is not None and job.body.get("samples"):
            self._node.nursery.start_soon(self._guarded_look_ahead, job, eff.round + 1)
        started = trio.current_time()
        progress = self.progress[key] = _Progress(started)
        try:
            samples = await self._node.executor.train(eff, progress.stopper(lambda: key in self.cancelled))
        finally:
            self.progress.pop(key, None)
            self.cancelled.discard(key)
        seconds = trio.current_time() - started
        stats = self._node.counters.job(job.id)
        stats.shards_trained += 1 if samples else 0
        stats.train_seconds += seconds
        batches = samples // job["batch_size"]
        self._report(Trained(job.id, eff.round, eff.shard, samples, batches, seconds))

    async def _guarded_look_ahead(self, job: Record, rnd: int) -> None:
        try:
            await self._look_ahead(job, rnd)
        except (TtpeerError, NetError) as exc:  # only a hint: a failure costs the prefetch
            log.info("job %s: looking ahead for round %d failed: %s", job.id[:12], rnd, exc)

    async def _publish_delta(self, eff: PublishDelta) -> None:
        job, rnd, base, shards = eff.job, eff.round, eff.base, eff.shards
        data, metrics = await self._node.executor.delta(eff)
        # The local model is free: the next shard trains while this delta uploads.
        self._report(DeltaEncoded(job, rnd, base, shards))
        blob = await self._node.blobs.upload_delta(data, cut=data[:4] == b"TTD2")
        if blob is None:
            self._report(Failed(eff))
            return
        stats = self._node.counters.job(job.id)
        stats.fp32_bytes += int(metrics.pop("fp32_bytes", 0))
        stats.wire_bytes += len(data)
        chunks = metrics.pop("chunks", None)
        self._report(DeltaPublished(job, rnd, base, shards, eff.samples, blob, len(data), metrics,
                                    None if chunks is None else int(chunks)))

    async def _reduce_slice(self, eff: ReduceSlice) -> None:
        if eff.sample and eff.against is not None and await self._sample_slice(eff, eff.against):
            return
        async with self._node.blobs.deltas(eff.job, eff.contribs, (eff.first, eff.stop)) as deltas:
            data = await self._node.executor.reduce_slice(eff.job, deltas, eff.first, eff.stop, rnd=eff.round)
        trim()
        sha = hashlib.sha256(data).hexdigest()
        blob: str | None = None
        if eff.against is None or eff.against["sha256"] != sha:
            if eff.against is not None:
                log.warning("slice %d of round %d (job %s) by %s did not reproduce here; publishing this "
                            "peer's own", eff.slice, eff.round, eff.job.id[:12], eff.against.author[:12])
            blob = await self._node.blobs.put(data)
        # Kept for the close that uses it (a check that reproduced ``against`` holds its bytes).
        kept = blob if blob is not None or eff.against is None else eff.against["blob"]
        if kept is not None:
            self._node.blobs.keep_slice(kept, data)
        self._report(SliceReduced(eff, sha, len(data), blob))

    async def _sample_slice(self, eff: ReduceSlice, rec: Record) -> bool:
        """A spot check of the result ``rec`` on one chunk of its slice, drawn here from this
        peer's own randomness (its author cannot foresee which): that chunk of every
        contribution is fetched and reduced, and the result downloaded (``_slice_result``;
        every peer needs it for the close, so it is kept). True when the chunk is the result's (its hash is
        signed, nothing uploaded); False when the whole slice is to be reduced. A result
        that does not hash as ``rec`` says is refused (``SliceRefused``: made again at once)."""
        chunk = eff.first + secrets.randbelow(eff.stop - eff.first)
        values = JobSpec.of(eff.job).chunk
        assert values is not None  # only a sliced job has slices

        async def alone() -> bytes:
            async with self._node.blobs.deltas(eff.job, eff.contribs, (chunk, chunk + 1)) as deltas:
                return await self._node.executor.reduce_slice(eff.job, deltas, chunk, chunk + 1, rnd=eff.round)

        data, part = await in_order([lambda: self._slice_result(rec), alone], limit=2)
        stats = self._node.counters.job(eff.job.id)
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
        self._node.blobs.keep_slice(rec["blob"], data)
        self._report(SliceReduced(eff, rec["sha256"], rec["size"], None))
        return True

    async def _slice_result(self, rec: Record) -> bytes:
        """The plaintext of the reduced slice of record ``rec``: the copy kept here (made or
        checked here), fetched ahead (waited for while under way), or downloaded. Raises
        ``SliceMismatch`` after ``SliceRefused`` when it does not size or hash as ``rec``
        says (the slice is then made again)."""
        pending = self._ahead_pending.get(rec["blob"])
        if pending is not None:  # fetched ahead right now: wait rather than fetch it twice
            await pending.wait()
        data = self._node.blobs.kept_slice(rec["blob"])
        if data is None and (data := self._ahead.pop(rec["blob"], None)) is not None:
            self.slices_ahead_used += 1
        if data is None:
            data = await self._node.blobs.get(rec["blob"], max_size=rec["size"] + 64, uploaders=[rec.author])
        if len(data) != rec["size"] or hashlib.sha256(data).hexdigest() != rec["sha256"]:
            self._node.blobs.refused("slice")
            self._report(SliceRefused(rec.id))
            raise SliceMismatch(f"slice {rec['slice']} of round {rec['round']} by {rec.author[:12]} does not "
                                "hash as its record says; it is made again")
        return data

    @contextlib.asynccontextmanager
    async def _outer_inputs(self, job: Record, contribs: tuple[Record, ...],
                            slices: tuple[Record, ...]) -> AsyncIterator[Deltas]:
        """What a close applies: the contributions' deltas, or a sliced close's reduced
        slices, each checked against its record (a slice that is not is refused)."""
        if not slices:
            async with self._node.blobs.deltas(job, contribs) as deltas:
                yield deltas
            return

        async def fetch(rec: Record) -> tuple[bytes, int]:
            return await self._slice_result(rec), 1

        # All at once (RANGES_AT_ONCE at a time): together they are one reduced model, held
        # here whichever way they come, and one at a time each cost a round trip.
        yield await in_order([functools.partial(fetch, rec) for rec in slices], limit=RANGES_AT_ONCE)

    def _on_fetch_slices(self, eff: FetchSlices) -> None:
        """Start fetching the slices not held here, ``RANGES_AT_ONCE`` at a time; each is
        marked pending at once, so an Aggregate or Apply started in the same step waits for
        it rather than fetch it too. Slices of an earlier round still held are dropped: one
        round's at most."""
        assert self._node.nursery is not None
        key = (eff.job.id, eff.round)
        if self._ahead_round != key:
            self._ahead.clear()
            self._ahead_round = key
        todo = [rec for rec in eff.slices if rec["blob"] not in self._ahead and rec["blob"] not in
                self._ahead_pending and self._node.blobs.kept_slice(rec["blob"]) is None]
        for rec in todo:
            self._ahead_pending[rec["blob"]] = trio.Event()
        if todo:
            self._node.nursery.start_soon(self._fetch_ahead, key, todo)

    async def _fetch_ahead(self, key: tuple[str, int], todo: list[Record]) -> None:
        """What does not come or does not check is left to the Aggregate or Apply that
        reads the slice (it fetches, checks and refuses it as ever): nothing is reported."""

        async def one(rec: Record) -> None:
            blob = rec["blob"]
            try:
                data = await self._node.blobs.get(blob, max_size=rec["size"] + 64, uploaders=[rec.author])
                if (self._ahead_round == key and len(data) == rec["size"]
                        and hashlib.sha256(data).hexdigest() == rec["sha256"]):
                    self._ahead[blob] = data
            except (NetError, SealError, TtpeerError) as exc:
                log.info("fetching slice %d of round %d ahead of its close failed (%s); it is fetched when "
                         "needed", rec["slice"], key[1], exc)
            except Exception:  # a bug here costs only the head start: the close fetches the slice
                log.exception("fetching slice %d of round %d ahead of its close failed", rec["slice"], key[1])
            finally:
                self._ahead_pending.pop(blob).set()

        await in_order([functools.partial(one, rec) for rec in todo], limit=RANGES_AT_ONCE)

    async def _aggregate(self, eff: Aggregate) -> None:
        async with self._outer_inputs(eff.job, eff.contribs, eff.slices) as deltas:
            state, metrics = await self._node.executor.aggregate(eff.job, eff.base, deltas, rnd=eff.round,
                                                                 sliced=bool(eff.slices), outer=eff.outer)
        trim()  # the blobs this close fetched: back to the system
        weights = tuple(cast("list[int]", metrics.pop("weights", None) or ()))  # an ensemble puts its vote there
        self._report(Aggregated(eff.job, eff.round, eff.base, tuple(c.id for c in eff.contribs), state, metrics,
                                tuple(s.id for s in eff.slices), weights, eff.outer))

    async def _apply(self, eff: Apply) -> None:
        job, close = eff.job, eff.close
        async with self._outer_inputs(job, eff.contribs, eff.slices) as deltas:
            ok = await self._node.executor.apply(job, close["base"], deltas, close["state"], rnd=close["round"],
                                                 sliced=bool(eff.slices), outer=eff.outer)
        trim()
        if not ok:
            log.warning("round %d of job %s did not reproduce state %s here; fetching a checkpoint instead",
                        close["round"], job.id[:12], close["state"][:19])
        self._report(Applied(close["state"], ok))

    async def _fetch_state(self, eff: FetchState) -> None:
        job, state = eff.job, eff.state
        what = "the initial state" if state == job["init"] else "the latest checkpoint"
        with self._phase(job.id, f"fetching {what}"), self._node.blobs.work_files(job.id, "fetch") as (sealed, plain):
            # The initial state this peer submitted is here already (it is checked all the same).
            if not await self._node.blobs.take_state(state, plain):
                await self._node.blobs.get_file(eff.blob, sealed, plain, uploaders=self._uploaders(job, eff.blob))
            ok = await self._node.executor.import_state(job, state, plain)
        self._report(Fetched(state, ok))

    def _uploaders(self, job: Record, blob: str) -> list[str]:
        """Who uploaded the state blob ``blob`` of ``job`` (the submitter, or the checkpoints'
        authors): the members that may serve it directly."""
        if blob == job.body.get("init_blob"):
            return [job.author]
        return sorted({r.author for r in self._node.machine.records.of_job(job.id, "ckpt") if r["blob"] == blob})

    async def _publish_checkpoint(self, eff: PublishCheckpoint) -> None:
        # File to file, a piece at a time: a model-sized state is never in the daemon's
        # memory (it was, three times over: bytes, sealed, in transport).
        with self._node.blobs.work_files(eff.job.id, "checkpoint") as (plain, sealed):
            # A held state is a file in the home, the bytes a checkpoint carries: copied from
            # there, it needs no worker (the job may have finished here long ago: an ask).
            try:
                await trio.to_thread.run_sync(shutil.copyfile, self._node.home.state_file(eff.job.id, eff.state), plain)
            except FileNotFoundError:
                await self._node.executor.export_state(eff.job, eff.state, plain)
            size = plain.stat().st_size
            blob = await self._node.blobs.put_file(plain, sealed)
        self._report(CheckpointPublished(eff.job, eff.round, eff.state, blob, size))

    def task_failed(self, job: Record, reason: str) -> None:
        log.error("job %s failed on this peer: %s", job.id[:12], reason)
        self._node.process(self._node.machine.report(JobFailed(job.id, reason), self._node.now()))
        self.release(job.id)

    def release(self, job: str) -> None:
        """The job ended here: the executor frees its model and worker processes."""
        if job not in self._released and self._node.nursery is not None:
            self._released.add(job)
            self._node.nursery.start_soon(self._node.executor.release, job)

    def release_ended(self) -> None:
        """Jobs the pool ended (cancelled, failed everywhere) hold nothing here any more."""
        rs = self._node.machine.records
        for job in rs.jobs():
            if job.id not in self._released and job_ended(rs, job) is not None:
                self.release(job.id)

    def _bug(self, job: Record, what: str, exc: Exception) -> None:
        """An exception outside the error tree escaped ``what``: log its traceback once and
        end the job on this peer, so a bug costs one job, never the daemon."""
        log.error("%s of job %s raised %s: a bug in ttpeer or an executor; the job ends on this peer "
                  "(please report this traceback)", what, job.id[:12], type(exc).__name__, exc_info=exc)
        self.task_failed(job, f"internal error: {type(exc).__name__}: {exc} (a bug; see this peer's log)")

    @contextlib.contextmanager
    def _phase(self, job: str, what: str) -> Iterator[None]:
        """Say in status what this peer is doing for ``job`` before it can train it."""
        self.phases[job] = what
        try:
            yield
        finally:
            if self.phases.get(job) == what:
                del self.phases[job]

    async def _finish(self, job: Record, state: str) -> None:
        try:
            await self._write_final(job, state)
        except DiskError as exc:
            self._node.disk_full(exc)
        except TaskFailed as exc:
            self.task_failed(job, exc.reason)
        except Exception as exc:  # noqa: BLE001 - as in _guarded: the job, not the daemon
            self._bug(job, "writing the final model", exc)

    async def _write_final(self, job: Record, state: str) -> None:
        chain = self._node.machine.chain(job)
        metrics = dict(chain.closes[-1]["metrics"]) if chain.closes else {}
        stats = self._node.counters.job(job.id)
        summary = {"job": job.id, "task": job["task"], "state": state, "rounds": chain.round,
                   "eval": metrics, "compression_ratio": stats.ratio(),
                   "weights": list(chain.closes[-1].body.get("weights", ())) if chain.closes else [],
                   "bytes_sent": self._node.bytes_sent, "bytes_received": self._node.bytes_received}
        await self._node.executor.finish(job, state, summary)
        self.finished[job.id] = state  # status says "done" from here: the final files exist
        self.done_event(job.id).set()
        log.info("job %s done: state %s", job.id[:12], state)


def _job_of(eff: Effect) -> Record:
    """The job of an effect that ``_guarded`` runs (each of them names one)."""
    job = getattr(eff, "job", None)
    if not isinstance(job, Record):
        raise TypeError(f"{type(eff).__name__} names no job")
    return job


# The handler of each effect: inline ones run at once on the trio thread, task ones in the
# node's nursery under ``Effects._guarded`` (their failure path), reporting back when done.
_INLINE: dict[type, Callable[[Effects, Any], None]] = {
    Persist: lambda fx, eff: fx._persist(eff.record),
    Broadcast: lambda fx, eff: fx.queue(None, eff.payload),
    Send: lambda fx, eff: fx.queue(eff.peer, eff.payload),
    Cancel: Effects._on_cancel,
    FetchSlices: Effects._on_fetch_slices,
    JobDone: Effects._on_job_done,
}
_TASKS: dict[type, Callable[[Effects, Any], Awaitable[None]]] = {
    PrepareJob: Effects._prepare,
    Train: Effects._train,
    PublishDelta: Effects._publish_delta,
    ReduceSlice: Effects._reduce_slice,
    Aggregate: Effects._aggregate,
    Apply: Effects._apply,
    FetchState: Effects._fetch_state,
    PublishCheckpoint: Effects._publish_checkpoint,
}
