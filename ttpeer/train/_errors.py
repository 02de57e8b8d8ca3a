"""Errors raised by the training layer.

    TrainError            anything the training layer refuses or cannot do (a TtpeerError)
    ├── TaskError         a task spec or task file is missing, broken or invalid
    ├── Diverged          local training produced a NaN/inf loss or delta
    ├── DeltaError        a compressed delta is malformed, oversized or non-finite
    └── CheckpointError   state bytes or a model file are malformed or do not match

DatasetMissing (a task asked for a dataset this peer does not hold yet) is re-exported
from ``ttpeer.proto``, where the daemon, which imports no torch, can match it.

A model that does not fit a peer is not an error: the fit check (``fit_problem``)
returns a ``Misfit`` and the peer declines the job with its message.

Programming errors (a caller breaking a documented precondition, such as a
negative round number) raise ValueError instead: they are bugs, not situations
a user can fix.

They derive from ttpeer's common root (``ttpeer.proto.TtpeerError``, which the
training layer may import: ``train -> proto``), so a caller that handles
``TtpeerError`` handles these too; keep them all in this file.
"""

from __future__ import annotations

from ttpeer.proto import DatasetMissing, TtpeerError

__all__ = ["CheckpointError", "DatasetMissing", "DeltaError", "Diverged", "TaskError", "TrainError"]


class TrainError(TtpeerError):
    """Base class for errors of the training layer."""


class TaskError(TrainError):
    """Raised while loading a task: the file is missing, does not import, has
    no ``task()`` function, or returns something that is not a valid task."""


class Diverged(TrainError):
    """Raised when local training went non-finite: a NaN/inf loss in a shard, or a
    pseudo-gradient holding NaN/inf. ``where`` says which (shown to the user)."""

    def __init__(self, where: str) -> None:
        super().__init__(f"training diverged ({where})")
        self.where = where


class DeltaError(TrainError):
    """Raised when encoding a delta that holds NaN/inf, or when decoding bytes
    that are not a well-formed delta for the current model."""


class CheckpointError(TrainError):
    """Raised when state bytes or an exported model cannot be read back, or
    their tensor names and shapes do not match the model they are meant for."""

