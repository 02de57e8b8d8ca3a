"""A round closed from all deltas: every peer fetches the others' deltas as soon as the
round is covered, so the closer's aggregate and the others' apply read them here, and no
peer downloads a delta twice; through a lossy relay, a delta that did not come ahead is
fetched by the close as before."""

from __future__ import annotations

import itertools

import pytest
import trio

from ttpeer.daemon.sealed._blobs import Blobs
from ttpeer.net import Faults, MemoryRelay, RelayUnavailable
from ttpeer.testing import Simulation

from .test_simulator import SPEC, assert_invariants


def _reads(sim: Simulation, job: str) -> tuple[int, list]:
    """Others' deltas the closes read over the whole job (each peer's aggregate or apply
    of each close reads every contribution it did not make), and the closes."""
    node = sim.peers[0].node
    records = node.machine.records
    closes = node.machine.chain(records.by_id[job]).closes
    ids = {p.node.machine.me for p in sim.peers}
    reads = sum(sum(1 for c in close["contribs"] if records.by_id[c].author != me) for close in closes for me in ids)
    return reads, closes


@pytest.mark.parametrize("overlap", [0, 1])
async def test_peers_fetch_a_rounds_deltas_once_ahead_of_its_close(tmp_path, autojump_clock, overlap):
    spec = {**SPEC, "overlap": overlap}
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=3)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(spec)
            await sim.wait_done(job, timeout=600)
            assert_invariants(sim, job, spec)
            reads, closes = _reads(sim, job)
            records = sim.peers[0].node.machine.records
            deltas = {records.by_id[c]["blob"] for close in closes for c in close["contribs"]}
            assert max(n for (_peer, blob), n in relay.blob_gets.items() if blob in deltas) == 1
            used = sum(p.node.effects.slices.deltas_ahead.used for p in sim.peers)
            assert used == reads, (used, reads)
            # Nothing fetched ahead is left on disk once the job is done.
            left = [f.name for p in sim.peers for f in (p.home.path / "work" / job).glob("ahead-*")]
            assert not left
            nursery.cancel_scope.cancel()


async def test_deltas_that_did_not_come_ahead_are_fetched_by_the_close(tmp_path, autojump_clock, monkeypatch):
    # Every other fetch ahead fails (a relay that dropped the connection): the close
    # fetches those deltas itself, and the pool ends as ever.
    fetch_delta = Blobs.fetch_delta
    tries = itertools.count()

    async def flaky(self, contrib, path):
        if path.name.startswith("ahead-") and next(tries) % 2:
            raise RelayUnavailable("the relay dropped the connection (a test's fault)")
        await fetch_delta(self, contrib, path)

    monkeypatch.setattr(Blobs, "fetch_delta", flaky)
    faults = Faults(seed=9, drop=0.05, duplicate=0.05, delay=0.3, max_delay=0.4)
    async with MemoryRelay(faults=faults) as relay:
        sim = Simulation(tmp_path, relay, seed=4)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SPEC)
            await sim.wait_done(job, timeout=900)
            assert_invariants(sim, job)
            reads, _closes = _reads(sim, job)
            used = sum(p.node.effects.slices.deltas_ahead.used for p in sim.peers)
            assert 0 < used < reads, (used, reads)
            assert not [f for p in sim.peers for f in (p.home.path / "work" / job).glob("ahead-*")]
            nursery.cancel_scope.cancel()


async def test_a_chunked_job_whose_slices_would_save_too_little_closes_from_all_deltas(tmp_path, autojump_clock):
    # What submit sends by default (slice_min): the fake model's deltas are far smaller than
    # what slices must save, so every round of 4 authors closes from all deltas, fetched ahead.
    spec = {**SPEC, "chunk": 4096, "slice_bits": 3, "slice_min": 1 << 20}
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=5)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(spec)
            await sim.wait_done(job, timeout=600)
            assert_invariants(sim, job, spec)
            reads, closes = _reads(sim, job)
            records = sim.peers[0].node.machine.records
            assert max(len({records.by_id[c].author for c in close["contribs"]}) for close in closes) >= 3
            assert not [c for c in closes if "slices" in c.body]
            assert not records.of_job(job, "slice")
            assert sum(p.node.effects.slices.deltas_ahead.used for p in sim.peers) == reads
            nursery.cancel_scope.cancel()
