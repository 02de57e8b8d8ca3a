"""What a running node counts for status: per job, the relay, peers heard, input refused."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JobStats:
    fp32_bytes: int = 0
    wire_bytes: int = 0
    shards_trained: int = 0
    train_seconds: float = 0.0
    # Shards that waited for dataset pieces (``dataset_samples``): how many, the seconds in
    # all, and the first one's (the job's start; prefetch should hide the rest).
    data_waits: int = 0
    data_wait_s: float = 0.0
    first_data_wait_s: float | None = None
    # Spot checks of others' reduced slices on one chunk: reproduced, and not (the whole
    # slice was then reduced here).
    samples: int = 0
    sample_misses: int = 0

    def ratio(self) -> float | None:
        """Compression: fp32 bytes per byte on the wire."""
        return round(self.fp32_bytes / self.wire_bytes, 2) if self.wire_bytes else None


@dataclass
class Touches:
    """The pin of running jobs' dataset pieces on the relay (``_data.Datasets.keep_pinned``)."""

    requests: int = 0  # touch requests the relay answered
    blobs: int = 0  # blob TTLs it restarted
    missing: int = 0  # blobs it no longer held when touched
    reuploaded: int = 0  # of those, uploaded again from this peer's copy


@dataclass
class Counters:
    started: float = 0.0
    peers_seen: dict[str, float] = field(default_factory=dict)
    jobs: dict[str, JobStats] = field(default_factory=dict)
    relay_ok: bool = False
    last_error: str = ""
    # Input refused as not authentic or malformed, by what it was ("message: SealError",
    # "blob"): a relay that tampers or forges shows up here, never in the state.
    rejected: dict[str, int] = field(default_factory=dict)
    touches: Touches = field(default_factory=Touches)

    def reject(self, what: str) -> None:
        self.rejected[what] = self.rejected.get(what, 0) + 1

    def job(self, job: str) -> JobStats:
        return self.jobs.setdefault(job, JobStats())
