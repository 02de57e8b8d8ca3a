"""The relay's HTTP API as an ASGI app: routing, admission, limits.

Every path lives under ``/v1``; every error is ``{"error": "...", "code": "..."}``,
the words for people and the code for clients (``ttpeer_wire``'s table). A request
is matched to a route, charged to a rate-limit bucket (the peer's when it holds
a session, else the client IP's), authenticated when the route needs it, and
handed to one short handler. The routes (``self._routes``; paths from ``ttpeer_wire``):

    GET  /v1/health                  no session
    POST /v1/challenge, /v1/session  log in (a nonce, then the signed proof): no session yet
    GET  /v1/roster, POST /v1/revoke the pool's admitted proofs; a root-signed revocation
    POST /v1/admit                   a root-signed acknowledgement of a join (``auth.Rosters``)
    POST /v1/send/<peer>, /v1/broadcast, GET /v1/recv   mailboxes
    PUT, GET, HEAD /v1/blob/<sha256> blobs, with their TTL and the pool's quota
    POST /v1/touch                   restart the TTL of the blobs named (a lease peers renew)

Status codes:

- 400 malformed request, 401 unknown/expired nonce or ``session expired``,
  403 bad membership proof or signature, 404 unknown route or blob, 405 method,
  408 request body arriving too slowly, 413 body over a cap, 416 range past the end of a blob,
- 429 rate limited (with Retry-After),
- 507 storage full: a mailbox or the relay's mailbox memory (with Retry-After,
  since the recipient draining it frees room), the pool's blob quota, the relay's
  disk or a full roster (without: waiting alone will not help).
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from ttpeer_wire import (
    ADMIT,
    BLOB,
    BROADCAST,
    CHALLENGE,
    HEALTH,
    MAX_RECORD_BYTES,
    MAX_WAIT,
    RECV,
    RECV_MAX_BYTES,
    RECV_MAX_COUNT,
    REVOKE,
    ROSTER,
    SEND,
    SESSION,
    TOUCH,
    TOUCH_MAX_BLOBS,
    ErrorCode,
    ProofError,
    login_message,
    parse,
    token_used_message,
    verify_proof,
)

from . import asgi
from .asgi import FileResponse, HttpError, Request, Response, json_response
from .auth import Nonces, RosterFull, Rosters, Session, Sessions, signature_ok
from .blobs import BlobError, BlobStore
from .config import RelayConfig
from .mailbox import Mailboxes, MailboxFull
from .ratelimit import RateLimiter

log = logging.getLogger(__name__)

MAILBOX_IDLE = 600.0  # forget empty mailboxes untouched this long
MAINTAIN_EVERY = 60.0
DRAIN_LIMIT = 2**20  # HTTP/1: read and drop refused bodies up to this size, then answer
DISCARD_TIMEOUT = 30.0  # HTTP/1: longest wait for a refused body while the answer goes out

_POOL = re.compile(r"^[0-9a-f]{32}$")
_PEER = re.compile(r"^[0-9a-f]{64}$")
_NONCE = _PEER
_SIG = re.compile(r"^[0-9a-f]{128}$")
_HEXBYTES = re.compile(r"^(?:[0-9a-f]{2})+$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_BLOB = re.compile(r"[0-9a-f]{64}")


def _path(path: str, rest: str = "") -> re.Pattern[str]:
    """A route's pattern: one of ``ttpeer_wire``'s paths, then ``rest`` (a regex)."""
    return re.compile(re.escape(path) + rest)


Handler = Callable[[Request, dict[str, str], Session | None], Awaitable[Response | FileResponse]]


def _field(body: dict[str, Any], name: str, pattern: re.Pattern[str]) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not pattern.match(value):
        raise HttpError(400, ErrorCode.BAD_REQUEST, f"field {name!r} is missing or malformed")
    return value


def _member(session: Session | None) -> Session:
    """The caller's session; ``_dispatch`` has already refused requests without one."""
    if session is None:
        raise HttpError(401, ErrorCode.SESSION_EXPIRED, "session expired")
    return session


class RelayApp:
    def __init__(self, config: RelayConfig, fingerprint: str) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.requests_seen = 0  # HTTP requests received, for tests and status
        pools = config.data / "pools"
        self.nonces = Nonces()
        self.sessions = Sessions(ttl=config.session_ttl)
        self.rosters = Rosters(pools, max_peers=config.max_peers_per_pool)
        self.mailboxes = Mailboxes(
            max_messages=config.mailbox_messages,
            max_bytes=config.mailbox_bytes,
            max_total_bytes=config.mailbox_total_bytes,
        )
        self.blobs = BlobStore(
            pools, max_blob_bytes=config.max_blob_bytes, ttl=config.blob_ttl,
            quota=config.pool_quota,
        )
        self.limiter = RateLimiter(config.rate, config.burst)
        # path pattern -> {method: (handler, needs a session)}
        self._routes: list[tuple[re.Pattern[str], dict[str, tuple[Handler, bool]]]] = [
            (_path(HEALTH), {"GET": (self.health, False)}),
            (_path(CHALLENGE), {"POST": (self.challenge, False)}),
            (_path(SESSION), {"POST": (self.session, False)}),
            (_path(ROSTER), {"GET": (self.roster, True)}),
            (_path(REVOKE), {"POST": (self.revoke, True)}),
            (_path(ADMIT), {"POST": (self.admit, True)}),
            (_path(SEND, "(?P<peer>[0-9a-f]{64})"), {"POST": (self.send, True)}),
            (_path(BROADCAST), {"POST": (self.broadcast, True)}),
            (_path(RECV), {"GET": (self.recv, True)}),
            (_path(BLOB, "(?P<blob>[0-9a-f]{64})"), {"PUT": (self.put_blob, True), "GET": (self.get_blob, True),
                                                     "HEAD": (self.get_blob, True)}),
            (_path(TOUCH), {"POST": (self.touch, True)}),
        ]

    def load(self) -> None:
        """Read saved rosters and the blob index from disk (blocking; call once at start)."""
        self.rosters.load()
        self.blobs.load()

    def close(self) -> None:
        """Answer every long-poll now: the relay is shutting down."""
        self.mailboxes.close()

    async def maintain(self) -> None:
        """Expire blobs and forget idle empty mailboxes, forever."""
        while True:
            await trio.sleep(min(MAINTAIN_EVERY, self.config.blob_ttl / 4))
            self.mailboxes.collect(trio.current_time(), MAILBOX_IDLE)
            removed = await self.blobs.sweep(time.time())
            if removed:
                log.info("expired %d blobs", removed)

    # -- ASGI entry -----------------------------------------------------------------

    async def __call__(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        self.requests_seen += 1
        request = Request.from_scope(scope, receive)
        request.min_rate, request.grace = self.config.min_body_rate, self.config.body_grace
        response: Response | FileResponse
        try:
            response = await self._dispatch(request)
        except HttpError as error:
            response = asgi.error_response(error)
        except asgi.Disconnected:
            return
        except Exception:  # a bug: answer it like one, and keep serving everyone else
            log.exception("failed on %s %s", request.method, request.path)
            response = asgi.error_response(HttpError(500, ErrorCode.INTERNAL, "internal relay error"))
        try:
            await self._answer(request, response, send)
        except asgi.Disconnected:
            return

    async def _answer(self, request: Request, response: Response | FileResponse,
                      send: asgi.Send) -> None:
        """Send ``response``, settling whatever is left of the request body first.

        HTTP/2: read the body to its end before answering, because hypercorn 0.18
        fails the whole server on DATA for a stream it has already answered.
        HTTP/1: drop a small rest; for a large one answer at once with
        ``connection: close``, while swallowing body chunks so hypercorn's queue
        never blocks the answer.
        """
        if request.body_done or (request.method in ("GET", "HEAD") and request.is_http1):
            await asgi.send_response(send, response)
        elif not request.is_http1:
            await request.discard_rest(timeout=None)
            await asgi.send_response(send, response)
        else:
            response.headers += await request.finish(DRAIN_LIMIT)
            async with trio.open_nursery() as nursery:
                if not request.body_done:
                    nursery.start_soon(partial(request.discard_rest, timeout=DISCARD_TIMEOUT))
                await asgi.send_response(send, response)

    async def _dispatch(self, request: Request) -> Response | FileResponse:
        for pattern, methods in self._routes:
            match = pattern.fullmatch(request.path)
            if match is None:
                continue
            if request.method not in methods:
                raise HttpError(405, ErrorCode.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.path}")
            handler, needs_session = methods[request.method]
            now = trio.current_time()
            session = None
            if needs_session:
                token = request.headers.get("authorization", "").removeprefix("Bearer ")
                session = self.sessions.get(token, now)
            key = ("peer", session.pool, session.peer) if session else ("ip", request.client)
            wait = self.limiter.check(key, now)
            if wait is not None:
                raise HttpError(429, ErrorCode.RATE_LIMITED, "too many requests; slow down", retry_after=wait)
            if needs_session and session is None:
                raise HttpError(401, ErrorCode.SESSION_EXPIRED, "session expired")
            if session is not None and self.rosters.is_revoked(session.pool, session.peer):
                raise HttpError(403, ErrorCode.REVOKED, "this peer was revoked from the pool")
            return await handler(request, match.groupdict(), session)
        raise HttpError(404, ErrorCode.NOT_FOUND, f"no such endpoint: {request.path}")

    # -- admission ------------------------------------------------------------------

    async def health(self, request: Request, _: dict[str, str], __: Session | None) -> Response:
        return json_response(200, {"ok": True})

    async def challenge(self, request: Request, _: dict[str, str], __: Session | None) -> Response:
        body = await request.json(self.config.max_json_bytes)
        pool, peer = _field(body, "pool", _POOL), _field(body, "peer", _PEER)
        return json_response(200, {"nonce": self.nonces.issue(pool, peer, trio.current_time())})

    async def session(self, request: Request, _: dict[str, str], __: Session | None) -> Response:
        body = await request.json(self.config.max_json_bytes)
        pool, peer = _field(body, "pool", _POOL), _field(body, "peer", _PEER)
        nonce, sig = _field(body, "nonce", _NONCE), _field(body, "sig", _SIG)
        proof_hex = body.get("proof")
        if not (isinstance(proof_hex, list) and len(proof_hex) == 2
                and all(isinstance(p, str) and _HEXBYTES.match(p) for p in proof_hex)):
            raise HttpError(400, ErrorCode.BAD_REQUEST, "field 'proof' must be [invite_hex, join_hex]")
        now = trio.current_time()
        if not self.nonces.take(nonce, pool, peer, now):
            raise HttpError(401, ErrorCode.BAD_NONCE, "unknown or expired nonce; ask for a new challenge")
        proof = [bytes.fromhex(p) for p in proof_hex]
        if self.rosters.is_revoked(pool, peer):
            raise HttpError(403, ErrorCode.REVOKED, "this peer was revoked from the pool")
        try:
            verify_proof(pool, peer, proof)
        except ProofError as exc:
            raise HttpError(403, ErrorCode.BAD_PROOF, f"bad membership proof: {exc}") from None
        used = self.rosters.used_by(pool, parse(proof[0]), parse(proof[1]).id)
        if used is not None:  # with the acknowledgements that prove it
            raise HttpError(403, ErrorCode.TOKEN_USED, token_used_message(used),
                            records=self.rosters.acknowledgements(pool, parse(proof[0]).id))
        if not signature_ok(peer, sig, login_message(self.fingerprint, pool, nonce)):
            raise HttpError(
                403, ErrorCode.BAD_SIGNATURE, "bad signature: not signed by the peer's key for this relay's certificate"
            )
        try:
            if self.rosters.admit(pool, peer, proof):
                await self.rosters.save(pool)
        except RosterFull as exc:
            raise HttpError(507, ErrorCode.ROSTER_FULL, str(exc)) from None
        token = self.sessions.open(pool, peer, now)
        limits = {"max_message_bytes": self.config.max_message_bytes,
                  "max_blob_bytes": self.config.max_blob_bytes, "max_wait": MAX_WAIT}
        return json_response(200, {"session": token, "expires": self.sessions.ttl,
                                   "limits": limits, "blob_ttl": self.config.blob_ttl})

    async def revoke(self, request: Request, _: dict[str, str], s: Session | None) -> Response:
        """A root-signed revocation (raw record bytes): refuse that peer from now on."""
        pool, peer = await self._root_record(request, s, self.rosters.revoke, ErrorCode.BAD_REVOCATION, "revocation")
        log.info("pool %s: revoked peer %s", pool[:12], peer[:12])
        return json_response(200, {"revoked": peer})

    async def admit(self, request: Request, _: dict[str, str], s: Session | None) -> Response:
        """A root-signed acknowledgement of a join (raw record bytes): once its invite's uses
        are all acknowledged, other joins of it are refused at login."""
        _pool, rec = await self._root_record(request, s, self.rosters.acknowledge, ErrorCode.BAD_ADMIT,
                                             "acknowledgement")
        return json_response(200, {"admitted": rec["node"]})

    async def _root_record(self, request: Request, s: Session | None, take: Callable[[str, bytes], Any],
                           bad: ErrorCode, what: str) -> tuple[str, Any]:
        """A member hands the relay a root-signed record it enforces: ``take`` (the rosters')
        checks and keeps it; the roster is saved. Returns the pool and what ``take`` did."""
        s = _member(s)
        body = await request.body(MAX_RECORD_BYTES)
        try:
            got = take(s.pool, body)
        except ProofError as exc:
            raise HttpError(403, bad, f"bad {what}: {exc}") from None
        except RosterFull as exc:
            raise HttpError(507, ErrorCode.ROSTER_FULL, str(exc)) from None
        await self.rosters.save(s.pool)
        return s.pool, got

    async def roster(self, request: Request, _: dict[str, str], s: Session | None) -> Response:
        s = _member(s)
        proofs = [[r.hex() for r in proof] for proof in self.rosters.proofs(s.pool)]
        return json_response(200, {"proofs": proofs})

    # -- mailboxes ------------------------------------------------------------------

    def _put(self, s: Session, peer: str, data: bytes) -> int:
        try:
            return self.mailboxes.put(s.pool, peer, s.peer, data, trio.current_time())
        except MailboxFull as exc:
            raise HttpError(507, ErrorCode.MAILBOX_FULL, str(exc), retry_after=exc.retry_after) from None

    async def send(self, request: Request, params: dict[str, str], s: Session | None) -> Response:
        s = _member(s)
        data = await request.body(self.config.max_message_bytes)
        return json_response(200, {"seq": self._put(s, params["peer"], data)})

    async def broadcast(self, request: Request, _: dict[str, str], s: Session | None) -> Response:
        s = _member(s)
        data = await request.body(self.config.max_message_bytes)
        delivered, full = 0, []
        for peer in self.rosters.peers(s.pool):
            if peer == s.peer:
                continue
            try:
                self._put(s, peer, data)
                delivered += 1
            except HttpError:
                full.append(peer)
        return json_response(200, {"delivered": delivered, "full": full})

    async def recv(self, request: Request, _: dict[str, str], s: Session | None) -> Response:
        s = _member(s)
        try:
            after = int(request.query.get("after", "0"))
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            raise HttpError(400, ErrorCode.BAD_REQUEST, "after must be an integer and wait a number") from None
        if after < 0 or not 0 <= wait < float("inf"):
            raise HttpError(400, ErrorCode.BAD_REQUEST, "after and wait must not be negative")
        messages = await self.mailboxes.receive(
            s.pool, s.peer, after, min(wait, MAX_WAIT),
            max_count=RECV_MAX_COUNT, max_bytes=RECV_MAX_BYTES,
        )
        out = [{"seq": m.seq, "from": m.sender, "data": base64.b64encode(m.data).decode()}
               for m in messages]
        cursor = messages[-1].seq if messages else after
        return json_response(200, {"messages": out, "cursor": cursor})

    # -- blobs ----------------------------------------------------------------------

    async def put_blob(self, request: Request, params: dict[str, str], s: Session | None) -> Response:
        s = _member(s)
        blob, now = params["blob"], time.time()
        declared = request.declared_length
        if declared is not None and declared > self.config.max_blob_bytes:
            raise HttpError(413, ErrorCode.TOO_LARGE, f"blob is over the {self.config.max_blob_bytes}-byte cap")
        if self.blobs.stat(s.pool, blob, now) is not None:
            await request.drain(self.config.max_blob_bytes)
            await self.blobs.touch(s.pool, blob, now)
            return json_response(200, {"blob": blob, "created": False})
        try:
            await self.blobs.put(s.pool, blob, request.chunks(), now)
        except BlobError as exc:
            raise HttpError(exc.status, exc.code, exc.message) from None
        return json_response(201, {"blob": blob, "created": True})

    async def get_blob(self, request: Request, params: dict[str, str], s: Session | None) -> FileResponse:
        s = _member(s)
        blob = params["blob"]
        size = self.blobs.stat(s.pool, blob, time.time())
        if size is None:
            raise HttpError(404, ErrorCode.NO_BLOB, "no such blob")
        try:
            source = await trio.open_file(self.blobs.path(s.pool, blob), "rb")
        except FileNotFoundError:
            raise HttpError(404, ErrorCode.NO_BLOB, "no such blob") from None
        status, start, length = 200, 0, size
        headers = [("accept-ranges", "bytes")]
        match = _RANGE.match(request.headers.get("range", ""))
        if match:  # single ranges only; anything else gets the whole blob (RFC 9110 allows)
            start = int(match[1])
            end = min(int(match[2]), size - 1) if match[2] else size - 1
            if start >= size or end < start:
                await source.aclose()
                raise HttpError(416, ErrorCode.BAD_RANGE, f"range starts past the end of the {size}-byte blob")
            status, length = 206, end - start + 1
            headers.append(("content-range", f"bytes {start}-{end}/{size}"))
        return FileResponse(status, source, start, length, headers, head=request.method == "HEAD")

    async def touch(self, request: Request, _: dict[str, str], s: Session | None) -> Response:
        """Restart the TTL of the pool's blobs named in ``{"blobs": [...]}``; answer how many
        were held and which were not (expired, never uploaded)."""
        s = _member(s)
        body = await request.json(self.config.max_json_bytes)
        blobs = body.get("blobs")
        problem = "field 'blobs' must be a list of sha256 hex blob names"
        if not isinstance(blobs, list):
            raise HttpError(400, ErrorCode.BAD_REQUEST, problem)
        if len(blobs) > TOUCH_MAX_BLOBS:
            raise HttpError(413, ErrorCode.TOO_LARGE, f"{len(blobs)} blobs is over the {TOUCH_MAX_BLOBS} "
                            "one touch may name")
        if not all(isinstance(b, str) and _BLOB.fullmatch(b) for b in blobs):
            raise HttpError(400, ErrorCode.BAD_REQUEST, problem)
        names = list(dict.fromkeys(blobs))
        missing = await self.blobs.touch_many(s.pool, names, time.time())
        return json_response(200, {"held": len(names) - len(missing), "missing": missing})
