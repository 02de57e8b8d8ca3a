"""Effects: what a peer machine asks its driver to do. The machine performs none.

Each effect that starts work has a matching report (``_reports``, named in the
docstring; ``Failed(effect)`` when it could not run), given to ``PeerMachine.report``;
until the report comes back the machine does not ask for the same work again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttpeer_wire import Record

from ._jobspec import JobSpec
from ._outer import Outer


@dataclass(frozen=True)
class Broadcast:
    """Send ``payload`` to every other member (through the relay's broadcast)."""

    payload: bytes


@dataclass(frozen=True)
class Send:
    """Send ``payload`` to one peer."""

    peer: str
    payload: bytes


@dataclass(frozen=True)
class Persist:
    """Append ``record`` to the durable record log before acting on it further."""

    record: Record


@dataclass(frozen=True)
class PrepareJob:
    """Load the job's task and check it fits this peer. Report: ``Prepared`` or ``Declined``."""

    job: JobSpec


@dataclass(frozen=True)
class Train:
    """Train one shard on the local model. ``fresh``: reset the local model to ``base``
    first. Report: ``Trained``."""

    job: JobSpec
    round: int
    shard: int
    attempt: int
    base: str
    fresh: bool
    inner_steps: int | None = None  # of the shard; None: the job's ``inner_steps``
    first_step: int | None = None  # the job's global inner step it starts at; None: round x inner steps
    # Overlap: the round's own base (the state its close applies the deltas to) when this
    # peer already holds it. A fresh shard then starts from it exactly, where otherwise it
    # starts from an estimate of it (or, with no estimate, from ``base``, a round behind).
    ahead: str | None = None

    def schedule(self) -> tuple[int, int]:
        """(inner steps, first global inner step) of this shard: what its round's plan fixed
        (``_cadence.Plan``), or a fixed-cadence job's ``inner_steps`` and round x those."""
        steps = self.job.inner_steps if self.inner_steps is None else self.inner_steps
        return steps, self.round * self.job.inner_steps if self.first_step is None else self.first_step


@dataclass(frozen=True)
class Cancel:
    """Stop training ``shard`` as soon as possible (it is covered or owned by another)."""

    job: str
    round: int
    shard: int


@dataclass(frozen=True)
class PublishDelta:
    """Compress, seal and upload the local model's delta against ``base``.
    Report: ``DeltaEncoded`` once the delta is taken from the local model (optional:
    the next shard may then train during the upload), then ``DeltaPublished``."""

    job: JobSpec
    round: int
    base: str
    shards: tuple[int, ...]
    samples: int


@dataclass(frozen=True)
class ReduceSlice:
    """Reduce chunks ``first`` .. ``stop``-1 of the mean of ``contribs`` (their slice of
    every delta, in this order), re-quantized; upload it sealed unless it hashes as
    ``against`` does (a check of another's result: then nothing is uploaded). ``sample``
    (with ``against``): a spot check of one chunk only, drawn by the executing peer where
    the result's author cannot foresee it; the result is taken (its hash signed, nothing
    uploaded) when that chunk of it is the chunk reduced here, else the whole slice is
    reduced as without ``sample``. Report: ``SliceReduced``."""

    job: JobSpec
    round: int
    base: str  # the contributions' base
    contribs: tuple[Record, ...]
    slice: int
    of: int
    first: int
    stop: int
    against: Record | None = None
    sample: bool = False


@dataclass(frozen=True)
class FetchSlices:
    """Download reduced ``slices`` of a sliced round (their records) as soon as they count,
    into memory until the round's ``Aggregate`` or ``Apply`` reads them: the reduced model
    comes while the round's last slices are still being reduced, not after its close.
    Nothing is reported: a slice that did not come, or does not hash as its record says,
    is left to the ``Aggregate``/``Apply`` (which fetches, checks and refuses it as ever)."""

    job: JobSpec
    round: int
    slices: tuple[Record, ...]


@dataclass(frozen=True)
class FetchDeltas:
    """Download the whole deltas of a covered round closed from all deltas (``contribs``:
    the cover's contributions this peer did not make), into work files until the round's
    ``Aggregate`` or ``Apply`` reads them. Nothing is reported: a delta that did not come
    is left to the ``Aggregate``/``Apply``, which fetches it."""

    job: JobSpec
    round: int
    contribs: tuple[Record, ...]


@dataclass(frozen=True)
class Aggregate:
    """Fetch the contributions' blobs (or, for a sliced round, the reduced ``slices`` in
    order), apply the outer step to ``base`` and report the resulting state. Report:
    ``Aggregated``; ``SliceRefused`` first for a slice blob that does not hash as its
    record says."""

    job: JobSpec
    round: int
    base: str
    contribs: tuple[Record, ...]
    slices: tuple[Record, ...] = ()
    outer: Outer | None = None  # the round's outer step (``outer_auto``); None: the job's


@dataclass(frozen=True)
class Apply:
    """Apply a round close to the held state ``base``; the result must hash to
    ``close["state"]``. Report: ``Applied``."""

    job: JobSpec
    close: Record
    contribs: tuple[Record, ...]
    slices: tuple[Record, ...] = ()  # a sliced close's reduced slices, in order: the mean
    outer: Outer | None = None  # the outer step the close names (``outer_auto``); None: the job's


@dataclass(frozen=True)
class FetchState:
    """Download the checkpoint blob holding ``state``. Report: ``Fetched``."""

    job: JobSpec
    state: str
    blob: str


@dataclass(frozen=True)
class PublishCheckpoint:
    """Upload the held ``state`` (the model entering ``round``) so late joiners and
    repairing peers can fetch it. Report: ``CheckpointPublished``."""

    job: JobSpec
    round: int
    state: str


@dataclass(frozen=True)
class JobDone:
    """The job's last round is closed and this peer holds the final ``state``."""

    job: JobSpec
    state: str


Effect = (
    Broadcast | Send | Persist | PrepareJob | Train | Cancel | PublishDelta | ReduceSlice | FetchSlices | FetchDeltas
    | Aggregate | Apply | FetchState | PublishCheckpoint | JobDone
)


@dataclass(frozen=True)
class Sign:
    """Internal to the machine, never seen by a driver: a part of ``PeerMachine`` asks it
    to sign, admit and broadcast a record of ``kind`` with ``body`` (parts hold no key)."""

    kind: str
    body: dict


def describe_effect(eff: Effect) -> str:
    """One line per effect for debug logs: its kind and small fields, never payloads."""
    parts = [type(eff).__name__]
    for name, value in vars(eff).items():
        if isinstance(value, bool | int | float):
            parts.append(f"{name}={value}")
        elif isinstance(value, str):
            parts.append(f"{name}={value[:19]}")
        elif isinstance(value, tuple) and all(isinstance(v, int) for v in value):
            parts.append(f"{name}={list(value)}")
        elif hasattr(value, "id"):
            parts.append(f"{name}={value.id[:12]}")
    return " ".join(parts)
