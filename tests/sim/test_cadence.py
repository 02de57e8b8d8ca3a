"""The auto cadence in the simulator: real daemons pick each round's inner steps from the
sync they measure. On a fast link rounds shrink (more outer steps for the same compute),
on a slow one they grow until the sync hides; either way the job trains exactly its
budget, every round is covered, and crashes and stealing work as with fixed rounds."""

from __future__ import annotations

import pytest
import trio

from ttpeer.net import Faults, MemoryRelay
from ttpeer.proto import Plan, covered
from ttpeer.testing import Simulation

# Budget: 10 x 20 = 200 inner steps per shard; a peer's shard of 20 steps takes 1 s.
SPEC = {
    "task": "sim", "mode": "fused", "rounds": 10, "shards": 4, "batches": 20, "batch_size": 8,
    "inner_lr": 1e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8,
    "seed": 1, "lease": 30.0, "steal": True, "overlap": 1, "h_min": 4, "h_max": 400,
}


def sizes_of(sim: Simulation, job: str) -> tuple[Plan, tuple[int, ...]]:
    """The finished job's plan and round sizes, after checking the invariants every live
    peer must show: one chain, the whole budget trained, every shard of every round
    covered by shards their authors trained, in rounds of exactly the planned size."""
    live = [p for p in sim.peers if p.alive]
    assert len({p.disk.finished[job] for p in live}) == 1
    machine = live[0].node.machine
    rec = machine.records.by_id[job]
    chains = {p.node.machine.chain(rec).states for p in live}
    assert len(chains) == 1
    chain = machine.chain(rec)
    plan = Plan.of(rec, chain.closes)
    assert plan.finished(chain.round) and not plan.finished(chain.round - 1)
    sizes = tuple(plan.inner_steps(r) for r in range(chain.round))
    assert sum(sizes) == SPEC["rounds"] * SPEC["batches"]
    for p in live:  # every peer reads the same sizes from its own records
        assert Plan.of(rec, p.node.machine.chain(rec).closes).sizes == plan.sizes
    trained = {}
    for p in sim.peers:
        trained.setdefault(p.home.node_key().public_key().public_bytes_raw().hex(), set()).update(
            (r, s) for j, r, s in p.trained + (p.executor.trained if p.executor else []) if j == job)
    for rnd, close in enumerate(chain.closes):
        parts = [machine.records.by_id[c] for c in close["contribs"]]
        assert covered(parts) == set(range(SPEC["shards"]))
        assert all((rnd, s) in trained[c.author] for c in parts for s in c["shards"])
        if rnd >= 1:
            assert all("work_s" in c["metrics"] for c in parts)
    return plan, sizes


async def _run(tmp_path, blob_seconds: float, spec: dict, *, kill: bool = False, faults=None):
    async with MemoryRelay(blob_seconds=blob_seconds, faults=faults) as relay:
        sim = Simulation(tmp_path, relay, seed=5, step_time=0.05)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(spec)
            if kill:
                await sim.wait_round(job, 3, timeout=600)
                # a peer that holds a claim: its shard must come back
                sim.kill(await sim.wait_training(timeout=120))
            await sim.wait_done(job, timeout=3000)
            nursery.cancel_scope.cancel()
    return sim, job


async def test_rounds_shrink_on_a_fast_link(tmp_path, autojump_clock):
    sim, job = await _run(tmp_path, 0.01, SPEC)
    _plan, sizes = sizes_of(sim, job)
    # A sync of a few hundredths of a second hides behind a handful of 50 ms steps.
    assert sizes[:2] == (20, 20)
    assert min(sizes[:-1]) <= 6 and len(sizes) >= 2 * SPEC["rounds"], sizes
    assert all(b >= a / 2 for a, b in zip(sizes[:-1], sizes[1:-1], strict=False)), sizes  # at most halved


async def test_rounds_grow_on_a_slow_link(tmp_path, autojump_clock):
    sim, job = await _run(tmp_path, 2.0, SPEC)
    _plan, sizes = sizes_of(sim, job)
    # Every blob takes 2 s: a round's sync is several seconds, so 1 s rounds grow (at most 2x a round).
    assert sizes[:2] == (20, 20)
    assert max(sizes) >= 2 * SPEC["batches"] and len(sizes) < SPEC["rounds"], sizes
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:], strict=False)), sizes


@pytest.mark.parametrize("overlap", [0, 1])
async def test_a_crash_and_a_lossy_relay_with_changing_rounds(tmp_path, autojump_clock, overlap):
    spec = {**SPEC, "overlap": overlap, "shards": 8}
    faults = Faults(seed=7, drop=0.05, duplicate=0.05, delay=0.3, max_delay=0.4)
    sim, job = await _run(tmp_path, 0.3, spec, kill=True, faults=faults)
    live = [p for p in sim.peers if p.alive]
    machine = live[0].node.machine
    rec = machine.records.by_id[job]
    chain = machine.chain(rec)
    plan = Plan.of(rec, chain.closes)
    sizes = [plan.inner_steps(r) for r in range(chain.round)]
    assert sum(sizes) == spec["rounds"] * spec["batches"] and len(set(sizes)) > 1, sizes
    for close in chain.closes:
        assert covered([machine.records.by_id[c] for c in close["contribs"]]) == set(range(8))
