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
from ._errors import ProofError, RecordError, TtpeerError
from ._ledger import (
    Chain,
    RecordSet,
    canonical_chain,
    checkpoints,
    contributions,
    covered,
    overlapped,
    select_cover,
    train_base,
)
from ._membership import Member, members, verify_proof
from ._peer import PeerMachine, Timing
from ._records import MAX_RECORD_BYTES, Record, parse, pool_id_of, public_hex, sign
from ._sizing import default_sizing
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
    "Timing",
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
    "train_base",
    "MAX_RECORD_BYTES",
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
    "parse",
    "pool_id_of",
    "public_hex",
    "sign",
    "verify_proof",
]
