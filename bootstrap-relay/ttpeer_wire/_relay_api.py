"""The relay's HTTPS API as both ends read it: paths, limits, login bytes, error codes.

The relay (``ttpeer_relay``) serves it; the peers' client (``ttpeer.net``) and the
in-memory relay of the tests and the simulator speak it. A constant that one side
relies on the other keeping lives here and nowhere else.

Errors. Every error answer is a JSON object ``{"error": MESSAGE, "code": CODE}``:
``error`` is English for people (logs, ``ttpeer status``) and may be reworded any
time; ``code`` is one of ``ErrorCode`` and never changes meaning. Clients decide on
the HTTP status and the code, never on the words. A code a client does not know
(a newer relay) is an error of its status class, its message shown as it is.

    status  code                          when
    400     bad_request                   a field, the query or the JSON body is malformed
    400     bad_blob                      an uploaded body does not hash to the blob's name
    401     session_expired               no session, or it expired (the relay restarted): log in again
    401     bad_nonce                     a login nonce is unknown, spent or stale: ask a new challenge
    403     bad_proof                     the membership proof does not admit the peer
    403     bad_signature                 the login is not signed for this relay's certificate
    403     revoked                       the pool's root revoked this peer: final
    403     bad_revocation                a revocation not signed by the pool's root
    403     bad_admit                     an acknowledgement of a join not signed by the pool's root
    403     token_used                    the join's invite has all its uses acknowledged for other
                                          machines (the message says who, when): final
    404     not_found | no_blob           no such endpoint | the relay does not hold the blob
    405     method_not_allowed
    408     too_slow                      a request body arrived too slowly
    413     too_large                     a body is over a cap (``limits`` in the session answer)
    416     bad_range                     a blob range starts past its end
    429     rate_limited                  with Retry-After
    500     internal                      a bug in the relay
    507     mailbox_full                  with Retry-After: the recipient collecting its mail frees room
    507     pool_quota | disk_full | roster_full    waiting alone will not help

Blob TTL and touches. The relay deletes a blob ``blob_ttl`` seconds (the session
answer's ``blob_ttl``; ``BLOB_TTL`` by default) after it was last uploaded or touched.
``POST /v1/touch`` with ``{"blobs": [sha256 hex, ...]}`` (at most ``TOUCH_MAX_BLOBS``,
within the JSON body cap) restarts the TTL of every one the pool holds and answers
``{"held": COUNT, "missing": [the others, in the order asked]}``: a lease that its
holders renew (peers pin a running job's dataset pieces so), lapsing with the TTL once
nobody does; it changes no quota. A relay older than the route answers 404 not_found.

Pure: no I/O, no clock; the login message and the fingerprint are functions of bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from enum import StrEnum
from typing import Any

API = "/v1"
HEALTH = f"{API}/health"
CHALLENGE = f"{API}/challenge"
SESSION = f"{API}/session"
ROSTER = f"{API}/roster"
REVOKE = f"{API}/revoke"
ADMIT = f"{API}/admit"
BROADCAST = f"{API}/broadcast"
RECV = f"{API}/recv"
SEND = f"{API}/send/"  # + the recipient's peer id
BLOB = f"{API}/blob/"  # + the blob's sha256 hex
TOUCH = f"{API}/touch"

MAX_WAIT = 30.0  # longest long-poll, seconds; longer waits are clamped
RECV_MAX_COUNT = 1024  # messages in one recv answer at most
RECV_MAX_BYTES = 8 * 2**20  # payload bytes in one recv answer at most (one message may pass it)
# Blobs named in one touch at most: 512 names are a 34 KiB body, well inside MAX_JSON_BYTES
# (1024 would pass it: 67 bytes a name).
TOUCH_MAX_BLOBS = 512
# The relay's default caps; a relay may be configured otherwise, and tells each peer its
# own in the session answer's ``limits``.
MAX_MESSAGE_BYTES = 256 * 2**10
MAX_JSON_BYTES = 64 * 2**10
MAX_BLOB_BYTES = 2**30
MAILBOX_MESSAGES = 4096
MAILBOX_BYTES = 64 * 2**20
POOL_QUOTA = 20 * 2**30
BLOB_TTL = 7 * 86400.0  # seconds a blob is kept after its last upload or touch

LOGIN_DOMAIN = b"ttpeer/relay-auth/v1\n"


def send_path(peer: str) -> str:
    return SEND + peer


def blob_path(blob: str) -> str:
    return BLOB + blob


def fingerprint(der: bytes) -> str:
    """``sha256:`` + hex sha256 of a DER certificate: the form invite tokens pin."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


def login_message(fingerprint: str, pool: str, nonce: str) -> bytes:
    """The bytes a peer signs to log in at the relay whose certificate is ``fingerprint``:
    a login captured at one relay is useless at another."""
    return LOGIN_DOMAIN + fingerprint.encode() + b"\n" + pool.encode() + b"\n" + nonce.encode()


class ErrorCode(StrEnum):
    """The ``code`` of a relay's error answer (see the module's table)."""

    BAD_REQUEST = "bad_request"
    BAD_BLOB = "bad_blob"
    SESSION_EXPIRED = "session_expired"
    BAD_NONCE = "bad_nonce"
    BAD_PROOF = "bad_proof"
    BAD_SIGNATURE = "bad_signature"
    REVOKED = "revoked"
    BAD_REVOCATION = "bad_revocation"
    BAD_ADMIT = "bad_admit"
    TOKEN_USED = "token_used"
    NOT_FOUND = "not_found"
    NO_BLOB = "no_blob"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    TOO_SLOW = "too_slow"
    TOO_LARGE = "too_large"
    BAD_RANGE = "bad_range"
    RATE_LIMITED = "rate_limited"
    INTERNAL = "internal"
    MAILBOX_FULL = "mailbox_full"
    POOL_QUOTA = "pool_quota"
    DISK_FULL = "disk_full"
    ROSTER_FULL = "roster_full"


_CODE = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_ERROR_MESSAGE = 500  # characters of an error message a client keeps


MAX_ERROR_RECORDS = 16  # signed records an error answer carries at most (``error_records``)


def error_body(code: ErrorCode, message: str, records: list[bytes] | None = None) -> dict[str, Any]:
    """The JSON object of an error answer; ``records``: signed records that prove what it
    says (``token_used``: the acknowledgements that used the token up), so that a client
    need not take the relay's word."""
    body: dict[str, Any] = {"error": message, "code": code.value}
    if records:
        body["records"] = [r.hex() for r in records[:MAX_ERROR_RECORDS]]
    return body


def error_records(raw: bytes) -> list[bytes]:
    """The signed records an error answer carries (unverified bytes; the caller parses
    them), none when it carries none or they are malformed."""
    try:
        value: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    records = value.get("records") if isinstance(value, dict) else None
    if not isinstance(records, list):
        return []
    out = []
    for r in records[:MAX_ERROR_RECORDS]:
        if isinstance(r, str) and re.fullmatch(r"(?:[0-9a-f]{2})+", r):
            out.append(bytes.fromhex(r))
    return out


def read_error(raw: bytes) -> tuple[str | None, str]:
    """(code, message) of an error answer's body, from any bytes a server sent.

    A known code comes back as its ``ErrorCode``; one that is well formed but unknown
    (a newer relay) as the string it is; None when the answer carries none that is
    well formed (not a relay, or an older one): the caller goes by the status alone.
    The message is the answer's ``error`` or, for an answer that is not ours, the start
    of its text."""
    try:
        value: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return None, raw[:200].decode("utf-8", "replace")
    if not isinstance(value, dict) or "error" not in value:
        return None, raw[:200].decode("utf-8", "replace")
    code = value.get("code")
    message = str(value["error"])[:MAX_ERROR_MESSAGE]
    if not isinstance(code, str) or not _CODE.fullmatch(code):
        return None, message
    try:
        return ErrorCode(code), message
    except ValueError:
        return code, message
