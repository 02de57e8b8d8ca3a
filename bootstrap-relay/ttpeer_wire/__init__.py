"""What the relay and the peers must agree on, defined once: ttpeer's wire contract.

- records: the signed facts peers hold, their canonical codec and schema table
  (``_records``, ``_codec``), and a dataset's manifest and id (``_dataset``);
- membership proofs and revocations, checked from their bytes alone (``_proofs``);
- the relay's HTTPS API: paths, limits, the login bytes, the certificate fingerprint,
  and the error codes of its answers (``_relay_api``);
- the join token, what an admin hands a new machine: the relays, their pins, the
  invite and its key (``_token``; the relay never sees one);
- the root of the exception tree, ``TtpeerError``, with the errors of reading all that.

Both ``ttpeer`` (``proto`` and ``net`` build on it) and the relay (``ttpeer_relay``)
import this package; it ships in both distributions from this one directory
(``bootstrap-relay/ttpeer_wire``). It is pure: no I/O, no clock, no trio, httpx or
torch; its only dependency is ``cryptography`` (Ed25519). ``tests/unit/test_wire.py``
holds it to that and pins the names below.
"""

from ._codec import decode, encode
from ._dataset import (
    DEFAULT_PIECE_SIZE,
    MIN_PIECE_SIZE,
    SAMPLE_FORMATS,
    dataset_id,
    path_problem,
    piece_count,
    piece_sizes,
    record_files,
    samples_hash,
    tar_key,
    urls_problem,
)
from ._errors import ProofError, RecordError, TokenError, TtpeerError
from ._netfields import MAX_RELAYS, host_ok
from ._proofs import (
    Member,
    join_fits_invite,
    token_used_by,
    token_used_message,
    verify_admit,
    verify_proof,
    verify_revocation,
)
from ._records import (
    MAX_KEEP,
    MAX_RECORD_BYTES,
    PRECISION_CODES,
    Record,
    parse,
    pool_id_of,
    public_hex,
    sign,
)
from ._relay_api import (
    ADMIT,
    API,
    BLOB,
    BLOB_TTL,
    BROADCAST,
    CHALLENGE,
    HEALTH,
    LOGIN_DOMAIN,
    MAILBOX_BYTES,
    MAILBOX_MESSAGES,
    MAX_BLOB_BYTES,
    MAX_JSON_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_WAIT,
    POOL_QUOTA,
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
    blob_path,
    error_body,
    error_records,
    fingerprint,
    login_message,
    read_error,
    send_path,
)
from ._token import Token, make_token, parse_token

__all__ = [
    "API",
    "BLOB",
    "BLOB_TTL",
    "BROADCAST",
    "CHALLENGE",
    "DEFAULT_PIECE_SIZE",
    "HEALTH",
    "LOGIN_DOMAIN",
    "MAILBOX_BYTES",
    "MAILBOX_MESSAGES",
    "MAX_BLOB_BYTES",
    "MAX_JSON_BYTES",
    "MAX_KEEP",
    "MAX_RELAYS",
    "MAX_MESSAGE_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_WAIT",
    "MIN_PIECE_SIZE",
    "POOL_QUOTA",
    "PRECISION_CODES",
    "RECV",
    "RECV_MAX_BYTES",
    "RECV_MAX_COUNT",
    "REVOKE",
    "ADMIT",
    "ROSTER",
    "SEND",
    "SESSION",
    "TOUCH",
    "TOUCH_MAX_BLOBS",
    "ErrorCode",
    "Member",
    "ProofError",
    "Record",
    "RecordError",
    "Token",
    "TokenError",
    "make_token",
    "parse_token",
    "TtpeerError",
    "blob_path",
    "dataset_id",
    "decode",
    "encode",
    "error_body",
    "error_records",
    "fingerprint",
    "host_ok",
    "join_fits_invite",
    "login_message",
    "parse",
    "path_problem",
    "piece_count",
    "piece_sizes",
    "SAMPLE_FORMATS",
    "samples_hash",
    "tar_key",
    "pool_id_of",
    "public_hex",
    "read_error",
    "record_files",
    "send_path",
    "urls_problem",
    "sign",
    "verify_proof",
    "verify_admit",
    "token_used_by",
    "token_used_message",
    "verify_revocation",
]
