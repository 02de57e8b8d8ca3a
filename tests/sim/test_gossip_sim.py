"""Anti-entropy at scale, in the simulator: a peer that joins a running job late takes its
history about twice (from each record's designated answerers), not once from every holder,
and ends on the same state as everyone (I3)."""

from __future__ import annotations

import trio

from ttpeer.net import MemoryRelay
from ttpeer.proto import Timing
from ttpeer.testing import Simulation

from .test_simulator import SPEC, assert_invariants

PEERS = 8


async def test_a_late_joiner_takes_the_history_about_twice_not_once_from_every_holder(tmp_path, autojump_clock):
    spec = {**SPEC, "rounds": 8, "shards": 2 * PEERS}
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=5, timing=Timing(digest_interval=2.0))
        sim.create(PEERS)
        async with trio.open_nursery() as nursery:
            sim._nursery = nursery
            for i in range(PEERS - 1):
                await sim.start(i)
            job = await sim.submit(spec)
            await sim.wait_round(job, 4, timeout=600)
            await sim.start(PEERS - 1)  # enrolled at the start, first heard of the job now
            late = sim.peers[PEERS - 1]
            with trio.fail_after(600):  # caught up: it holds the closes the others hold
                while sim.round_of(late, job) < sim.round_of(sim.peers[0], job) or sim.round_of(late, job) < 4:
                    await trio.sleep(0.5)
            await trio.sleep(3 * sim.timing.digest_interval)  # answers still on their way
            traffic = dict(late.node.machine.gossip_traffic)
            await sim.wait_done(job, timeout=900)
            assert_invariants(sim, job, spec)
            nursery.cancel_scope.cancel()
    # Every one of the 7 holders answered everything before: 6 more copies of each record.
    new, held = traffic["records_in_new"], traffic["records_in_held"]
    assert new > 20_000, traffic  # the history came by answers and broadcasts
    assert held < 1.5 * new, traffic
