"""Ensemble jobs in the deterministic simulator: members are the work units, each
contribution is one member's checkpoint, peers train different members at once,
and a member whose peer crashed is finished by another peer."""

from __future__ import annotations

import trio

from ttpeer.net import Faults, MemoryRelay
from ttpeer.testing import Simulation

from .test_simulator import assert_invariants

SPEC = {
    "task": "sim", "mode": "ensemble", "members": 4, "rounds": 4, "shards": None, "batches": 10, "batch_size": 8,
    "inner_lr": 1e-3, "weight_decay": 0.01, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8,
    "seed": 1, "lease": 5.0, "steal": True,
}


def _units(sim: Simulation, job: str) -> list:
    node = next(p.node for p in sim.peers if p.alive)
    machine = node.machine
    chain = machine.chain(machine.records.by_id[job])
    return [machine.records.by_id[c] for close in chain.closes for c in close["contribs"]]


async def test_two_peers_train_different_members_in_every_round(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=2)
        sim.create(2)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(dict(SPEC))
            await sim.wait_done(job, timeout=300)
            assert_invariants(sim, job, {**SPEC, "shards": 4})
            nursery.cancel_scope.cancel()
    units = _units(sim, job)
    assert len(units) == 4 * 4 and all(len(u["shards"]) == 1 for u in units)  # one member per contribution
    # Round 0 may go to one peer alone while the other is still getting the pool key.
    for rnd in range(1, 4):
        assert len({u.author for u in units if u["round"] == rnd}) == 2  # both peers trained members


async def test_a_crashed_peers_member_is_finished_by_another(tmp_path, autojump_clock):
    async with MemoryRelay(faults=Faults(seed=7, drop=0.03, duplicate=0.03, delay=0.2, max_delay=0.3)) as relay:
        sim = Simulation(tmp_path, relay, seed=7)
        sim.create(3)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(dict(SPEC))
            await sim.wait_round(job, 1, timeout=300)
            # Kill whichever non-admin peer is training a member now. Waiting for one peer in
            # particular could outlast the job: with drops and delays it may miss every round left.
            index = await sim.wait_training(timeout=60)
            training = sim.peers[index].node.machine.training
            sim.kill(index)
            await sim.wait_done(job, timeout=600)
            assert_invariants(sim, job, {**SPEC, "shards": 4})
            nursery.cancel_scope.cancel()
    _job, rnd, member = training
    units = _units(sim, job)
    victim = sim.peers[index].home.node_key().public_key().public_bytes_raw().hex()
    assert [u.author != victim for u in units if (u["round"], u["shards"]) == (rnd, [member])] == [True]
