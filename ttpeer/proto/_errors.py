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
    ``name`` is the name the task asked for. A task reading a dataset sample by sample
    (``dataset_samples``) raises it with the ``dataset``'s id and the ``pieces`` it needs
    that are not here, or with ``whole=False`` when its sample index is not here yet (the
    daemon then fetches the index, not the data): the daemon fetches those and asks again."""

    def __init__(self, name: str, *, dataset: str = "", pieces: list[int] | None = None, whole: bool = True) -> None:
        what = f"pieces {_few(pieces)} of dataset {name!r} are" if pieces else f"dataset {name!r} is"
        super().__init__(f"{what} not held on this peer")
        self.name, self.dataset, self.pieces, self.whole = name, dataset, list(pieces or ()), whole
        self.moved = False  # raised after training steps: the call is not made again as it was


def _few(pieces: list[int]) -> str:
    return ", ".join(map(str, pieces[:5])) + (f" (+{len(pieces) - 5} more)" if len(pieces) > 5 else "")


__all__ = ["DatasetMissing", "ProofError", "RecordError", "RevokeError", "TtpeerError"]
