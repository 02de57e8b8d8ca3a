"""The relay over real TLS on loopback, driven through RelayClient and raw HTTP.

Relays run in-process (``serve`` in the test's nursery, port 0, a temporary data
dir) except one started as a real process to check the ready line and signals.
Nothing here sleeps and hopes: waits are bounded with ``trio.fail_after``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

import ttpeer.net._session as relay_session
from ttpeer.net import (
    RelayClient,
    RelayFingerprintMismatch,
    RelayLimit,
    RelayRejected,
    RelayUnavailable,
    fetch_certificate,
    fingerprint,
    login_message,
    pinned_ssl_context,
)
from ttpeer.net._relay_client import ASK_FIRST_BYTES
from ttpeer.net._session import UPLOAD_PIECE, _pieces
from ttpeer.proto import Record, pool_id_of, public_hex, sign

ROOT = Path(__file__).resolve().parents[2]
RELAY_SRC = ROOT / "bootstrap-relay"
try:
    import ttpeer_relay  # noqa: F401
except ImportError:  # the root distribution does not ship the relay; use the checkout
    sys.path.insert(0, str(RELAY_SRC))

from ttpeer_relay import RelayConfig, RelayRunning, serve  # noqa: E402
from ttpeer_relay.app import login_message as relay_login_message  # noqa: E402
from ttpeer_relay.auth import Nonces, Sessions  # noqa: E402
from ttpeer_relay.blobs import BlobError, BlobStore  # noqa: E402
from ttpeer_relay.mailbox import Mailboxes, MailboxFull  # noqa: E402
from ttpeer_relay.ratelimit import RateLimiter  # noqa: E402
from ttpeer_wire import ErrorCode  # noqa: E402

# -- a pool with real records ---------------------------------------------------------


@dataclass
class Pool:
    id: str
    invite: Record
    invite_key: Ed25519PrivateKey
    root: Ed25519PrivateKey | None = None  # the pool's admin key, to sign revocations

    @classmethod
    def create(cls) -> Pool:
        root = Ed25519PrivateKey.generate()
        pool = pool_id_of(public_hex(root))
        invite_key = Ed25519PrivateKey.generate()
        body = {"key": public_hex(invite_key), "expires": 2**40, "uses": 100, "role": "member"}
        return cls(pool, sign("invite", pool, body, root), invite_key, root)

    def member(self, name: str) -> tuple[Ed25519PrivateKey, list[bytes]]:
        node = Ed25519PrivateKey.generate()
        seal = X25519PrivateKey.generate().public_key().public_bytes_raw().hex()
        body = {"invite": self.invite.id, "node": public_hex(node), "seal": seal, "name": name,
                "at": 1}
        join = sign("join", self.id, body, self.invite_key)
        return node, [self.invite.raw, join.raw]


StartRelay = Callable[..., Awaitable[RelayRunning]]


@asynccontextmanager
async def member(
    running: RelayRunning, pool: Pool, name: str,
    identity: tuple[Ed25519PrivateKey, list[bytes]] | None = None, **kwargs: object,
) -> AsyncIterator[RelayClient]:
    key, proof = identity or pool.member(name)
    async with RelayClient(running.url, running.fingerprint, pool=pool.id, peer_key=key,
                           proof=proof, **kwargs) as client:  # type: ignore[arg-type]
        yield client


def cert_der(running: RelayRunning) -> bytes:
    pem = (running.app.config.data / "tls" / "cert.pem").read_text()
    return ssl.PEM_cert_to_DER_cert(pem)


def raw_http(running: RelayRunning) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=running.url, verify=pinned_ssl_context(cert_der(running)))


async def raw_login(http: httpx.AsyncClient, running: RelayRunning, pool: Pool,
                    key: Ed25519PrivateKey, proof: list[bytes], *, sign_fp: str | None = None,
                    nonce: str | None = None) -> httpx.Response:
    peer = public_hex(key)
    if nonce is None:
        answer = await http.post("/v1/challenge", json={"pool": pool.id, "peer": peer})
        nonce = answer.json()["nonce"]
    sig = key.sign(login_message(sign_fp or running.fingerprint, pool.id, nonce)).hex()
    return await http.post("/v1/session", json={
        "pool": pool.id, "peer": peer, "nonce": nonce, "sig": sig,
        "proof": [p.hex() for p in proof],
    })


# -- admission ------------------------------------------------------------------------


async def test_admission_roster_and_tls_settings(start_relay: StartRelay, pool: Pool) -> None:
    running = await start_relay()
    assert re.fullmatch(r"https://127\.0\.0\.1:\d+", running.url) and running.port > 0
    assert running.fingerprint == fingerprint(cert_der(running))
    ida, idb = pool.member("a"), pool.member("b")
    async with member(running, pool, "a", ida) as a, member(running, pool, "b", idb):
        proofs = await a.roster()
        assert sorted(proofs) == sorted([ida[1], idb[1]])
    # TLS 1.3 only, ALPN offers h2.
    for alpn, max_version, ok in (("h2", None, True), ("h2", ssl.TLSVersion.TLSv1_2, False)):
        context = pinned_ssl_context(cert_der(running))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if max_version is not None:
            context.maximum_version = max_version
        context.set_alpn_protocols(["h2", "http/1.1"])
        stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", running.port), context)
        if ok:
            await stream.do_handshake()
            assert stream.selected_alpn_protocol() == alpn
        else:
            with pytest.raises(trio.BrokenResourceError):
                await stream.do_handshake()
        await trio.aclose_forcefully(stream)


async def test_wrong_fingerprint_is_refused_before_any_request(
    start_relay: StartRelay, pool: Pool
) -> None:
    running = await start_relay()
    key, proof = pool.member("a")
    client = RelayClient(running.url, "sha256:" + "0" * 64, pool=pool.id, peer_key=key,
                         proof=proof)
    with pytest.raises(RelayFingerprintMismatch) as info:
        await client.connect()
    assert info.value.got == running.fingerprint
    assert "intercepting" in str(info.value)
    assert running.app.requests_seen == 0
    await client.aclose()


async def test_bad_proofs_and_signatures_are_rejected(start_relay: StartRelay, pool: Pool) -> None:
    # (A proof for another node or pool, through the client: test_relay_contract.py.)
    running = await start_relay()
    key, proof = pool.member("a")
    # A proof from another pool, by hand: the relay's own answer.
    foreign = Pool.create()
    _, foreign_proof = foreign.member("x")
    async with raw_http(running) as http:
        answer = await raw_login(http, running, pool, key, foreign_proof)
        assert answer.status_code == 403 and "bad membership proof" in answer.json()["error"]
        assert answer.json()["code"] == "bad_proof"
        # Signed for another relay: a login captured elsewhere cannot be replayed here.
        answer = await raw_login(http, running, pool, key, proof, sign_fp="sha256:" + "1" * 64)
        assert answer.status_code == 403 and "bad signature" in answer.json()["error"]
        assert answer.json()["code"] == "bad_signature"
        # A nonce is good once.
        nonce = (await http.post("/v1/challenge",
                                 json={"pool": pool.id, "peer": public_hex(key)})).json()["nonce"]
        assert (await raw_login(http, running, pool, key, proof, nonce=nonce)).status_code == 200
        replay = await raw_login(http, running, pool, key, proof, nonce=nonce)
        assert replay.status_code == 401 and "nonce" in replay.json()["error"]
        assert replay.json()["code"] == "bad_nonce"
        # Malformed requests and missing sessions.
        for bad in (await http.post("/v1/challenge", json={"pool": "zz"}),
                    await http.post("/v1/challenge", content=b"[")):
            assert bad.status_code == 400 and bad.json()["code"] == "bad_request"
        too_big = await http.post("/v1/challenge", content=b" " * (65 * 1024))
        assert too_big.status_code == 413 and too_big.json()["code"] == "too_large"
        unauthorized = await http.get("/v1/roster", headers={"authorization": "Bearer nope"})
        assert unauthorized.status_code == 401
        assert unauthorized.json() == {"error": "session expired", "code": "session_expired"}
        nowhere = await http.get("/v1/nowhere")
        assert nowhere.status_code == 404 and nowhere.json()["code"] == "not_found"
        delete = await http.delete("/v1/roster")
        assert delete.status_code == 405 and delete.json()["code"] == "method_not_allowed"
        assert (await http.get("/v1/health")).json() == {"ok": True}


def test_client_and_relay_sign_the_same_login_bytes() -> None:
    args = ("sha256:" + "ab" * 32, "0" * 32, "cd" * 32)
    assert login_message is relay_login_message  # one definition, in ttpeer_wire
    assert login_message(*args) == relay_login_message(*args)
    assert login_message(*args).startswith(b"ttpeer/relay-auth/v1\n")


# -- codes, not words ----------------------------------------------------------------


async def test_clients_go_by_the_code_not_the_words(
    start_relay: StartRelay, pool: Pool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The relay rewords every error answer, and later sends a code this client has never
    # heard of: what the client decides rests on the status and the code alone, and
    # whatever the relay said is shown as it said it.
    import ttpeer_relay.asgi as relay_asgi

    answer_with = {"code": None}

    def reworded(error: relay_asgi.HttpError) -> relay_asgi.Response:
        code = answer_with["code"] or error.code.value
        return relay_asgi.json_response(error.status, {"error": f"(reworded {error.status})", "code": code},
                                        error.headers)

    monkeypatch.setattr(relay_asgi, "error_response", reworded)
    running = await start_relay(mailbox_messages=1)
    assert pool.root is not None
    bob_key, bob_proof = pool.member("bob")
    revoke = sign("revoke", pool.id, {"node": public_hex(bob_key), "keep": [], "at": 1}, pool.root)
    async with member(running, pool, "alice") as alice, member(running, pool, "bob", (bob_key, bob_proof)) as bob:
        await alice.send(bob.peer, b"1")
        with pytest.raises(RelayLimit) as full:
            await alice.send(bob.peer, b"2")
        assert full.value.code == ErrorCode.MAILBOX_FULL and full.value.retry_after is not None
        assert full.value.message == "(reworded 507)"
        await alice.revoke(revoke.raw)
        with pytest.raises(RelayRejected) as refused:
            await bob.recv(0, 0)
        assert refused.value.status == 403 and refused.value.code == ErrorCode.REVOKED
        assert "revoked" not in str(refused.value) and "(reworded 403)" in str(refused.value)
        answer_with["code"] = "a_code_from_the_future"
        with pytest.raises(RelayRejected) as unknown:
            await bob.recv(0, 0)
        assert unknown.value.status == 403 and unknown.value.code == "a_code_from_the_future"
        assert unknown.value.code not in set(ErrorCode)  # a generic refusal, not a revocation
        assert str(unknown.value) == f"relay {running.url} refused the request (403): (reworded 403)"
        with pytest.raises(RelayLimit) as limit:  # the status still picks the error's class
            await alice.send(bob.peer, b"2")
        assert limit.value.status == 507 and limit.value.code == "a_code_from_the_future"
        assert "(reworded 507)" in str(limit.value)


# -- limits ---------------------------------------------------------------------------


async def test_rate_limit_answers_429_with_retry_after(start_relay: StartRelay, pool: Pool) -> None:
    running = await start_relay(rate=1.0, burst=3)
    async with raw_http(running) as http:
        codes = [(await http.get("/v1/health")) for _ in range(5)]
        assert [r.status_code for r in codes] == [200, 200, 200, 429, 429]
        assert codes[-1].headers["retry-after"] == "1"
        assert "slow down" in codes[-1].json()["error"]
    # Per IP before login: the client's own login is refused with RelayLimit.
    with pytest.raises(RelayLimit) as info:
        async with member(running, pool, "a"):
            pass
    assert info.value.status == 429 and info.value.retry_after == 1


# -- blobs ----------------------------------------------------------------------------


async def session_of(running: RelayRunning, pool: Pool) -> str:
    """A session token for a fresh member, for requests made by hand."""
    async with raw_http(running) as http:
        return (await raw_login(http, running, pool, *pool.member("raw"))).json()["session"]


async def test_blob_on_disk_head_range_and_hash_over_http(start_relay: StartRelay, pool: Pool) -> None:
    # What a peer sees of blobs is in test_relay_contract.py (both relays); here the
    # HTTPS relay's own side: the file, HEAD, ranges, a body that does not hash to its name.
    running = await start_relay()
    data = os.urandom(700_000)
    async with member(running, pool, "a") as a:
        blob = await a.put_blob(data)
        assert (running.app.config.data / "pools" / pool.id / "blobs" / blob).stat().st_size == len(data)
        sent = a.bytes_sent
        assert await a.put_blob(data) == blob and a.bytes_sent == sent  # HEAD said it is there
        missing = hashlib.sha256(b"nothing").hexdigest()
        headers = {"authorization": f"Bearer {await session_of(running, pool)}"}
        async with raw_http(running) as http:
            head = await http.head(f"/v1/blob/{blob}", headers=headers)
            assert head.status_code == 200 and head.headers["content-length"] == str(len(data))
            part = await http.get(f"/v1/blob/{blob}", headers={**headers, "range": "bytes=500000-"})
            assert part.status_code == 206 and part.content == data[500_000:]
            assert part.headers["content-range"] == f"bytes 500000-{len(data) - 1}/{len(data)}"
            past = await http.get(f"/v1/blob/{blob}", headers={**headers, "range": "bytes=9999999-"})
            assert past.status_code == 416 and past.json()["code"] == "bad_range"
            wrong = await http.put(f"/v1/blob/{missing}", content=b"not nothing", headers=headers)
            assert wrong.status_code == 400 and "hashes to" in wrong.json()["error"]
            assert wrong.json()["code"] == "bad_blob"
            again = await http.put(f"/v1/blob/{blob}", content=data, headers=headers)
            assert again.status_code == 200


async def test_a_touch_restarts_blob_ttls_so_they_outlive_a_sweep(start_relay: StartRelay, pool: Pool) -> None:
    # The pin of a running job's dataset pieces: a touch is a lease the peers renew.
    running = await start_relay(blob_ttl=100.0)
    store = running.app.blobs
    async with member(running, pool, "a") as a:
        assert a.blob_ttl == 100.0  # the session answer says it: peers pace their touches by it
        kept, lapsed = await a.put_blob(b"kept" * 100), await a.put_blob(b"lapsed" * 100)
        for blob in (kept, lapsed):  # both uploaded 90 s ago, 10 s from their expiry
            await store.touch(pool.id, blob, time.time() - 90)
        never = hashlib.sha256(b"never uploaded").hexdigest()
        used = store._pools[pool.id].used
        assert await a.touch_blobs([never, kept, kept]) == [never]
        assert await a.touch_blobs([]) == []
        assert store._pools[pool.id].used == used  # a touch changes no quota
        # Past their first expiry: the touched one stays, on disk too (its mtime restarted).
        assert await store.sweep(time.time() + 50) == 1
        assert await a.get_blob(kept, max_size=400) == b"kept" * 100
        assert await a.touch_blobs([lapsed, kept]) == [lapsed]
        assert time.time() - (running.app.config.data / "pools" / pool.id / "blobs" / kept).stat().st_mtime < 60
        with pytest.raises(ValueError, match="at most 512"):  # refused before anything is sent
            await a.touch_blobs([kept] * 513)
        # A relay from before the route: 404 not_found, which the daemon takes as "no pin here".
        running.app._routes = [r for r in running.app._routes if r[0].pattern != re.escape("/v1/touch")]
        with pytest.raises(RelayRejected) as info:
            await a.touch_blobs([kept])
        assert info.value.status == 404 and info.value.code == ErrorCode.NOT_FOUND


async def test_malformed_over_cap_and_unauthenticated_touches_are_refused(
    start_relay: StartRelay, pool: Pool,
) -> None:
    running = await start_relay()
    blob = hashlib.sha256(b"x").hexdigest()
    headers = {"authorization": f"Bearer {await session_of(running, pool)}"}
    async with raw_http(running) as http:
        nobody = await http.post("/v1/touch", json={"blobs": [blob]})
        assert nobody.status_code == 401 and nobody.json()["code"] == "session_expired"
        for bad, words in (({"blobs": blob}, "field 'blobs' must be a list of sha256 hex blob names"),
                           ({"blobs": [blob.upper()]}, "field 'blobs'"), ({"blobs": [blob + "\n"]}, "field 'blobs'"),
                           ({"blobs": [1]}, "field 'blobs'"), ({"blob": [blob]}, "field 'blobs'"),
                           ([blob], "body must be a JSON object")):
            answer = await http.post("/v1/touch", json=bad, headers=headers)
            assert answer.status_code == 400 and answer.json()["code"] == "bad_request", bad
            assert words in answer.json()["error"], bad
        over = await http.post("/v1/touch", json={"blobs": [blob] * 513}, headers=headers)
        assert over.status_code == 413 and over.json()["code"] == "too_large"
        assert "over the 512" in over.json()["error"]
        huge = await http.post("/v1/touch", content=b" " * (65 * 1024), headers=headers)
        assert huge.status_code == 413 and huge.json()["code"] == "too_large"  # the JSON body cap
        wrong = await http.get("/v1/touch", headers=headers)
        assert wrong.status_code == 405
        ok = await http.post("/v1/touch", json={"blobs": [blob] * 512}, headers=headers)
        assert ok.status_code == 200 and ok.json() == {"held": 0, "missing": [blob]}


async def test_large_upload_goes_out_in_pieces_under_its_content_length(
    start_relay: StartRelay, pool: Pool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = await start_relay()
    data = os.urandom(2 * UPLOAD_PIECE + 12_345)
    assert [len(p) async for p in _pieces(data)] == [UPLOAD_PIECE, UPLOAD_PIECE, 12_345]
    assert b"".join([bytes(p) async for p in _pieces(data)]) == data
    async with member(running, pool, "a") as a, member(running, pool, "b") as b:
        seen: list[httpx.Request] = []
        pieces: list[int] = []
        transmit, cut = a._transmit, relay_session._pieces

        async def counted(body: bytes) -> AsyncIterator[memoryview]:
            async for piece in cut(body):
                pieces.append(len(piece))
                yield piece

        monkeypatch.setattr(relay_session, "_pieces", counted)

        async def spy(request: httpx.Request, stream: bool) -> httpx.Response:
            seen.append(request)
            return await transmit(request, stream)

        monkeypatch.setattr(a, "_transmit", spy)
        sent = a.bytes_sent
        blob = await a.put_blob(data)
        assert [r.method for r in seen] == ["HEAD", "PUT"]  # a large blob: asked for first
        assert seen[1].headers["content-length"] == str(len(data))  # sized, not chunked
        assert "transfer-encoding" not in seen[1].headers
        assert pieces == [UPLOAD_PIECE, UPLOAD_PIECE, 12_345]
        assert a.bytes_sent - sent == len(data)
        assert await b.get_blob(blob, max_size=len(data)) == data


async def test_a_small_blob_is_put_without_asking_first(start_relay: StartRelay, pool: Pool) -> None:
    running = await start_relay()
    data = os.urandom(ASK_FIRST_BYTES)
    async with member(running, pool, "a") as a:
        before, sent = running.app.requests_seen, a.bytes_sent
        blob = await a.put_blob(data)
        assert running.app.requests_seen == before + 1  # the PUT alone: no HEAD round trip
        assert await a.put_blob(data) == blob  # there already: the relay drains it, keeps one
        assert running.app.requests_seen == before + 2 and a.bytes_sent - sent == 2 * len(data)
        blob_dir = running.app.config.data / "pools" / pool.id / "blobs"
        assert [p.name for p in blob_dir.iterdir()] == [blob]
        assert (blob_dir / blob).read_bytes() == data


async def test_oversize_upload_is_cut_off_while_streaming(start_relay: StartRelay, pool: Pool) -> None:
    running = await start_relay(max_blob_bytes=256 * 1024)
    async with member(running, pool, "a") as a:
        token = await session_of(running, pool)
        sent = 0

        async def body() -> AsyncIterator[bytes]:  # chunked: no Content-Length to refuse early
            nonlocal sent
            for _ in range(256):  # 16 MiB, far more than socket buffers hold
                sent += 64 * 1024
                yield b"\0" * (64 * 1024)

        name = hashlib.sha256(b"\0" * (16 * 2**20)).hexdigest()
        async with raw_http(running) as http:
            try:
                answer = await http.put(f"/v1/blob/{name}", content=body(),
                                        headers={"authorization": f"Bearer {token}"})
                assert answer.status_code == 413
                assert "cap" in answer.json()["error"]
            except httpx.TransportError:
                pass  # HTTP/1.1: the relay answers 413 and closes while we are still sending
        assert sent < 16 * 2**20  # refused long before the whole body arrived
        with pytest.raises(RelayLimit) as info:  # declared too big: refused up front
            await a.put_blob(b"\1" * (256 * 1024 + 1))
        assert info.value.status == 413
        blob_dir = running.app.config.data / "pools" / pool.id / "blobs"
        assert not list(blob_dir.iterdir())  # no temporary file left behind


# -- restarts, expiry, pinning later, proxies -----------------------------------------


async def test_restart_forgets_sessions_and_client_logs_in_again(
    tmp_path: Path, pool: Pool
) -> None:
    stop, stopped = trio.Event(), trio.Event()
    config = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")

    async def first_relay(task_status: trio.TaskStatus[RelayRunning]) -> None:
        await serve(config, shutdown_trigger=stop.wait, task_status=task_status)
        stopped.set()

    async with trio.open_nursery() as nursery:
        first: RelayRunning = await nursery.start(first_relay)
        key_b, proof_b = pool.member("b")
        async with member(first, pool, "a") as a:
            b = RelayClient(first.url, first.fingerprint, pool=pool.id, peer_key=key_b,
                            proof=proof_b)
            await b.connect()
            await b.aclose()
            stop.set()
            with trio.fail_after(10):  # graceful: idle connections close, serve returns
                await stopped.wait()
            again = RelayConfig(data=tmp_path / "relay", listen=f"127.0.0.1:{first.port}")
            second: RelayRunning = await nursery.start(serve, again)
            assert second.fingerprint == first.fingerprint  # the certificate is reused
            # The old session is unknown to the new relay: 401, re-login, retry.
            proofs = await a.roster()
            # roster (401), challenge, session, roster again: transparent to the caller
            assert second.app.requests_seen == 4
            assert proof_b in proofs  # b's admission survived the restart on disk
        nursery.cancel_scope.cancel()


async def test_uploads_on_a_forgotten_session_log_in_again(tmp_path: Path, pool: Pool) -> None:
    # After a relay restart the session is unknown: a small blob's PUT is answered 401
    # (its body drained) and sent again, body and all, after a new login; a large one's
    # HEAD is answered 401 first.
    data = os.urandom(ASK_FIRST_BYTES), os.urandom(16 * 2**20)
    expected = (4, 5)  # PUT (401), challenge, session, PUT | HEAD (401), ..., HEAD, PUT
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def relay(task_status: trio.TaskStatus[RelayRunning]) -> None:
            with scope:
                await serve(RelayConfig(data=tmp_path / "relay", listen=f"127.0.0.1:{port}"),
                            task_status=task_status)

        port = 0
        running: RelayRunning = await nursery.start(relay)
        port = running.port
        async with member(running, pool, "a") as a:
            for body, requests in zip(data, expected, strict=True):
                scope.cancel()  # the relay goes away and comes back on the same port
                scope = trio.CancelScope()
                running = await nursery.start(relay)
                blob = await a.put_blob(body)
                assert running.app.requests_seen == requests
                assert (running.app.config.data / "pools" / pool.id / "blobs" / blob).read_bytes() == body
        nursery.cancel_scope.cancel()


async def test_relay_with_a_new_certificate_fails_the_pin(tmp_path: Path, pool: Pool) -> None:
    async with trio.open_nursery() as nursery:
        first_scope = trio.CancelScope()

        async def first_relay(task_status: trio.TaskStatus[RelayRunning]) -> None:
            with first_scope:
                await serve(RelayConfig(data=tmp_path / "one", listen="127.0.0.1:0"),
                            task_status=task_status)

        first: RelayRunning = await nursery.start(first_relay)
        async with member(first, pool, "a") as a:
            first_scope.cancel()
            other = RelayConfig(data=tmp_path / "two", listen=f"127.0.0.1:{first.port}")
            impostor: RelayRunning = await nursery.start(serve, other)
            with pytest.raises(RelayFingerprintMismatch) as info:
                await a.roster()
            assert info.value.got == impostor.fingerprint
            assert impostor.app.requests_seen == 0
        nursery.cancel_scope.cancel()


async def test_relay_down_is_unavailable(pool: Pool) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()  # nothing listens there now
    key, proof = pool.member("a")
    client = RelayClient(f"https://127.0.0.1:{port}", "sha256:" + "0" * 64, pool=pool.id,
                         peer_key=key, proof=proof, timeout=5)
    with pytest.raises(RelayUnavailable) as info:
        await client.connect()
    assert f"127.0.0.1:{port}" in str(info.value)
    with pytest.raises(RelayUnavailable):
        await client.roster()  # not connected: still a NetError, never an AttributeError


async def _connect_proxy(stream: trio.SocketStream, seen: list[bytes]) -> None:
    """A minimal HTTP CONNECT proxy: one tunnel per connection."""
    request = b""
    while b"\r\n\r\n" not in request:
        request += await stream.receive_some(4096)
    seen.append(request.split(b"\r\n", 1)[0])
    host, port = request.split(b" ")[1].decode().rsplit(":", 1)
    upstream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")

    async def pump(src: trio.abc.Stream, dst: trio.abc.Stream) -> None:
        try:
            while chunk := await src.receive_some(65536):
                await dst.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(dst)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, stream, upstream)
        nursery.start_soon(pump, upstream, stream)


async def start_connect_proxy(nursery: trio.Nursery) -> tuple[str, list[bytes]]:
    """Serve ``_connect_proxy`` on loopback: its URL, and the CONNECT lines it has seen."""
    seen: list[bytes] = []
    listeners = await nursery.start(
        partial(trio.serve_tcp, partial(_connect_proxy, seen=seen), 0, host="127.0.0.1")
    )
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", seen


async def test_through_a_connect_proxy(
    start_relay: StartRelay, pool: Pool, nursery: trio.Nursery
) -> None:
    running = await start_relay()
    proxy, seen = await start_connect_proxy(nursery)
    der = await fetch_certificate(running.url, proxy=proxy, timeout=10)
    assert fingerprint(der) == running.fingerprint
    async with member(running, pool, "a", proxy=proxy) as a, member(running, pool, "b") as b:
        await a.send(b.peer, b"via proxy")
        messages, _ = await b.recv(0, 0)
        assert messages[0].data == b"via proxy"
    assert all(line == f"CONNECT 127.0.0.1:{running.port} HTTP/1.1".encode() for line in seen)
    assert len(seen) >= 2  # the pin check and the HTTP connection both went through it


# -- the real process -----------------------------------------------------------------


def _relay_env() -> dict[str, str]:
    paths = [str(RELAY_SRC), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@pytest.mark.slow
async def test_process_prints_ready_line_and_stops_on_sigterm(tmp_path: Path, pool: Pool) -> None:
    data = tmp_path / "relay"
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "ttpeer_relay", "--listen", "127.0.0.1:0", "--data", str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_relay_env(),
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        with trio.fail_after(30):
            line = b""
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                assert chunk, "the relay exited before printing its ready line"
                line += chunk
        match = re.fullmatch(rb"relay ready https://127\.0\.0\.1:(\d+) (sha256:[0-9a-f]{64})\n", line)
        assert match, line
        url, fp = f"https://127.0.0.1:{match[1].decode()}", match[2].decode()
        assert fp == fingerprint(ssl.PEM_cert_to_DER_cert((data / "tls" / "cert.pem").read_text()))
        assert (data / "tls" / "key.pem").stat().st_mode & 0o777 == 0o600
        assert (data / "tls").stat().st_mode & 0o777 == 0o700
        key, proof = pool.member("a")
        async with RelayClient(url, fp, pool=pool.id, peer_key=key, proof=proof) as client:
            assert await client.recv(0, 0) == ([], 0)
            with trio.fail_after(10):  # a pending long-poll is answered at shutdown
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client.recv, 0, 30)
                    await trio.testing.wait_all_tasks_blocked(0.2)
                    process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
        rest = await process.stdout.receive_some(65536)
        assert rest == b""  # exactly one line on stdout
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# Run with the relay's own modules first on the path: torch and ttpeer are made unimportable,
# and the relay must load all it needs (ttpeer_wire included) from the one place given.
_ALONE = (
    "import sys; sys.modules['torch'] = None; sys.modules['ttpeer'] = None\n"
    "import ttpeer_relay.cli, ttpeer_relay.app, ttpeer_wire\n"
    "assert not any(m == 'torch' or m.startswith(('ttpeer.', 'ttpeer_relay._proto'))\n"
    "               for m in sys.modules if sys.modules[m])\n"
    "for module in (ttpeer_relay, ttpeer_wire):\n"
    "    assert module.__file__.startswith(sys.argv[1]), (module.__file__, sys.argv[1])\n"
)


@pytest.mark.slow
def test_relay_imports_neither_torch_nor_ttpeer() -> None:
    subprocess.run([sys.executable, "-c", _ALONE, str(RELAY_SRC)], check=True, env={
        **os.environ, "PYTHONPATH": str(RELAY_SRC)}, timeout=60)


@pytest.mark.slow
def test_the_relay_installs_alone_from_its_own_directory(tmp_path: Path) -> None:
    # `pip install ./bootstrap-relay`, from a copy outside the checkout: everything it
    # needs is inside its directory (no link into ttpeer/), and it carries ttpeer_wire.
    pytest.importorskip("setuptools", reason="building the relay offline needs setuptools in this environment")
    source, target = tmp_path / "bootstrap-relay", tmp_path / "installed"
    shutil.copytree(RELAY_SRC, source, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    assert not [p for p in source.rglob("*") if p.is_symlink()]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(source)], check=True, timeout=300, capture_output=True)
    assert sorted(p.name for p in (target / "ttpeer_wire").glob("*.py")) == sorted(
        p.name for p in (RELAY_SRC / "ttpeer_wire").glob("*.py"))
    subprocess.run([sys.executable, "-c", _ALONE, str(target)], check=True, env={
        **os.environ, "PYTHONPATH": str(target)}, timeout=60)


def test_cli_rejects_bad_flags(tmp_path: Path) -> None:
    from ttpeer_relay.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--listen", "nope", "--data", str(tmp_path)])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path), "--cert", str(tmp_path / "c.pem")])


# -- pure parts -----------------------------------------------------------------------


def test_rate_limiter_refills_over_time() -> None:
    limiter = RateLimiter(rate=2.0, burst=2)
    assert limiter.check("ip", 0.0) is None and limiter.check("ip", 0.0) is None
    assert limiter.check("ip", 0.0) == pytest.approx(0.5)
    assert limiter.check("other", 0.0) is None
    assert limiter.check("ip", 0.5) is None


def test_nonces_are_single_use_and_expire() -> None:
    nonces = Nonces(ttl=60, max_entries=2)
    n1 = nonces.issue("p", "a", 0)
    assert not nonces.take(n1, "p", "b", 1)  # issued to someone else (and now spent)
    n2 = nonces.issue("p", "a", 0)
    assert not nonces.take(n2, "p", "a", 61)
    n3, n4, n5 = (nonces.issue("p", "a", 0) for _ in range(3))
    assert not nonces.take(n3, "p", "a", 1)  # evicted: the table is bounded
    assert nonces.take(n4, "p", "a", 1) and nonces.take(n5, "p", "a", 1)


def test_sessions_expire() -> None:
    sessions = Sessions(ttl=10)
    token = sessions.open("p", "a", 0)
    assert sessions.get(token, 10) is not None
    assert sessions.get(token, 10.5) is None


async def test_mailbox_seqs_survive_ack_and_restart() -> None:
    clock = iter([1_000, 5_000])
    boxes = Mailboxes(max_messages=10, max_bytes=1000, first_seq=lambda: next(clock))
    now = trio.current_time()
    assert boxes.put("p", "b", "a", b"x", now) == 1_000
    assert boxes.put("p", "b", "a", b"y", now) == 1_001
    got = await boxes.receive("p", "b", 1_001, 0, max_count=10, max_bytes=10)
    assert got == [] and boxes.total_bytes == 0
    boxes.collect(now=trio.current_time() + 100, idle=10)  # empty and idle: forgotten
    assert boxes.put("p", "b", "a", b"z", now) == 5_000  # a new start, past every old seq
    with pytest.raises(MailboxFull):
        boxes.put("p", "b", "a", b"z" * 1000, now)


async def test_blob_store_ttl_quota_and_restart(tmp_path: Path) -> None:
    def store() -> BlobStore:
        return BlobStore(tmp_path, max_blob_bytes=1000, ttl=100.0, quota=1500)

    async def chunks(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 300):
            yield data[i:i + 300]

    blobs = store()
    one, two = b"1" * 900, b"2" * 900
    name_one, name_two = (hashlib.sha256(d).hexdigest() for d in (one, two))
    await blobs.put("p", name_one, chunks(one), now=1000.0)
    assert blobs.stat("p", name_one, 1050.0) == 900
    with pytest.raises(BlobError) as info:  # 900 + 900 is over the 1500-byte quota
        await blobs.put("p", name_two, chunks(two), now=1000.0)
    assert info.value.status == 507
    await blobs.touch("p", name_one, 1090.0)  # a repeated upload restarts the TTL
    assert blobs.stat("p", name_one, 1150.0) == 900
    (blobs.directory("p") / "dead.part").write_bytes(b"left by a crash")
    reloaded = store()
    reloaded.load()  # the index comes back from disk; leftovers go
    assert reloaded.stat("p", name_one, 1150.0) == 900
    assert not (blobs.directory("p") / "dead.part").exists()
    assert await reloaded.sweep(1191.0) == 1  # expired 100 s after its last upload
    assert not (blobs.directory("p") / name_one).exists()
    await reloaded.put("p", name_two, chunks(two), now=1200.0)  # its room is free again
    assert reloaded.stat("p", name_two, 1200.0) == 900


async def test_blob_store_touches_restart_ttls_in_one_batch(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path, max_blob_bytes=1000, ttl=100.0, quota=10_000)

    async def body(data: bytes) -> AsyncIterator[bytes]:
        yield data

    one, two = b"1" * 900, b"2" * 900
    name_one, name_two = (hashlib.sha256(d).hexdigest() for d in (one, two))
    await blobs.put("p", name_one, body(one), now=1000.0)
    await blobs.put("p", name_two, body(two), now=1000.0)
    never = hashlib.sha256(b"never").hexdigest()
    assert await blobs.touch_many("p", [name_one, never], 1090.0) == [never]
    assert await blobs.touch_many("other pool", [name_one], 1090.0) == [name_one]
    assert await blobs.sweep(1150.0) == 1  # past the first expiry: only the untouched one goes
    assert blobs.stat("p", name_one, 1150.0) == 900 and blobs.stat("p", name_two, 1150.0) is None
    assert await blobs.touch_many("p", [name_two, name_one], 1180.0) == [name_two]  # lapsed: missing
    reloaded = BlobStore(tmp_path, max_blob_bytes=1000, ttl=100.0, quota=10_000)
    reloaded.load()  # the touch is on disk: the file's mtime
    assert reloaded.stat("p", name_one, 1270.0) == 900 and reloaded.stat("p", name_one, 1281.0) is None


async def _in_chunks(data: bytes, sizes: tuple[int, ...] = (16384, 1000, 70_001)) -> AsyncIterator[bytes]:
    """``data`` cut in chunks of uneven sizes, as records arrive."""
    at, i = 0, 0
    while at < len(data):
        yield data[at:at + sizes[i % len(sizes)]]
        at += sizes[i % len(sizes)]
        i += 1


async def test_blob_store_writes_everything_through_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    writev, calls = os.writev, []

    def short(fd: int, buffers: list[memoryview]) -> int:  # the kernel may take less than asked
        calls.append(len(buffers))
        return writev(fd, [b"".join(buffers)[:100_003]])

    monkeypatch.setattr(os, "writev", short)
    blobs = BlobStore(tmp_path, max_blob_bytes=8 * 2**20, ttl=100.0, quota=2**30)
    data = os.urandom(3 * 2**20 + 17)
    name = hashlib.sha256(data).hexdigest()
    await blobs.put("p", name, _in_chunks(data), now=1.0)
    assert (blobs.directory("p") / name).read_bytes() == data
    assert len(calls) > len(data) // 100_003 and max(calls) > 1  # short, and gathered


async def test_blob_store_full_disk_is_507_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(fd: int, buffers: list[memoryview]) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    blobs = BlobStore(tmp_path, max_blob_bytes=8 * 2**20, ttl=100.0, quota=2**30)
    data = os.urandom(3 * 2**20)
    name = hashlib.sha256(data).hexdigest()
    with monkeypatch.context() as patch:
        patch.setattr(os, "writev", full)
        with pytest.raises(BlobError) as info:
            await blobs.put("p", name, _in_chunks(data), now=1.0)
    assert info.value.status == 507 and info.value.message == "the relay's disk is full"
    assert list(blobs.directory("p").iterdir()) == []  # no partial file left
    assert blobs.stat("p", name, 1.0) is None
    await blobs.put("p", name, _in_chunks(data), now=2.0)  # room again: nothing was lost
    assert (blobs.directory("p") / name).read_bytes() == data


async def test_early_answers_over_http2_leave_the_relay_up(start_relay: StartRelay) -> None:
    # hypercorn 0.18 fails the whole server on DATA for a stream it already answered;
    # the relay must read every request body to its end before finishing an answer.
    running = await start_relay()
    peer = "ab" * 32
    async with httpx.AsyncClient(base_url=running.url, http2=True,
                                 verify=pinned_ssl_context(cert_der(running))) as http:
        for _ in range(3):
            answer = await http.post(f"/v1/send/{peer}", content=b"\0" * (3 * 2**20),
                                     headers={"authorization": "Bearer nope"})
            assert answer.status_code == 401 and answer.http_version == "HTTP/2"
            answer = await http.post("/v1/challenge", content=b"\0" * (3 * 2**20))
            assert answer.status_code == 413
        assert (await http.get("/v1/health")).json() == {"ok": True}
