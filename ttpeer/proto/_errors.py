"""The errors of the pure protocol layer; the root of the tree comes from ``ttpeer_wire``.

``TtpeerError`` lives in ``ttpeer_wire``, the bottom layer, so that every package and
the relay share one root; ``RecordError`` and ``ProofError`` are the wire's errors of
reading records and proofs, re-exported here. The full tree is drawn in
``ttpeer/errors.py``.
"""

from __future__ import annotations

from ttpeer_wire import ProofError, RecordError, TtpeerError


class RevokeError(TtpeerError):
    """A revocation cannot be made: not the admin, not a member, or too much to keep."""


__all__ = ["ProofError", "RecordError", "RevokeError", "TtpeerError"]
