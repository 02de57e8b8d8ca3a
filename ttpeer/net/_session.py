"""``RelaySession``: one pinned, logged-in HTTPS session with a relay, and its connections.

Theory of operation. ``connect`` fetches the relay's certificate with a bare
TLS handshake and compares its fingerprint with the pinned one before any
request exists; from then on every request uses a context that trusts exactly
that certificate. It then logs in: a nonce from ``/v1/challenge``, signed with
the node key over the relay's fingerprint, the pool and the nonce, presented
with the membership proof to ``/v1/session``. A request answered 401 (the
session expired, or the relay restarted) logs in again once and is retried;
concurrent requests share one re-login. The login's answer also tells the relay's
limits (``_check_size`` refuses locally what it would refuse) and its blob TTL.

Requests go through httpx (``_send``, ``_json``); blob downloads through TLS
connections of the session's own (``_ask``: same pin, same CONNECT proxy), up to
``SPARES`` of them kept idle for the next GET. Large upload bodies go out in
``UPLOAD_PIECE`` pieces under their Content-Length.

Errors are translated here, at the boundary: no httpx or ssl exception leaves a
request, only ``NetError`` subclasses, chosen by the answer's status and carrying its
error code (``ttpeer_wire.read_error``); its words are only shown. The routes built on
the session are ``RelayClient``'s (``_relay_client.py``).
"""

from __future__ import annotations

import json
import math
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, NoReturn, Self

import httpx
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_wire import (
    CHALLENGE,
    SESSION,
    ErrorCode,
    error_records,
    fingerprint,
    login_message,
    public_hex,
    read_error,
)

from ._download import Answer
from ._errors import (
    BlobMissing,
    RelayFingerprintMismatch,
    RelayLimit,
    RelayRejected,
    RelayUnavailable,
)
from ._tls import fetch_certificate, host_port, open_tcp, pinned_ssl_context

# JSON answers are read raw up to this many bytes, and a Content-Encoding is refused: a
# relay cannot exhaust a peer's memory with a huge or gzip-bombed answer. The largest
# real one, a recv answer, is about 11 MiB (8 MiB of messages in base64).
MAX_ANSWER_BYTES = 64 * 2**20
MAX_RETRY_AFTER = 3600.0
MAX_ERROR_BYTES = 65536  # an error answer says little: read this much of it at most
# An upload goes out in pieces of this size: TLS encrypts one while the relay reads the
# last (given whole, 128 MiB would be encrypted into memory before a byte left).
UPLOAD_PIECE = 2**20
# Idle blob connections kept for the next GETs: an aggregator fetches its slice of every
# contribution at once (``daemon.Blobs.deltas``), and a new TLS connection costs two round
# trips more than a kept one (at 50 ms, 0.1 s a request).
SPARES = 8


def cert_rejected(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception that led to it, is a failed certificate check."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait, from a Retry-After in seconds; None if absent or not a sane number."""
    try:
        seconds = float(headers["retry-after"])
    except (KeyError, ValueError):
        return None
    return min(seconds, MAX_RETRY_AFTER) if math.isfinite(seconds) and seconds >= 0 else None


class RelaySession:
    """The session under a ``RelayClient`` (which adds the routes): ``connect`` pins and
    logs in, ``aclose`` closes every connection.

    ``bytes_sent`` and ``bytes_received`` count request and response bodies; ``blob_ttl``
    is the relay's blob TTL in seconds as its session answer said (None before a login,
    or from a relay that does not say).
    """

    def __init__(self, url: str, fingerprint: str, *, pool: str, peer_key: Ed25519PrivateKey,
                 proof: list[bytes], proxy: str | None = None, timeout: float = 30.0) -> None:
        host_port(url)  # a malformed URL or proxy is a configuration error: ValueError now
        if proxy is not None and not proxy.startswith("http://"):
            raise ValueError(f"proxy must be an http://HOST:PORT CONNECT proxy, not {proxy!r}")
        self.url = url.rstrip("/")
        self.fingerprint = fingerprint.lower()
        self.pool = pool
        self.peer = public_hex(peer_key)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._key = peer_key
        self._proof = list(proof)
        self._proxy = proxy
        self._timeout = timeout
        self._http: httpx.AsyncClient | None = None
        self._blob_context: ssl.SSLContext | None = None  # pinned, for the blob GETs' connections (_ask)
        self._spares: list[trio.SSLStream] = []  # idle ones of them, at most SPARES
        self._session = ""
        self._generation = 0  # bumped by every login
        self._login_lock = trio.Lock()
        self._limits: dict[str, int] = {}  # the relay's caps, learnt at login
        self.blob_ttl: float | None = None

    def _check_size(self, data: bytes, limit: str, *, size: int | None = None) -> None:
        """Refuse locally what the relay would refuse: it cannot answer a large body
        cleanly before the whole body has been sent."""
        cap = self._limits.get(limit)
        size = len(data) if size is None else size
        if cap is not None and size > cap:
            raise RelayLimit(self.url, 413, f"{size} bytes is over the relay's {cap}-byte "
                             "cap", None, code=ErrorCode.TOO_LARGE)

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- connection -----------------------------------------------------------------

    async def connect(self) -> None:
        """Pin the relay's certificate, then log in.

        Raises ``RelayFingerprintMismatch`` (before any request is sent),
        ``RelayRejected`` (proof or signature refused), ``RelayUnavailable``.
        """
        der = await fetch_certificate(self.url, proxy=self._proxy, timeout=self._timeout)
        got = fingerprint(der)
        if got != self.fingerprint:
            raise RelayFingerprintMismatch(self.url, self.fingerprint, got)
        if self._http is not None:
            await self._http.aclose()
        await self._drop_spare()
        self._http = httpx.AsyncClient(
            base_url=self.url,
            verify=pinned_ssl_context(der),
            proxy=self._proxy,
            timeout=httpx.Timeout(self._timeout),
            trust_env=False,  # the proxy is configuration, passed in; not read here
            follow_redirects=False,
            headers={"accept-encoding": "identity"},  # answers are read raw; see _json
        )
        self._blob_context = pinned_ssl_context(der)
        self._blob_context.set_alpn_protocols(["http/1.1"])
        await self._login(self._generation)

    async def aclose(self) -> None:
        self._blob_context = None
        await self._drop_spare()
        if self._http is not None:
            http, self._http = self._http, None
            with trio.CancelScope(shield=True):
                await http.aclose()

    async def _login(self, seen_generation: int) -> None:
        async with self._login_lock:
            if self._generation != seen_generation:
                return  # another task logged in while we waited
            answer = await self._json("POST", CHALLENGE, auth=False,
                                      json={"pool": self.pool, "peer": self.peer})
            nonce = self._field(answer, "nonce", str)
            sig = self._key.sign(login_message(self.fingerprint, self.pool, nonce)).hex()
            answer = await self._json("POST", SESSION, auth=False, json={
                "pool": self.pool, "peer": self.peer, "nonce": nonce, "sig": sig,
                "proof": [record.hex() for record in self._proof],
            })
            self._session = self._field(answer, "session", str)
            limits = answer.get("limits")
            if isinstance(limits, dict):
                self._limits = {k: int(v) for k, v in limits.items()
                                if isinstance(v, int | float) and not isinstance(v, bool)
                                and math.isfinite(v) and v >= 1}
            ttl = answer.get("blob_ttl")
            self.blob_ttl = (float(ttl) if isinstance(ttl, int | float) and not isinstance(ttl, bool)
                             and math.isfinite(ttl) and ttl > 0 else None)
            self._generation += 1

    # -- requests -------------------------------------------------------------------

    async def _send(
        self, method: str, path: str, *, auth: bool, stream: bool = False,
        blob: str | None = None, read_timeout: float | None = None, upload: bytes | Path | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send one request (logging in again once on 401); a 2xx response or a NetError.
        ``upload`` is a large body (bytes, or a file read as it goes), sent in pieces with
        its Content-Length."""
        if self._http is None:
            raise RelayUnavailable(self.url, "not connected; call connect() first")
        for attempt in (1, 2):
            generation = self._generation
            headers = dict(kwargs.pop("headers", {}))
            if auth:
                headers["authorization"] = f"Bearer {self._session}"
            timeout = httpx.Timeout(self._timeout, read=read_timeout or self._timeout)
            upload_size = 0
            if upload is not None:  # a fresh iterator each attempt: a 401 sends it again
                upload_size = upload.stat().st_size if isinstance(upload, Path) else len(upload)
                headers["content-length"] = str(upload_size)
                kwargs["content"] = _file_pieces(upload) if isinstance(upload, Path) else _pieces(upload)
            request = self._http.build_request(method, path, headers=headers, timeout=timeout,
                                               **kwargs)
            kwargs["headers"] = headers
            # Other bodies are bytes, read at build time.
            self.bytes_sent += upload_size if upload is not None else len(request.content)
            response = await self._transmit(request, stream)
            if response.status_code == 401 and auth and attempt == 1:
                await response.aclose()
                await self._login(generation)
                continue
            if response.status_code < 300:
                return response
            await self._raise_for(response, blob)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _transmit(self, request: httpx.Request, stream: bool) -> httpx.Response:
        if self._http is None:
            raise RelayUnavailable(self.url, "the client was closed")
        try:
            response = await self._http.send(request, stream=stream)
            if not stream:
                self.bytes_received += len(response.content)
            return response
        except httpx.TimeoutException:
            raise RelayUnavailable(self.url, "timed out") from None
        except httpx.HTTPError as exc:
            if cert_rejected(exc):
                await self._certificate_changed()
            raise RelayUnavailable(self.url, f"{type(exc).__name__}: {exc}") from None

    async def _certificate_changed(self) -> None:
        """The pinned handshake failed: report which certificate the server shows now."""
        got = fingerprint(await fetch_certificate(self.url, proxy=self._proxy,
                                                  timeout=self._timeout))
        if got != self.fingerprint:
            raise RelayFingerprintMismatch(self.url, self.fingerprint, got)
        # Same certificate, yet it no longer verifies: it has expired (a --cert one).
        raise RelayUnavailable(self.url, "its pinned certificate no longer verifies (expired?)")

    async def _raise_for(self, response: httpx.Response, blob: str | None) -> NoReturn:
        raw = bytearray()
        try:
            async for chunk in response.aiter_raw():
                raw += chunk
                if len(raw) > MAX_ERROR_BYTES:
                    break
            code, message = read_error(bytes(raw))
        except httpx.HTTPError:
            code, message = None, "(the answer broke off)"
        finally:
            await response.aclose()
        if response.status_code == 403 and code == ErrorCode.TOKEN_USED:  # with its proof
            raise RelayRejected(self.url, 403, message, code=code, records=tuple(error_records(bytes(raw))))
        self._raise_status(response.status_code, code, message, response.headers, blob)

    def _raise_status(self, status: int, code: str | None, message: str, headers: Mapping[str, str],
                      blob: str | None) -> NoReturn:
        """The error for an answer: its class by the status, with the answer's code."""
        if status in (413, 429, 507):
            raise RelayLimit(self.url, status, message, _retry_after(headers), code=code)
        if status in (404, 416) and blob is not None:
            raise BlobMissing(blob)
        if 400 <= status < 500:
            raise RelayRejected(self.url, status, message, code=code)
        raise RelayUnavailable(self.url, f"HTTP {status}: {message}", code=code)

    async def _json(self, method: str, path: str, *, auth: bool = True, **kwargs: Any) -> Any:
        response = await self._send(method, path, auth=auth, stream=True, **kwargs)
        body = bytearray()
        try:
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):  # undoing it could inflate without bound
                raise RelayUnavailable(self.url, f"{path} answered with content-encoding {encoding[:20]!r}; "
                                       "the relay never compresses")
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise RelayUnavailable(self.url, f"{path} answered over {MAX_ANSWER_BYTES} bytes")
        except httpx.HTTPError as exc:
            raise RelayUnavailable(self.url, f"{path} answer broke off: {type(exc).__name__}") from None
        finally:
            self.bytes_received += len(body)
            await response.aclose()
        try:
            return json.loads(body)
        except ValueError:
            raise RelayUnavailable(self.url, f"{path} answered something other than JSON") from None

    def _field(self, answer: Any, name: str, kind: type) -> Any:
        value = answer.get(name) if isinstance(answer, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise RelayUnavailable(self.url, f"malformed answer: no valid {name!r}")
        return value

    async def _ask(self, host: str, port: int, request: bytes, idle: trio.CancelScope) -> Answer:
        """Send ``request`` on a spare connection, or on a new one if there is none or
        the spare turns out closed (nothing at all came back: the relay dropped it idle)."""
        tls = self._spares.pop() if self._spares else None
        if tls is not None:
            answer = Answer(tls, idle, self._timeout)
            try:
                await tls.send_all(request)
                await answer.read_head()
                return answer
            except (OSError, EOFError, trio.BrokenResourceError):
                await trio.aclose_forcefully(tls)
                if answer.started:
                    raise
            except BaseException:
                await trio.aclose_forcefully(tls)
                raise
        if self._blob_context is None:
            raise RelayUnavailable(self.url, "the client was closed")
        tls = trio.SSLStream(await open_tcp(host, port, self._proxy), self._blob_context,
                             server_hostname=host, https_compatible=True)
        answer = Answer(tls, idle, self._timeout)
        try:
            await tls.send_all(request)
            await answer.read_head()
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
        return answer

    async def _keep_or_close(self, answer: Answer) -> None:
        """Keep the answer's connection as a spare if it can carry another GET."""
        if answer.reusable and len(self._spares) < SPARES and self._blob_context is not None:
            self._spares.append(answer.stream)
        else:
            await trio.aclose_forcefully(answer.stream)

    async def _drop_spare(self) -> None:
        spares, self._spares = self._spares, []
        for spare in spares:
            await trio.aclose_forcefully(spare)


async def _file_pieces(path: Path) -> AsyncIterator[bytes]:
    """The file at ``path`` in ``UPLOAD_PIECE`` reads, one in memory at a time."""
    async with await trio.open_file(path, "rb") as f:
        while piece := await f.read(UPLOAD_PIECE):
            yield piece


async def _pieces(data: bytes) -> AsyncIterator[memoryview]:
    """``data`` in ``UPLOAD_PIECE`` slices, without copying it (views, which httpx sends
    as they are)."""
    view = memoryview(data)
    for start in range(0, len(view), UPLOAD_PIECE):
        yield view[start:start + UPLOAD_PIECE]
