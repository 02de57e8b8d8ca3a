"""The worker processes of one peer: started, configured for its device, one kept spare.

``WorkerPool`` starts each worker (``python -m ttpeer.daemon.worker._worker``) in its own
nursery (``run``: cancelling it kills the spare; the executor ends the workers its jobs
hold), sends it this peer's configuration and the device it trains on, and keeps one
started worker waiting (torch imported, the default task's data made) so that the next
job or submission pays for no interpreter start. It knows no job: ``ProcessExecutor``
(``_procexec.py``) takes workers from it and gives back the ones that hold none.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable

import trio

from ttpeer.errors import JobError, TaskFailed

from . import _workermsg as msg
from ._workerproc import HELLO_TIMEOUT, WorkerDied, _Worker

log = logging.getLogger("ttpeer.daemon")


class WorkerPool:
    def __init__(self, config: Callable[[str], msg.Configure], *, device: str, python: str,
                 env: dict[str, str] | None, spare: bool) -> None:
        """``config``: what a worker is configured with, given its device; ``device``: a
        torch device, or "auto" (the first CUDA device if the worker sees one, else the CPU);
        ``env``: the workers' environment (None: this process's); ``spare``: keep one waiting."""
        self._config = config
        self._device = device
        self._python = python
        self._env = env
        self.keeps_spare = spare
        self._nursery: trio.Nursery | None = None
        self._spare: _Worker | None = None
        self._spare_lock = trio.Lock()
        self.devices: list[str] = []  # what the workers train on, for status

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start workers until cancelled; then kill the spare."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            if self._spare is not None:
                self._spare.kill("the daemon is stopping")

    async def warm_up(self) -> None:
        """Start the spare worker (torch imported, meta kernels loaded, the default task's
        data made) off any job's path."""
        if self.keeps_spare:
            await self._refill_spare()

    async def _refill_spare(self) -> None:
        async with self._spare_lock:
            if self._spare is not None and self._spare.alive:
                return
            try:
                spare = await self.new()
                await spare.call(msg.Warm(), timeout=HELLO_TIMEOUT)
            except (WorkerDied, TaskFailed, JobError) as exc:
                log.warning("could not start a spare worker: %s", exc)
                return
            self._spare = spare

    async def _spawn(self) -> _Worker:
        if self._nursery is None:
            raise JobError("the worker supervisor is not running")
        env = dict(self._env if self._env is not None else os.environ)
        env.setdefault("TTPEER_WORKER_LOG", logging.getLevelName(logging.getLogger("ttpeer").getEffectiveLevel()))
        # glibc keeps freed blocks under its mmap threshold in its heaps (one per thread that
        # allocated, and the executor's calls run in several threads), and that threshold
        # rises to 32 MB as large blocks are freed: a model's tensors, freed, stayed
        # resident. A fixed 1 MiB threshold maps each tensor of a model on its own and
        # gives it back when freed (scripts/bench/memory). Other allocators ignore it.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        process = await trio.lowlevel.open_process(
            # -P: a folder named ttpeer in the daemon's working directory must not shadow ours
            [self._python, "-P", "-m", "ttpeer.daemon.worker._worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, start_new_session=False)
        worker = _Worker(process)
        await self._nursery.start(worker.start)
        self._nursery.start_soon(worker._sender)
        return worker

    async def new(self) -> _Worker:
        """A new worker, started and configured."""
        worker = await self._spawn()
        device = worker.device = self.device_for(worker)
        await worker.configure(self._config(device))
        if device not in self.devices:
            self.devices.append(device)
        return worker

    async def take(self) -> _Worker:
        """A configured worker with no job: the spare if one is ready, else a new one."""
        async with self._spare_lock:
            worker, self._spare = self._spare, None
        if worker is not None and worker.alive:
            return worker
        return await self.new()

    async def give_back(self, worker: _Worker) -> None:
        """A worker that holds no job (it built a submission): keep it as the spare."""
        async with self._spare_lock:
            if self.keeps_spare and worker.alive and (self._spare is None or not self._spare.alive):
                self._spare = worker
                return
        await worker.close()

    def spare_soon(self) -> None:
        """A job's worker ended: have a spare ready for the next job, off its path."""
        if self.keeps_spare and self._nursery is not None:
            self._nursery.start_soon(self._refill_spare)

    def device_for(self, worker: _Worker) -> str:
        if self._device == "cuda":
            return "cuda:0"
        if self._device != "auto":
            return self._device
        return "cuda:0" if worker.hello.cuda_devices > 0 else "cpu"
