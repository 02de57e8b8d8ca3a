"""The real executor: torch in worker threads, states on disk.

Theory of operation. Per job it keeps the loaded task, this peer's inner trainer
(its AdamW state persists across rounds, as in DiLoCo), its error-feedback
residual, and the model states it holds. Every held state is written to
``HOME/states/<job>/<hash>.state`` atomically before it is reported held, so a
peer killed at any moment restarts from a state the pool agreed on; only the
newest few are kept on disk. A fused job keeps none in memory: a state is read from
its file where it is used (a shard's start reads the base's params into the local
model, the delta reads them a tensor at a time, the close streams the base through
the outer step), and its hash is checked the first time this executor reads a file it
did not write. Kept in memory, the round's base (params and outer momentum, 8 bytes a
parameter) sat idle beside the model and AdamW while every shard trained. An ensemble
keeps the one in use (every unit of a round reads its members from it).

Host memory is bounded by the model, not by the round: a round's contributions are
read, decoded and added to a running sum one at a time (``train.OuterSum``), states
go between files and tensors without a copy in bytes, and the template every state
and delta is checked against (``like``) is names and shapes on the meta device.

Torch never runs on the event loop: each call goes through
``trio.to_thread.run_sync``, one at a time per job (a lock), since the inner
trainer is not thread-safe.

Ensemble jobs use the same paths with other contents (``train/_ensemble.py``): a
held state is the whole ensemble, ``train`` runs one unit of one member from its
checkpoint in the round's state, ``delta`` returns that member's new checkpoint,
and ``aggregate``/``apply`` put the round's member checkpoints into the state.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import trio

from ttpeer import train
from ttpeer.errors import DiskError, JobError, StateMissing
from ttpeer.proto import JobSpec, Outer, PublishDelta, Record, Train, overlapped, slice_chunks
from ttpeer.train import LoadedTask, OuterState  # by name: in annotations the method ``train`` hides the module

from ._datastore import DataStore
from ._executor import Decline, Deltas, delta_bytes
from ._files import write_atomic
from ._home import Home, shared_data_dir
from ._overlap import EagerStart, correcting, estimate
from ._torchutil import available_memory, chunk_run, in_thread, need_pieces, unfinish, values_of

log = logging.getLogger("ttpeer.train")
T = TypeVar("T")
KEEP_STATES = 3
WARM_TASK = "mnist1d"  # the README's and the demo's task: its data is made at start-up


@dataclass
class _Job:
    task: LoadedTask
    trainer: train.InnerTrainer
    like: OuterState  # names and shapes only, on the meta device (``train.template``)
    # Ensemble: at most one, the one in use. Fused: none (states are read from their files
    # when used, see ``_state_path``).
    states: dict[str, OuterState] = field(default_factory=dict)
    verified: set[str] = field(default_factory=set)  # states whose file's hash was checked here
    residual: dict[str, torch.Tensor] | None = None
    # Ensemble: member checkpoints trained here and not yet published, by (round, member).
    units: dict[tuple[int, int], OuterState] = field(default_factory=dict)
    mode: str = "fused"
    # Overlapped fused jobs: where each round's local work started, and its corrections.
    overlap: EagerStart = field(default_factory=EagerStart)
    # Ensembles: the training samples the vote is weighed on, and those the members train on.
    held: list[int] = field(default_factory=list)
    kept: list[int] | None = None

    @property
    def ensemble(self) -> bool:
        return self.mode == "ensemble"


class TorchExecutor:
    def __init__(self, home: Home, *, device: str = "cpu", task_options: dict[str, Any] | None = None,
                 memory_limit: int | None = None) -> None:
        """``memory_limit``: bytes of the device this peer may use at most (the
        ``memory_limit`` setting); None: what the device has free."""
        self.home, self.device = home, device
        self.on_missing = None  # unused: a task here raises DatasetMissing to its caller (the worker)
        # This executor's place among the peer's workers (``join_group``): fused shards are
        # trained by all of them together, each on its part of every batch.
        self.rank, self.world = 0, 1
        self.memory_limit = memory_limit
        self.task_options = task_options or {}
        self._jobs: dict[str, _Job] = {}
        # Training (train, delta) and closing rounds (aggregate, apply) take different
        # locks: with overlapped rounds, the close of round r runs while round r+1 trains.
        # Under one lock the close waited for the shard in training to end, so the round's
        # sync was not hidden at all. They share no tensors: evaluation has its own model
        # copy, and a training round's base is never among the states a close prunes.
        self._train_lock = trio.Lock()
        self._close_lock = trio.Lock()
        self._data_lock = threading.Lock()  # held in worker threads while a task loads
        self.shared_data = shared_data_dir()  # built-in data made once per machine, not per home

    async def join_group(self, store: Path, rank: int, world: int, device: str) -> None:
        """Become worker ``rank`` of ``world`` that train this peer's shards together."""
        await trio.to_thread.run_sync(train.join_group, store, rank, world, device)
        self.rank, self.world, self.device = rank, world, device

    async def warm_up(self) -> None:
        """Load torch's lazily imported pieces a job's first step would wait for (``train.warm_up``)
        and make the default built-in task's data where its extra is installed, in a worker thread
        at start-up: once per home, off the path of the first ``submit`` and this peer's first job."""
        await trio.to_thread.run_sync(train.warm_up)
        if importlib.util.find_spec("mnist1d") is None:  # a headless install: no demo data to make
            return
        try:
            await in_thread(lambda: self._load_task(WARM_TASK, None), WARM_TASK)
        except (JobError, OSError) as exc:  # the job that needs it will say so
            log.warning("could not prepare the %s data ahead: %s", WARM_TASK, exc)

    # -- tasks ---------------------------------------------------------------------------

    def _task_path(self, task_file: bytes) -> Path:
        folder = self.home.path / "tasks"
        folder.mkdir(exist_ok=True)
        path = folder / f"{hashlib.sha256(task_file).hexdigest()}.py"
        if not path.exists():
            write_atomic(path, task_file)
        return path

    def _load_task(self, name: str, task_file: bytes | None,
                   check: Callable[[LoadedTask], None] | None = None,
                   datasets: train.DatasetResolver | None = None) -> LoadedTask:
        """Load a built-in by ``name``, or the task file (its copy in the home, compiled
        under ``name``, the user's file name), and run ``check`` on it. A copy that does
        not load or pass is not kept. ``datasets`` answers the task's ``dataset_path``."""
        if task_file is None:
            with self._data_lock:  # a submit during the warm-up waits for its data, not makes it twice
                task = train.load_task(name, self.home.data_dir, self.task_options, shared_data=self.shared_data)
            if check is not None:
                check(task)
            return task
        path = self._task_path(task_file)
        try:
            with self._data_lock, train.resolving(datasets or self._no_datasets()):
                task = train.load_task(str(path), self.home.data_dir, self.task_options, shown_as=name,
                                       shared_data=self.shared_data)
            if check is not None:
                check(task)
            return task
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    # -- datasets (``train.dataset_path``) ---------------------------------------------------

    def _no_datasets(self) -> train.DatasetResolver:
        def find(name: str) -> tuple[str, Path]:
            raise train.TaskError(f"the task asks for dataset {name!r}, but this job names no dataset")

        return train.DatasetResolver(find)

    def _held_datasets(self) -> train.DatasetResolver:
        """At submit: a name means the dataset of that name held here (the daemon fetches
        one it does not hold and asks again: ``DatasetMissing``)."""
        return train.held_resolver(DataStore(self.home.path / "datasets"))

    def _job_datasets(self, job: Record) -> train.DatasetResolver:
        """On a peer preparing ``job``: the names the job recorded, as the ids it recorded."""
        store, ids = DataStore(self.home.path / "datasets"), dict(job.body.get("datasets") or {})

        def find(name: str) -> tuple[str, Path]:
            if name not in ids:
                raise train.TaskError(f"the task asks for dataset {name!r}, which its job did not record at "
                                      f"submit (it names {sorted(ids) or 'none'}): is the task's choice of "
                                      "dataset the same on every peer?")
            if ids[name] not in store.held():
                raise train.DatasetMissing(name)
            return ids[name], store.files(ids[name])

        def find_samples(name: str) -> tuple[str, str, dict[str, Any], Path]:
            if name not in sampled:
                raise train.TaskError(f"the task reads dataset {name!r} sample by sample, but its job did not at "
                                      "submit: is the task's choice the same on every peer?")
            found = store.index(ids[name], sampled[name])
            if found is None:
                raise train.DatasetMissing(name, whole=False)
            return ids[name], found[0], found[1], store.root

        sampled = dict(job.body.get("samples") or {})
        return train.DatasetResolver(find, find_samples)

    async def new_job(self, spec: dict[str, Any], task_file: bytes | None) -> tuple[dict[str, Any], bytes]:
        """Also runs the task on one batch (``train.probe``) before anything is published,
        so a task that fails at once is refused here, with its file and line. Raises
        ``train.DatasetMissing`` when the task asks for a dataset not held here."""
        def build() -> tuple[dict[str, Any], bytes]:
            datasets = self._held_datasets()
            probe = partial(train.probe, batch_size=spec["batch_size"], seed=spec["seed"], device=self.device)
            task = self._load_task(spec["task"], task_file, probe, datasets)
            # A warm start names its file in ``init``; the record's ``init`` is the state's hash.
            warm = spec.get("init")
            try:
                train.check_job(task, spec)
                if spec["mode"] == "ensemble":
                    if warm:
                        raise JobError("--init warm-starts a fused job; an ensemble's members start fresh")
                    state = train.init_ensemble(task, spec["members"])
                else:
                    state = train.warm_state(task, Path(warm)) if warm else train.init_state(task, spec["seed"])
            except (train.TaskError, train.CheckpointError) as exc:
                raise JobError(str(exc)) from None
            trainable, params = train.parameter_counts(train.check_model(task.spec, f"task {task.name}"))
            fixed = {"task_hash": task.source_hash, "init": train.state_hash(state),
                     "data": train.data_fingerprint(task), "params": params, "trainable": trainable}
            if spec["mode"] == "ensemble" and (holdout := train.holdout_size(task.n_train)):
                fixed["holdout"] = holdout
            fixed.update({k: dict(v) for k, v in (("datasets", datasets.used), ("samples", datasets.used_samples))
                          if v})
            return fixed, train.state_to_bytes(state)

        return await in_thread(build, spec["task"])

    async def prepare(self, job: Record, task_file: bytes | None) -> Decline | str | None:
        def load() -> Decline | str | None:
            task = self._load_task(job["task"], task_file, datasets=self._job_datasets(job))
            if task.source_hash != job["task_hash"]:
                return Decline(f"task {job['task']!r} here differs from the submitter's: its code, or the data "
                               f"or model files it reads (hash {task.source_hash[:12]} vs {job['task_hash'][:12]})",
                               code="task")
            if "data" in job.body and (mine := train.data_fingerprint(task)) != job["data"]:
                return Decline(f"your copy of the task's data differs from the submitter's: fingerprint "
                               f"{mine[:12]} here, {job['data'][:12]} there (build it deterministically, from a "
                               "fixed seed or files that are the same on every peer)", code="data")
            device_free, host_free, limited = available_memory(self.device, self.memory_limit)
            if self.world > 1:  # the peer's workers share its host memory (and its CPU's)
                host_free //= self.world
                device_free = device_free // self.world if self.device == "cpu" else device_free
            # The largest micro-batch this peer's memory holds: the job's batch stays its meaning.
            fit = train.fit_batch(task, batch_size=job["batch_size"], forced=job.body.get("micro_batch"),
                                  device=self.device, device_free=device_free, host_free=host_free,
                                  limited=limited, shards=job["shards"], held_states=KEEP_STATES,
                                  members=len(job["members"]) if job["mode"] == "ensemble" else 0,
                                  overlap=overlapped(job), checkpointing=bool(job.body.get("checkpointing")))
            if fit.misfit is not None:
                return Decline(fit.misfit.message, need=fit.misfit.need, have=fit.misfit.have, code="fit")
            try:
                recipe = train.Recipe.of_job(job.body, self.device, fit.micro_batch)
            except ValueError as exc:  # a precision this device cannot run
                return Decline(str(exc), code="fit")
            trainer = train.InnerTrainer(task, lr=job["inner_lr"], weight_decay=job["weight_decay"],
                                         device=self.device, seed=job["seed"], recipe=recipe)
            if self.world > 1:
                train.average_gradients(trainer.model, self.world)
            log.info("job %s trains in %s, micro-batch %d of %d", job.id[:12], recipe.precision, fit.micro_batch,
                     job["batch_size"])
            if job["mode"] == "ensemble":
                like = train.template(train.init_ensemble(task, job["members"]))
            else:  # the local model's own tensors, as meta: no second model is built
                own = {n: t for n, t in trainer.model.state_dict().items() if t.is_floating_point()}
                like = train.template(OuterState(params=own, momentum=own))
            ctx = self._jobs[job.id] = _Job(task, trainer, like, mode=job["mode"])
            if job.body.get("holdout"):
                ctx.held, ctx.kept = train.holdout_split(task.n_train, job["holdout"], job["seed"])
            return None

        return await in_thread(load, job["task"])

    def _job(self, job: Record) -> _Job:
        ctx = self._jobs.get(job.id)
        if ctx is None:
            raise JobError(f"job {job.id[:12]} is not prepared on this peer")
        return ctx

    # -- states ------------------------------------------------------------------------

    def _state_file(self, job: str, state: str) -> Path:
        return self.home.state_file(job, state)

    def held_states(self, job: Record) -> set[str]:
        return self.home.held_states(job.id)

    def _state_path(self, job: Record, state: str) -> Path:
        """The file of ``state``, its hash checked (once: a file this executor wrote or
        checked is not hashed again). Raises StateMissing, JobError if it is corrupt."""
        ctx = self._job(job)
        path = self._state_file(job.id, state)
        if not path.exists():
            # States are named by their hash, so another job's file with this name holds
            # the same bytes (two jobs of one task and seed start from one state).
            name = path.name
            path = next((p for p in (self.home.path / "states").glob(f"*/{name}")), path)
        if state not in ctx.verified or not path.exists():
            try:
                digest = train.file_state_hash(path)
            except FileNotFoundError:
                raise StateMissing(state) from None
            except train.CheckpointError:
                digest = None
            if digest != state:
                raise JobError(f"state file for {state[:19]} is corrupt")
            ctx.verified.add(state)
        return path

    def _state(self, job: Record, state: str) -> OuterState:
        """``state`` in memory. A fused job's is read from its file at every call and not
        kept: while a shard trains, the local model has the params and nothing needs the
        outer momentum, so 8 bytes a parameter stayed resident for nothing (the peak of a
        fused job is the round's close, which streams the base from the file)."""
        ctx = self._job(job)
        if state not in ctx.states:
            try:
                loaded = train.state_from_file(self._state_path(job, state), like=ctx.like)
            except FileNotFoundError:
                raise StateMissing(state) from None
            if not ctx.ensemble:
                return loaded
            ctx.states = {state: loaded}  # one state in memory: the others are on disk
        return ctx.states[state]

    def _params(self, job: Record, state: str) -> Iterator[tuple[str, torch.Tensor]]:
        """``state``'s params one tensor at a time, from its file."""
        ctx = self._job(job)
        try:
            for name, param, _momentum in train.iter_state_file(self._state_path(job, state), ctx.like):
                yield name, param
        except FileNotFoundError:
            raise StateMissing(state) from None

    def _hold(self, job: Record, state: OuterState) -> str:
        ctx = self._job(job)
        digest = train.state_hash(state)
        write_atomic(self._state_file(job.id, digest), train.state_chunks(state))
        ctx.verified.add(digest)
        ctx.states = {digest: state} if ctx.ensemble else {}
        # The initial state stays: the peer remembers holding it, and a later job of the same
        # task and seed starts from it (found by its hash in this job's folder).
        files = sorted((p for p in self.home.states(job.id).glob("*.state") if "sha256:" + p.stem != job["init"]),
                       key=lambda p: p.stat().st_mtime)
        for old in files[:-KEEP_STATES]:
            old.unlink(missing_ok=True)
        return digest

    # -- work ----------------------------------------------------------------------------

    async def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        job = eff.job
        ctx = self._job(job)

        def unit() -> int:
            # Ensemble: one unit of one member, continued from the member's checkpoint in ``base``.
            member = eff.shard
            ckpt, samples = train.train_unit(
                ctx.task, self._state(job, eff.base), member, job["members"][member], eff.round,
                job["batches"], job["batch_size"], device=self.device, should_stop=should_stop,
                recipe=ctx.trainer.recipe, kept=ctx.kept)
            if ckpt is not None:
                # Units of closed rounds were covered by someone else first: drop them.
                ctx.units = {k: v for k, v in ctx.units.items() if k[0] >= eff.round}
                ctx.units[(eff.round, member)] = ckpt
            return samples

        def run() -> int:
            need_pieces(ctx.task, self._shard_pieces(ctx.task, job, eff.round, eff.shard, *eff.span()),
                         self.world, self.device)
            try:
                return steps()
            except train.DatasetMissing as exc:
                # Read after steps were taken (a dataset_samples wrapped in another Dataset,
                # whose pieces ttpeer cannot see ahead): fetched, then the shard trains again
                # from its round's base, as after a lost worker.
                exc.moved = True
                raise

        def steps() -> int:
            if eff.fresh:
                self._start(ctx, eff)
            steps, first = eff.span()
            batches = train.shard_batches(ctx.task, job["seed"], eff.round, eff.shard, job["shards"], steps,
                                          job["batch_size"], first_step=first)
            stop = should_stop
            if overlapped(job):
                agree = train.agreed_signal(self.device) if self.world > 1 else None
                stop = correcting(ctx.trainer, ctx.overlap, lambda state: self._params(job, state), should_stop,
                                  agree)
            elif self.world > 1:
                stop = train.agreed_stop(should_stop, self.device)
            if self.world == 1:
                return ctx.trainer.train_shard(batches, stop, first)
            parts = train.split_batches(batches, self.rank, self.world)
            mine = ctx.trainer.train_shard(parts, stop, first)
            # The peer trained whole batches (every worker its part): count them whole.
            done, total = 0, 0
            while done < len(parts) and total < mine:
                total += len(parts[done])
                done += 1
            return sum(len(b) for b in batches[:done])

        def shard() -> int:
            try:
                return run()
            finally:
                # The gradients are not needed until the next shard's first step, which sets
                # them anew: freed here, the delta and the round's close do not sit beside them.
                ctx.trainer.optimizer.zero_grad(set_to_none=True)

        async with self._train_lock:
            return await in_thread(unit if ctx.ensemble else shard, job["task"])

    @staticmethod
    def _shard_pieces(task: LoadedTask, job: Record, rnd: int, shard: int, steps: int, first: int) -> list[int]:
        """The pieces of a ``dataset_samples`` training set that shard ``shard`` of ``rnd`` reads."""
        if not isinstance(task.train, train.Samples) or job["mode"] == "ensemble":
            return []
        batches = train.shard_batches(task, job["seed"], rnd, shard, job["shards"], steps, job["batch_size"],
                                      first_step=first)
        return task.train.pieces_for(i for b in batches for i in b)

    async def pieces(self, job: Record, rnd: int, shards: list[int], steps: int, first: int) -> dict[str, Any]:
        """What the shards ``shards`` of round ``rnd`` (``steps`` inner steps from global
        step ``first``) read of the job's ``dataset_samples`` training set: its dataset,
        name, and per shard the pieces, and of them those not here yet. Empty when the
        training set is not read by pieces. ``test``: the pieces of the test set (a part of
        the same dataset) not here yet."""
        ctx = self._job(job)
        train_set = ctx.task.train
        if not isinstance(train_set, train.Samples) or ctx.ensemble:
            return {}

        def run() -> dict[str, Any]:
            try:
                return look()
            except Exception as exc:  # noqa: BLE001 - only a hint: its failure must not fail the job
                log.warning("job %s: could not work out the pieces of round %d: %s", job.id[:12], rnd, exc)
                return {}

        def look() -> dict[str, Any]:
            per = {s: self._shard_pieces(ctx.task, job, rnd, s, steps, first) for s in shards}
            test = ctx.task.test
            # The test set, when it is a part of the same dataset (``split``): every close reads it.
            same = test if isinstance(test, train.Samples) and test.index.dataset == train_set.index.dataset else None
            return {"dataset": train_set.index.dataset, "name": train_set.index.name,
                    "pieces": {str(s): p for s, p in per.items()},
                    "missing": {str(s): train_set.missing(p) for s, p in per.items()},
                    "test": train_set.missing(same.pieces_for(range(len(same)))) if same is not None else []}

        return await in_thread(run, job["task"])

    async def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        ctx = self._job(eff.job)

        if ctx.ensemble:
            (member,) = eff.shards
            ckpt = ctx.units.pop((eff.round, member), None)
            if ckpt is None:
                raise JobError(f"member {member} of round {eff.round} was not trained on this peer")
            data = await in_thread(lambda: train.encode_member(member, ckpt), eff.job["task"])
            return data, {"fp32_bytes": float(4 * sum(t.numel() for t in ckpt.params.values())),
                          **ctx.trainer.recipe.metrics(eff.job["batch_size"])}

        def run() -> tuple[bytes, dict[str, float]]:
            began = ctx.overlap.same_round(eff.round, eff.base)
            if began is not None and began.estimate is not None:
                delta = ctx.trainer.delta(began.estimate)
            else:  # from the held state it started from (or was moved onto), else the base
                held = began.state if began is not None and began.state is not None else eff.base
                delta = ctx.trainer.delta_from(self._params(eff.job, held))
            ctx.overlap.own = (eff.round, delta) if overlapped(eff.job) else None
            chunk = eff.job.body.get("chunk")
            data, ctx.residual = train.encode_delta(delta, ctx.residual, bits=eff.job["bits"], chunk=chunk)
            metrics = {"fp32_bytes": float(train.fp32_size(delta)), **ctx.trainer.recipe.metrics(eff.job["batch_size"])}
            if chunk is not None:
                metrics["chunks"] = float(-(-values_of(ctx.like) // chunk))
            loss = ctx.trainer.take_train_loss()
            if loss is not None and math.isfinite(loss):  # a record holds finite numbers only
                metrics["train_loss"] = round(loss, 6)
            return data, metrics

        async with self._train_lock:
            return await in_thread(run, eff.job["task"])

    def _start(self, ctx: _Job, eff: Train) -> None:
        """Load the local model for a fresh shard: the round's base, or with overlap
        (``_overlap.py``) the round's own base once held here (``eff.ahead``), else this
        peer's estimate of it made with its own delta of the round before. A second shard
        of the same round (a backup after publishing, when ``own`` is already this round's)
        starts where the first did; a peer with no delta of the round before (it trained
        none, or restarted) starts from the base."""
        job, ov = eff.job, ctx.overlap
        if overlapped(job):
            ahead = eff.ahead or ov.known(eff.round, eff.base)  # made here before the machine saw it
            if ahead is not None and ahead in self.held_states(job):
                return self._start_from(ctx, eff, ahead)
            began = ov.same_round(eff.round, eff.base)
            if began is not None:
                if began.estimate is not None:
                    return self._start_from(ctx, eff, None, began.estimate)
                return self._start_from(ctx, eff, began.state or eff.base)
            own = ov.own
            if own is not None and own[0] == eff.round - 1:
                base = train.iter_state_file(self._state_path(job, eff.base), ctx.like)
                guess = estimate(ctx.like, base, own[1], ov.outer or _job_outer(job, eff.round - 1))
                return self._start_from(ctx, eff, None, guess)
        self._start_from(ctx, eff, eff.base)

    def _start_from(self, ctx: _Job, eff: Train, state: str | None, guess: OuterState | None = None) -> None:
        """Load held ``state``'s params (read from its file) or ``guess`` into the local model."""
        if guess is not None:
            ctx.trainer.start(guess)
        else:
            assert state is not None
            params = dict(self._params(eff.job, state))
            ctx.trainer.start(OuterState(params=params, momentum=params))
        if overlapped(eff.job):
            ctx.overlap.begin(eff.round, eff.base, estimate=guess, state=state)

    def _outer(self, job: Record, base: str, deltas: Deltas, rnd: int, sliced: bool,
               step: Outer) -> OuterState:
        ctx = self._job(job)
        if ctx.ensemble:  # the round's member checkpoints replace their members in ``base``
            try:
                parts = [train.decode_member(delta_bytes(ref), ctx.like) for ref, _samples in deltas]
            except train.CheckpointError as exc:
                raise JobError(str(exc)) from None
            if sorted(i for i, _ckpt in parts) != list(range(len(job["members"]))):
                raise JobError(f"round of job {job.id[:12]} does not hold one checkpoint per member "
                               f"(got members {sorted(i for i, _ckpt in parts)})")
            return train.combine(self._state(job, base), parts)
        # One contribution at a time, tensor by tensor, into the running sum: memory holds
        # the sum and one delta's bytes, whatever the number of contributions. The base is
        # read from its file one tensor at a time as the step goes: it is never whole in
        # memory beside the sum and the new state.
        path = self._state_path(job, base)
        if sliced:  # the reduced slices, in order, are the round's mean
            numel, chunk = values_of(ctx.like), job["chunk"]
            spans = slice_chunks(-(-numel // chunk), len(deltas))
            if len(spans) != len(deltas):
                raise JobError(f"{len(deltas)} slices for a model of {-(-numel // chunk)} chunks")
            means = (train.decode_slice(delta_bytes(ref), min(stop * chunk, numel) - first * chunk)
                     for (ref, _samples), (first, stop) in zip(deltas, spans, strict=True))
            return train.mean_step(ctx.like, means, lr=step.lr, momentum=step.momentum, nesterov=True,
                                   base=train.iter_state_file(path, ctx.like))
        total = train.OuterSum(ctx.like, [samples for _ref, samples in deltas])
        for ref, _samples in deltas:
            total.add_parts(train.iter_delta(delta_bytes(ref), ctx.like))
        return total.step(lr=step.lr, momentum=step.momentum, nesterov=True, base=train.iter_state_file(path, ctx.like))

    async def reduce_slice(self, job: Record, deltas: Deltas, first: int, stop: int, *, rnd: int) -> bytes:
        ctx = self._job(job)

        def run() -> bytes:
            numel = values_of(ctx.like)
            parts = [chunk_run(ref, numel, first, stop) for ref, _samples in deltas]
            mean = train.reduce_slice(parts, [samples for _ref, samples in deltas], first, stop)
            return train.encode_slice(mean, bits=JobSpec.of(job).slice_bits, block=parts[0][0].block)

        async with self._close_lock:
            return await in_thread(run, job["task"])

    async def aggregate(self, job: Record, base: str, deltas: Deltas, *, rnd: int,
                        sliced: bool = False, outer: Outer | None = None) -> tuple[str, dict[str, float]]:
        ctx = self._job(job)
        step = outer or _job_outer(job, rnd)

        def run() -> tuple[str, dict[str, float]]:
            new = self._outer(job, base, deltas, rnd, sliced, step)
            # The base is on disk: not kept in memory beside the new state and the model
            # that evaluates it (a training round that uses it holds its own reference).
            ctx.states.pop(base, None)
            if ctx.ensemble:  # the vote, weighed on the held-out samples (``train/_select.py``)
                weights, models, _held = train.weigh_members(ctx.task, new, ctx.held, self.device)
                members, (loss, metric) = train.evaluate_ensemble(ctx.task, new, self.device, weights, models)
                best = max(m for _loss, m in members)
                return self._hold(job, new), {"eval_loss": round(loss, 6), ctx.task.metric_name: round(metric, 6),
                                              "best_member": round(best, 6), "weights": weights}  # type: ignore[dict-item]
            # Held (on disk) first, so the outer momentum is gone before the evaluation model
            # is built, and the params once it has them: the close's peak is that model and
            # its activations beside the trainer's model, AdamW and residual.
            digest = self._hold(job, new)
            ctx.overlap.landed(rnd, base, digest, step)
            params = new.params
            del new
            loss, metric = ctx.trainer.evaluate(params, consume=True)
            return digest, {"eval_loss": round(loss, 6), ctx.task.metric_name: round(metric, 6)}

        async with self._close_lock:
            return await in_thread(run, job["task"])

    async def apply(self, job: Record, base: str, deltas: Deltas, expect: str, *, rnd: int,
                    sliced: bool = False, outer: Outer | None = None) -> bool:
        ctx = self._job(job)
        step = outer or _job_outer(job, rnd)

        def run() -> bool:
            new = self._outer(job, base, deltas, rnd, sliced, step)
            if train.state_hash(new) != expect:
                return False
            ctx.overlap.landed(rnd, base, self._hold(job, new), step)
            return True

        async with self._close_lock:
            return await in_thread(run, job["task"])

    async def export_state(self, job: Record, state: str, out: Path) -> None:
        """A copy of the held state's file, so neither its bytes nor a second set of
        tensors are in memory."""
        def run() -> None:
            src = self._state_file(job.id, state)
            if not src.exists():  # held in memory only: a state always has a file, but be safe
                write_atomic(out, train.state_chunks(self._state(job, state)))
                return
            tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, out)

        await in_thread(run, job["task"])

    async def import_state(self, job: Record, state: str, data: bytes | Path) -> bool:
        """Hold the state in ``data`` (its bytes, or a file read straight into tensors)."""
        ctx = self._job(job)

        def run() -> bool:
            try:
                loaded = (train.state_from_file(data, like=ctx.like) if isinstance(data, Path)
                          else train.state_from_bytes(data, like=ctx.like))
            except train.CheckpointError as exc:
                log.warning("checkpoint for %s refused: %s", state[:19], exc)
                return False
            if train.state_hash(loaded) != state:
                return False
            self._hold(job, loaded)
            return True

        return await in_thread(run, job["task"])

    async def release(self, job: str) -> None:
        self._jobs.pop(job, None)

    async def finish(self, job: Record, state: str, metrics: dict[str, Any]) -> None:
        ctx = self._job(job)

        def run() -> None:
            final = self._state(job, state)
            folder = self.home.states(job.id)
            unfinish(folder, state)
            try:
                if ctx.ensemble:
                    weights = list(metrics.get("weights") or [1] * len(job["members"]))
                    _w, models, (probs, target) = train.weigh_members(ctx.task, final, ctx.held, self.device)
                    scores = train.evaluate_ensemble(ctx.task, final, self.device, weights, models)
                    held = train.holdout_scores(ctx.task, probs, target, weights)
                    train.export_ensemble(final, ctx.task, job["members"], folder / "final.safetensors",
                                          metrics, scores, weights, held)
                else:
                    train.export_model(final, ctx.task, folder / "final.safetensors", metrics)
            except OSError as exc:
                raise DiskError(folder / "final.safetensors", exc) from None
            write_atomic(folder / "done.json", json.dumps(metrics, indent=2).encode())

        await in_thread(run, job["task"])




def _job_outer(job: Record, rnd: int) -> Outer:
    """The job's own outer step of round ``rnd`` (its outer lr schedule there)."""
    return Outer(train.outer_lr(job.body, rnd), job["outer_momentum"])
