"""A pool of two relays in the simulator (issue 15 point 3): ten peers over two lossy
relays; mid-job the first relay (the primary, which held every blob) dies for good and a
peer is SIGKILLed and restarted. Every message still arrives through the other relay, the
uploaders send again what only the dead relay held, and I2 and I3 hold."""

from __future__ import annotations

import pytest
import trio

from ttpeer.errors import UsageError
from ttpeer.net import Faults, MemoryRelay
from ttpeer.proto import RevokeError
from ttpeer.testing import Simulation
from ttpeer.testing._sim import FAKE_FP, sim_relay_url

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


async def _until(condition, seconds: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.05)


async def test_the_admin_changes_the_pools_relays_and_every_peer_follows(tmp_path, autojump_clock):
    url0, url1 = sim_relay_url(0), sim_relay_url(1)
    async with MemoryRelay() as first, MemoryRelay() as second:
        sim = Simulation(tmp_path, first, seed=3, more_relays=[second])
        sim.create(3)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            admin, member = sim.peers[0].node, sim.peers[1].node
            assert admin is not None and member is not None
            with pytest.raises(RevokeError, match="only the pool admin"):
                member.relay_change(remove=url1)
            with pytest.raises(UsageError, match="not one of the pool's relays"):
                admin.relay_change(remove="https://nowhere.example")
            # The pool's config names relay 0 only: adding relay 1 signs the first relays record.
            rec, said = admin.relay_change(add=(url1 + "/", FAKE_FP))
            assert rec is not None and rec["n"] == 1 and said == f"added {url1}; the pool has 2 relays"
            again, said = admin.relay_change(add=(url1, FAKE_FP))
            assert again is None and "already" in said
            both = [(url0, FAKE_FP), (url1, FAKE_FP)]
            await _until(lambda: all(p.home.config().relay_pairs() == both for p in sim.peers))
            rec, _said = admin.relay_change(remove=url0)
            assert rec is not None and rec["n"] == 2

            def only_second(p) -> bool:  # type: ignore[no-untyped-def]
                return (p.node is not None and [d["url"] for d in p.node.transport.describe()] == [url1]
                        and p.home.config().relay_pairs() == [(url1, FAKE_FP)])

            await _until(lambda: all(only_second(p) for p in sim.peers))
            assert [r["url"] for r in member.relay_list()] == [url1]
            with pytest.raises(UsageError, match="the pool's only relay"):
                admin.relay_change(remove=url1)
            # A peer that restarts uses the newest list from its records before it connects.
            sim.kill(2)
            await sim.start(2)
            await _until(lambda: only_second(sim.peers[2]))
            job = await sim.submit({**SPEC, "rounds": 2})
            await sim.wait_done(job, timeout=600)
            assert not first.blobs  # nothing went through the relay the pool dropped
            nursery.cancel_scope.cancel()
