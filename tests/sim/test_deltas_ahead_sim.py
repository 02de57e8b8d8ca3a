"""A round closed from all deltas: every peer fetches the others' deltas as soon as the
round is covered, so the closer's aggregate and the others' apply read them here, and no
peer downloads a delta twice; through a lossy relay, a delta that did not come ahead is
fetched by the close as before."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

import pytest
import trio

from ttpeer.daemon.sealed._blobs import Blobs
from ttpeer.net import Faults, MemoryRelay, RelayUnavailable
from ttpeer.testing import Simulation

from .test_simulator import SPEC, assert_invariants


@contextlib.asynccontextmanager
async def finished(tmp_path, relay: MemoryRelay, spec: dict, seed: int) -> AsyncIterator[tuple[Simulation, str]]:
    """A pool of 4 that ran ``spec`` to its end, its invariants checked; stopped after the block."""
    sim = Simulation(tmp_path, relay, seed=seed)
    sim.create(4)
    async with trio.open_nursery() as nursery:
        await sim.start_all(nursery)
        job = await sim.submit(spec)
        await sim.wait_done(job, timeout=900)
        assert_invariants(sim, job, spec)
        yield sim, job
        nursery.cancel_scope.cancel()


def _reads(sim: Simulation, job: str) -> tuple[int, list]:
    """Others' deltas the closes read over the whole job (each peer's aggregate or apply
    of each close reads every contribution it did not make), and the closes."""
    node = sim.peers[0].node
    records = node.machine.records
    closes = node.machine.chain(records.by_id[job]).closes
    ids = {p.node.machine.me for p in sim.peers}
    reads = sum(sum(1 for c in close["contribs"] if records.by_id[c].author != me) for close in closes for me in ids)
    return reads, closes


def _used(sim: Simulation) -> int:
    return sum(p.node.effects.slices.deltas_ahead.used for p in sim.peers)


def _left(sim: Simulation, job: str) -> list:
    """Files fetched ahead still on disk."""
    return [f for p in sim.peers for f in (p.home.path / "work" / job).glob("ahead-*")]


@pytest.mark.parametrize("overlap", [0, 1])
async def test_peers_fetch_a_rounds_deltas_once_ahead_of_its_close(tmp_path, autojump_clock, overlap):
    async with MemoryRelay() as relay, finished(tmp_path, relay, {**SPEC, "overlap": overlap}, 3) as (sim, job):
        reads, closes = _reads(sim, job)
        records = sim.peers[0].node.machine.records
        deltas = {records.by_id[c]["blob"] for close in closes for c in close["contribs"]}
        assert max(n for (_peer, blob), n in relay.blob_gets.items() if blob in deltas) == 1
        assert _used(sim) == reads
        assert not _left(sim, job)


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
    async with MemoryRelay(faults=faults) as relay, finished(tmp_path, relay, SPEC, 4) as (sim, job):
        reads, _closes = _reads(sim, job)
        assert 0 < _used(sim) < reads, (_used(sim), reads)
        assert not _left(sim, job)


async def test_a_chunked_job_whose_slices_would_save_too_little_closes_from_all_deltas(tmp_path, autojump_clock):
    # What submit sends by default (slice_min): the fake model's deltas are far smaller than
    # what slices must save, so every round of 4 authors closes from all deltas, fetched ahead.
    spec = {**SPEC, "chunk": 4096, "slice_bits": 3, "slice_min": 1 << 20}
    async with MemoryRelay() as relay, finished(tmp_path, relay, spec, 5) as (sim, job):
        reads, closes = _reads(sim, job)
        records = sim.peers[0].node.machine.records
        assert max(len({records.by_id[c].author for c in close["contribs"]}) for close in closes) >= 3
        assert not [c for c in closes if "slices" in c.body]
        assert not records.of_job(job, "slice")
        assert _used(sim) == reads
