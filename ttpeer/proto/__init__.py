"""Pure protocol state machines: no I/O, no clock reads, no trio, no torch.

Everything here takes ``now`` as an argument and returns effects; the daemon and
the simulator execute them. Only relative imports, so the relay can carry this
package unchanged (``bootstrap-relay/ttpeer_relay/_proto`` links here).
"""

from ._codec import decode, encode
from ._effects import (
    Aggregate,
    Apply,
    Broadcast,
    Cancel,
    Effect,
    FetchState,
    JobDone,
    Persist,
    PrepareJob,
    PublishCheckpoint,
    PublishDelta,
    Send,
    Train,
)
from ._ensemble import member_variants
from ._errors import ProofError, RecordError, RevokeError, TtpeerError
from ._ledger import (
    Chain,
    RecordSet,
    canonical_chain,
    checkpoints,
    contributions,
    covered,
    overlapped,
    revocation_keep,
    select_cover,
    train_base,
)
from ._membership import Member, lost_joins, members, revocations, verify_proof, verify_revocation
from ._peer import RETRY_AFTER, PeerMachine, Timing
from ._records import MAX_KEEP, MAX_RECORD_BYTES, PRECISION_CODES, Record, parse, pool_id_of, public_hex, sign
from ._sizing import default_sizing
from ._tasksig import TaskSignatureError, open_task, sign_task
from ._token import Token, TokenError, make_token, parse_token

__all__ = [
    "Aggregate",
    "Apply",
    "Broadcast",
    "Cancel",
    "Chain",
    "Effect",
    "FetchState",
    "JobDone",
    "PeerMachine",
    "Persist",
    "PrepareJob",
    "PublishCheckpoint",
    "PublishDelta",
    "RecordSet",
    "Send",
    "RETRY_AFTER",
    "Timing",
    "TaskSignatureError",
    "open_task",
    "sign_task",
    "Token",
    "TokenError",
    "make_token",
    "parse_token",
    "Train",
    "canonical_chain",
    "checkpoints",
    "contributions",
    "covered",
    "overlapped",
    "select_cover",
    "revocation_keep",
    "revocations",
    "train_base",
    "MAX_KEEP",
    "MAX_RECORD_BYTES",
    "PRECISION_CODES",
    "RevokeError",
    "Member",
    "ProofError",
    "Record",
    "RecordError",
    "TtpeerError",
    "decode",
    "default_sizing",
    "encode",
    "member_variants",
    "members",
    "lost_joins",
    "parse",
    "pool_id_of",
    "public_hex",
    "sign",
    "verify_proof",
    "verify_revocation",
]
