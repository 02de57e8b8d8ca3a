"""Pure protocol state machines: no I/O, no clock reads, no trio, no torch.

Everything here takes ``now`` as an argument and returns effects; the daemon and
the simulator execute them. Records, their codec, membership proofs and the root
error live in ``ttpeer_wire`` (the contract the relay shares, without this package)
and are re-exported here unchanged.
"""

from ttpeer_wire import (
    MAX_KEEP,
    MAX_RECORD_BYTES,
    PRECISION_CODES,
    Member,
    Record,
    decode,
    encode,
    parse,
    pool_id_of,
    public_hex,
    sign,
    verify_proof,
    verify_revocation,
)

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
from ._membership import admitted, lost_joins, members, revocations, standing
from ._outcome import (
    DECLINE_CODES,
    Ended,
    cancel_of,
    failed_here,
    job_ended,
    may_cancel,
    standing_declines,
)
from ._peer import RETRY_AFTER, PeerMachine, Timing
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
    "DECLINE_CODES",
    "Ended",
    "cancel_of",
    "failed_here",
    "job_ended",
    "may_cancel",
    "standing_declines",
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
    "admitted",
    "lost_joins",
    "standing",
    "parse",
    "pool_id_of",
    "public_hex",
    "sign",
    "verify_proof",
    "verify_revocation",
]
