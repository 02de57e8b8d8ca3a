"""Task code runs in supervised worker processes (``ProcessExecutor``): real workers,
real torch, real signals. A hang, an exit, a segfault or a SIGKILL of the worker is
this peer's job failing (or its local work being trained again), never the daemon
ending; a job trained through workers ends bit-identical on every peer."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from ttpeer.daemon import Home, Node
from ttpeer.daemon.worker._procexec import ProcessExecutor
from ttpeer.errors import LocalWorkLost, TaskFailed
from ttpeer.net import MemoryRelay
from ttpeer.proto import JobSpec, Timing, Train, sign

from .test_torch_nodes import FP, RELAY, _homes, _spec

pytestmark = pytest.mark.slow

FAULTY = Path(__file__).parent.parent / "unit" / "fixtures" / "task_faulty.py"


def _env(fault: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TTPEER_TEST_FAULT": fault}


async def _prepared(home: Home, executor: ProcessExecutor, **changes: Any) -> tuple[Any, str]:
    """A fused job of the faulty task, made and prepared through the executor's workers."""
    task_file = FAULTY.read_bytes()
    spec = _spec(rounds=2, shards=2, batches=8, steal=False, task=FAULTY.name, **changes)
    fixed, init = await executor.new_job(spec, task_file)
    body = {**spec, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = JobSpec.of(sign("job", home.config().pool, body, home.node_key()))
    assert await executor.prepare(job, task_file) is None
    assert await executor.import_state(job, fixed["init"], init)
    return job, fixed["init"]


def _pool_home(tmp_path: Path) -> Home:
    home = Home(tmp_path / "a")
    home.create_pool(RELAY, FP, "a", time.time())
    return home


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone for our purposes: it runs nothing.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


async def test_a_step_that_hangs_fails_the_job_here_and_stops_the_worker(tmp_path: Path) -> None:
    home = _pool_home(tmp_path)
    executor = ProcessExecutor(home, env=_env("hang:3"), step_timeout=2, spare=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        job, s0 = await _prepared(home, executor)
        (worker,) = executor.workers()
        with trio.fail_after(60):
            with pytest.raises(TaskFailed, match=r"a step took longer than 2 s"):
                await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False)
        assert _gone(worker["pid"])
        # The job stays failed here: no worker is started for it again.
        with pytest.raises(TaskFailed):
            await executor.train(Train(job, 0, 1, 0, s0, fresh=True), lambda: False)
        assert executor.workers() == []
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("fault", "said"), [("exit:2", "exited with code 3"), ("segv:2", "killed by SIGSEGV")])
async def test_a_worker_that_keeps_dying_fails_the_job_with_how_it_died(tmp_path: Path, fault: str,
                                                                          said: str) -> None:
    home = _pool_home(tmp_path)
    executor = ProcessExecutor(home, env=_env(fault), spare=False, max_deaths=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        job, s0 = await _prepared(home, executor)
        with trio.fail_after(120):
            # A death loses the local model (the protocol trains those shards again) and a
            # new worker is started, until the job has had max_deaths of them.
            with pytest.raises(LocalWorkLost, match=said):
                await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False)
            with pytest.raises(TaskFailed, match=said):
                await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False)
        nursery.cancel_scope.cancel()


async def test_after_a_death_the_lost_local_model_is_said_before_it_is_used(tmp_path: Path) -> None:
    home = _pool_home(tmp_path)
    executor = ProcessExecutor(home, env=_env("none:0"), spare=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        job, s0 = await _prepared(home, executor)
        with trio.fail_after(60):
            assert await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False) == 8 * 16
            (worker,) = executor.workers()
            os.kill(worker["pid"], signal.SIGKILL)
            # The next shard would continue the local model, which died with the worker.
            with pytest.raises(LocalWorkLost):
                await executor.train(Train(job, 0, 1, 0, s0, fresh=False), lambda: False)
            assert await executor.train(Train(job, 0, 1, 1, s0, fresh=True), lambda: False) == 8 * 16
        (again,) = executor.workers()
        assert again["pid"] != worker["pid"] and again["deaths"] == 1
        nursery.cancel_scope.cancel()


async def test_a_worker_sigkilled_mid_shard_is_restarted_and_the_pool_ends_identical(tmp_path: Path) -> None:
    homes = _homes(tmp_path)
    spec = _spec(rounds=4, shards=4, batches=12, steal=True, task=FAULTY.name)
    executors = [ProcessExecutor(home, env=_env("slow:30")) for home in homes]

    async def kill_bobs_worker(nodes: list[Node], executors: list[ProcessExecutor]) -> None:
        while nodes[1].machine.training is None or nodes[1].machine.training[1] < 1:
            await trio.sleep(0.02)
        (victim,) = executors[1].workers()
        os.kill(victim["pid"], signal.SIGKILL)

    job = await _pool_run(homes, executors, spec, during=kill_bobs_worker)
    assert len(_finals(homes, job)) == 1
    assert executors[1]._jobs[job.id].deaths == 1


async def _pool_run(homes: list[Home], executors: list[ProcessExecutor], spec: dict[str, Any],
                    during: Any = None, timeout: float = 180) -> Any:
    """Run ``spec`` on real nodes with these executors; ``during(nodes, executors)`` runs
    once the job is submitted. Returns the job once every node has finished it."""
    async with MemoryRelay() as relay, trio.open_nursery() as nursery:
        nodes = []
        for home, executor in zip(homes, executors, strict=True):
            await nursery.start(executor.run)
            cfg = home.config()
            nodes.append(Node(home, relay.client(cfg.pool, home.node_key(), cfg.proof), executor,
                              timing=Timing(digest_interval=0.5)))
            await nursery.start(nodes[-1].run)
        with trio.fail_after(timeout):
            for executor in executors:  # as the daemon does at start: a spare worker waits
                await executor.warm_up()
            job = await nodes[0].submit(spec, FAULTY.read_bytes())
            if during is not None:
                await during(nodes, executors)
            for node in nodes:
                await node.done_event(job.id).wait()
        nursery.cancel_scope.cancel()
    return job


def _finals(homes: list[Home], job: Any) -> set[str]:
    return {hashlib.sha256((h.path / "states" / job.id / "final.safetensors").read_bytes()).hexdigest()
            for h in homes}


async def test_a_peer_with_two_local_workers_trains_its_shards_together_and_ends_identical(tmp_path: Path) -> None:
    homes = _homes(tmp_path)
    # Overlapped, with the pool's outer step: the pair agrees on each correction too.
    spec = _spec(rounds=4, shards=4, batches=10, steal=True, task=FAULTY.name, overlap=1, outer_auto=1)
    gate = tmp_path / "bob-is-ready"
    # Alice's first step waits for the gate, opened once bob's two workers are up: else, on
    # a loaded machine, alice trained the whole job while bob was still starting them.
    executors = [ProcessExecutor(homes[0], env={**_env("slow:40"), "TTPEER_TEST_GATE": str(gate)}),
                 ProcessExecutor(homes[1], env=_env("slow:40"), workers=2)]
    seen: list[list[dict[str, Any]]] = []

    async def watch(nodes: list[Node], executors: list[ProcessExecutor]) -> None:
        while len(executors[1].workers()) < 2:
            await trio.sleep(0.05)
        gate.touch()
        while not seen:  # until the pair of workers trains a shard
            if nodes[1].machine.training is not None and len(group := executors[1].workers()) == 2:
                seen.append(group)
            await trio.sleep(0.05)

    job = await _pool_run(homes, executors, spec, during=watch)
    assert len(_finals(homes, job)) == 1
    (group,) = seen
    assert [w["rank"] for w in group] == [0, 1] and group[0]["pid"] != group[1]["pid"]
    assert all(w["device"] == "cpu" for w in group)
    # Both peers trained: the pair of workers contributed shards of their own.
    authors = {c.author for c in nodes_records(homes[1], "contrib", job.id)}
    assert len(authors) == 2


def nodes_records(home: Home, kind: str, job: str) -> list[Any]:
    from ttpeer.daemon.node._recordlog import RecordLog
    from ttpeer.proto import parse

    records = [parse(raw) for raw in RecordLog(home.records_log, fsync=False).load()]
    return [r for r in records if r.kind == kind and r["job"] == job]


async def test_a_worker_stopped_because_the_job_ended_here_is_not_said_to_have_died(tmp_path: Path) -> None:
    home = _pool_home(tmp_path)
    executor = ProcessExecutor(home, env=_env("hang:2"), step_timeout=120, spare=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        job, s0 = await _prepared(home, executor)
        lost: list[LocalWorkLost] = []

        async def train() -> None:
            with pytest.raises(LocalWorkLost) as caught:
                await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False)
            lost.append(caught.value)

        with trio.fail_after(60):
            async with trio.open_nursery() as inner:
                inner.start_soon(train)
                while not executor.workers() or not _busy(executor):  # the shard is in its hanging step
                    await trio.sleep(0.05)
                await executor.release(job.id)  # as a cancel does
        (said,) = [str(e) for e in lost]
        assert "stopped" in said and "the job ended on this peer" in said, said
        assert "SIGKILL" not in said and "out-of-memory" not in said and "trains its shards again" not in said
        nursery.cancel_scope.cancel()


def _busy(executor: ProcessExecutor) -> bool:
    return any(w.busy for j in executor._jobs.values() for w in j.group)
