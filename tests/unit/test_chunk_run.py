"""An aggregator's fetch of its slice of one delta (``Blobs.chunk_run``): a chunked delta
sealed in cut pieces is read back by three range requests, its head and exactly its
chunks, as a sparse file whose bytes at their places are the delta's; a flipped piece on
the relay is refused (``SealError``, counted) and nothing is written from it."""

import time

import pytest
from ttpeer_wire import sign

from ttpeer._chunked import HEAD, LENGTH, MAGIC, chunk_span
from ttpeer.daemon import Home
from ttpeer.daemon._keys import Blobs, PoolKeys, sealed_bound
from ttpeer.net import MemoryRelay
from ttpeer.net._seal import SealError

RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64
CHUNKS = 6


def _delta() -> bytes:
    frames = [bytes([c]) * (3000 + 500 * c) for c in range(CHUNKS)]
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
