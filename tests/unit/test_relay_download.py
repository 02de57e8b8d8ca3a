"""Blob downloads, which ``RelayClient`` reads without httpx (``ttpeer.net._download``):
over the real TLS relay on loopback, through a forwarder that cuts or stalls the
connection mid-body, through a CONNECT proxy, across a relay restart (401), and the
answer-head parser on bytes a broken or hostile server might send.
"""

from __future__ import annotations

import functools
import hashlib
import os
import ssl
import tempfile
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ttpeer_relay import RelayConfig, RelayRunning, serve
from ttpeer_relay.tls import ensure_certificate

from ttpeer.net import BlobCorrupt, NetError, RelayClient, RelayUnavailable, pinned_ssl_context
from ttpeer.net._download import MAX_HEAD_BYTES, Answer, Body, Malformed, parse_head

from .test_relay import Pool, StartRelay, member, start_connect_proxy

BIG = 5 * 2**20 + 12345  # hundreds of TLS records, not a multiple of any chunk size


async def test_large_blob_round_trips_and_oversize_is_refused_unread(
    start_relay: StartRelay, pool: Pool
) -> None:
    running = await start_relay()
    data = os.urandom(BIG)
    async with member(running, pool, "a") as a, member(running, pool, "b") as b:
        blob = await a.put_blob(data)
        before = b.bytes_received
        got = await b.get_blob(blob, max_size=len(data))
        assert got == data and isinstance(got, bytes)
        assert b.bytes_received - before == len(data)
        before = b.bytes_received
        with pytest.raises(BlobCorrupt, match="over"):
            await b.get_blob(blob, max_size=len(data) - 1)
        assert b.bytes_received == before  # refused from content-length, no body read
        assert await b.get_blob(blob, max_size=len(data)) == data  # and the client still works


class Forwarder:
    """A TCP forwarder in front of the relay that breaks the first connection that
    carries more than ``after`` bytes toward the client: ``cut`` closes it, ``stall``
    stops forwarding and holds it open."""

    def __init__(self, relay_port: int, mode: str, after: int) -> None:
        self.relay_port, self.mode, self.after = relay_port, mode, after
        self.broken = 0
        self.connections = 0
        self.release = trio.Event()

    async def handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        upstream = await trio.open_tcp_stream("127.0.0.1", self.relay_port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, client, upstream, False, nursery.cancel_scope)
            nursery.start_soon(self._pump, upstream, client, True, nursery.cancel_scope)
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(upstream)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, down: bool,
                    both: trio.CancelScope) -> None:
        sent = 0
        try:
            while chunk := await src.receive_some(65536):
                if down and not self.broken and sent + len(chunk) > self.after:
                    self.broken += 1
                    if self.mode == "stall":
                        await self.release.wait()  # hold the connection, send nothing more
                    break
                await dst.send_all(chunk)
                sent += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        both.cancel()


async def _behind(forwarder: Forwarder, running: RelayRunning, pool: Pool, nursery: trio.Nursery) -> RelayClient:
    """Member b's client, reaching the relay through ``forwarder`` (not yet connected)."""
    listeners = await nursery.start(partial(trio.serve_tcp, forwarder.handle, 0, host="127.0.0.1"))
    url = f"https://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    key, proof = pool.member("b")
    return RelayClient(url, running.fingerprint, pool=pool.id, peer_key=key, proof=proof, timeout=2.0)


@pytest.mark.parametrize("mode", ["cut", "stall"])
async def test_a_download_broken_mid_body_resumes_with_range(
    start_relay: StartRelay, pool: Pool, nursery: trio.Nursery, mode: str
) -> None:
    running = await start_relay()
    data = os.urandom(BIG)
    async with member(running, pool, "a") as a:
        blob = await a.put_blob(data)
    forwarder = Forwarder(running.port, mode, after=2 * 2**20)
    async with await _behind(forwarder, running, pool, nursery) as b:
        with trio.fail_after(20):
            got = await b.get_blob(blob, max_size=len(data))
        forwarder.release.set()
    assert got == data
    assert forwarder.broken == 1
    # Every byte was fetched once: the second GET asked for the rest with Range
    # (a restart would count the first part twice).
    assert b.bytes_received - len(data) < 4096  # the login answers' bodies
    assert b.bytes_received >= len(data)


async def test_a_file_blob_streams_both_ways_resumes_and_leaves_no_file_on_failure(
    start_relay: StartRelay, pool: Pool, nursery: trio.Nursery, tmp_path: Path
) -> None:
    running = await start_relay()
    data = os.urandom(BIG)
    (tmp_path / "up").write_bytes(data)
    async with member(running, pool, "a") as a:
        blob = await a.put_blob_file(tmp_path / "up")
        assert blob == hashlib.sha256(data).hexdigest()
        assert await a.get_blob(blob, max_size=len(data)) == data  # the same blob as put_blob's
        with pytest.raises(BlobCorrupt, match="over"):
            await a.get_blob_file(blob, tmp_path / "small", max_size=len(data) - 1)
        assert not (tmp_path / "small").exists()
    forwarder = Forwarder(running.port, "cut", after=2 * 2**20)
    async with await _behind(forwarder, running, pool, nursery) as b:
        with trio.fail_after(20):
            await b.get_blob_file(blob, tmp_path / "down", max_size=len(data))
        forwarder.release.set()
    assert forwarder.broken == 1  # cut mid-body: the file was resumed with Range, not restarted
    assert (tmp_path / "down").read_bytes() == data
    assert b.bytes_received - len(data) < 4096


async def test_download_through_a_connect_proxy(
    start_relay: StartRelay, pool: Pool, nursery: trio.Nursery
) -> None:
    running = await start_relay()
    proxy, seen = await start_connect_proxy(nursery)
    data = os.urandom(BIG)
    async with member(running, pool, "a") as a, member(running, pool, "b", proxy=proxy) as b:
        blob = await a.put_blob(data)
        tunnels = len(seen)
        assert await b.get_blob(blob, max_size=len(data)) == data
        assert len(seen) == tunnels + 1  # the download had a tunnel of its own...
        assert await b.get_blob(blob, max_size=len(data)) == data
        assert len(seen) == tunnels + 1  # ...which the next one reused
    assert all(line == f"CONNECT 127.0.0.1:{running.port} HTTP/1.1".encode() for line in seen)


async def test_downloads_at_once_keep_their_connections_for_the_next_ones(
    start_relay: StartRelay, pool: Pool, nursery: trio.Nursery
) -> None:
    """An aggregator fetches its slice of every contribution at once: the connections those
    GETs opened (up to SPARES) carry the next round's, without a new TLS handshake each."""
    running = await start_relay()
    proxy, seen = await start_connect_proxy(nursery)
    data = os.urandom(4096)
    async with member(running, pool, "a") as a, member(running, pool, "b", proxy=proxy) as b:
        blob = await a.put_blob(data)
        tunnels = len(seen)

        async def four() -> None:
            async with trio.open_nursery() as inner:
                for _ in range(4):
                    inner.start_soon(functools.partial(b.get_blob, blob, max_size=len(data)))

        await four()
        opened = len(seen) - tunnels
        assert 1 < opened <= 4  # at once: a connection each (one at a time would share one)
        await four()
        await four()
        assert len(seen) - tunnels == opened  # all kept, all reused


async def test_a_download_after_a_relay_restart_reconnects_and_logs_in_again(tmp_path: Path, pool: Pool) -> None:
    stop, stopped = trio.Event(), trio.Event()
    config = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")

    async def first_relay(task_status: trio.TaskStatus[RelayRunning]) -> None:
        await serve(config, shutdown_trigger=stop.wait, task_status=task_status)
        stopped.set()

    data = os.urandom(300_000)
    async with trio.open_nursery() as nursery:
        first: RelayRunning = await nursery.start(first_relay)
        async with member(first, pool, "a") as a:
            blob = await a.put_blob(data)
            assert await a.get_blob(blob, max_size=len(data)) == data  # leaves a spare connection
            stop.set()
            with trio.fail_after(10):
                await stopped.wait()
            again = RelayConfig(data=tmp_path / "relay", listen=f"127.0.0.1:{first.port}")
            second: RelayRunning = await nursery.start(serve, again)
            # The spare is dead (the relay restarted): a new connection, then 401, login, retry.
            assert await a.get_blob(blob, max_size=len(data)) == data
            assert second.app.requests_seen == 4  # GET (401), challenge, session, GET again
        nursery.cancel_scope.cancel()


async def test_a_closed_client_raises_a_net_error(
    start_relay: StartRelay, pool: Pool
) -> None:
    running = await start_relay()
    async with member(running, pool, "a") as a:
        blob = await a.put_blob(b"x" * 1000)
    with pytest.raises(RelayUnavailable, match="not connected"):
        await a.get_blob(blob, max_size=1000)


# -- the answer head -------------------------------------------------------------------


def test_parse_head_reads_status_and_fields() -> None:
    status, headers = parse_head(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 5\r\nX-A:  b ")
    assert status == 206 and headers == {"content-length": "5", "x-a": "b"}
    for bad in (b"HTTP/2 200 OK", b"HTTP/1.1 2x0 OK", b"SSH-2.0-x",
                b"HTTP/1.1 200 OK\r\nno colon here", b"HTTP/1.1 200 OK\r\n folded: x"):
        with pytest.raises(Malformed):
            parse_head(bad)


async def _answer(raw: bytes) -> tuple[Answer, Body]:
    stream = trio.testing.MemoryReceiveStream()
    stream.put_data(raw)
    stream.put_eof()
    answer, body = Answer(stream, trio.CancelScope(), 5.0), Body()
    await answer.read_head()
    await answer.read_into(body)
    return answer, body


async def test_answers_are_framed_by_content_length_or_refused() -> None:
    answer, body = await _answer(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabcTRAILING")
    assert answer.status == 200 and b"".join(body.parts) == b"abc" and body.size == 3
    assert body.sha256.hexdigest() == hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(EOFError):  # the connection ended before the body did
        await _answer(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
    with pytest.raises(EOFError):
        await _answer(b"HTTP/1.1 200 OK\r\ncontent-len")
    for head in (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3",
                 b"HTTP/1.1 200 OK\r\nx: y", b"HTTP/1.1 200 OK\r\ncontent-length: -1",
                 b"HTTP/1.1 200 OK\r\ncontent-length: 1" + b"0" * 30):
        with pytest.raises(Malformed):
            await _answer(head + b"\r\n\r\nabc")
    with pytest.raises(Malformed, match="over"):
        await _answer(b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * (MAX_HEAD_BYTES // 6 + 10) + b"\r\n")


# -- a hostile server's answers to a blob GET ------------------------------------------


@functools.cache
def _server_tls() -> tuple[ssl.SSLContext, bytes]:
    cert, key = ensure_certificate(Path(tempfile.mkdtemp(prefix="ttpeer-test-tls-")), "127.0.0.1")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, ssl.PEM_cert_to_DER_cert(cert.read_text())


def _head(status: int, framing: str, retry: str | None, body: bytes) -> bytes:
    fields = {"ok": f"content-length: {len(body)}", "short": f"content-length: {len(body) + 7}",
              "none": "", "chunked": "transfer-encoding: chunked", "junk": "content-length: 1e3"}[framing]
    head = f"HTTP/1.1 {status} X\r\n{fields}\r\n" + (f"retry-after: {retry}\r\n" if retry else "")
    return head.encode() + b"\r\n"


class _Refusal(httpx.AsyncByteStream):
    """A 403 body that arrives off the wire, as a real server's does (not pre-read)."""

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield b'{"error":"no"}'


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(status=st.sampled_from([200, 204, 206, 301, 400, 401, 403, 404, 413, 416, 429, 500, 507]),
       framing=st.sampled_from(["ok", "ok", "short", "none", "chunked", "junk", "raw"]),
       retry=st.one_of(st.none(), st.sampled_from(["nan", "inf", "-1", "1e999", "5", "soon"])),
       body=st.binary(max_size=300))
def test_hostile_blob_answers_raise_only_net_errors(status: int, framing: str, retry: str | None,
                                                     body: bytes) -> None:
    """Whatever a relay (or something in its place) answers to a blob GET, over real
    TLS: a NetError (bytes that do not hash to the blob's name included), nothing else."""
    server_context, der = _server_tls()
    answer = body if framing == "raw" else _head(status, framing, retry, body) + body

    async def reply(stream: trio.SSLStream) -> None:
        try:
            request = b""
            while b"\r\n\r\n" not in request:
                request += await stream.receive_some(65536)
            await stream.send_all(answer)
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_ssl_over_tcp, reply, 0, server_context,
                                                    host="127.0.0.1"))
            url = f"https://127.0.0.1:{listeners[0].transport_listener.socket.getsockname()[1]}"
            client = RelayClient(url, "sha256:" + "0" * 64, pool="ef" * 16,
                                 peer_key=Ed25519PrivateKey.from_private_bytes(bytes(32)), proof=[], timeout=5)
            # Connected by hand (no login): the pinned context for downloads, and a
            # re-login after a 401 that the relay refuses.
            client._blob_context = pinned_ssl_context(der)
            client._http = httpx.AsyncClient(base_url=url, transport=httpx.MockTransport(
                lambda request: httpx.Response(403, stream=_Refusal())))
            with pytest.raises(NetError):
                await client.get_blob(hashlib.sha256(b"wanted").hexdigest(), max_size=1000)
            await client.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
