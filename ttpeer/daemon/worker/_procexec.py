"""The executor the daemon runs: task code in supervised worker processes.

Theory of operation. ``ProcessExecutor`` implements the executor interface
(``_executor.py``) by forwarding each call to the job's worker process
(``_worker.py``), which runs the same ``TorchExecutor`` the in-process tests use.
The daemon itself never imports torch: its memory and start-up stay small, and
nothing a task does (raise, hang, segfault, exhaust memory) can take it down.

Per job it keeps a ``_JobWorkers``: the job (``JobSpec``) and task file (to start a worker
again), the worker, and how often it died. A worker is started on first use
(``prepare``) and again after it died; the one after a death has lost the local
model, so the next call that needs it (``train`` without ``fresh``, ``delta``)
raises ``LocalWorkLost`` and the protocol trains those shards again. Failures
become one of three outcomes, matched by the kind the worker sends (``_failures``),
never words:

    the task's code raised / diverged            TaskFailed (the job ends on this peer)
    no batch finished within step_timeout        the worker is killed; TaskFailed
    (another call not done in CALL_TIMEOUT)
    CUDA out of memory                           TaskFailed, "out of GPU memory on cuda:N..."
    the worker died (signal, exit code)          restarted up to MAX_DEATHS - 1 times
                                                 (LocalWorkLost), then TaskFailed
    a state missing, a full disk, other          StateMissing, DiskError, JobError as before

The executor's ``WorkerPool`` (``_workerpool.py``) starts the worker processes in its
own nursery (``run``); cancelling it kills them all. One spare worker, torch already
imported, waits for the next job or submission so that neither pays for an interpreter
start.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from ttpeer.errors import JobError, LocalWorkLost, TaskFailed
from ttpeer.proto import DatasetMissing, JobSpec, Outer, PublishDelta, Train

from .._codec import Message
from .._executor import Decline, Deltas
from .._home import Home
from .._workfiles import read_and_remove, task_copy, write_work
from . import _workermsg as msg
from ._workermsg import DeltaFiles
from ._workerpool import WorkerPool
from ._workerproc import WorkerDied, _all, _close_all, _loading, _Worker

log = logging.getLogger("ttpeer.workers")
T = TypeVar("T")
R = TypeVar("R")

DEFAULT_STEP_TIMEOUT = 600.0
# Calls that are not a shard's steps (load the task, evaluate, an outer step, export)
# have no progress to watch: they get this long, or the step timeout if that is longer.
CALL_TIMEOUT = 1800.0
MAX_FETCHES = 64  # fetches of missing dataset pieces one call may wait for
MAX_DEATHS = 3  # a worker that dies this often in one job fails the job on this peer


@dataclass
class _JobWorkers:
    job: JobSpec
    task_file: bytes | None
    group: list[_Worker] = field(default_factory=list)  # rank 0 first
    deaths: int = 0
    model_lost: bool = False  # a restarted worker does not hold the local model
    failed: str | None = None
    retire: bool = False
    lock: trio.Lock = field(default_factory=trio.Lock)
    # Workers whose ``prepare`` read dataset pieces not here yet: kept (torch imported, in
    # their group) and asked again once the daemon fetched them, not started anew.
    pending: list[_Worker] = field(default_factory=list)


class ProcessExecutor:
    def __init__(self, home: Home, *, device: str = "auto", task_options: dict[str, Any] | None = None,
                 memory_limit: int | None = None, python: str = sys.executable, spare: bool = True,
                 env: dict[str, str] | None = None, step_timeout: float = DEFAULT_STEP_TIMEOUT,
                 max_deaths: int = MAX_DEATHS, workers: int | None = None) -> None:
        """``device``: a torch device, or "auto" (the first CUDA device if the worker
        sees one, else the CPU). ``spare``: keep one started worker waiting.
        ``step_timeout``: for jobs whose record sets none. ``max_deaths``: worker deaths
        in one job that fail it on this peer. ``workers``: processes per fused job, one
        per local device, that train each shard data-parallel (the ``workers`` setting;
        None: one per CUDA device the first worker sees, 1 on the CPU)."""
        if workers is not None and workers < 1:
            raise ValueError("workers must be at least 1")
        self.workers_per_job = workers
        self.home = home
        self.device = device
        self.task_options = task_options or {}
        self.memory_limit = memory_limit
        self.pool = WorkerPool(self._config, device=device, python=python, env=env, spare=spare)
        self._step_timeout = step_timeout
        self._max_deaths = max_deaths
        self._jobs: dict[str, _JobWorkers] = {}
        # Pieces a task read that are not here (``DatasetMissing`` with pieces): the node
        # fetches them (``TaskData.fetch_missing``) and the call is made again.
        self.on_missing: Callable[[JobSpec, DatasetMissing], Awaitable[None]] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the worker processes until cancelled; then end them all."""
        try:
            await self.pool.run(task_status=task_status)
        finally:
            for w in (w for j in self._jobs.values() for w in j.group):
                w.kill("the daemon is stopping")

    async def warm_up(self) -> None:
        """Start the spare worker off any job's path (``WorkerPool.warm_up``)."""
        await self.pool.warm_up()

    @property
    def devices(self) -> list[str]:
        """What the workers train on, for status."""
        return self.pool.devices

    def _timeout(self, step_timeout: float | None, *, step: bool = False) -> float:
        """A call's limit in a job whose ``step_timeout`` is the one given (None: this
        executor's default)."""
        limit = step_timeout or self._step_timeout
        return limit if step else max(limit, CALL_TIMEOUT)

    def _config(self, device: str) -> msg.Configure:
        return msg.Configure(self.home.path, device, self.task_options, self.memory_limit)

    # -- per job -------------------------------------------------------------------------

    def _work_dir(self, job: str) -> Path:
        path = self.home.path / "work" / job
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _task_path(self, task_file: bytes | None) -> Path | None:
        return None if task_file is None else task_copy(self.home.path, task_file)

    def _ranks(self, job: JobSpec, first: _Worker) -> int:
        # Ensemble units train one member at a time: one worker (see the README's limits).
        if not job.mode.data_parallel:
            return 1
        if self.workers_per_job is not None:
            return self.workers_per_job
        cuda = first.device.startswith("cuda") and self.device in ("auto", "cuda")
        return max(1, first.hello.cuda_devices) if cuda else 1

    async def _start(self, j: _JobWorkers) -> Decline | str | None:
        """Start the job's workers (one per local device, joined into a process group
        when there are several) and prepare the job in each (under ``j.lock``). Returns
        a worker's decline, if any (then no worker is kept)."""
        group, j.pending = j.pending, []
        if group and not all(w.alive for w in group):
            await _close_all(group)
            group = []
        if not group:
            group = await self._new_group(j)
        try:
            async with _loading(group, keep=(DatasetMissing,)):
                request = msg.Prepare(j.job, self._task_path(j.task_file))
                declines = await _all(group, lambda _rank: request, timeout=self._timeout(j.job.step_timeout))
        except DatasetMissing:
            j.pending = group  # the daemon fetches what it missed; then these prepare again
            raise
        decline = next((d for d in declines if d is not None), None)
        if decline is not None:
            await _close_all(group)
            return decline
        j.group = group
        return None

    async def _new_group(self, j: _JobWorkers) -> list[_Worker]:
        """The job's workers, started: one per local device, joined into a process group
        when there are several. Raises as ``_start`` says; closes what it started."""
        group: list[_Worker] = []
        async with _loading(group):
            group.append(await self.pool.take())
            n = self._ranks(j.job, group[0])
            for _ in range(n - 1):
                group.append(await self.pool.new())
            if n > 1:
                store = self._work_dir(j.job.id) / f"group-{j.deaths}-{os.getpid()}"
                store.unlink(missing_ok=True)
                threads = max(1, (os.cpu_count() or 1) // n)
                await _all(group, lambda rank: msg.JoinGroup(store, rank, n, self._rank_device(group[rank], rank),
                                                             threads), timeout=self._timeout(j.job.step_timeout))
        return group

    def _rank_device(self, worker: _Worker, rank: int) -> str:
        device = self.pool.device_for(worker)
        return f"cuda:{rank}" if device.startswith("cuda") else device

    async def _group(self, j: _JobWorkers) -> list[_Worker]:
        """The job's live workers, started again (and the job prepared) if one died."""
        if j.failed is not None:
            raise TaskFailed(j.failed)
        async with j.lock:
            if j.group and all(w.alive for w in j.group):
                return j.group
            if j.group:  # one died since the last call: the others hold nothing it did not
                why = next((w.died for w in j.group if w.died), "it ended")
                await self._note_death(j, why)
            decline = await self._start(j)
            if decline is not None:
                reason = decline.reason if isinstance(decline, Decline) else decline
                raise JobError(f"the restarted worker declines the job: {reason}")
            return j.group

    async def _note_death(self, j: _JobWorkers, why: str) -> None:
        j.deaths += 1
        group, j.group = j.group, []
        await _close_all(group)
        if j.deaths >= self._max_deaths:
            j.failed = f"the worker process died {j.deaths} times; the last time {why}"
            raise TaskFailed(j.failed)
        j.model_lost = True
        log.warning("job %s: a worker process died (%s); starting the job's workers again", j.job.id[:12], why)

    async def _fetching(self, job: JobSpec, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, made again after the pieces it found missing were fetched. A task
        raises that before anything it does counts (a shard checks its pieces before its
        first step), so the second call is the first that did anything."""
        for _ in range(MAX_FETCHES):
            try:
                return await call()
            except DatasetMissing as exc:
                if self.on_missing is None:
                    raise
                await self.on_missing(job, exc)
                if exc.moved:  # the local model took steps first: those shards train again
                    raise LocalWorkLost(job.id, f"the task read pieces of dataset {exc.name!r} mid-shard (now "
                                                "fetched); this peer trains its shards again") from None
        raise JobError(f"job {job.id[:12]}: the task still misses pieces of its datasets after {MAX_FETCHES} "
                       "fetches (a task reading many pieces one at a time, outside its shards?)")

    async def _call(self, job: JobSpec, request: Message[R] | Callable[[int], Message[R]], *, step: bool = False,
                    on_progress: Callable[[int], bool] | None = None) -> R:
        """``request`` in the job's first worker; or, given the request for each rank, in
        each of its workers, the first one's result returned (training and the delta keep
        every local copy in step); again once the dataset pieces it missed are here."""
        return await self._fetching(job, lambda: self._call_once(job, request, step=step, on_progress=on_progress))

    async def _call_once(self, job: JobSpec, request: Message[R] | Callable[[int], Message[R]], *,
                         step: bool = False, on_progress: Callable[[int], bool] | None = None) -> R:
        j = self._jobs.get(job.id)
        if j is None:
            raise JobError(f"job {job.id[:12]} is not prepared on this peer")
        group = await self._group(j)
        timeout = self._timeout(job.step_timeout, step=step)
        try:
            if isinstance(request, Message):
                return await group[0].call(request, timeout=timeout, step=step, on_progress=on_progress)
            results = await _all(group, request, timeout=timeout, step=step, on_progress=on_progress)
            return results[0]
        except WorkerDied as exc:
            if any(w.stopped for w in group):  # ended here on purpose: nothing died, nothing trains again
                raise LocalWorkLost(job.id, f"the job's worker was stopped ({exc})") from None
            async with j.lock:
                if j.group is group:
                    await self._note_death(j, str(exc))
            raise LocalWorkLost(job.id, f"the worker process died ({exc}); this peer trains its shards again") \
                from None
        except TaskFailed as exc:
            j.failed = exc.reason
            await self._drop(j)
            raise
        finally:
            if j.retire and j.group and all(w.busy == 0 for w in j.group):
                await self._retire(j)

    async def _retire(self, j: _JobWorkers) -> None:
        """The job finished here: a lone worker forgets it and becomes the spare (it keeps
        what it imported, such as transformers, so the next job starts at once); a group
        ends (its workers are joined in this job's process group)."""
        group, j.group = j.group, []
        if len(group) == 1 and group[0].alive and self.pool.keeps_spare:
            try:
                await group[0].call(msg.Forget(j.job.id), timeout=CALL_TIMEOUT)
            except (WorkerDied, TaskFailed, JobError):
                await _close_all(group)
            else:
                await self.pool.give_back(group[0])
                return
        await _close_all(group)
        self.pool.spare_soon()

    async def _drop(self, j: _JobWorkers, why: str | None = None) -> None:
        group, j.group, pending, j.pending = j.group, [], j.pending, []
        group += pending
        if group:
            await _close_all(group, why)
            self.pool.spare_soon()

    # -- the executor interface ------------------------------------------------------------

    async def new_job(self, spec: dict[str, Any], task_file: bytes | None) -> tuple[dict[str, Any], Path]:
        """The initial state comes back as the worker's file: the caller removes it."""
        worker = await self.pool.take()
        out = self._work_dir("submit") / f"init-{os.getpid()}-{id(worker)}.state"
        try:
            limit = spec.get("step_timeout")  # a number the record's schema will check; else the default
            built = await worker.call(msg.NewJob(spec, self._task_path(task_file), out),
                                      timeout=self._timeout(limit if isinstance(limit, int | float) else None))
        except WorkerDied as exc:
            raise TaskFailed(f"the worker process died while building the job ({exc})") from None
        except BaseException:
            await worker.close()
            raise
        await self.pool.give_back(worker)  # it holds no job: the job's own worker, if this peer prepares it
        return built.fixed, built.file

    async def prepare(self, job: JobSpec, task_file: bytes | None) -> Decline | str | None:
        j = self._jobs.get(job.id)
        if j is None or j.failed is not None:
            j = self._jobs[job.id] = _JobWorkers(job, task_file)
        async def start() -> Decline | str | None:
            async with j.lock:
                if j.group and all(w.alive for w in j.group):
                    return None
                return await self._start(j)

        try:
            decline = await self._fetching(job, start)
        except BaseException:
            if j.pending:  # it gave up: the kept workers go
                await _close_all(j.pending)
                j.pending = []
            raise
        if decline is None:
            return None
        self._jobs.pop(job.id, None)
        return decline

    async def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        j = self._jobs.get(eff.job.id)
        if j is not None and j.model_lost:
            if not eff.fresh:
                j.model_lost = False
                raise LocalWorkLost(eff.job.id, "the restarted worker does not hold this round's local model")
            j.model_lost = False
        asked = 0

        def on_progress(started: int) -> bool:
            nonlocal asked
            stop = False
            while asked < started:  # the node counts one call of should_stop per batch started
                asked += 1
                stop = should_stop() or stop
            return stop

        return await self._call(eff.job, lambda _rank: msg.Train(eff), step=True, on_progress=on_progress)

    async def pieces(self, job: JobSpec, rnd: int, shards: list[int], inner_steps: int,
                     first: int) -> dict[str, Any]:
        """See ``TorchExecutor.pieces``."""
        return await self._call(job, msg.Pieces(job, rnd, shards, inner_steps, first))

    async def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        j = self._jobs.get(eff.job.id)
        if j is not None and j.model_lost:
            j.model_lost = False
            raise LocalWorkLost(eff.job.id, "the restarted worker does not hold this round's local model")
        out = self._work_dir(eff.job.id) / f"delta-{eff.round}-{'-'.join(map(str, eff.shards))[:64]}.bin"
        made = await self._call(eff.job, lambda rank: msg.Delta(eff, out, rank))
        if made.file is None:
            raise JobError("the first worker of the job's group wrote no delta")
        return read_and_remove(made.file), made.metrics

    async def _with_deltas(self, job: JobSpec, deltas: Deltas, request: Callable[[DeltaFiles], Message[R]]) -> R:
        # Files the node wrote go to the worker as they are (no second copy); bytes become
        # files here, removed here afterwards. The worker reads each when it adds it.
        folder = self._work_dir(job.id)
        mine = [write_work(folder / f"deltas-{id(deltas)}-{i}.bin", ref) for i, (ref, _s) in enumerate(deltas)
                if isinstance(ref, bytes)]
        made = iter(mine)
        files = [(ref if isinstance(ref, Path) else next(made), samples) for ref, samples in deltas]
        try:
            return await self._call(job, request(files))
        finally:
            for p in mine:
                p.unlink(missing_ok=True)

    async def reduce_slice(self, job: JobSpec, deltas: Deltas, first: int, stop: int, *, rnd: int) -> bytes:
        out = self._work_dir(job.id) / f"slice-{rnd}-{first}-{stop}.bin"
        return read_and_remove(await self._with_deltas(
            job, deltas, lambda files: msg.ReduceSlice(job, files, first, stop, rnd, out)))

    async def aggregate(self, job: JobSpec, base: str, deltas: Deltas, *, rnd: int,
                        sliced: bool = False, outer: Outer | None = None) -> tuple[str, dict[str, float]]:
        done = await self._with_deltas(job, deltas, lambda files: msg.Aggregate(job, base, files, rnd, sliced, outer))
        return done.state, done.metrics

    async def apply(self, job: JobSpec, base: str, deltas: Deltas, expect: str, *, rnd: int,
                    sliced: bool = False, outer: Outer | None = None) -> bool:
        return await self._with_deltas(job, deltas,
                                       lambda files: msg.Apply(job, base, files, expect, rnd, sliced, outer))

    async def export_state(self, job: JobSpec, state: str, out: Path) -> None:
        await self._call(job, msg.ExportState(job, state, out))

    async def import_state(self, job: JobSpec, state: str, data: bytes | Path) -> bool:
        """A file is handed to the worker as it is (the worker removes it once read)."""
        path = data if isinstance(data, Path) else write_work(
            self._work_dir(job.id) / f"import-{state.removeprefix('sha256:')[:16]}.state", data)
        try:
            return await self._call(job, msg.ImportState(job, state, path))
        finally:
            path.unlink(missing_ok=True)

    def held_states(self, job: str) -> set[str]:
        return self.home.held_states(job)

    async def finish(self, job: JobSpec, state: str, metrics: dict[str, Any]) -> None:
        await self._call(job, msg.Finish(job, state, metrics))
        j = self._jobs.get(job.id)
        if j is not None:  # the job is over here: free the workers' memory once they are idle
            j.retire = True
            if j.group and all(w.busy == 0 for w in j.group):
                await self._retire(j)

    async def release(self, job: str) -> None:
        """The job ended here (failed, cancelled): end its worker."""
        j = self._jobs.pop(job, None)
        if j is not None:
            await self._drop(j, "the job ended on this peer (cancelled, or failed)")

    def workers(self) -> list[dict[str, Any]]:
        """For status: each job's worker, its device and process id."""
        out = []
        for jid, j in self._jobs.items():
            for rank, w in enumerate(j.group):
                if w.alive:
                    out.append({"job": jid, "rank": rank, "pid": w.process.pid, "device": w.device,
                                "deaths": j.deaths, "torch": w.hello.torch})
        return out

