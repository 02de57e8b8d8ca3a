"""The pin (``Datasets.keep_pinned``): while a job that names a dataset has not ended, the
peers running it restart the relay's TTL of that dataset's pieces, so the pieces outlive
their holder; a lapsed one comes back from a holder on the touch's ``missing`` answer; once
the job ends the pieces lapse with the TTL; an older relay without the route is left alone.
Real ``Node``s on the in-memory relay, whose blob TTL runs on trio's (mock) clock."""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import trio
from ttpeer_wire import ErrorCode

from ttpeer.daemon.data._dataholder import pin_period
from ttpeer.net import MemoryRelay, RelayRejected
from ttpeer.net._memory import URL
from ttpeer.proto import dataset_sources, sign
from ttpeer.testing import Simulation

PIECE = 4096
TTL = 90.0  # the relay's blob TTL here: peers touch every 30 s
SPEC: dict[str, Any] = {
    # Slow steps and many rounds: the job runs for many TTLs of simulated time in few events
    # (it is cancelled, not finished), however long the fetches take on a busy machine.
    "task": "sim", "mode": "fused", "rounds": 200, "shards": 2, "batches": 5, "batch_size": 8,
    "inner_lr": 1e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8,
    "seed": 1, "lease": 30.0, "steal": True,
}


async def _until(condition: Any, within: float, step: float = 1.0) -> None:
    with trio.fail_after(within):
        while not condition():
            await trio.sleep(step)


async def _corpus(sim: Simulation, nursery: trio.Nursery, tmp_path: Any) -> tuple[Any, list[str]]:
    await sim.start_all(nursery)
    await _until(lambda: all(p.node is not None and p.node.pool_key is not None for p in sim.peers), 600, 0.5)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.bin").write_bytes(random.Random(5).randbytes(5 * PIECE))
    rec, _new = await sim.peers[0].node.data.add(str(folder), "corpus", PIECE)
    return rec, [p[1] for f in rec["files"] for p in f["pieces"]]


async def _held(node: Any, blobs: list[str]) -> list[bool]:
    return [await node.transport.has_blob(b) for b in blobs]


def test_the_period_is_a_third_of_the_ttl_within_bounds() -> None:
    assert pin_period(TTL) == 30.0 and pin_period(600.0) == 200.0
    assert pin_period(10.0) == 30.0 and pin_period(None) == 3600.0 == pin_period(7 * 86400.0)


async def test_a_running_jobs_pieces_outlive_their_holder_and_lapse_once_it_ends(tmp_path, autojump_clock):
    async with MemoryRelay(blob_ttl=TTL) as relay:
        sim = Simulation(tmp_path / "sim", relay, seed=7, step_time=2.0)
        sim.create(3)
        async with trio.open_nursery() as nursery:
            rec, blobs = await _corpus(sim, nursery, tmp_path)
            alice, bob, carol = (p.node for p in sim.peers)
            job = await sim.submit({**SPEC, "datasets": {"corpus": rec["id"]}}, via=1)
            await _until(lambda: all(rec["id"] in n.data.store.held() for n in (bob, carol)), 600)
            assert set(bob.data.pinned()) == {rec["id"]}
            # A piece the relay lost (a lapse, a restart): a holder uploads it again on the
            # touch's answer, within one period, with no fetcher asking (all three hold it).
            del relay.blobs[alice.cfg.pool][blobs[1]]
            # (Bounded by 3 periods, not 1: the upload's worker threads let the mock clock jump.)
            await _until(lambda: blobs[1] in relay.blobs[alice.cfg.pool], 3 * pin_period(TTL))
            assert sum(n.counters.touches.reuploaded for n in (alice, bob, carol)) >= 1
            assert sum(n.counters.touches.missing for n in (alice, bob, carol)) >= 1
            # The holder goes away for good; the others train on for many TTLs and keep its pieces.
            sim.kill(0)
            before = relay.touches
            began = trio.current_time()
            await trio.sleep(5 * TTL)
            assert sim.round_of(sim.peers[1], job) < SPEC["rounds"]  # still running
            assert await _held(bob, blobs) == [True] * 5
            touched = relay.touches - before
            # Every running peer touches: one request for the 5 blobs per period, each.
            assert 2 * 5 * TTL / pin_period(TTL) - 3 <= touched <= 2 * 5 * TTL / pin_period(TTL) + 3, touched
            # (Names sent: held or, once, the piece deleted above and not yet back.)
            assert bob.counters.touches.blobs + bob.counters.touches.missing >= 5 * int(5 * TTL / pin_period(TTL))
            assert bob.status()["relay"]["touches"]["requests"] == bob.counters.touches.requests > 0
            assert trio.current_time() - began < 6 * TTL
            # Cancelled, nobody pins: the pieces lapse with the TTL (no permanent pin).
            await bob.cancel(job)
            await _until(lambda: not bob.data.pinned() and not carol.data.pinned(), 60)
            await trio.sleep(TTL + pin_period(TTL) + 1)
            assert await _held(bob, blobs) == [False] * 5
            assert dataset_sources(bob.machine.records, rec["id"])  # the record stands; a want re-uploads
            nursery.cancel_scope.cancel()


class OldRelay(MemoryRelay):
    """A relay from before ``POST /v1/touch``: it answers 404 not_found."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.asked = 0

    def _touch(self, pool: str, blobs: list[str]) -> list[str]:
        self.asked += 1
        raise RelayRejected(URL, 404, "no such endpoint: /v1/touch", code=ErrorCode.NOT_FOUND)


async def test_an_older_relay_without_touches_is_asked_once_and_said_once(tmp_path, autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="ttpeer.daemon")
    async with OldRelay(blob_ttl=TTL) as relay:
        sim = Simulation(tmp_path / "sim", relay, seed=8, step_time=2.0)
        sim.create(1)
        async with trio.open_nursery() as nursery:
            rec, _blobs = await _corpus(sim, nursery, tmp_path)
            alice = sim.peers[0].node
            await sim.submit({**SPEC, "datasets": {"corpus": rec["id"]}})
            await _until(lambda: relay.asked, 2 * pin_period(TTL) + 5)
            await trio.sleep(5 * pin_period(TTL))
            assert relay.asked == 1 and alice.data.pinned()  # no error loop
            said = [r.getMessage() for r in caplog.records if "does not take touches" in r.getMessage()]
            assert len(said) == 1 and "older relay" in said[0]
            assert alice.counters.touches.requests == 0
            nursery.cancel_scope.cancel()


async def test_a_dataset_served_from_urls_is_touched_but_never_uploaded_by_the_pin(tmp_path, autojump_clock):
    """``--no-relay`` uploads nothing: a pin must not undo that (a want still can)."""
    async with MemoryRelay(blob_ttl=TTL) as relay:
        sim = Simulation(tmp_path / "sim", relay, seed=9, step_time=2.0)
        sim.create(1)
        async with trio.open_nursery() as nursery:
            rec, blobs = await _corpus(sim, nursery, tmp_path)
            alice = sim.peers[0].node
            body = json.loads(json.dumps(dict(rec.body)))
            newer = sign("dataset", alice.cfg.pool, {**body, "urls": ["https://data.example/corpus"],
                                                     "at": rec["at"] + 1}, alice.node_key)
            alice.process(alice.machine.add_local(newer, alice.now()))
            await sim.submit({**SPEC, "datasets": {"corpus": rec["id"]}})
            await _until(lambda: alice.data.pinned(), 60)
            assert alice.data.pinned()[rec["id"]].id == newer.id
            del relay.blobs[alice.cfg.pool][blobs[2]]
            await alice.data.touch_pinned()
            assert alice.counters.touches.missing >= 1 and alice.counters.touches.reuploaded == 0
            assert blobs[2] not in relay.blobs[alice.cfg.pool]
            nursery.cancel_scope.cancel()
