"""Datasets between real ``Node``s over the in-memory relay (issue 17): a piece the relay
lost comes back under its name and one it damaged under a new name (in a newer record),
because their holder uploads them again when asked; and a record whose pieces nobody
serves leaves the fetching peer waiting, saying so, without an exception."""

from __future__ import annotations

import hashlib
import random

import trio
from ttpeer_wire import dataset_id

from ttpeer.net import MemoryRelay
from ttpeer.proto import dataset_sources, sign
from ttpeer.testing import Simulation

PIECE = 4096


async def _started(sim: Simulation, nursery: trio.Nursery) -> None:
    await sim.start_all(nursery)
    with trio.fail_after(600):
        while not all(p.node is not None and p.node.pool_key is not None for p in sim.peers):
            await trio.sleep(0.5)


async def _record_reaches(node, dataset: str) -> None:
    with trio.fail_after(600):
        while not dataset_sources(node.machine.records, dataset):
            await trio.sleep(0.5)


async def test_lost_and_damaged_pieces_are_uploaded_again_and_fetched(tmp_path, autojump_clock):
    rng = random.Random(3)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    files = {"a.bin": rng.randbytes(3 * PIECE + 7), "sub/b.bin": rng.randbytes(PIECE)}
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path / "sim", relay, seed=1)
        sim.create(2)
        async with trio.open_nursery() as nursery:
            await _started(sim, nursery)
            alice, bob = sim.peers[0].node, sim.peers[1].node
            rec, new = await alice.data.add(str(folder), "corpus", PIECE)
            assert new and rec["piece_size"] == PIECE
            blobs = [p[1] for f in rec["files"] for p in f["pieces"]]
            assert len(blobs) == 5
            stored = relay.blobs[alice.cfg.pool]
            del stored[blobs[1]]  # the relay lost it (TTL, quota, a restart)
            stored[blobs[3]] = stored[blobs[3]][:-1] + bytes([stored[blobs[3]][-1] ^ 1])  # damaged
            await _record_reaches(bob, rec["id"])
            said: list[str] = []
            with trio.fail_after(600):
                await bob.data.fetch(rec["id"], "corpus", said.append, None)
            assert any(s.startswith("waiting for dataset corpus: 3/5 pieces (2 not served yet") for s in said), said
            held = bob.data.store.files(rec["id"])
            for rel, data in files.items():
                assert hashlib.sha256((held / rel).read_bytes()).digest() == hashlib.sha256(data).digest()
            row = {r["name"]: r for r in bob.data.listing()}["corpus"]
            assert (row["here"], row["pieces_here"], row["fetched_bytes"]) == ("fetched", 5, 4 * PIECE + 7)
            assert row["bad_pieces"] >= 1  # the damaged copy was refused at least once
            assert alice.data.reuploads[rec["id"]] >= 2
            stored = relay.blobs[alice.cfg.pool]
            assert hashlib.sha256(stored[blobs[1]]).hexdigest() == blobs[1]  # the lost one: back, same name
            newest = dataset_sources(bob.machine.records, rec["id"])[0]  # the damaged one: a new name
            repaired = [p[1] for f in newest["files"] for p in f["pieces"]]
            assert newest.id != rec.id and repaired[:3] + repaired[4:] == blobs[:3] + blobs[4:]
            assert repaired[3] != blobs[3] and hashlib.sha256(stored[repaired[3]]).hexdigest() == repaired[3]
            nursery.cancel_scope.cancel()


async def test_pieces_nobody_serves_leave_the_fetch_waiting_with_a_clear_line(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path / "sim", relay, seed=2)
        sim.create(2)
        async with trio.open_nursery() as nursery:
            await _started(sim, nursery)
            alice, bob = sim.peers[0].node, sim.peers[1].node
            # A member's record of files nobody holds: its blobs were never uploaded.
            hashes = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
            entries = [("x.bin", 3 * PIECE, hashes)]
            body = {"name": "ghost", "id": dataset_id(PIECE, entries), "piece_size": PIECE, "at": 1,
                    "files": [{"path": "x.bin", "size": 3 * PIECE, "pieces": [[h, h] for h in hashes]}]}
            rec = sign("dataset", alice.cfg.pool, body, alice.node_key)
            alice.process(alice.machine.add_local(rec, alice.now()))
            await _record_reaches(bob, rec["id"])
            said: list[str] = []
            with trio.move_on_after(120) as waited:
                await bob.data.fetch(rec["id"], "ghost", said.append, None)
            assert waited.cancelled_caught  # still waiting, no exception
            assert "waiting for dataset ghost: 0/3 pieces (3 not served yet, asked their holders again)" in said
            assert len([s for s in said if s.startswith("waiting")]) >= 3  # it kept trying
            row = {r["name"]: r for r in bob.data.listing()}["ghost"]
            assert (row["here"], row["pieces_here"]) == ("partial", 0)
            nursery.cancel_scope.cancel()


async def test_a_part_of_a_dataset_is_fetched_alone_and_a_full_disk_is_the_daemons_end(
        tmp_path, autojump_clock, monkeypatch):
    """``dataset_samples``' fetches: only the pieces asked for (the shard's), a wait bounded
    when a shard asks (it gives its claim back), and ENOSPC writing a piece is a DiskError."""
    import errno

    import pytest

    from ttpeer.daemon.data._datastore import DataStore
    from ttpeer.errors import DiskError, JobError

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"".join(b"line %05d\n" % i for i in range(3000)))  # 33,000 bytes
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path / "sim", relay, seed=4)
        sim.create(2)
        async with trio.open_nursery() as nursery:
            await _started(sim, nursery)
            alice, bob = sim.peers[0].node, sim.peers[1].node
            rec, _new = await alice.data.add(str(folder), "corpus", PIECE, "lines")
            assert sum(rec["samples"]["counts"]) == 3000 and len(rec["samples"]["counts"]) == 9
            await _record_reaches(bob, rec["id"])
            with trio.fail_after(600):
                await bob.data.fetch(rec["id"], "corpus", lambda _t: None, None, pieces=[2, 5])
            row = {r["name"]: r for r in bob.data.listing()}["corpus"]
            assert (row["here"], row["pieces_here"], row["fetched_bytes"]) == ("partial", 2, 2 * PIECE)
            assert bob.data.store.part_done(rec["id"]) == {2, 5}
            # Its copy removed (data rm, or evicted), nothing of it is remembered as here.
            await bob.data.remove("corpus", False)
            with trio.fail_after(600):
                await bob.data.fetch(rec["id"], "corpus", lambda _t: None, None, pieces=[2])
            assert bob.data.store.part_done(rec["id"]) == {2}
            # A piece the relay lost and nobody uploads again (alice has stopped serving):
            # a shard's wait ends after ``within`` seconds, with the reason.
            stored = relay.blobs[alice.cfg.pool]
            lost = rec["files"][0]["pieces"][7][1]
            del stored[lost]
            monkeypatch.setattr(alice.data, "on_want", lambda sender, payload: None)
            began = trio.current_time()
            with pytest.raises(JobError, match="not served within 30 s"):
                await bob.data.fetch(rec["id"], "corpus", lambda _t: None, None, pieces=[7], within=30)
            assert 30 <= trio.current_time() - began < 45
            # The disk fills while a piece is written: the daemon's end, as everywhere.
            def full(*_args, **_kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(DataStore, "put_piece", full)
            with pytest.raises(DiskError):
                await bob.data.fetch(rec["id"], "corpus", lambda _t: None, None, pieces=[0])
            nursery.cancel_scope.cancel()
