"""Effects: what a peer machine asks its driver to do. The machine performs none.

Each effect that starts work has a matching report method on ``PeerMachine``
(named in the docstring); until the report comes back the machine does not ask
for the same work again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttpeer_wire import Record


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
    """Load the job's task and check it fits this peer. Report: ``job_prepared``."""

    job: Record


@dataclass(frozen=True)
class Train:
    """Train one shard on the local model. ``fresh``: reset the local model to ``base``
    first. Report: ``train_done``."""

    job: Record
    round: int
    shard: int
    attempt: int
    base: str
    fresh: bool


@dataclass(frozen=True)
class Cancel:
    """Stop training ``shard`` as soon as possible (it is covered or owned by another)."""

    job: str
    round: int
    shard: int


@dataclass(frozen=True)
class PublishDelta:
    """Compress, seal and upload the local model's delta against ``base``.
    Report: ``delta_encoded`` once the delta is taken from the local model (optional:
    the next shard may then train during the upload), then ``delta_published``."""

    job: Record
    round: int
    base: str
    shards: tuple[int, ...]
    samples: int


@dataclass(frozen=True)
class Aggregate:
    """Fetch the contributions' blobs, apply the outer step to ``base`` and report the
    resulting state. Report: ``aggregated``."""

    job: Record
    round: int
    base: str
    contribs: tuple[Record, ...]


@dataclass(frozen=True)
class Apply:
    """Apply a round close to the held state ``base``; the result must hash to
    ``close["state"]``. Report: ``applied``."""

    job: Record
    close: Record
    contribs: tuple[Record, ...]


@dataclass(frozen=True)
class FetchState:
    """Download the checkpoint blob holding ``state``. Report: ``fetched``."""

    job: Record
    state: str
    blob: str


@dataclass(frozen=True)
class PublishCheckpoint:
    """Upload the held ``state`` (the model entering ``round``) so late joiners and
    repairing peers can fetch it. Report: ``checkpoint_published``."""

    job: Record
    round: int
    state: str


@dataclass(frozen=True)
class JobDone:
    """The job's last round is closed and this peer holds the final ``state``."""

    job: Record
    state: str


Effect = (
    Broadcast | Send | Persist | PrepareJob | Train | Cancel | PublishDelta | Aggregate | Apply
    | FetchState | PublishCheckpoint | JobDone
)
