"""What a failure means, in the simulator: a task that fails on one peer is a decline and
the others finish; one that fails on every peer fails for the pool (status says why on
every peer) and a restart does not run it again; a cancel ends a job everywhere; and an
exception that escapes an executor fails the job, never the daemon."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from rich.console import Console

from ttpeer._watch import render
from ttpeer.errors import JobError
from ttpeer.net import MemoryRelay
from ttpeer.testing import Simulation

SPEC = {
    "task": "sim", "mode": "fused", "rounds": 3, "shards": 6, "batches": 5, "batch_size": 8,
    "inner_lr": 1e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8,
    "seed": 1, "lease": 5.0, "steal": True,
}
GOOD = {**SPEC, "task": "good"}


def job_status(sim: Simulation, i: int, job: str) -> dict[str, Any]:
    node = sim.peers[i].node
    assert node is not None
    return next((j for j in node.status()["jobs"] if j["id"] == job), {"state": "unknown here yet"})


async def wait_states(sim: Simulation, job: str, want: dict[int, str], timeout: float = 300) -> None:
    """Wait (simulated time) until peer i's status says ``want[i]`` for ``job``."""
    with trio.fail_after(timeout):
        while any(job_status(sim, i, job)["state"] != s for i, s in want.items()):
            await trio.sleep(0.2)


async def test_a_failure_on_one_peer_is_a_decline_and_the_others_finish(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=3)
        sim.create(3)
        sim.peers[2].fails["sim"] = "my_task.py:7 in loss: RuntimeError: this GPU only"
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SPEC)
            await wait_states(sim, job, {0: "done", 1: "done", 2: "failed"})
            me2 = sim.peers[2].node.me
            for i in range(3):
                st = job_status(sim, i, job)
                assert st["ended"] is None  # not failed for the pool: the others finished it
                [decline] = st["declines"]
                assert (decline["peer"], decline["code"]) == (me2, "failed")
                assert decline["reason"] == "my_task.py:7 in loss: RuntimeError: this GPU only"
            assert sim.peers[2].executor.failures == 1  # it tried once, then sat the job out
            assert job not in sim.peers[2].disk.finished
            assert sim.peers[0].disk.finished[job] == sim.peers[1].disk.finished[job]
            nursery.cancel_scope.cancel()


async def test_a_task_that_fails_everywhere_fails_for_the_pool_and_is_not_rerun(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=4)
        sim.create(3)
        for peer in sim.peers:
            peer.fails["sim"] = f"my_task.py:31 in loss: RuntimeError: boom on {peer.name}"
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SPEC)
            await wait_states(sim, job, {0: "failed", 1: "failed", 2: "failed"})
            for i in range(3):
                end = job_status(sim, i, job)["ended"]
                assert end["how"] == "failed" and end["by"] is None
                assert {r["name"]: r["reason"] for r in end["reasons"]} == {
                    p.name: f"my_task.py:31 in loss: RuntimeError: boom on {p.name}" for p in sim.peers}
            console = Console(width=300, record=True)  # what 'ttpeer status --watch' draws
            console.print(render(sim.peers[0].node.status()))
            assert "failed on every peer: peer00: my_task.py:31 in loss: RuntimeError: boom on peer00" in (
                console.export_text())
            # Restarted, a peer replays the records: the job failed here and for the pool, so it
            # is not run again, and the next job (after it in the queue) finishes everywhere.
            sim.kill(1)
            await sim.start(1)
            good = await sim.submit(GOOD)
            await sim.wait_done(good, timeout=300)
            assert job_status(sim, 1, job)["state"] == "failed"
            assert sim.peers[1].executor.failures == 0
            assert not [t for t in sim.peers[1].executor.trained if t[0] == job]
            nursery.cancel_scope.cancel()


async def test_cancel_by_the_submitter_stops_every_peer_and_others_are_refused(tmp_path, autojump_clock):
    spec = {**SPEC, "rounds": 50}
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=5)
        sim.create(3)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(spec, via=1)  # a member (not the admin) submits
            await sim.wait_round(job, 1, timeout=300)
            await wait_states(sim, job, {0: "running", 2: "running"})
            with pytest.raises(JobError, match=r"only the job's submitter \(peer01\) or the pool's admin"):
                await sim.peers[2].node.cancel(job[:10])
            _job, rec, again = await sim.peers[1].node.cancel(job[:10])
            assert not again and rec.kind == "cancel"
            await wait_states(sim, job, {0: "cancelled", 1: "cancelled", 2: "cancelled"}, timeout=30)
            for i in range(3):
                st = job_status(sim, i, job)
                assert st["ended"]["by"] == {"peer": sim.peers[1].node.me, "name": "peer01"}
            # Every peer stops at once: nobody trains it a lease later, and no round closes.
            rounds = {i: sim.round_of(sim.peers[i], job) for i in range(3)}
            trained = len(sim.all_trained())
            await trio.sleep(2 * spec["lease"])
            assert all(sim.peers[i].node.machine.training is None for i in range(3))
            assert {i: sim.round_of(sim.peers[i], job) for i in range(3)} == rounds
            assert len(sim.all_trained()) <= trained + 3  # at most the shards in flight ended
            # The admin may cancel too; the job is already cancelled, so it is told so.
            _job, again_rec, again = await sim.peers[0].node.cancel(job)
            assert again and again_rec.id == rec.id
            good = await sim.submit(GOOD)
            await sim.wait_done(good, timeout=300)
            nursery.cancel_scope.cancel()


async def test_an_exception_that_escapes_the_executor_fails_the_job_not_the_daemon(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=6)
        sim.create(2)
        for peer in sim.peers:
            peer.fails["sim"] = ZeroDivisionError("a bug in an executor")
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SPEC)
            await wait_states(sim, job, {0: "failed", 1: "failed"})
            reasons = [r["reason"] for r in job_status(sim, 0, job)["ended"]["reasons"]]
            assert reasons == ["internal error: ZeroDivisionError: a bug in an executor (a bug; see this "
                               "peer's log)"] * 2
            good = await sim.submit(GOOD)  # the same daemons, still running
            await sim.wait_done(good, timeout=300)
            nursery.cancel_scope.cancel()
