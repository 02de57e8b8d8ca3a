"""The LAN shortcut: members that can reach each other fetch dataset pieces, deltas and
states directly.

Theory of operation. Every daemon (unless ``direct = "off"``) serves the pieces it holds,
and the sealed blobs it uploaded (its deltas, the initial state it submitted, the
checkpoints it published: the transport's spool, ``net/_multi.py``), over HTTPS on a port
of its own, and says where in a signed ``direct`` record: the
addresses (``host:port``) and its TLS certificate, self-signed and made once per home
(``HOME/direct-tls``). A fetcher asks the members that serve directly before the relay,
the dataset's authors first; it trusts exactly the certificate of the record (pinned: the
record is signed with the member's key, so a server that shows another certificate is
not that member), and signs each request with its own key and the pool key, so only
members holding the pool key are served. A member it cannot reach (behind NAT, a
firewall, another LAN) costs one connect of at most ``CONNECT_TIMEOUT`` seconds, then is
skipped for ``DOWN_FOR``; peers that reach no one see no change. A member that answers
404 lacks the piece (not asked again for that dataset for a while, ``_data.LACKS_FOR``);
one that sends slower than ``MIN_RATE`` or anything else that goes wrong is skipped like
an unreachable one. Every piece is still checked against the record's hash by the
fetcher, so a direct peer is trusted for nothing but the bytes it sends.

The address: ``auto`` advertises the IPv4 address this machine reaches the relay from
(its LAN address behind a home router, its own on a cloud box with a public address), on
the port it listened on last time if that is free (a firewall rule stays right); ``PORT``
the same on a fixed port; ``HOST:PORT`` that address (a forwarded port), listening on
``PORT`` on every IPv4 interface.

The requests: ``GET /v1/piece/<dataset id>/<piece index>`` and ``GET /v1/blob/<sha256>``
(asked only of the blob's uploader; the fetcher checks the bytes hash to the name), with ``Authorization: ttpeer
<member>.<unix time>.<signature>.<mac>``: the member's Ed25519 signature over
``AUTH_DOMAIN``, the server's member id, the path and the time, and an HMAC of the same
under a key derived from the pool's newest key. So it names this server and this piece,
is good for ``AUTH_WINDOW`` seconds, and needs the pool key (a member that joined with an
expired token never got it). Answers: 200 and the bytes; 404 when this peer does
not hold it; 401 for a missing, malformed, stale or wrong signature or MAC, or a caller
who is no member.

What breaks it: nothing of the pool's: a direct fetch that fails falls back to the relay.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ttpeer.errors import TtpeerError
from ttpeer.net import pinned_ssl_context
from ttpeer.proto import Record, direct_routes, sign

log = logging.getLogger("ttpeer.daemon")

AUTH_DOMAIN = b"ttpeer/direct/v1\n"
AUTH_WINDOW = 300.0  # seconds a signed request stays good (clocks of members differ by less)
CONNECT_TIMEOUT = 2.0  # a LAN answers within this; a peer that does not is elsewhere
READ_TIMEOUT = 30.0
MIN_RATE = 256 * 1024  # bytes/s: a piece that comes slower than this (after the connect) is given up
SLACK = 10.0  # seconds a piece may take beyond its connects and MIN_RATE
DOWN_FOR = 300.0  # a member that could not be reached is not tried again for this long
_CHUNK = 1 << 20
_PATH = re.compile(r"^/v1/piece/([0-9a-f]{64})/([0-9]{1,9})$")
_BLOB_PATH = re.compile(r"^/v1/blob/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=([0-9]{1,15})-([0-9]{1,15})$")  # one closed range, as chunk_run asks
_AUTH = re.compile(r"^ttpeer ([0-9a-f]{64})\.([0-9]{1,12})\.([0-9a-f]{128})\.([0-9a-f]{64})$")


class DirectFailed(TtpeerError):
    """A member did not serve a piece directly (``reachable``: it answered at all;
    ``lacks``: it answered that it does not hold the piece, so it is not down)."""

    def __init__(self, message: str, *, reachable: bool, lacks: bool = False) -> None:
        super().__init__(message)
        self.reachable = reachable
        self.lacks = lacks


def local_address(relay_url: str) -> str | None:
    """The IPv4 address this machine reaches the relay from (a UDP socket's, connected: no
    packet is sent), or None if there is none (the server listens on IPv4 only). Blocks
    on DNS: call it in a thread."""
    parts = urlsplit(relay_url)
    host, port = parts.hostname or "", parts.port or 443
    try:
        info = socket.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_DGRAM)[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            addr = s.getsockname()[0]
    except OSError:
        return None
    return str(addr)


def _mac(pool_key: bytes, message: bytes) -> str:
    sub = hmac.new(pool_key, b"ttpeer/direct/v1 key", hashlib.sha256).digest()
    return hmac.new(sub, message, hashlib.sha256).hexdigest()


def signed_request(key: Ed25519PrivateKey, me: str, server: str, path: str, now: float, pool_key: bytes) -> str:
    """The ``Authorization`` value of a request for ``path`` to member ``server``: signed
    with the member's key, and keyed with the pool's newest key (a member the pool never
    gave the key to, e.g. one that joined with an expired token, cannot make one)."""
    t = str(int(now))
    message = AUTH_DOMAIN + f"{server}\n{path}\n{t}".encode()
    return f"ttpeer {me}.{t}.{key.sign(message).hex()}.{_mac(pool_key, message)}"


def check_request(header: str, server: str, path: str, now: float, members: Any,
                  pool_key: bytes | None) -> str | None:
    """The member who signed ``header`` for ``path`` here, or None (any fault at all)."""
    m = _AUTH.fullmatch(header)
    if m is None or pool_key is None:
        return None
    member, t, sig, mac = m.groups()
    if member not in members or abs(now - int(t)) > AUTH_WINDOW:
        return None
    message = AUTH_DOMAIN + f"{server}\n{path}\n{t}".encode()
    if not hmac.compare_digest(mac, _mac(pool_key, message)):
        return None
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(member)).verify(bytes.fromhex(sig), message)
    except (InvalidSignature, ValueError):
        return None
    return member


PieceSource = Callable[[str, int], Awaitable[tuple[Path, int, int] | None]]
BlobSource = Callable[[str], Path | None]  # a sealed blob this peer uploaded, by name: its file


@dataclass
class DirectStats:
    served_pieces: int = 0
    served_bytes: int = 0  # pieces' bytes
    served_blobs: int = 0  # sealed blobs (deltas, states) this peer uploaded, served again directly
    served_blob_bytes: int = 0
    served_ranges: int = 0  # of those blobs, answers with a range (a slice's chunks of a delta)
    refused: int = 0  # requests answered 401
    addrs: list[str] = field(default_factory=list)


class DirectServer:
    """The ASGI app that serves this peer's pieces to members (hypercorn runs it)."""

    def __init__(self, me: str, members: Callable[[], Any], source: PieceSource,
                 pool_key: Callable[[], bytes | None], wall: Callable[[], float] = time.time,
                 blobs: BlobSource = lambda _name: None) -> None:
        self.me = me
        self._members = members
        self._pool_key = pool_key
        self._source = source
        self._blobs = blobs
        self._wall = wall
        self.stats = DirectStats()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        piece, blob = _PATH.fullmatch(path), _BLOB_PATH.fullmatch(path)
        if scope.get("method") != "GET" or (piece is None and blob is None):
            await _answer(send, 404, b"no such route\n")
            return
        who = check_request(headers.get("authorization", ""), self.me, path, self._wall(), self._members(),
                            self._pool_key())
        if who is None:
            self.stats.refused += 1
            await _answer(send, 401, b"sign the request with a member's key\n")
            return
        if blob is not None:
            file = self._blobs(blob.group(1))
            found = None if file is None else await trio.to_thread.run_sync(_whole, file)
        else:
            assert piece is not None
            found = await self._source(piece.group(1), int(piece.group(2)))
        if found is None:
            await _answer(send, 404, b"this peer does not hold that\n")
            return
        file, offset, size = found
        status, extra = 200, []
        if blob is not None and "range" in headers:  # a slice's chunks of a delta (``DirectFetcher.get_range``)
            asked = _RANGE.fullmatch(headers["range"].strip())
            if asked is None or not int(asked.group(1)) <= int(asked.group(2)) < size:
                await _answer(send, 416, b"ask for one range bytes=FIRST-LAST within the blob\n")
                return
            first, last = int(asked.group(1)), int(asked.group(2))
            status, extra = 206, [(b"content-range", f"bytes {first}-{last}/{size}".encode())]
            offset, size = first, last - first + 1
        try:
            fd = await trio.to_thread.run_sync(os.open, file, os.O_RDONLY)
        except OSError:  # evicted, or the assembly became the dataset, since it was found
            await _answer(send, 404, b"this peer does not hold that\n")
            return
        # Counted as the answer starts (the fetcher may be done first).
        if blob is not None:
            self.stats.served_blobs += 1
            self.stats.served_blob_bytes += size
            self.stats.served_ranges += 1 if status == 206 else 0
        else:
            self.stats.served_pieces += 1
            self.stats.served_bytes += size
        try:
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/octet-stream"),
                                    (b"content-length", str(size).encode()), *extra]})
            sent = 0
            while sent < size:
                n = min(_CHUNK, size - sent)
                chunk = await trio.to_thread.run_sync(os.pread, fd, n, offset + sent)
                if not chunk:
                    raise OSError(f"{file} ends before the piece does")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            os.close(fd)
        log.debug("served %s directly to %s", path, who[:12])


def _whole(file: Path) -> tuple[Path, int, int] | None:
    try:
        return file, 0, file.stat().st_size
    except OSError:
        return None


async def _answer(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DirectFetcher:
    """Fetches pieces from the members that serve directly, pinned to their certificates."""

    def __init__(self, key: Ed25519PrivateKey, me: str, pool_key: Callable[[], bytes | None],
                 wall: Callable[[], float] = time.time) -> None:
        self._key = key
        self.me = me
        self._pool_key = pool_key
        self._wall = wall
        self._down: dict[str, float] = {}  # member -> until when it is not tried
        self._contexts: dict[str, ssl.SSLContext | None] = {}  # certificate hex -> its pinned context
        self._routes: tuple[int, dict[str, Record]] | None = None  # (records seen, direct_routes of them)

    def routes(self, records: Any, prefer: list[str]) -> list[tuple[str, Record]]:
        """The members to ask, ``prefer`` first (then by id), without this peer and those down."""
        now = trio.current_time()
        if self._routes is None or self._routes[0] != len(records):  # records only grow: a new one may count
            self._routes = (len(records), direct_routes(records))
        routes = self._routes[1]
        order = {m: i for i, m in enumerate(prefer)}
        return sorted(((m, r) for m, r in routes.items() if m != self.me and self._down.get(m, now) <= now),
                      key=lambda mr: (order.get(mr[0], len(order)), mr[0]))

    async def get(self, member: str, route: Record, dataset: str, index: int, size: int, dest: Path) -> None:
        """Write piece ``index`` of ``dataset`` (``size`` bytes) from ``member`` into ``dest``,
        within ``CONNECT_TIMEOUT`` an address, ``SLACK``, and the piece at ``MIN_RATE``. Raises ``DirectFailed``
        for anything that goes wrong, whatever the member's record or answer says (then the
        member is down for ``DOWN_FOR`` unless it answered and lacks the piece)."""
        await self._fetch(member, route, f"/v1/piece/{dataset}/{index}", size, dest, exact=True)

    async def get_blob(self, member: str, route: Record, blob: str, max_size: int, dest: Path) -> None:
        """Write the sealed blob ``blob`` (at most ``max_size`` bytes) that ``member`` uploaded
        into ``dest``, as ``get`` does a piece; the caller checks its hash. Raises ``DirectFailed``."""
        await self._fetch(member, route, f"/v1/blob/{blob}", max_size, dest, exact=False)

    async def get_range(self, member: str, route: Record, blob: str, start: int, stop: int, dest: Path) -> None:
        """Write bytes ``start`` .. ``stop``-1 of the sealed blob ``blob`` that ``member``
        uploaded into ``dest`` (one Range request), as ``get`` does a piece. Not hash-checked
        (a range cannot be): the caller opens its sealed pieces. Raises ``DirectFailed``."""
        await self._fetch(member, route, f"/v1/blob/{blob}", stop - start, dest, exact=True, span=(start, stop))

    async def _fetch(self, member: str, route: Record, path: str, size: int, dest: Path, *, exact: bool,
                     span: tuple[int, int] | None = None) -> None:
        try:
            with trio.fail_after(CONNECT_TIMEOUT * len(route["addrs"]) + SLACK + size / MIN_RATE):
                await self._get(member, route, path, size, dest, exact, span)
        except DirectFailed as exc:
            if not exc.lacks:
                self._down[member] = trio.current_time() + DOWN_FOR
            raise
        except trio.TooSlowError:
            self._down[member] = trio.current_time() + DOWN_FOR
            raise DirectFailed(f"{member[:12]} sent too slowly", reachable=True) from None
        except Exception as exc:  # noqa: BLE001 - a member's record or answer must never fail a fetch
            self._down[member] = trio.current_time() + DOWN_FOR
            raise DirectFailed(f"{member[:12]} could not be asked ({type(exc).__name__}: {exc})",
                               reachable=False) from None

    async def _get(self, member: str, route: Record, path: str, size: int, dest: Path, exact: bool,
                   span: tuple[int, int] | None) -> None:
        pool_key = self._pool_key()
        if pool_key is None:
            raise DirectFailed("this peer holds no pool key yet", reachable=False, lacks=True)
        cert = route["cert"]
        if cert not in self._contexts:
            try:
                self._contexts[cert] = pinned_ssl_context(bytes.fromhex(cert))
            except (ssl.SSLError, ValueError):
                self._contexts[cert] = None
        context = self._contexts[cert]
        if context is None:
            raise DirectFailed(f"{member[:12]}'s record names no usable certificate", reachable=False)
        auth = signed_request(self._key, self.me, member, path, self._wall(), pool_key)
        headers = {"authorization": auth, "accept-encoding": "identity"}
        if span is not None:
            headers["range"] = f"bytes={span[0]}-{span[1] - 1}"
        for addr in route["addrs"]:
            async with httpx.AsyncClient(verify=context, trust_env=False,
                                         timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)) as client:
                try:
                    async with client.stream("GET", f"https://{addr}{path}", headers=headers) as r:
                        await self._receive(member, r, size, dest, exact, 200 if span is None else 206)
                        return
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    continue  # this address is not reachable from here: the next one
                except httpx.HTTPError as exc:
                    raise DirectFailed(f"{member[:12]} stopped sending ({type(exc).__name__})",
                                       reachable=True) from None
        raise DirectFailed(f"{member[:12]} is not reachable directly at {', '.join(route['addrs'])}",
                           reachable=False)

    @staticmethod
    async def _receive(member: str, r: httpx.Response, size: int, dest: Path, exact: bool, ok: int) -> None:
        if r.status_code == 404:
            raise DirectFailed(f"{member[:12]} answered 404 (it lacks it)", reachable=True, lacks=True)
        if r.status_code != ok:
            raise DirectFailed(f"{member[:12]} answered {r.status_code}", reachable=True)
        got = 0
        f = await trio.open_file(dest, "wb")
        async with f:
            async for chunk in r.aiter_raw(_CHUNK):
                got += len(chunk)
                if got > size:
                    raise DirectFailed(f"{member[:12]} sent more than {size} bytes", reachable=True)
                await f.write(chunk)
        if got != size and (exact or got == 0):
            raise DirectFailed(f"{member[:12]} sent {got} of {size} bytes", reachable=True)


# -- running the server ---------------------------------------------------------------


def _saved_port(home: Path) -> int:
    try:
        port = int(json.loads((home / "direct.json").read_text())["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return port if 1 <= port <= 65535 else 0


def _save_port(home: Path, port: int) -> None:
    try:
        (home / "direct.json").write_text(json.dumps({"port": port}))
    except OSError as exc:
        log.info("could not remember the direct port: %s", exc)


async def serve_direct(node: Any, mode: tuple[str | None, int], relay_url: str) -> None:
    """Serve ``node``'s pieces directly and publish where (a ``direct`` record) until
    cancelled. Whatever goes wrong here (no port, no certificate, a bug) logs a warning
    and serves nothing: the relay still carries everything, and the daemon goes on."""
    try:
        await _serve_direct(node, mode, relay_url)
    except Exception as exc:  # noqa: BLE001 - the shortcut is optional; the daemon is not
        log.warning("not serving pieces directly (%s): peers fetch them through the relay",
                    getattr(exc, "strerror", None) or exc, exc_info=not isinstance(exc, OSError))


async def _serve_direct(node: Any, mode: tuple[str | None, int], relay_url: str) -> None:
    from ttpeer_relay.tls import ensure_certificate

    advertised, port = mode
    home: Path = node.home.path
    cert, key = await trio.to_thread.run_sync(ensure_certificate, home / "direct-tls", "0.0.0.0")
    der = ssl.PEM_cert_to_DER_cert(await trio.to_thread.run_sync(cert.read_text))
    app = DirectServer(node.me, lambda: node.machine.records.members, node.data.piece_source,
                       lambda: node.pool_key, node.wall, blobs=node.transport.spooled)  # the sealed blobs we uploaded
    node.data.direct_stats = app.stats
    choice = port or await trio.to_thread.run_sync(_saved_port, home)
    if choice and not _free(choice):
        if port:  # the port the user chose
            log.warning("cannot serve pieces directly on port %d (it is in use): peers fetch them through the relay",
                        port)
            return
        choice = 0  # the one used last is taken: any other
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(listen, app, cert, key, choice)
        await trio.to_thread.run_sync(_save_port, home, bound)
        host = advertised or await trio.to_thread.run_sync(local_address, relay_url)
        if host is None:
            log.warning("serving pieces directly on port %d, but found no IPv4 address to advertise (say which "
                        "with --direct HOST:PORT)", bound)
            return
        app.stats.addrs = [f"{host}:{bound}"]
        log.info("serving dataset pieces directly at %s", app.stats.addrs[0])
        await _advertise(node, app.stats.addrs, der)


async def listen(app: DirectServer, cert: Path, key: Path, port: int, host: str = "0.0.0.0",
                 *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` over TLS (``cert``, ``key``) on ``host:port`` until cancelled; reports
    the port bound. Raises ``OSError`` when it cannot listen."""
    import hypercorn.config
    import hypercorn.trio

    hc = hypercorn.config.Config()
    hc.bind = [f"{host}:{port}"]
    hc.certfile, hc.keyfile = str(cert), str(key)
    hc.alpn_protocols = ["http/1.1"]
    hc.include_server_header = False
    hc.graceful_timeout = 1.0
    hc.ssl_handshake_timeout = 5.0  # a connection that never finishes its handshake holds a descriptor
    hc.keep_alive_timeout = 5.0
    hc.errorlog = logging.getLogger("ttpeer.direct.server")
    hc.accesslog = None

    async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn.trio.serve(app, hc, mode="asgi", task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve)
        task_status.started(int(binds[0].rpartition(":")[2]))


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


async def _advertise(node: Any, addrs: list[str], der: bytes) -> None:
    """Sign a ``direct`` record unless this peer's newest one already says the same."""
    await node.key_event.wait()
    mine = direct_routes(node.machine.records).get(node.me)
    if mine is not None and list(mine["addrs"]) == addrs and mine["cert"] == der.hex():
        return
    at = max(int(node.wall()), int(mine["at"]) + 1 if mine is not None else 0)
    rec = sign("direct", node.cfg.pool, {"addrs": addrs, "cert": der.hex(), "at": at}, node.node_key)
    node.process(node.machine.add_local(rec, node.now()))
