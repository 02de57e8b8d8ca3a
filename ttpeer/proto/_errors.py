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


class DatasetMissing(TtpeerError):
    """A task's ``dataset_path(name)`` named a dataset this peer does not hold: the daemon
    fetches it and loads the task again (at submit), or retries preparing the job. Raised
    in the training layer, matched in the daemon (which imports no torch): so it lives here.
    ``name`` is the name the task asked for."""

    def __init__(self, name: str) -> None:
        super().__init__(f"dataset {name!r} is not held on this peer")
        self.name = name


__all__ = ["DatasetMissing", "ProofError", "RecordError", "RevokeError", "TtpeerError"]
