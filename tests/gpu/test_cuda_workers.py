"""Checks that need a CUDA device (``scripts/gpu-check`` runs them on a GPU machine);
elsewhere they skip, saying so. A CUDA job trains in a worker process on the GPU, and
CUDA running out of memory fails the job on this peer with a message that says what
to do, never the daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ttpeer.daemon.worker._procexec import ProcessExecutor
from ttpeer.errors import TaskFailed
from ttpeer.proto import Train

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check)")

from tests.integration.test_workers import _pool_home, _prepared  # noqa: E402


def _env(fault: str) -> dict[str, str]:
    return {**os.environ, "TTPEER_TEST_FAULT": fault}


async def test_a_cuda_job_trains_in_a_worker_on_the_gpu(tmp_path: Path) -> None:
    home = _pool_home(tmp_path)
    executor = ProcessExecutor(home, env=_env("none:0"), spare=False, device="auto")
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        job, s0 = await _prepared(home, executor)
        assert await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False) == 8 * 16
        (worker,) = executor.workers()
        assert worker["device"] == "cuda:0"
        nursery.cancel_scope.cancel()


async def test_cuda_out_of_memory_fails_the_job_here_with_what_to_do(tmp_path: Path) -> None:
    home = _pool_home(tmp_path)
    executor = ProcessExecutor(home, env=_env("oom:2"), spare=False, device="cuda")
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        job, s0 = await _prepared(home, executor)
        with pytest.raises(TaskFailed, match=r"out of GPU memory on cuda:0: try a smaller --micro-batch"):
            await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False)
        nursery.cancel_scope.cancel()
