"""Dataset pieces from https addresses (issue 17: ``data add --url``), against a real HTTPS
server on loopback (``https_helpers``): what ``UrlSource`` accepts as a piece and what it
refuses, and, between real ``Node``s over the in-memory relay, that a peer fetches from the
address first, falls back to the relay when the address fails or lies, and that ``data add``
refuses an address that does not serve the files."""

from __future__ import annotations

import hashlib
import random
import ssl
from pathlib import Path

import pytest
import trio

from ttpeer._logging import redact
from ttpeer.daemon.data._urlsource import UrlFailed, UrlSource, file_url, host_of, shown
from ttpeer.errors import DataError
from ttpeer.net import MemoryRelay
from ttpeer.proto import dataset_sources
from ttpeer.testing import Simulation

from .https_helpers import FileServer

PIECE = 4096
RNG = random.Random(17)
# a.bin: 3 pieces (the last short); sub dir/b c.bin: one piece, a name that must be quoted
FILES = {"a.bin": RNG.randbytes(2 * PIECE + 100), "sub dir/b c.bin": RNG.randbytes(PIECE - 1)}
TOTAL = sum(map(len, FILES.values()))


async def _serve(nursery: trio.Nursery, tmp_path: Path, mode: str = "range") -> tuple[FileServer, ssl.SSLContext]:
    server = FileServer(dict(FILES), mode=mode)
    trust = await server.start(nursery, tmp_path)
    return server, trust


def test_addresses_keep_their_query_after_the_path_and_logs_keep_only_the_host():
    base = "https://bucket.example.com/pre/fix/?X-Amz-Signature=secret&t=1"
    assert file_url(base, "sub dir/b c.bin") == ("https://bucket.example.com/pre/fix/sub%20dir/b%20c.bin"
                                                 "?X-Amz-Signature=secret&t=1")
    assert file_url("https://h.example", "a%b#?.bin") == "https://h.example/a%25b%23%3F.bin"
    assert host_of(base) == "bucket.example.com" and "secret" not in shown(base)
    assert shown(base) == "https://bucket.example.com/pre/fix/?..."
    # The second wall: any https address's query is redacted from every log line.
    line = redact(f"fetching {file_url(base, 'a.bin')} (\"{base}\") and https://plain.example/x.")
    assert "secret" not in line and "https://bucket.example.com/pre/fix/a.bin?[redacted]" in line
    assert "https://plain.example/x." in line


# -- UrlSource against a real server --------------------------------------------------------------


async def test_a_range_is_fetched_exactly(nursery, tmp_path):
    server, trust = await _serve(nursery, tmp_path)
    source, out = UrlSource(context=trust), tmp_path / "out"
    async with source.client() as client:
        total = await source.get(client, server.url, "a.bin", PIECE, PIECE, out)
        assert out.read_bytes() == FILES["a.bin"][PIECE:2 * PIECE] and total == len(FILES["a.bin"])
        await source.get(client, server.url, "sub dir/b c.bin", 0, PIECE - 1, out)
    assert out.read_bytes() == FILES["sub dir/b c.bin"]
    assert server.requests == [("a.bin", f"bytes={PIECE}-{2 * PIECE - 1}", ""),
                               ("sub dir/b c.bin", f"bytes=0-{PIECE - 2}", "")]


async def test_a_missing_file_a_short_answer_and_an_untrusted_certificate_fail(nursery, tmp_path):
    server, trust = await _serve(nursery, tmp_path)
    source, out = UrlSource(context=trust), tmp_path / "out"
    async with source.client() as client:
        with pytest.raises(UrlFailed, match="answered HTTP 404") as failed:
            await source.get(client, server.url, "nothing.bin", 0, 10, out)
        assert failed.value.status == 404
        # The server holds fewer bytes than the record says: a 206 of another range.
        with pytest.raises(UrlFailed, match="another range") as failed:
            await source.get(client, server.url, "a.bin", 2 * PIECE, PIECE, out)
        assert failed.value.status == 206
    async with UrlSource().client() as client:  # the system's trust store knows no test CA
        with pytest.raises(UrlFailed, match="could not be read") as failed:
            await UrlSource().get(client, server.url, "a.bin", 0, 10, out)
    assert failed.value.status is None


async def test_a_server_that_ignores_range_serves_only_whole_file_pieces(nursery, tmp_path):
    server, trust = await _serve(nursery, tmp_path, "ignore_range")
    source, out = UrlSource(context=trust), tmp_path / "out"
    async with source.client() as client:
        await source.get(client, server.url, "sub dir/b c.bin", 0, PIECE - 1, out)  # the file is the piece
        assert out.read_bytes() == FILES["sub dir/b c.bin"]
        for offset in (0, PIECE):  # a piece of a longer file: the body is the whole file, not read
            with pytest.raises(UrlFailed, match="ignores Range") as failed:
                await source.get(client, server.url, "a.bin", offset, PIECE, out)
            assert failed.value.status == 200


async def test_a_redirect_to_plain_http_is_not_followed(nursery, tmp_path):
    server, trust = await _serve(nursery, tmp_path, "to_http")
    source = UrlSource(context=trust)
    async with source.client() as client:
        with pytest.raises(UrlFailed, match="redirected to a http address"):
            await source.get(client, server.url, "a.bin", 0, PIECE, tmp_path / "out")
    assert len(server.requests) == 1


# -- between nodes ------------------------------------------------------------------------------------


# The nodes run under the simulator's mock clock (``autojump_clock``), and so does the
# server: it is a task of the same trio run on loopback, so whenever the client waits for
# it, it has work to do and the clock does not jump past the client's timeouts.


def _tree(root: Path) -> Path:
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


async def _pool(tmp_path: Path, relay: MemoryRelay, nursery: trio.Nursery, trust: ssl.SSLContext):
    sim = Simulation(tmp_path / "sim", relay, seed=5)
    sim.create(2)
    await sim.start_all(nursery)
    with trio.fail_after(600):
        while not all(p.node is not None and p.node.pool_key is not None for p in sim.peers):
            await trio.sleep(0.05)
    alice, bob = sim.peers[0].node, sim.peers[1].node
    for node in (alice, bob):
        node.data.urls = UrlSource(context=trust, timeout=600)  # mock seconds: the clock jumps when all wait
    return alice, bob


async def _fetched(bob, rec) -> dict:
    with trio.fail_after(600):
        while not dataset_sources(bob.machine.records, rec["id"]):
            await trio.sleep(0.05)
        await bob.data.fetch(rec["id"], "corpus", lambda _text: None, None)
    held = bob.data.store.files(rec["id"])
    for rel, data in FILES.items():
        assert hashlib.sha256((held / rel).read_bytes()).digest() == hashlib.sha256(data).digest(), rel
    return {r["name"]: r for r in bob.data.listing()}["corpus"]


async def test_a_peer_fetches_every_piece_from_the_address_and_none_from_the_relay(nursery, tmp_path, autojump_clock):
    server, trust = await _serve(nursery, tmp_path)
    async with MemoryRelay() as relay:
        alice, bob = await _pool(tmp_path, relay, nursery, trust)
        rec, new = await alice.data.add(str(_tree(tmp_path / "corpus")), "corpus", PIECE, urls=[server.url],
                                        relay=False)
        assert new and rec["urls"] == [server.url]
        assert relay.blobs.get(alice.cfg.pool, {}) == {}  # --no-relay: nothing uploaded
        probes = len(server.requests)
        assert probes == 1  # data add read back the start of the first file
        row = await _fetched(bob, rec)
        assert (row["here"], row["fetched_bytes"], row["url_bytes"], row["bad_pieces"]) == ("fetched", TOTAL,
                                                                                          TOTAL, 0)
        assert len(server.requests) - probes == 4  # one ranged GET a piece
        assert relay.blobs.get(alice.cfg.pool, {}) == {}


@pytest.mark.parametrize("mode", ["wrong", "404", "ignore_range"])
async def test_an_address_that_fails_or_lies_falls_back_to_the_relay(nursery, tmp_path, autojump_clock, mode):
    server, trust = await _serve(nursery, tmp_path)
    async with MemoryRelay() as relay:
        alice, bob = await _pool(tmp_path, relay, nursery, trust)
        rec, _new = await alice.data.add(str(_tree(tmp_path / "corpus")), "corpus", PIECE, urls=[server.url])
        assert len(relay.blobs[alice.cfg.pool]) == 4  # uploaded too (no --no-relay)
        server.mode = mode  # after data add checked it
        row = await _fetched(bob, rec)
        # "wrong": every piece refused by hash, counted, then fetched from the relay. "404":
        # no piece there. "ignore_range": the one-piece file comes from the address.
        url_bytes, refused = {"wrong": (0, 4), "404": (0, 0), "ignore_range": (PIECE - 1, 0)}[mode]
        assert (row["fetched_bytes"], row["url_bytes"], row["bad_pieces"]) == (TOTAL, url_bytes, refused)
        assert len(server.requests) == 1 + 4  # each piece was asked of the address once, then the relay
        assert bob.counters.rejected.get("dataset piece", 0) == refused  # status: relay.rejected


async def test_data_add_refuses_an_address_that_does_not_serve_the_files(nursery, tmp_path, autojump_clock):
    server, trust = await _serve(nursery, tmp_path)
    async with MemoryRelay() as relay:
        alice, _bob = await _pool(tmp_path, relay, nursery, trust)
        corpus = str(_tree(tmp_path / "corpus"))
        secret = "?X-Amz-Signature=s3cr3t"
        for mode, base, said in [("404", server.url, "(HTTP 404)"), ("range", server.url + "/elsewhere", "(HTTP 404)"),
                                 ("wrong", server.url, "are not the file's"),
                                 ("ignore_range", server.url, "(HTTP 200): 127.0.0.1 ignores Range")]:
            server.mode = mode
            with pytest.raises(DataError) as refused:
                await alice.data.add(corpus, "corpus", PIECE, urls=[base + secret])
            text = str(refused.value)
            assert f"--url {base}?... does not serve the dataset" in text and said in text, text
            assert "s3cr3t" not in text and "a.bin" in text
        server.mode = "range"
        with pytest.raises(DataError, match="--no-relay needs --url"):
            await alice.data.add(corpus, "corpus", PIECE, relay=False)
        with pytest.raises(DataError, match="--url: each url must be an https://"):
            await alice.data.add(corpus, "corpus", PIECE, urls=[server.url.replace("https", "http")])
        assert relay.blobs.get(alice.cfg.pool, {}) == {} and not alice.data.store.held()  # nothing was added
        assert server.requests[-1][2] == secret[1:]  # the query went to the server, after the path


async def test_with_no_relay_a_failing_address_gets_its_pieces_uploaded_when_asked(nursery, tmp_path,
                                                                                    autojump_clock):
    """--no-relay named each piece's blob without uploading it: when the address fails, the
    fetcher's want makes the holder upload the pieces under exactly those names."""
    server, trust = await _serve(nursery, tmp_path)
    async with MemoryRelay() as relay:
        alice, bob = await _pool(tmp_path, relay, nursery, trust)
        rec, _new = await alice.data.add(str(_tree(tmp_path / "corpus")), "corpus", PIECE, urls=[server.url],
                                         relay=False)
        server.mode = "404"
        row = await _fetched(bob, rec)
        assert (row["fetched_bytes"], row["url_bytes"], row["bad_pieces"]) == (TOTAL, 0, 0)
        named = {p[1] for f in rec["files"] for p in f["pieces"]}
        # Each of the 4 pieces at least once (a want repeated after REUPLOAD_EVERY while an
        # upload is in flight may send one twice), under exactly the names the record gave.
        assert set(relay.blobs[alice.cfg.pool]) == named and alice.data.reuploads[rec["id"]] >= 4
        assert dataset_sources(bob.machine.records, rec["id"]) == [rec]  # no repair record: nothing was damaged


def test_the_cli_takes_several_addresses_and_no_relay():
    from ttpeer.cli import build_parser

    args = build_parser().parse_args(["data", "add", "corpus", "--url", "https://a.example/c", "--url",
                                      "https://b.example/c", "--no-relay"])
    assert (args.urls, args.no_relay) == (["https://a.example/c", "https://b.example/c"], True)
    args = build_parser().parse_args(["data", "add", "corpus"])
    assert (args.urls, args.no_relay) == (None, False)
