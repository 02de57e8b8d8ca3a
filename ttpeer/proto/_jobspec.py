"""A job record, read once into the fields the peer machine runs it by.

The record schema (``ttpeer_wire``'s ``SCHEMAS``) has already checked every field's type and
range when the record was admitted; ``JobSpec.of`` only refuses a record that is not a
job, so the parts of the machine index no ``job["..."]``: a misspelt field is a typed
attribute that a checker catches, not a ``KeyError`` in the middle of a round.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttpeer_wire import Record

from ._errors import RecordError


@dataclass(frozen=True)
class JobSpec:
    """What the machine needs of a job; ``record`` is the job itself, for effects."""

    record: Record
    id: str
    mode: str  # "fused" or "ensemble"
    rounds: int
    shards: int
    batches: int  # per shard: the inner steps of one shard
    lease: float  # seconds a claim lives without a renewal, on the observer's clock
    steal: bool  # idle peers may run backup copies of stragglers' shards
    bits: int  # quantization of deltas (sizes the first checkpoint's estimate)
    overlap: bool  # round r trains on the base of round r-1
    init: str  # the initial state's hash
    init_blob: str  # and its sealed blob
    h_min: int | None = None  # auto cadence (``_cadence``): each round's batches within h_min..h_max
    h_max: int | None = None
    chunk: int | None = None  # deltas are chunked in runs of this many values; rounds reduce in slices
    slice_bits: int = 8  # a reduced slice's bits (a sliced job's ``slice_bits``; 8 where it is not named)
    slow_links: bool = False  # slow authors reduce last (``_slices.slow_authors``): jobs that name slice_bits
    outer_auto: bool = False  # each close picks its outer lr and momentum (``_outer.py``)

    @classmethod
    def of(cls, job: Record) -> JobSpec:
        """Raises ``RecordError`` if ``job`` is not a job record."""
        if job.kind != "job":
            raise RecordError(f"a {job.kind} record is not a job")
        b = job.body
        return cls(
            record=job, id=job.id, mode=b["mode"], rounds=b["rounds"], shards=b["shards"],
            batches=b["batches"], lease=b["lease"], steal=b["steal"], bits=b["bits"],
            overlap=bool(b.get("overlap", 0)), init=b["init"], init_blob=b["init_blob"],
            h_min=b.get("h_min"), h_max=b.get("h_max"), chunk=b.get("chunk"),
            slice_bits=b.get("slice_bits", 8), slow_links="slice_bits" in b, outer_auto=bool(b.get("outer_auto")),
        )

    @property
    def auto(self) -> bool:
        """The pool picks each round's inner steps (``_cadence``)."""
        return self.h_min is not None

    @property
    def ensemble(self) -> bool:
        return self.mode == "ensemble"
