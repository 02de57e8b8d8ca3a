"""The deterministic simulator: real daemons over a faulty in-memory relay, a mock
clock, fake training. Asserts the invariants of DESIGN.md under crashes."""

from __future__ import annotations

import pytest
import trio

from ttpeer.net import Faults, MemoryRelay
from ttpeer.proto import covered
from ttpeer.testing import Simulation

SPEC = {
    "task": "sim", "mode": "fused", "rounds": 4, "shards": 12, "batches": 10, "batch_size": 8,
    "inner_lr": 1e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8,
    "seed": 1, "lease": 5.0, "steal": True,
}


def assert_invariants(sim: Simulation, job: str, spec: dict | None = None) -> None:
    spec = spec or SPEC
    live = [p for p in sim.peers if p.alive]
    # I3: every live peer ends on the same final state, through the same chain.
    finals = {p.disk.finished[job] for p in live}
    assert len(finals) == 1, finals
    chains = {p.node.machine.chain(p.node.machine.records.by_id[job]).states for p in live}
    assert len(chains) == 1
    # I2: every shard of every round is covered by the close's contributions, and
    # every shard a contribution claims was trained by its author.
    node = live[0].node
    records = node.machine.records
    chain = node.machine.chain(records.by_id[job])
    assert chain.round == spec["rounds"]
    trained = {}
    for p in sim.peers:
        trained.setdefault(p.home.node_key().public_key().public_bytes_raw().hex(), set()).update(
            (r, s) for j, r, s in p.trained + (p.executor.trained if p.executor else []) if j == job
        )
    for rnd, close in enumerate(chain.closes):
        parts = [records.by_id[c] for c in close["contribs"]]
        assert covered(parts) == set(range(spec["shards"]))
        for c in parts:
            for shard in c["shards"]:
                assert (rnd, shard) in trained[c.author], (rnd, shard, c.author[:8])


@pytest.mark.parametrize("overlap", [0, 1])
async def test_ten_peers_lossy_network_and_a_crash(tmp_path, autojump_clock, overlap):
    spec = {**SPEC, "overlap": overlap}
    faults = Faults(seed=11, drop=0.05, duplicate=0.05, delay=0.3, max_delay=0.4)
    async with MemoryRelay(faults=faults) as relay:
        sim = Simulation(tmp_path, relay, seed=11)
        sim.create(10)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(spec)
            await sim.wait_round(job, 1, timeout=300)
            # Kill a peer while it holds a claim: its shard must come back via the lease.
            sim.kill(await sim.wait_training(timeout=60))
            await sim.wait_done(job, timeout=600)
            assert_invariants(sim, job, spec)
            nursery.cancel_scope.cancel()


async def test_killed_peer_restarts_from_disk_and_finishes(tmp_path, autojump_clock):
    async with MemoryRelay(faults=Faults(seed=3, drop=0.02, delay=0.2, max_delay=0.3)) as relay:
        sim = Simulation(tmp_path, relay, seed=3)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SPEC)
            await sim.wait_round(job, 2, timeout=300)
            sim.kill(2)
            await trio.sleep(3)
            await sim.start(2)  # same home, same disk: resumes from its durable state
            await sim.wait_done(job, timeout=600)
            assert sim.peers[2].lives == 2
            assert_invariants(sim, job)
            nursery.cancel_scope.cancel()


async def test_peer_joining_mid_run_catches_up_and_contributes(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=5)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            sim._nursery = nursery
            for i in range(3):
                await sim.start(i)
            job = await sim.submit(SPEC)
            await sim.wait_round(job, 2, timeout=300)
            joined_at = sim.round_of(sim.peers[0], job)
            await sim.start(3)
            await sim.wait_done(job, timeout=600)
            late = sim.peers[3]
            assert late.executor is not None
            rounds = {r for j, r, _s in late.executor.trained if j == job}
            assert rounds and min(rounds) >= joined_at  # I5: contributes from the next round on
            assert_invariants(sim, job)
            nursery.cancel_scope.cancel()


async def test_relay_outage_declares_nobody_dead_and_requeues_nothing(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=9)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit({**SPEC, "batches": 40})
            await sim.wait_round(job, 1, timeout=300)
            rnd = sim.round_of(sim.peers[0], job)
            relay.available = False  # every peer loses the relay at once, for 4 leases
            await trio.sleep(4 * SPEC["lease"])
            relay.available = True
            with trio.fail_after(60):
                while not all(p.node.counters.relay_ok for p in sim.peers):
                    await trio.sleep(0.1)
            for p in sim.peers:
                assert {p.node.liveness(q.node.me) for q in sim.peers} == {"alive"}
            await sim.wait_done(job, timeout=600)
            records = sim.peers[0].node.machine.records
            attempts = [r["attempt"] for r in records.in_round(job, "claim", rnd) if not r["backup"]]
            assert attempts and max(attempts) == 0  # nobody's lease ran out because of the relay
            assert_invariants(sim, job)
            nursery.cancel_scope.cancel()


async def test_status_says_done_only_once_the_final_model_is_written(tmp_path, autojump_clock):
    # The protocol knows a job is done before the driver has written the final model
    # (what `ttpeer export` reads); status says "finishing" in between, not "done".
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=3)
        sim.create(2)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            release = trio.Event()
            for p in sim.peers:
                assert p.executor is not None
                finish = p.executor.finish

                async def held(*args, finish=finish):
                    await release.wait()
                    await finish(*args)

                p.executor.finish = held  # type: ignore[method-assign]
            job = await sim.submit({**SPEC, "rounds": 2})
            node, disk = sim.peers[0].node, sim.peers[0].disk
            assert node is not None

            def state() -> str:
                return next(j["state"] for j in node.status()["jobs"] if j["id"] == job)

            with trio.fail_after(300):
                while job not in node.machine.done_jobs:
                    await trio.sleep(0.5)
            assert state() == "finishing" and job not in disk.finished
            release.set()
            with trio.fail_after(30):
                while state() != "done":
                    await trio.sleep(0.1)
            assert disk.finished[job] == node.machine.done_jobs[job]
            nursery.cancel_scope.cancel()


async def test_no_peer_downloads_its_own_delta(tmp_path, autojump_clock):
    """A peer aggregates and applies its own contributions from the copy it kept when it
    uploaded them: the relay serves each peer only the others' deltas."""
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=13)
        sim.create(3)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SPEC)
            await sim.wait_done(job, timeout=600)
            assert_invariants(sim, job)
            records = sim.peers[0].node.machine.records
            own = {(c.author, c["blob"]) for c in records.of_job(job, "contrib")}
            fetched = set(relay.blob_gets)  # (peer, blob) of every whole-blob GET
            others = {(p, b) for p, b in fetched if any(b == blob for _a, blob in own)}
            assert others, "the peers fetched each other's deltas"
            assert not own & fetched, "a peer downloaded a delta it had uploaded"
            nursery.cancel_scope.cancel()
