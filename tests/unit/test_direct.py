"""The LAN shortcut's server and fetcher (``ttpeer/daemon/data/_direct.py``), in process over
real TLS on loopback: a member fetches a piece pinned to the record's certificate; a
caller who is no member, a stale or misdirected signature, another certificate, an
unreachable address and a piece not held are each refused or skipped, never served."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_relay.tls import ensure_certificate
from ttpeer_wire import public_hex

from ttpeer.config import ConfigError, direct_mode, load
from ttpeer.daemon.data import _direct
from ttpeer.daemon.data._direct import (
    AUTH_WINDOW,
    DirectFailed,
    DirectFetcher,
    DirectServer,
    check_request,
    listen,
    signed_request,
)
from ttpeer.net._tls import pinned_ssl_context
from ttpeer.proto import Record, RecordError, sign

from .proto_helpers import cert_hex

POOL = "ab" * 16
POOL_KEY = bytes(range(32))
PIECE = b"0123456789" * 1000 + b"tail"
BLOB = b"sealed delta " * 500
BLOB_NAME = hashlib.sha256(BLOB).hexdigest()


def _route(key: Ed25519PrivateKey, cert: Path, addrs: list[str], at: int = 1):
    import ssl

    der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    return sign("direct", POOL, {"addrs": addrs, "cert": der.hex(), "at": at}, key)


class _Peer:
    """A server whose pieces are one file: piece (DATASET, 0) is PIECE at offset 10."""

    def __init__(self, tmp: Path, members: dict[str, object]) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.me = public_hex(self.key)
        self.file = tmp / "piece.bin"
        self.file.write_bytes(b"x" * 10 + PIECE + b"y" * 5)
        self.cert, self.tls_key = ensure_certificate(tmp / f"tls-{self.me[:6]}", "127.0.0.1")
        self.members = members
        self.blob = tmp / "sent" / f"{BLOB_NAME}.blob"  # a sealed blob this peer uploaded (its spool)
        self.blob.parent.mkdir()
        self.blob.write_bytes(BLOB)
        self.app = DirectServer(self.me, lambda: self.members, self.source, lambda: POOL_KEY,
                                blobs=lambda name: self.blob if name == BLOB_NAME else None)

    async def source(self, dataset: str, index: int):
        return (self.file, 10, len(PIECE)) if (dataset, index) == ("d" * 64, 0) else None


class _Records:
    """What ``DirectFetcher.routes`` reads of a record set: one member and its record."""

    def __init__(self, member: str, route: Record) -> None:
        self.members = {member: object()}
        self._route = route

    def __iter__(self):
        return iter([self._route])

    def __len__(self):
        return 1


@pytest.fixture
async def served(tmp_path, nursery):
    fetcher_key = Ed25519PrivateKey.generate()
    me = public_hex(fetcher_key)
    peer = _Peer(tmp_path, {})
    peer.members.update({me: object(), peer.me: object()})
    port = await nursery.start(listen, peer.app, peer.cert, peer.tls_key, 0, "127.0.0.1")
    return peer, port, fetcher_key


async def test_a_member_fetches_a_piece_pinned_to_the_record_certificate(served, tmp_path):
    peer, port, key = served
    fetcher = DirectFetcher(key, public_hex(key), lambda: POOL_KEY)
    dest = tmp_path / "got"
    await fetcher.get(peer.me, _route(peer.key, peer.cert, [f"127.0.0.1:{port}"]), "d" * 64, 0, len(PIECE), dest)
    assert dest.read_bytes() == PIECE
    assert (peer.app.stats.served_pieces, peer.app.stats.served_bytes) == (1, len(PIECE))
    # A piece it does not hold: answered, and not served.
    with pytest.raises(DirectFailed, match="answered 404") as info:
        await fetcher.get(peer.me, _route(peer.key, peer.cert, [f"127.0.0.1:{port}"]), "e" * 64, 0, 5, dest)
    assert info.value.reachable


async def test_a_member_fetches_a_blob_its_uploader_serves_and_nothing_else(served, tmp_path):
    peer, port, key = served
    fetcher = DirectFetcher(key, public_hex(key), lambda: POOL_KEY)
    route = _route(peer.key, peer.cert, [f"127.0.0.1:{port}"])
    dest = tmp_path / "got"
    await fetcher.get_blob(peer.me, route, BLOB_NAME, len(BLOB) + 64, dest)  # a size cap, not the size
    assert dest.read_bytes() == BLOB
    assert (peer.app.stats.served_blobs, peer.app.stats.served_blob_bytes) == (1, len(BLOB))
    assert peer.app.stats.served_pieces == 0
    with pytest.raises(DirectFailed, match="404") as info:  # a blob it did not upload
        await fetcher.get_blob(peer.me, route, "e" * 64, 100, dest)
    assert info.value.lacks
    with pytest.raises(DirectFailed, match="more than 100 bytes"):  # over the cap: given up
        await fetcher.get_blob(peer.me, route, BLOB_NAME, 100, dest)


async def test_a_member_fetches_a_range_of_a_blob_and_a_range_outside_it_is_refused(served, tmp_path):
    """A slice's aggregator asks the uploader for ranges of a delta (``Blobs.chunk_run``)."""
    peer, port, key = served
    fetcher = DirectFetcher(key, public_hex(key), lambda: POOL_KEY)
    route = _route(peer.key, peer.cert, [f"127.0.0.1:{port}"])
    dest = tmp_path / "got"
    for start, stop in ((0, 1), (100, 2100), (len(BLOB) - 7, len(BLOB))):
        await fetcher.get_range(peer.me, route, BLOB_NAME, start, stop, dest)
        assert dest.read_bytes() == BLOB[start:stop]
    assert peer.app.stats.served_blob_bytes == 1 + 2000 + 7
    assert (peer.app.stats.served_ranges, peer.app.stats.served_blobs) == (3, 3)
    with pytest.raises(DirectFailed, match="answered 416") as info:  # past its end: refused, nothing sent
        await fetcher.get_range(peer.me, route, BLOB_NAME, len(BLOB) - 1, len(BLOB) + 1, dest)
    assert info.value.reachable and not info.value.lacks
    assert peer.app.stats.served_blob_bytes == 2008
    with pytest.raises(DirectFailed, match="404"):  # a blob it did not upload
        await fetcher.get_range(peer.me, route, "e" * 64, 0, 10, dest)


@pytest.mark.parametrize("asked", ["bytes=5-", "bytes=9-3", "bytes=0-1,4-5", "items=0-3", "bytes=-5"])
async def test_the_server_answers_416_to_a_range_it_does_not_serve(served, asked):
    peer, port, key = served
    path = f"/v1/blob/{BLOB_NAME}"
    auth = signed_request(key, public_hex(key), peer.me, path, time.time(), POOL_KEY)
    context = pinned_ssl_context(bytes.fromhex(_route(peer.key, peer.cert, ["h:1"])["cert"]))
    async with httpx.AsyncClient(verify=context, trust_env=False) as client:
        r = await client.get(f"https://127.0.0.1:{port}{path}", headers={"authorization": auth, "range": asked})
    assert r.status_code == 416, r.text
    assert peer.app.stats.served_blob_bytes == 0


async def test_callers_who_are_no_members_or_sign_for_another_server_are_refused(served, tmp_path):
    peer, port, key = served
    stranger = Ed25519PrivateKey.generate()
    path = f"/v1/piece/{'d' * 64}/0"
    context = pinned_ssl_context(bytes.fromhex(_route(peer.key, peer.cert, ["h:1"])["cert"]))
    now = time.time()
    me = public_hex(key)
    cases = {
        "none": None,
        "stranger": signed_request(stranger, public_hex(stranger), peer.me, path, now, POOL_KEY),
        "another server": signed_request(key, me, "f" * 64, path, now, POOL_KEY),
        "another piece": signed_request(key, me, peer.me, f"/v1/piece/{'d' * 64}/1", now, POOL_KEY),
        "stale": signed_request(key, me, peer.me, path, now - AUTH_WINDOW - 5, POOL_KEY),
        # A member the pool never gave its key (one that joined with an expired token).
        "no pool key": signed_request(key, me, peer.me, path, now, bytes(32)),
        "garbage": "ttpeer " + "0" * 64 + ".1.zz",
    }
    async with httpx.AsyncClient(verify=context) as client:
        for what, auth in cases.items():
            r = await client.get(f"https://127.0.0.1:{port}{path}", headers={"authorization": auth} if auth else {})
            assert r.status_code == 401, what
        good = signed_request(key, me, peer.me, path, now, POOL_KEY)
        r = await client.get(f"https://127.0.0.1:{port}{path}", headers={"authorization": good})
        assert r.status_code == 200 and r.content == PIECE
        r = await client.post(f"https://127.0.0.1:{port}{path}", headers={"authorization": good})
        assert r.status_code == 404
    assert peer.app.stats.refused == len(cases)


async def test_a_server_showing_another_certificate_is_not_trusted(served, tmp_path):
    peer, port, key = served
    other_cert, _ = ensure_certificate(tmp_path / "other-tls", "127.0.0.1")
    fetcher = DirectFetcher(key, public_hex(key), lambda: POOL_KEY)
    with pytest.raises(DirectFailed, match="not reachable directly") as info:
        await fetcher.get(peer.me, _route(peer.key, other_cert, [f"127.0.0.1:{port}"]), "d" * 64, 0,
                          len(PIECE), tmp_path / "got")
    assert not info.value.reachable and not (tmp_path / "got").exists()
    assert peer.app.stats.served_pieces == 0


async def test_an_unreachable_address_is_tried_once_then_the_next_and_the_member_skipped(served, tmp_path):
    peer, port, key = served
    fetcher = DirectFetcher(key, public_hex(key), lambda: POOL_KEY)
    with trio.socket.socket() as s:  # a port nothing listens on
        await s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    route = _route(peer.key, peer.cert, [f"127.0.0.1:{closed}", f"127.0.0.1:{port}"])
    await fetcher.get(peer.me, route, "d" * 64, 0, len(PIECE), tmp_path / "got")  # the second address
    assert (tmp_path / "got").read_bytes() == PIECE
    dead = _route(peer.key, peer.cert, [f"127.0.0.1:{closed}"], at=2)
    with pytest.raises(DirectFailed, match="not reachable"):
        await fetcher.get(peer.me, dead, "d" * 64, 0, len(PIECE), tmp_path / "got")

    assert fetcher.routes(_Records(peer.me, dead), []) == []  # down: not asked again for a while


def test_check_request_refuses_a_signature_of_other_bytes():
    key = Ed25519PrivateKey.generate()
    me = public_hex(key)
    auth = signed_request(key, me, "s" * 64, "/v1/piece/x/0", 1000.0, POOL_KEY)
    assert check_request(auth, "s" * 64, "/v1/piece/x/0", 1000.0, {me: 1}, POOL_KEY) == me
    assert check_request(auth, "s" * 64, "/v1/piece/x/0", 1000.0, {}, POOL_KEY) is None  # no member
    assert check_request(auth, "s" * 64, "/v1/piece/x/0", 1000.0, {me: 1}, bytes(32)) is None  # another key
    assert check_request(auth, "s" * 64, "/v1/piece/x/0", 1000.0, {me: 1}, None) is None  # no key here yet
    sig_end = auth.rindex(".")
    flipped = auth[:sig_end - 1] + ("0" if auth[sig_end - 1] != "0" else "1") + auth[sig_end:]
    assert check_request(flipped, "s" * 64, "/v1/piece/x/0", 1000.0, {me: 1}, POOL_KEY) is None


def test_the_direct_record_and_setting_refuse_what_they_cannot_use(tmp_path):
    key = Ed25519PrivateKey.generate()
    good = {"addrs": ["192.168.1.5:7000"], "cert": cert_hex(), "at": 1}
    sign("direct", POOL, good, key)
    for bad in ({**good, "addrs": []}, {**good, "addrs": ["h:0"]}, {**good, "addrs": ["h:70000"]},
                {**good, "addrs": ["a b:1"]}, {**good, "addrs": ["h:1"] * 2},
                {**good, "addrs": [f"h{i}:1" for i in range(5)]},
                {**good, "addrs": ["a..b:1"]}, {**good, "addrs": ["[::::]:1"]}, {**good, "addrs": ["[1.2.3.4]:1"]},
                {**good, "addrs": ["999.1.1.1:1"]}, {**good, "cert": "ab" * 300},  # hex, but no certificate
                {**good, "cert": "ab" * 3000}, {**good, "cert": "xyz"}, {k: v for k, v in good.items() if k != "at"}):
        with pytest.raises(RecordError):
            sign("direct", POOL, bad, key)
    assert direct_mode("auto") == (None, 0) and direct_mode("off") is None
    assert direct_mode("7000") == (None, 7000) and direct_mode("203.0.113.7:7000") == ("203.0.113.7", 7000)
    assert direct_mode("[2001:db8::1]:7000") == ("[2001:db8::1]", 7000)
    for bad_text in ("0", "70000", "host:", "::1:7000", "a b:7"):
        with pytest.raises(ValueError):
            direct_mode(bad_text)
    with pytest.raises(ConfigError, match="direct"):
        load({"direct": "nonsense"}, file=tmp_path / "none.toml")
    assert load({"direct": None}, file=tmp_path / "none.toml").direct == "auto"


def _unchecked_route(addrs: list[str], cert: str) -> tuple[str, Record]:
    """A ``direct`` record the schema would refuse (an older peer's, a bug's): the fetcher
    must fail it with ``DirectFailed`` all the same, never with anything else."""
    k = Ed25519PrivateKey.generate()
    body = {"addrs": addrs, "cert": cert, "at": 1}
    return public_hex(k), Record("direct", POOL, public_hex(k), body, "00", b"", "e" * 64)


@pytest.mark.parametrize(("addrs", "cert"), [(["127.0.0.1:9"], "ab" * 300), (["a..b:7000"], None),
                                             (["[::::]:7000"], None), (["[1.2.3.4]:7000"], None)])
async def test_whatever_a_record_says_a_fetch_fails_as_direct_failed(tmp_path, addrs, cert):
    cert = cert or _route(Ed25519PrivateKey.generate(), ensure_certificate(tmp_path / "tls", "127.0.0.1")[0],
                          ["h:1"])["cert"]
    member, route = _unchecked_route(addrs, cert)
    key = Ed25519PrivateKey.generate()
    fetcher = DirectFetcher(key, public_hex(key), lambda: POOL_KEY)
    with pytest.raises(DirectFailed):
        await fetcher.get(member, route, "d" * 64, 0, 10, tmp_path / "got")


async def test_a_member_that_sends_too_slowly_is_given_up_and_skipped(tmp_path, nursery, monkeypatch):
    peer = _Peer(tmp_path, {})
    key = Ed25519PrivateKey.generate()
    peer.members.update({public_hex(key): object()})

    class Stalling(DirectServer):  # answers, then sends nothing
        async def __call__(self, scope, receive, send):
            if scope["type"] == "lifespan":
                return await super().__call__(scope, receive, send)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
            await trio.sleep_forever()

    app = Stalling(peer.me, lambda: peer.members, peer.source, lambda: POOL_KEY)
    port = await nursery.start(listen, app, peer.cert, peer.tls_key, 0, "127.0.0.1")
    monkeypatch.setattr(_direct, "SLACK", 0.5)
    fetcher = DirectFetcher(key, public_hex(key), lambda: POOL_KEY)
    route = _route(peer.key, peer.cert, [f"127.0.0.1:{port}"])
    with trio.fail_after(10):
        with pytest.raises(DirectFailed, match="too slowly"):
            await fetcher.get(peer.me, route, "d" * 64, 0, 100, tmp_path / "got")

    assert fetcher.routes(_Records(peer.me, route), []) == []  # down for a while: not asked again at once
