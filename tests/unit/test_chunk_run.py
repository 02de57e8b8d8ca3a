"""An aggregator's fetch of its slice of one delta (``Blobs.chunk_run``): a chunked delta
sealed in cut pieces is read back by three range requests, its head and exactly its
chunks, as a sparse file whose bytes at their places are the delta's; a flipped piece on
the relay is refused (``SealError``, counted) and nothing is written from it; pieces from
the uploader directly (the LAN shortcut) that do not open are fetched again through the
relay. An aggregator fetches its slice of many contributions at once, in their order."""

import functools
import time
from types import SimpleNamespace

import pytest
import trio
from ttpeer_wire import sign

from ttpeer._chunked import HEAD, LENGTH, MAGIC, chunk_span
from ttpeer.daemon import Home
from ttpeer.daemon._offload import in_order
from ttpeer.daemon.sealed._blobs import RANGES_AT_ONCE, Blobs, sealed_bound
from ttpeer.daemon.sealed._keys import PoolKeys
from ttpeer.net import MemoryRelay
from ttpeer.net._seal import SealError

RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64
CHUNKS = 6


def _delta(seed: int = 0) -> bytes:
    frames = [bytes([(c + seed) % 256]) * (3000 + 500 * c + seed) for c in range(CHUNKS)]
    return (HEAD.pack(MAGIC, 8, 256, CHUNKS * 4096, 4096) + b"".join(LENGTH.pack(len(f)) for f in frames)
            + b"".join(frames))


async def _setup(tmp_path, relay):
    home = Home(tmp_path / "h")
    cfg = home.create_pool(RELAY, FP, "a", time.time())
    keys = PoolKeys(home)
    keys.set([bytes(range(32))])
    transport = relay.client(cfg.pool, home.node_key(), cfg.proof)
    await transport.connect()
    refused: list[str] = []
    return home, cfg, Blobs(keys, transport, home, refused.append), transport, refused


def _contrib(cfg, home, blob: str, size: int):
    return sign("contrib", cfg.pool, {"job": "ab" * 32, "round": 0, "base": "sha256:" + "cd" * 32, "shards": [0],
                                      "samples": 8, "blob": blob, "size": size, "metrics": {}, "chunks": CHUNKS},
                home.node_key())


async def test_a_run_of_chunks_comes_back_by_range_and_no_more(tmp_path):
    async with MemoryRelay() as relay:
        home, cfg, blobs, transport, refused = await _setup(tmp_path, relay)
        data = _delta()
        blob = await blobs.upload_delta(data, cut=True)
        assert blob is not None
        sealed = len(relay.blobs[cfg.pool][blob])
        assert len(data) < sealed <= sealed_bound(_contrib(cfg, home, blob, len(data)))
        before = transport.bytes_received
        dest = tmp_path / "run.bin"
        await blobs.chunk_run(_contrib(cfg, home, blob, len(data)), 2, 4, dest)
        got = dest.read_bytes()
        begin, end = chunk_span(data, 2, 4)
        head = HEAD.size + LENGTH.size * CHUNKS
        assert got[:head] == data[:head] and got[begin:end] == data[begin:end] and len(got) == end
        fetched = transport.bytes_received - before
        assert fetched < head + (end - begin) + 300  # the table, the head and two chunks; not the blob
        assert fetched < sealed / 2 and not refused


async def test_a_flipped_piece_is_refused(tmp_path):
    async with MemoryRelay() as relay:
        home, cfg, blobs, _transport, refused = await _setup(tmp_path, relay)
        data = _delta()
        blob = await blobs.upload_delta(data, cut=True)
        stored = bytearray(relay.blobs[cfg.pool][blob])
        stored[-100] ^= 1  # in the last chunk's piece
        relay.blobs[cfg.pool][blob] = bytes(stored)
        dest = tmp_path / "run.bin"
        await blobs.chunk_run(_contrib(cfg, home, blob, len(data)), 0, 2, dest)  # other pieces still open
        with pytest.raises(SealError):
            await blobs.chunk_run(_contrib(cfg, home, blob, len(data)), 4, 6, tmp_path / "bad.bin")
        assert refused == ["blob"] and not (tmp_path / "bad.bin").exists()
        with pytest.raises(SealError, match="holds no chunks"):
            await blobs.chunk_run(_contrib(cfg, home, blob, len(data)), 5, 7, tmp_path / "past.bin")


async def test_pieces_from_the_uploader_that_do_not_open_come_again_through_the_relay(tmp_path):
    async with MemoryRelay() as relay:
        home, cfg, blobs, transport, refused = await _setup(tmp_path, relay)
        data = _delta()
        blob = await blobs.upload_delta(data, cut=True)
        contrib = _contrib(cfg, home, blob, len(data))
        served: list[tuple[int, int]] = []
        flip = [False]

        async def direct_range(blob_, start, stop, path, uploaders):  # the uploader's direct server
            assert uploaders == [contrib.author]
            piece = bytearray(relay.blobs[cfg.pool][blob_][start:stop])
            if flip[0] and stop - start > 1000:  # the chunks' range, not the table
                piece[-100] ^= 1
            path.write_bytes(piece)
            served.append((start, stop))
            return True

        blobs.direct_range = direct_range
        begin, end = chunk_span(data, 4, 6)
        before = transport.bytes_received
        await blobs.chunk_run(contrib, 4, 6, tmp_path / "direct.bin")
        assert (tmp_path / "direct.bin").read_bytes()[begin:end] == data[begin:end]
        assert len(served) == 3 and transport.bytes_received == before and not refused  # all three directly

        flip[0] = True
        await blobs.chunk_run(contrib, 4, 6, tmp_path / "again.bin")
        assert (tmp_path / "again.bin").read_bytes()[begin:end] == data[begin:end]
        assert refused == ["direct range"] and transport.bytes_received > before + (end - begin)

        stored = bytearray(relay.blobs[cfg.pool][blob])  # the relay's copy is bad too: refused
        stored[-100] ^= 1
        flip[0] = False  # the uploader serves the same bad bytes
        relay.blobs[cfg.pool][blob] = bytes(stored)
        with pytest.raises(SealError):
            await blobs.chunk_run(contrib, 4, 6, tmp_path / "bad.bin")
        assert refused == ["direct range", "direct range", "blob"] and not (tmp_path / "bad.bin").exists()


class _Slow:
    """The transport, with every range request taking a while: counts how many are in flight."""

    def __init__(self, inner):
        self._inner, self.in_flight, self.most = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def get_blob_range(self, blob, start, stop):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await trio.sleep(0.01)
            return await self._inner.get_blob_range(blob, start, stop)
        finally:
            self.in_flight -= 1


async def _uploaded(tmp_path, relay, n):
    home, cfg, blobs, transport, _refused = await _setup(tmp_path, relay)
    deltas = [_delta(seed) for seed in range(n)]
    contribs = []
    for data in deltas:
        blob = await blobs.upload_delta(data, cut=True)
        contribs.append(_contrib(cfg, home, blob, len(data)))
    return home, cfg, transport, deltas, contribs


async def test_an_aggregator_fetches_its_slice_of_every_contribution_at_once_and_in_order(tmp_path):
    async with MemoryRelay() as relay:
        home, cfg, transport, deltas, contribs = await _uploaded(tmp_path, relay, 3 * RANGES_AT_ONCE)
        slow = _Slow(transport)
        keys = PoolKeys(home)
        keys.set([bytes(range(32))])
        fetcher = Blobs(keys, slow, home, [].append)  # another node's view: none of the deltas is its own
        job = SimpleNamespace(id="ab" * 32)
        async with fetcher.deltas(job, tuple(contribs), (1, 3)) as files:
            assert [samples for _path, samples in files] == [8] * len(contribs)
            for (path, _samples), data in zip(files, deltas, strict=True):
                begin, end = chunk_span(data, 1, 3)
                assert path.read_bytes()[begin:end] == data[begin:end]
        # the table, then the head and the chunks, of up to RANGES_AT_ONCE contributions
        assert 2 < slow.most <= 2 * RANGES_AT_ONCE
        assert not any((home.path / "work" / job.id).iterdir())


async def test_one_forged_slice_among_many_fails_the_fetch_as_itself_and_leaves_no_file(tmp_path):
    async with MemoryRelay() as relay:
        home, cfg, transport, _deltas, contribs = await _uploaded(tmp_path, relay, 12)
        stored = bytearray(relay.blobs[cfg.pool][contribs[7]["blob"]])
        stored[-100] ^= 1
        relay.blobs[cfg.pool][contribs[7]["blob"]] = bytes(stored)
        keys = PoolKeys(home)
        keys.set([bytes(range(32))])
        refused: list[str] = []
        fetcher = Blobs(keys, _Slow(transport), home, refused.append)
        job = SimpleNamespace(id="ab" * 32)
        with pytest.raises(SealError):  # itself, not an exception group: callers catch it so
            async with fetcher.deltas(job, tuple(contribs), (4, 6)):
                pytest.fail("a forged piece was opened")
        assert refused == ["blob"]
        assert not any((home.path / "work" / job.id).iterdir())


async def test_in_order_keeps_order_and_limit_and_raises_the_first_failure(autojump_clock: trio.abc.Clock) -> None:
    # Under the mock clock the sleeps below end in their order exactly: on the real one, a
    # loaded machine woke 7 and 6 together, and 6's failure cancelled 7 before it finished.
    running, most, finished = 0, 0, []

    async def work(i):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await trio.sleep(0.001 * (10 - i))  # later calls finish first
            if i == 6:
                raise ValueError("six")
            finished.append(i)
            return i * i
        finally:
            running -= 1

    assert await in_order([functools.partial(work, i) for i in range(6)], limit=3) == [i * i for i in range(6)]
    assert most == 3
    finished.clear()
    with pytest.raises(ValueError, match="six"):
        await in_order([functools.partial(work, i) for i in range(10)], limit=10)
    assert finished == [9, 8, 7] and running == 0  # those still running when 6 failed were cancelled
