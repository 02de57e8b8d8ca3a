"""Reports: what the driver tells the peer machine, one small frozen dataclass each.

``PeerMachine.report(report, now)`` takes any of them and returns the effects that
follow. Each effect that starts work (``_effects``) ends in one report: its own on
success (``Prepared`` or ``Declined`` for ``PrepareJob``, ``Trained`` for ``Train``,
``DeltaEncoded`` then ``DeltaPublished`` for ``PublishDelta``, ``Aggregated``,
``Applied``, ``Fetched``, ``CheckpointPublished``), or ``Failed(effect)`` when it could
not run (a blob out of reach, an upload given up): the activity that asked waits
``RETRY_AFTER`` seconds before asking again, and no other activity waits with it.
``JobFailed`` ends the job on this peer (its task's code failed). ``StateLost`` and
``WorkLost`` correct what the machine believes the driver holds; they come before the
``Failed`` of the effect that found out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._effects import Effect, ReduceSlice
from ._jobspec import JobSpec
from ._outer import Outer

RETRY_AFTER = 2.0  # seconds before an activity retries work whose effect failed


@dataclass(frozen=True)
class Prepared:
    """``PrepareJob`` succeeded: the task loaded and fits this peer."""

    job: str


@dataclass(frozen=True)
class Declined:
    """``PrepareJob``: this peer sits the job out for ``reason``; ``need`` and ``have``:
    bytes of memory when it does not fit; ``code``: the kind of reason (``DECLINE_CODES``;
    a code for good, such as "failed", ends the job here as ``JobFailed`` does)."""

    job: str
    reason: str
    need: int = 0
    have: int = 0
    code: str = ""


@dataclass(frozen=True)
class Progress:
    """The shard in training has ``done`` batches at ``rate`` batches/s (carried by the
    next lease renewal, so others can project when it ends). Returns no effects."""

    job: str
    round: int
    shard: int
    done: int
    rate: float


@dataclass(frozen=True)
class Trained:
    """A ``Train`` ended: ``samples`` trained (0: stopped before one batch), ``batches``
    of them in ``seconds`` (this peer's speed)."""

    job: str
    round: int
    shard: int
    samples: int
    batches: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class DeltaEncoded:
    """``PublishDelta``: the delta of ``shards`` is out of the local model and uploading,
    so the next shard may train meanwhile. ``DeltaPublished`` or ``Failed`` follows; if
    the upload fails those shards are trained again, since the local model moved on."""

    job: JobSpec
    round: int
    base: str
    shards: tuple[int, ...]


@dataclass(frozen=True)
class DeltaPublished:
    """``PublishDelta``: the delta is uploaded as ``blob`` of ``size`` bytes."""

    job: JobSpec
    round: int
    base: str
    shards: tuple[int, ...]
    samples: int
    blob: str
    size: int
    metrics: dict[str, float] = field(default_factory=dict)
    chunks: int | None = None  # a sliced job's chunked delta: its chunk count


@dataclass(frozen=True)
class Aggregated:
    """``Aggregate``: the outer step on ``base`` with ``contribs`` made ``state``."""

    job: JobSpec
    round: int
    base: str
    contribs: tuple[str, ...]
    state: str
    metrics: dict[str, float] = field(default_factory=dict)
    slices: tuple[str, ...] = ()  # a sliced round: the slice records it applied, in order
    weights: tuple[int, ...] = ()  # an ensemble's round: each member's count in the vote
    outer: Outer | None = None  # the outer step it took (``Aggregate.outer``)


@dataclass(frozen=True)
class SliceReduced:
    """``ReduceSlice`` made the slice whose plaintext hashes to ``sha256`` (``size``
    bytes), uploaded as ``blob``; or, a check that reproduced ``against``, uploaded
    nothing (``blob`` is None)."""

    effect: ReduceSlice
    sha256: str
    size: int
    blob: str | None


@dataclass(frozen=True)
class SliceRefused:
    """The reduced slice of record ``record`` did not hash or size as the record says
    (forged, tampered, oversized): this peer ignores it and the slice is made again.
    ``Failed`` of the effect that fetched it follows."""

    record: str


@dataclass(frozen=True)
class Applied:
    """``Apply``: the close's result hashed to ``state`` (``ok``), or not (the machine
    fetches a checkpoint instead)."""

    state: str
    ok: bool


@dataclass(frozen=True)
class Fetched:
    """``FetchState``: the bytes hashed to ``state`` (``ok``), or not."""

    state: str
    ok: bool


@dataclass(frozen=True)
class CheckpointPublished:
    """``PublishCheckpoint``: the state is uploaded as ``blob`` of ``size`` bytes."""

    job: JobSpec
    round: int
    state: str
    blob: str
    size: int


@dataclass(frozen=True)
class Failed:
    """``effect`` could not run (a network error, a blob not reachable yet): the activity
    that asked for it tries again after ``RETRY_AFTER``. ``Failed(PrepareJob)`` declines
    the job ("could not load the task")."""

    effect: Effect


@dataclass(frozen=True)
class JobFailed:
    """The task's code failed on this peer, in any effect of ``job``: the peer sits the
    job out for good (a decline of code "failed", kept across restarts), drops what it
    was doing for it and releases its claim at once."""

    job: str
    reason: str


@dataclass(frozen=True)
class Holds:
    """The driver holds ``state`` (restored from disk, or given by a test)."""

    state: str


@dataclass(frozen=True)
class StateLost:
    """The driver does not have ``state`` after all (a job that shares a state hash with
    an earlier one, whose file was pruned): the machine recomputes or fetches it."""

    state: str


@dataclass(frozen=True)
class WorkLost:
    """The driver lost this peer's local model (its worker process died): the shards
    trained into it and not yet published become this peer's to claim again."""

    job: str


Report = (
    Prepared | Declined | Progress | Trained | DeltaEncoded | DeltaPublished | Aggregated | Applied | Fetched
    | CheckpointPublished | Failed | JobFailed | Holds | StateLost | WorkLost | SliceReduced | SliceRefused
)
