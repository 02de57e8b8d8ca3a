"""Aggregation slices in the simulator: real daemons close sliced rounds from reduced
slices, through a lossy relay, with a peer killed mid-round, an aggregator that never
publishes, and a peer whose every slice is forged."""

from __future__ import annotations

import pytest
import trio

from ttpeer.daemon.node._status import snapshot
from ttpeer.net import Faults, MemoryRelay
from ttpeer.proto import _slices
from ttpeer.testing import Simulation

from .test_simulator import SPEC, assert_invariants

SLICED = {**SPEC, "chunk": 4096, "rounds": 4, "shards": 8}


def _node_id(peer) -> str:
    return peer.home.node_key().public_key().public_bytes_raw().hex()


def sliced_closes(sim: Simulation, job: str) -> list:
    node = next(p for p in sim.peers if p.alive).node
    return [c for c in node.machine.chain(node.machine.records.by_id[job]).closes if "slices" in c.body]


@pytest.mark.parametrize("one_in", [_slices.CHECK_ONE_IN, 1])
async def test_peers_fetch_a_rounds_slices_ahead_of_its_close_and_only_once(tmp_path, autojump_clock, monkeypatch,
                                                                            one_in):
    # Each slice is fetched as soon as it counts, so the closer's aggregate and the others'
    # apply read them here: no slice is downloaded twice by one peer. A spot check fetches
    # the result it checks, and that copy is the one the close reads.
    monkeypatch.setattr(_slices, "CHECK_ONE_IN", one_in)
    spec = {**SLICED, "overlap": 0}
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=11)
        sim.create(5)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(spec)
            await sim.wait_done(job, timeout=600)
            assert_invariants(sim, job, spec)
            closes = sliced_closes(sim, job)
            assert len(closes) >= 2
            records = sim.peers[0].node.machine.records
            blobs = {records.by_id[s]["blob"] for c in closes for s in c["slices"]}
            assert max(n for (_peer, blob), n in relay.blob_gets.items() if blob in blobs) == 1
            assert sum(p.node.effects.slices.ahead_used for p in sim.peers) >= 2 * len(closes)
            # What `ttpeer status` shows of each: the final model held, how many rounds it trained.
            rows = [next(j for j in snapshot(p.node)["jobs"] if j["id"] == job) for p in sim.peers]
            assert {(r["held_round"], r["rounds_looked_at"]) for r in rows} == {(spec["rounds"], 3)}
            chain = sim.peers[0].node.machine.chain(records.by_id[job])
            authors = [{records.by_id[c].author for c in close["contribs"]} for close in chain.closes[-3:]]
            assert [r["rounds_trained"] for r in rows] == [sum(_node_id(p) in a for a in authors) for p in sim.peers]
            # Every checked slice was checked on one chunk, and reproduced there (the fake
            # model's 12 chunks make slices of two or three chunks for these 5 peers).
            named = [records.by_id[rid] for c in closes for rid in c["slices"]]
            assert all(r["stop"] - r["first"] > 1 for r in named)
            seconds = sum(1 for n in named if len(
                {r.author for r in records.of_job(job, "slice") if r["sha256"] == n["sha256"]}) > 1)
            assert sum(r["spot_checks"]["reproduced"] for r in rows) == seconds
            assert sum(r["spot_checks"]["missed"] for r in rows) == 0
            if one_in == 1:
                assert seconds == sum(len(c["slices"]) for c in closes)
                # The checkers drew their chunks: some check reduced a chunk that starts no
                # slice (a checker that always took a slice's first chunk would be foreseeable).
                starts = {r["first"] for r in records.of_job(job, "slice")}
                drawn = {first for p in sim.peers if p.executor for _job, _rnd, first in p.executor.reduced}
                assert drawn - starts, (drawn, starts)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("overlap", [0, 1])
async def test_rounds_close_from_reduced_slices_through_loss_and_a_kill(tmp_path, autojump_clock, overlap):
    # With overlap (the CLI's default) round r+1 trains while round r's slices are reduced.
    spec = {**SLICED, "overlap": overlap}
    faults = Faults(seed=5, drop=0.05, duplicate=0.05, delay=0.3, max_delay=0.4)
    async with MemoryRelay(faults=faults) as relay:
        sim = Simulation(tmp_path, relay, seed=5)
        sim.create(6)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(spec)
            await sim.wait_round(job, 1, timeout=300)
            sim.kill(await sim.wait_training(timeout=60))  # its shard and its slices pass on
            await sim.wait_done(job, timeout=900)
            assert_invariants(sim, job, spec)
            closes = sliced_closes(sim, job)
            assert len(closes) >= 3, "rounds of three or more authors are reduced in slices"
            records = next(p for p in sim.peers if p.alive).node.machine.records
            for close in closes:
                named = [records.by_id[s] for s in close["slices"]]
                authors = {records.by_id[c].author for c in close["contribs"]}
                assert [r["slice"] for r in named] == list(range(len(authors)))  # one per author, in order
                assert named[0]["first"] == 0
                assert all(a["stop"] == b["first"] for a, b in zip(named, named[1:], strict=False))
                assert all(r["contribs"] == close["contribs"] for r in named)
            # The fake slice bytes hold the chunks and the contributions: every peer that
            # reduced made real slices, and the mean was never recomputed from all deltas.
            reduced = sum(len(p.executor.reduced) for p in sim.peers if p.executor)
            assert reduced >= sum(len(c["slices"]) for c in closes if c["round"] > 0) // 2
            nursery.cancel_scope.cancel()


async def test_a_forged_slice_is_refused_and_made_again(tmp_path, autojump_clock, monkeypatch):
    monkeypatch.setattr(_slices, "CHECK_ONE_IN", 1)  # every slice checked: a forgery never counts
    async with MemoryRelay(faults=Faults(seed=7, drop=0.02, delay=0.2, max_delay=0.3)) as relay:
        sim = Simulation(tmp_path, relay, seed=7)
        sim.create(4)
        sim.peers[2].forge = True
        forger = _node_id(sim.peers[2])
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SLICED)
            await sim.wait_done(job, timeout=1200)
            assert_invariants(sim, job, SLICED)
            records = sim.peers[0].node.machine.records
            closes = sliced_closes(sim, job)
            assert closes
            forged = {r["sha256"] for r in records.of_job(job, "slice") if r.author == forger}
            assert forged, "the forger reduced or checked slices"
            # Honest checkers found its results wrong on the chunk they drew (and it found
            # theirs wrong on its own), and reproduced one another's.
            checks = [next(j for j in snapshot(p.node)["jobs"] if j["id"] == job)["spot_checks"] for p in sim.peers]
            assert checks[2]["reproduced"] == 0
            assert sum(c["missed"] for c in checks) > 0 and sum(c["reproduced"] for c in checks) > 0
            for close in closes:
                for rid in close["slices"]:
                    rec = records.by_id[rid]
                    assert rec["sha256"] not in forged
                    assert len({r.author for r in records.of_job(job, "slice") if r["sha256"] == rec["sha256"]}) >= 2
            nursery.cancel_scope.cancel()


async def test_an_aggregator_that_never_publishes_costs_one_lease_a_round(tmp_path, autojump_clock):
    async with MemoryRelay(faults=Faults(seed=9, drop=0.02, delay=0.2, max_delay=0.3)) as relay:
        sim = Simulation(tmp_path, relay, seed=9)
        sim.create(4)
        sim.peers[1].silent = True
        silent = _node_id(sim.peers[1])
        times: list[float] = []
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            job = await sim.submit(SLICED)
            nursery.start_soon(sim.watch_rounds, job, times)
            await sim.wait_done(job, timeout=600)
            assert_invariants(sim, job, SLICED)
            records = sim.peers[0].node.machine.records
            closes = sliced_closes(sim, job)
            assert closes
            for close in closes:
                # Its turn came (it is an author of the cover) and passed to the next.
                assert silent in {records.by_id[c].author for c in close["contribs"]}
                assert all(records.by_id[s].author != silent for s in close["slices"])
            rounds = [b - a for a, b in zip([0.0, *times], times, strict=False)]
            lease = SLICED["lease"]
            sliced_rounds = [rounds[c["round"]] for c in closes]
            assert max(sliced_rounds) < 2 * lease, (rounds, lease)  # one lease, not two
            assert min(sliced_rounds) > lease, rounds  # and it did wait that lease
            nursery.cancel_scope.cancel()


async def test_an_author_on_a_slow_link_reduces_no_slice(tmp_path, autojump_clock):
    # One peer's every blob transfer takes 3 s, the others' 0.2 s: its contributions say so
    # (``up_s``), so the rounds it contributes to are cut for the others alone.
    async with MemoryRelay(blob_seconds=0.2) as relay:
        sim = Simulation(tmp_path, relay, seed=13, step_time=0.5)
        sim.create(5)
        slow = _node_id(sim.peers[4])
        relay.peer_blob_seconds[slow] = 3.0
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            spec = {**SLICED, "rounds": 8, "slice_bits": 4}  # as submit writes it: slow authors reduce last
            job = await sim.submit(spec)
            await sim.wait_done(job, timeout=1200)
            assert_invariants(sim, job, spec)
            records = sim.peers[0].node.machine.records
            closes = sliced_closes(sim, job)
            mine = [c for c in closes if slow in {records.by_id[i].author for i in c["contribs"]}]
            assert mine, "the slow peer contributed to no sliced round"
            for close in closes:
                parts = [records.by_id[i] for i in close["contribs"]]
                assert all(p["metrics"]["up_s"] > 0 for p in parts)
                authors = {p.author for p in parts}
                assert len(close["slices"]) == len(authors - {slow})
                assert all(records.by_id[s].author != slow for s in close["slices"])
            # Its status says so, with its rate against the pool's; nobody else's does.
            for peer in sim.peers:
                row = next(j for j in snapshot(peer.node)["jobs"] if j["id"] == job)
                chain = peer.node.machine.chain(records.by_id[job])
                recent = [c for c in chain.closes[-3:] if "slices" in c.body
                          and _node_id(peer) in {records.by_id[i].author for i in c["contribs"]}]
                if _node_id(peer) != slow:
                    assert row["slow_link"] is None, row["slow_link"]
                    continue
                assert recent, "the slow peer trained in none of the last 3 rounds"
                assert row["slow_link"]["round"] == recent[-1]["round"]
                assert row["slow_link"]["rate"] * 3 < row["slow_link"]["median_rate"]
            nursery.cancel_scope.cancel()
