"""The real executor: torch in worker threads, states on disk.

Theory of operation. Per job it keeps the loaded task, this peer's inner trainer (its
AdamW state persists across rounds, as in DiLoCo), the states it holds
(``_jobstates.py``: on disk before they are reported held, so a peer killed at any moment
restarts from a state the pool agreed on) and the job's mode, which owns all that differs
between a fused job (``_fused.py``: one model, a delta a shard, the outer step) and an
ensemble (``_ensemble.py``: a member's unit a shard, its checkpoint, the weighed vote).
This class owns what both share: loading the task and its datasets, the fit check, the
locks, and moving states in and out.

Torch never runs on the event loop: each call goes through ``trio.to_thread.run_sync``.
Training (train, delta) and closing rounds (aggregate, apply) take different locks: with
overlapped rounds, the close of round r runs while round r+1 trains. They share no tensors:
evaluation has its own model copy, and a training round's base is never among the states a
close prunes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ttpeer import train
from ttpeer.errors import DiskError, JobError
from ttpeer.proto import ENSEMBLE, JobSpec, Outer, PublishDelta, Train
from ttpeer.train import LoadedTask, OuterState  # by name: in annotations the method ``train`` hides the module

from .._executor import Decline, Deltas
from .._files import write_atomic
from .._home import Home, shared_data_dir
from .._workfiles import task_copy
from ..data._datastore import DataStore
from ._ensemble import Ensemble
from ._fused import Fused, job_outer
from ._jobstates import KEEP_STATES, JobStates
from ._torchutil import available_memory, chunk_run, in_thread, unfinish, values_of

log = logging.getLogger("ttpeer.train")
WARM_TASK = "mnist1d"  # the README's and the demo's task: its data is made at start-up


@dataclass
class _Job:
    task: LoadedTask
    trainer: train.InnerTrainer
    states: JobStates
    mode: Fused | Ensemble


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
        path = task_copy(self.home.path, task_file)
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

    def _job_datasets(self, job: JobSpec) -> train.DatasetResolver:
        """On a peer preparing ``job``: the names the job recorded, as the ids it recorded."""
        store, ids = DataStore(self.home.path / "datasets"), job.datasets

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

        sampled = job.samples
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
                if spec["mode"] == ENSEMBLE.name:  # its members start fresh (``Mode.problem``)
                    state = train.init_ensemble(task, spec["members"])
                else:
                    state = train.warm_state(task, Path(warm)) if warm else train.init_state(task, spec["seed"])
            except (train.TaskError, train.CheckpointError) as exc:
                raise JobError(str(exc)) from None
            trainable, params = train.parameter_counts(train.check_model(task.spec, f"task {task.name}"))
            fixed = {"task_hash": task.source_hash, "init": train.state_hash(state),
                     "data": train.data_fingerprint(task), "params": params, "trainable": trainable}
            if spec["mode"] == ENSEMBLE.name and (holdout := train.holdout_size(task.n_train)):
                fixed["holdout"] = holdout
            fixed.update({k: dict(v) for k, v in (("datasets", datasets.used), ("samples", datasets.used_samples))
                          if v})
            return fixed, train.state_to_bytes(state)

        return await in_thread(build, spec["task"])

    async def prepare(self, job: JobSpec, task_file: bytes | None) -> Decline | str | None:
        def load() -> Decline | str | None:
            task = self._load_task(job.task, task_file, datasets=self._job_datasets(job))
            if task.source_hash != job.task_hash:
                return Decline(f"task {job.task!r} here differs from the submitter's: its code, or the data "
                               f"or model files it reads (hash {task.source_hash[:12]} vs {job.task_hash[:12]})",
                               code="task")
            if job.data is not None and (mine := train.data_fingerprint(task)) != job.data:
                return Decline(f"your copy of the task's data differs from the submitter's: fingerprint "
                               f"{mine[:12]} here, {job.data[:12]} there (build it deterministically, from a "
                               "fixed seed or files that are the same on every peer)", code="data")
            device_free, host_free, limited = available_memory(self.device, self.memory_limit)
            if self.world > 1:  # the peer's workers share its host memory (and its CPU's)
                host_free //= self.world
                device_free = device_free // self.world if self.device == "cpu" else device_free
            # The largest micro-batch this peer's memory holds: the job's batch stays its meaning.
            fit = train.fit_batch(task, batch_size=job.batch_size, forced=job.micro_batch,
                                  device=self.device, device_free=device_free, host_free=host_free,
                                  limited=limited, shards=job.shards, held_states=KEEP_STATES,
                                  members=len(job.members), overlap=job.overlap, checkpointing=job.checkpointing)
            if fit.misfit is not None:
                return Decline(fit.misfit.message, need=fit.misfit.need, have=fit.misfit.have, code="fit")
            try:
                recipe = train.Recipe.of_job(job.body, self.device, fit.micro_batch)
            except ValueError as exc:  # a precision this device cannot run
                return Decline(str(exc), code="fit")
            trainer = train.InnerTrainer(task, lr=job.inner_lr, weight_decay=job.weight_decay,
                                         device=self.device, seed=job.seed, recipe=recipe)
            if self.world > 1:
                train.average_gradients(trainer.model, self.world)
            log.info("job %s trains in %s, micro-batch %d of %d", job.id[:12], recipe.precision, fit.micro_batch,
                     job.batch_size)
            ensemble = job.mode is ENSEMBLE
            if ensemble:
                like = train.template(train.init_ensemble(task, list(job.members)))
            else:  # the local model's own tensors, as meta: no second model is built
                own = {n: t for n, t in trainer.model.state_dict().items() if t.is_floating_point()}
                like = train.template(OuterState(params=own, momentum=own))
            states = JobStates(self.home, job.id, job.init, like, keep_one=ensemble)
            mode = (Ensemble(job, task, trainer, states, device=self.device) if ensemble else
                    Fused(job, task, trainer, states, device=self.device, rank=self.rank, world=self.world))
            self._jobs[job.id] = _Job(task, trainer, states, mode)
            return None

        return await in_thread(load, job.task)

    def _job(self, job: JobSpec) -> _Job:
        ctx = self._jobs.get(job.id)
        if ctx is None:
            raise JobError(f"job {job.id[:12]} is not prepared on this peer")
        return ctx

    # -- states ------------------------------------------------------------------------

    def held_states(self, job: str) -> set[str]:
        return self.home.held_states(job)

    def _state(self, job: JobSpec, state: str) -> OuterState:
        """``state`` in memory (``JobStates.load``)."""
        return self._job(job).states.load(state)

    # -- work ----------------------------------------------------------------------------

    async def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        ctx = self._job(eff.job)
        async with self._train_lock:
            return await in_thread(lambda: ctx.mode.train(eff, should_stop), eff.job.task)

    async def pieces(self, job: JobSpec, rnd: int, shards: list[int], inner_steps: int,
                     first: int) -> dict[str, Any]:
        """What the shards ``shards`` of round ``rnd`` (``inner_steps`` from global
        step ``first``) read of the job's ``dataset_samples`` training set: its dataset,
        name, and per shard the pieces, and of them those not here yet. Empty when the
        training set is not read by pieces. ``test``: the pieces of the test set (a part of
        the same dataset) not here yet."""
        ctx = self._job(job)
        return await in_thread(lambda: ctx.mode.pieces(rnd, shards, inner_steps, first), job.task)

    async def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        ctx = self._job(eff.job)
        async with self._train_lock if ctx.mode.delta_locked else contextlib.nullcontext():
            return await in_thread(lambda: ctx.mode.delta(eff), eff.job.task)

    async def reduce_slice(self, job: JobSpec, deltas: Deltas, first: int, stop: int, *, rnd: int) -> bytes:
        ctx = self._job(job)

        def run() -> bytes:
            numel = values_of(ctx.states.like)
            parts = [chunk_run(ref, numel, first, stop) for ref, _samples in deltas]
            mean = train.reduce_slice(parts, [samples for _ref, samples in deltas], first, stop)
            return train.encode_slice(mean, bits=job.slice_bits, block=parts[0][0].block)

        async with self._close_lock:
            return await in_thread(run, job.task)

    async def aggregate(self, job: JobSpec, base: str, deltas: Deltas, *, rnd: int,
                        sliced: bool = False, outer: Outer | None = None) -> tuple[str, dict[str, float]]:
        ctx = self._job(job)
        step = outer or job_outer(job, rnd)

        async with self._close_lock:
            return await in_thread(lambda: ctx.mode.close(base, deltas, sliced, rnd, step), job.task)

    async def apply(self, job: JobSpec, base: str, deltas: Deltas, expect: str, *, rnd: int,
                    sliced: bool = False, outer: Outer | None = None) -> bool:
        ctx = self._job(job)
        step = outer or job_outer(job, rnd)

        def run() -> bool:
            new = ctx.mode.outer(base, deltas, sliced, step)
            if train.state_hash(new) != expect:
                return False
            ctx.mode.applied(new, rnd, base, step)
            return True

        async with self._close_lock:
            return await in_thread(run, job.task)

    async def export_state(self, job: JobSpec, state: str, out: Path) -> None:
        """A copy of the held state's file, so neither its bytes nor a second set of
        tensors are in memory."""
        def run() -> None:
            src = self._job(job).states.file(state)
            if not src.exists():  # held in memory only: a state always has a file, but be safe
                write_atomic(out, train.state_chunks(self._state(job, state)))
                return
            tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, out)

        await in_thread(run, job.task)

    async def import_state(self, job: JobSpec, state: str, data: bytes | Path) -> bool:
        """Hold the state in ``data`` (its bytes, or a file read straight into tensors)."""
        ctx = self._job(job)

        def run() -> bool:
            try:
                like = ctx.states.like
                loaded = train.state_from_file(data, like=like) if isinstance(data, Path) else train.state_from_bytes(
                    data, like=like)
            except train.CheckpointError as exc:
                log.warning("checkpoint for %s refused: %s", state[:19], exc)
                return False
            if train.state_hash(loaded) != state:
                return False
            ctx.states.hold(loaded)
            return True

        return await in_thread(run, job.task)

    async def release(self, job: str) -> None:
        self._jobs.pop(job, None)

    async def finish(self, job: JobSpec, state: str, metrics: dict[str, Any]) -> None:
        ctx = self._job(job)

        def run() -> None:
            final = ctx.states.load(state)
            folder = self.home.states(job.id)
            unfinish(folder, state)
            try:
                ctx.mode.export(final, folder / "final.safetensors", metrics)
            except OSError as exc:
                raise DiskError(folder / "final.safetensors", exc) from None
            write_atomic(folder / "done.json", json.dumps(metrics, indent=2).encode())

        await in_thread(run, job.task)
