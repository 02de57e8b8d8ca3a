"""A pool of two relays in the simulator (issue 15 point 3): ten peers over two lossy
relays; mid-job the first relay (the primary, which held every blob) dies for good and a
peer is SIGKILLed and restarted. Every message still arrives through the other relay, the
uploaders send again what only the dead relay held, and I2 and I3 hold."""

from __future__ import annotations

import trio

from ttpeer.net import Faults, MemoryRelay
from ttpeer.testing import Simulation
from ttpeer.testing._sim import sim_relay_url

from .test_simulator import SPEC, assert_invariants


def contributed(sim: Simulation, job: str) -> bool:
    """Whether peer00 holds a contribution to the round it is in."""
    node = sim.peers[0].node
    assert node is not None
    records = node.machine.records
    rnd = node.machine.chain(records.by_id[job]).round
    return any(c["round"] == rnd for c in records.of_job(job, "contrib"))


async def test_ten_peers_lose_their_primary_relay_mid_job(tmp_path, autojump_clock):
    faults = [Faults(seed=s, drop=0.03, duplicate=0.03, delay=0.3, max_delay=0.4) for s in (21, 22)]
    async with MemoryRelay(faults=faults[0]) as first, MemoryRelay(faults=faults[1]) as second:
        sim = Simulation(tmp_path, first, seed=21, more_relays=[second])
        sim.create(10, speeds=[1.0, 1.0, 0.5, 1.0, 1.5, 1.0, 0.7, 1.0, 1.2, 1.0])
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SPEC)
            await sim.wait_round(job, 1, timeout=300)
            # The worst moment: a delta of the open round is on the primary, not yet closed on.
            with trio.fail_after(300):
                while not contributed(sim, job):
                    await trio.sleep(0.01)
            assert first.blobs and not second.blobs  # every upload went to the primary
            first.available = False  # gone for good, its blobs with it
            sim.kill(4)
            await sim.wait_round(job, 2, timeout=300)
            await sim.start(4)
            await sim.wait_done(job, timeout=900)
            live = [p.node for p in sim.peers if p.node is not None]
            states = {tuple((d["url"], d["state"]) for d in n.transport.describe()) for n in live}
            assert states == {((sim_relay_url(0), "down"), (sim_relay_url(1), "live"))}
            # What the dead relay held and was still needed came again from its uploaders.
            assert sum(n.transport.resent for n in live) > 0
            assert second.blobs[sim.peers[0].home.config().pool]
            nursery.cancel_scope.cancel()
    assert_invariants(sim, job)
