"""The outer step picked by the pool, in the simulator: each close of an ``outer_auto`` job
names the step its rule gives for that round's contributions, and every peer applies that
step (the fake executor's states depend on it, so a peer that took the job's own would not
reproduce the close). A peer killed mid-run leaves rounds with fewer contributions, whose
closes pick their own step; the pool still ends on one state."""

from __future__ import annotations

import trio

from ttpeer.net import MemoryRelay
from ttpeer.proto import Outer, Plan, close_outer, outer_settings
from ttpeer.testing import Simulation

SPEC = {
    "task": "sim", "mode": "fused", "rounds": 12, "shards": 4, "batches": 20, "batch_size": 8,
    "inner_lr": 1e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8,
    "seed": 3, "lease": 30.0, "steal": True, "overlap": 1, "outer_auto": 1,
}


async def test_every_close_names_the_rules_step_and_every_peer_applies_it(tmp_path, autojump_clock):
    async with MemoryRelay(blob_seconds=0.2) as relay:
        sim = Simulation(tmp_path, relay, seed=9, step_time=0.05)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(dict(SPEC))
            await sim.wait_round(job, 3, timeout=600)
            sim.kill(await sim.wait_training(timeout=120))
            await sim.wait_done(job, timeout=3000)
            nursery.cancel_scope.cancel()

    live = [p for p in sim.peers if p.alive]
    assert len(live) == 3 and len({p.disk.finished[job] for p in live}) == 1
    machine = live[0].node.machine
    rec = machine.records.by_id[job]
    chain = machine.chain(rec)
    plan = Plan.of(rec, chain.closes)
    counts = set()
    for rnd, close in enumerate(chain.closes):
        step = close_outer(close)
        assert step == outer_settings(len(close["contribs"]), plan.inner_steps(rnd)), (rnd, close.body)
        assert isinstance(step, Outer) and step != Outer(SPEC["outer_lr"], SPEC["outer_momentum"])
        counts.add(len(close["contribs"]))
    # Rounds closed from different numbers of contributions took different steps.
    assert len(counts) >= 2, counts
    for p in live:  # every peer holds the chain's states, reproduced with the closes' steps
        assert p.node.machine.chain(rec).states == chain.states
