"""The root of ttpeer's exception tree and the errors of reading what came from outside.

``TtpeerError`` lives here, in the bottom layer, so that every package of ttpeer and
the relay share one root. The full tree is drawn in ``ttpeer/errors.py``.
"""

from __future__ import annotations


class TtpeerError(Exception):
    """Anything a ttpeer user can meet. The message says what happened and what to do."""


class RecordError(TtpeerError):
    """A record was malformed, oversized, non-canonical, forged or tampered with.

    Raised while decoding or verifying bytes that came from outside; the record is
    dropped and nothing already held changes.
    """


class ProofError(TtpeerError):
    """A membership proof does not chain from the pool root to the claimed node."""


class TokenError(TtpeerError):
    """A join token is malformed, expired, or does not match the pool it names."""
