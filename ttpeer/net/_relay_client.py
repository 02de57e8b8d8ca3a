"""``RelayClient``: the ``Transport`` over HTTPS to a ttpeer relay.

Each method is one route of the relay's API (``ttpeer_wire``'s paths) on a
``RelaySession`` (``_session.py``: the pin, the login, the requests and their errors):
messages (send, broadcast, the long-polled receive, revocations, admissions, the
roster) and blobs (put, touch, get, a range).

Blob downloads skip httpx: each is one GET on a TLS connection of the session's own,
opened the same way (the pinned certificate, the CONNECT proxy if configured), read
by ``_download`` and kept as a spare for the next download; httpx's per-record
overhead had made it the download's limit. A download that breaks off resumes with a
Range request, and a whole blob is checked against its name (its sha256).

Like the session, no httpx, ssl or trio exception leaves this module, only ``NetError``
subclasses (and ``OSError`` for a local file, ``ValueError`` for a bad argument).
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from urllib.parse import urlsplit

import trio
from ttpeer_wire import (
    ADMIT,
    BROADCAST,
    RECV,
    REVOKE,
    ROSTER,
    TOUCH,
    blob_path,
    read_error,
    send_path,
)

from ._download import Answer, Body, FileBody, Malformed, request_head
from ._errors import BlobCorrupt, BlobMissing, RelayUnavailable
from ._session import MAX_ERROR_BYTES, UPLOAD_PIECE, RelaySession, cert_rejected
from ._tls import host_port
from ._transport import Message, check_blob_name, check_range, check_touch

_FETCH_ATTEMPTS = 3  # a blob download resumes (Range) after a broken connection
# A larger blob is PUT only after a HEAD found it missing. A smaller one (a delta) is
# PUT straight away: sending it twice costs less than a round trip on every upload
# (at 20 Mbit/s, 256 KiB take 100 ms); the relay drains a body it already has.
ASK_FIRST_BYTES = 256 * 1024


class RelayClient(RelaySession):
    """One peer's connection to one relay. Use ``async with`` or ``connect``/``aclose``.

    The constructor raises ``ValueError`` for a malformed URL or proxy; every
    method after that raises only ``NetError`` subclasses.

    ``bytes_sent`` and ``bytes_received`` count request and response bodies; ``blob_ttl``
    is the relay's blob TTL in seconds as its session answer said (None before a login,
    or from a relay that does not say).
    """

    async def send(self, peer: str, data: bytes) -> None:
        """Queue ``data`` for ``peer``. Raises ``RelayLimit`` (over 256 KiB, mailbox full)."""
        self._check_size(data, "max_message_bytes")
        await self._json("POST", send_path(peer), content=data)

    async def broadcast(self, data: bytes) -> int:
        self._check_size(data, "max_message_bytes")
        answer = await self._json("POST", BROADCAST, content=data)
        return int(self._field(answer, "delivered", int))

    async def recv(self, after: int, wait: float) -> tuple[list[Message], int]:
        answer = await self._json("GET", RECV, params={"after": after, "wait": wait},
                                  read_timeout=wait + self._timeout)
        try:
            messages = [
                Message(int(m["seq"]), str(m["from"]), base64.b64decode(m["data"], validate=True))
                for m in answer["messages"]
            ]
            return messages, int(answer["cursor"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise RelayUnavailable(self.url, "malformed recv answer") from None

    async def revoke(self, record: bytes) -> None:
        """Hand the relay a root-signed revocation. Raises ``RelayRejected``."""
        await self._json("POST", REVOKE, content=record)

    async def admit(self, record: bytes) -> None:
        """Hand the relay a root-signed acknowledgement of a join. Raises ``RelayRejected``."""
        await self._json("POST", ADMIT, content=record)

    async def roster(self) -> list[list[bytes]]:
        answer = await self._json("GET", ROSTER)
        try:
            return [[bytes.fromhex(r) for r in proof] for proof in answer["proofs"]]
        except (KeyError, TypeError, ValueError):
            raise RelayUnavailable(self.url, "malformed roster answer") from None

    async def has_blob(self, blob: str) -> bool:
        check_blob_name(blob)
        try:
            response = await self._send("HEAD", blob_path(blob), auth=True, blob=blob, stream=True)
        except BlobMissing:
            return False
        await response.aclose()
        return True

    async def touch_blobs(self, blobs: list[str]) -> list[str]:
        """Restart the relay's TTL of ``blobs`` (at most ``TOUCH_MAX_BLOBS``); returns those
        it does not hold, in order. Raises ``ValueError`` for a bad name or too many,
        ``RelayRejected`` with code ``not_found`` from a relay older than the route."""
        check_touch(blobs)
        answer = await self._json("POST", TOUCH, json={"blobs": blobs})
        missing = answer.get("missing") if isinstance(answer, dict) else None
        asked = set(blobs)
        if not isinstance(missing, list) or not all(isinstance(b, str) and b in asked for b in missing):
            raise RelayUnavailable(self.url, "malformed touch answer")
        return missing

    async def put_blob(self, data: bytes) -> str:
        blob = hashlib.sha256(data).hexdigest()
        self._check_size(data, "max_blob_bytes")
        if len(data) <= ASK_FIRST_BYTES or not await self.has_blob(blob):
            response = await self._send("PUT", blob_path(blob), auth=True, upload=data, stream=True)
            await response.aclose()  # its small JSON answer says nothing a peer needs
        return blob

    async def put_blob_file(self, path: Path) -> str:
        """``put_blob`` of a file's bytes, read from the file as they go out (hashed first,
        in a thread): a model-sized blob is never in memory. Raises ``OSError`` too."""
        blob = await trio.to_thread.run_sync(_file_sha256, path)
        size = path.stat().st_size
        self._check_size(b"", "max_blob_bytes", size=size)
        if size <= ASK_FIRST_BYTES or not await self.has_blob(blob):
            response = await self._send("PUT", f"/v1/blob/{blob}", auth=True, upload=path, stream=True)
            await response.aclose()
        return blob

    async def get_blob_file(self, blob: str, path: Path, *, max_size: int) -> None:
        """``get_blob`` into the file ``path`` (created or replaced), chunk by chunk as it
        arrives; the file is removed if the download fails. Raises as ``get_blob`` does,
        and ``OSError``."""
        try:
            with open(path, "wb") as file:
                await self._get_into(FileBody(file), blob, max_size)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    async def get_blob(self, blob: str, *, max_size: int) -> bytes:
        """Fetch ``blob``, resuming with Range after a broken connection.

        Raises ``BlobMissing``, ``BlobCorrupt`` (wrong hash, larger than
        ``max_size``), ``RelayUnavailable``.
        """
        body = Body()
        await self._get_into(body, blob, max_size)
        return b"".join(body.parts)

    async def get_blob_range(self, blob: str, start: int, stop: int) -> bytes:
        """Bytes ``start`` .. ``stop``-1 of ``blob``: one Range request, resumed after a broken
        connection. Not hash-checked (a range cannot be): the caller authenticates it
        (``open_cut``). Raises ``BlobMissing``, ``BlobCorrupt`` (the relay answered other
        bytes than asked), ``RelayUnavailable``, ValueError for an empty range."""
        check_blob_name(blob)
        check_range(start, stop)
        body = Body()
        for attempt in range(1, _FETCH_ATTEMPTS + 1):
            before = body.size
            try:
                await self._fetch_into(body, blob, stop - start, span=(start, stop))
                break
            except RelayUnavailable:
                if attempt == _FETCH_ATTEMPTS or body.size == before:
                    raise
        if body.size != stop - start:
            raise BlobCorrupt(blob, f"the relay sent {body.size} bytes for a {stop - start}-byte range")
        return b"".join(body.parts)

    async def _get_into(self, body: Body, blob: str, max_size: int) -> None:
        check_blob_name(blob)
        for attempt in range(1, _FETCH_ATTEMPTS + 1):
            before = body.size
            try:
                await self._fetch_into(body, blob, max_size)
                break
            except RelayUnavailable:
                if attempt == _FETCH_ATTEMPTS or body.size == before:
                    raise
        if body.sha256.hexdigest() != blob:
            raise BlobCorrupt(blob, "its bytes do not hash to its name")

    async def _fetch_into(self, body: Body, blob: str, max_size: int, span: tuple[int, int] | None = None) -> None:
        """Append the rest of ``blob`` to ``body`` (all of it if the relay ignores the
        Range), or of its bytes ``span``: one GET, on the spare blob connection or a new
        one, logging in again once on 401."""
        host, port = host_port(self.url)
        target = urlsplit(self.url).path + blob_path(blob)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        for attempt in (1, 2):
            if self._blob_context is None:
                raise RelayUnavailable(self.url, "not connected; call connect() first")
            headers = {"authorization": f"Bearer {self._session}"}
            if span is not None:
                headers["range"] = f"bytes={span[0] + body.size}-{span[1] - 1}"
            elif body.size:
                headers["range"] = f"bytes={body.size}-"
            generation, error = self._generation, Body()
            request = request_head(target, authority, headers)
            with trio.CancelScope(deadline=trio.current_time() + self._timeout) as idle:
                try:
                    answer = await self._ask(host, port, request, idle)
                    try:
                        if answer.status >= 300:
                            await answer.read_into(error, MAX_ERROR_BYTES)
                        else:
                            await self._read_blob(answer, body, blob, max_size, ranged=span is not None)
                    finally:
                        await self._keep_or_close(answer)
                    if answer.status < 300:
                        return
                except (OSError, EOFError, Malformed, trio.BrokenResourceError) as exc:
                    if cert_rejected(exc):
                        await self._certificate_changed()
                    raise RelayUnavailable(self.url, f"download broke: {type(exc).__name__}: {exc}") from None
            if idle.cancelled_caught:
                raise RelayUnavailable(self.url, f"download timed out (nothing for {self._timeout:g} s)")
            if answer.status == 401 and attempt == 1:
                await self._login(generation)
                continue
            self._raise_status(answer.status, *read_error(b"".join(error.parts)), answer.headers, blob)

    async def _read_blob(self, answer: Answer, body: Body, blob: str, max_size: int, *, ranged: bool = False) -> None:
        if answer.status != 206:
            if ranged:
                raise BlobCorrupt(blob, "the relay answered a range request with the whole blob")
            body.clear()  # a full answer: start over
        if body.size + answer.length > max_size:  # refused before its body is read
            raise BlobCorrupt(blob, f"it is {body.size + answer.length} bytes, over {max_size}")
        start = body.size
        try:
            await answer.read_into(body)
        finally:
            self.bytes_received += body.size - start


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(UPLOAD_PIECE):
            digest.update(piece)
    return digest.hexdigest()
