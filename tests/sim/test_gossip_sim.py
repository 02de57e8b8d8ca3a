"""Anti-entropy in the simulator: a peer that joins a running job late takes its history
about twice (from each record's designated answerers), not once from every holder; a peer
that cannot read packed payloads still follows the job; and every peer ends on the same
state (I3)."""

from __future__ import annotations

import trio

from ttpeer.net import MemoryRelay
from ttpeer.proto import Broadcast, Timing, _gossip
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


async def test_a_peer_that_cannot_read_packed_payloads_still_follows_the_job(tmp_path, autojump_clock):
    # A peer of a version before packed payloads drops them as malformed. The others learn
    # that it never sends one, so they broadcast unpacked and answer it unpacked; it misses
    # only the probing digests, every other one.
    spec = {**SPEC, "rounds": 5, "shards": 8}
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=9, timing=Timing(digest_interval=1.0))
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            old = sim.peers[3].node
            dropped = []
            new_receive, new_tick = old.machine.receive, old.machine.tick

            def receive(sender, payload, now, *, settle=True):
                if payload.startswith(_gossip.PACKED):
                    dropped.append(payload)
                    return new_receive(sender, b"not json", now, settle=settle)
                return new_receive(sender, payload, now, settle=settle)

            def tick(now):  # and never sends a packed digest of its own
                return [Broadcast(_gossip.unpack(e.payload)[0]) if isinstance(e, Broadcast) else e
                        for e in new_tick(now)]

            old.machine.receive, old.machine.tick = receive, tick
            job = await sim.submit(spec)
            await sim.wait_done(job, timeout=900)
            assert_invariants(sim, job, spec)
            assert sim.round_of(sim.peers[3], job) == spec["rounds"]
            others = [p.node.machine for p in sim.peers[:3]]
            nursery.cancel_scope.cancel()
    assert dropped, "the others probed it"
    assert all(old.me not in m._gossip.packs for m in others)
    assert all({p.node.me for p in sim.peers[:3]} - {m.me} <= m._gossip.packs for m in others)
