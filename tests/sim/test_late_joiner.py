"""A machine that joins after a job has finished skips it: it never loads the task (which
could be a model-sized load, and a stop in the middle of it once published a false
failure); status calls the job "skipped". A member that was merely down for the whole
job still finishes it on its return, as before (it holds the final model, for export)."""

from __future__ import annotations

import trio

from ttpeer.daemon.node._status import snapshot
from ttpeer.net import MemoryRelay
from ttpeer.testing import Simulation

from .test_simulator import SPEC


def _holds_the_whole_chain(sim: Simulation, i: int, job: str) -> bool:
    node = sim.peers[i].node
    rec = node.machine.records.by_id.get(job) if node is not None else None
    return rec is not None and node is not None and node.machine.chain(rec).round == SPEC["rounds"]


async def test_a_machine_that_joins_after_a_job_ended_skips_it(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=3)
        sim.create(3)  # peer02 is a member from the start, but down for the whole job
        async with trio.open_nursery() as nursery:
            sim._nursery = nursery
            for i in range(2):
                await sim.start(i)
            job = await sim.submit(SPEC)
            await sim.wait_done(job, timeout=600)
            await trio.sleep(5)  # the joiner's clock reads later than the submission
            late = sim.enroll_racers(["late"])[0]
            await sim.start(2)
            await sim.start(sim.peers.index(late))
            # The member that was down catches up and finishes; the newcomer does not.
            with trio.fail_after(600):
                while job not in sim.peers[2].disk.finished:
                    await trio.sleep(0.5)
            with trio.fail_after(60):
                while not _holds_the_whole_chain(sim, sim.peers.index(late), job):
                    await trio.sleep(0.5)
            await trio.sleep(30)  # ticks in which a wrongly active job would be prepared
            assert late.node is not None and late.executor is not None
            assert job not in late.executor.task_files  # never prepared: the task never loaded
            assert job in late.node.machine.skipped
            states = {j["id"]: j["state"] for j in snapshot(late.node)["jobs"]}
            assert states[job] == "skipped"
            down = sim.peers[2]
            assert down.executor is not None and job in down.executor.task_files
            assert {j["id"]: j["state"] for j in snapshot(down.node)["jobs"]}[job] == "done"
            nursery.cancel_scope.cancel()
