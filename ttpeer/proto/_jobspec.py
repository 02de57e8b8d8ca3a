"""A job record, read once into the fields every part runs it by, and the job's mode.

The record schema (``ttpeer_wire``'s ``SCHEMAS``) has already checked every field's type and
range when the record was admitted; ``JobSpec.of`` only refuses a record that is not a
job, so no part indexes ``job["..."]``: a misspelt field is a typed attribute that a
checker catches, not a ``KeyError`` in the middle of a round.

A round's size has one name in code, ``inner_steps``: the inner steps each shard trains in
a round (an ensemble: in a unit), ``--inner-steps`` on the command line. The record keeps
the field's wire name, ``batches``, which signed records of every version carry.

A ``Mode`` is what the protocol does differently for fused and ensemble jobs, each rule
named for what it decides; the torch executor's counterparts (start, delta or checkpoint,
outer step or combine) are ``daemon/worker/_fused.py`` and ``_ensemble.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ttpeer_wire import Record

from ._ensemble import member_variants
from ._errors import RecordError

MAX_MEMBERS = 4096  # an ensemble's members are its shards: the ledger's shard bound


@dataclass(frozen=True, repr=False)
class Mode:
    """The protocol's rules for one mode of job."""

    name: str
    # A contribution is the round's local change against its base (fused), or the new
    # checkpoint of the member a shard is (ensemble): a peer publishes after every unit.
    publishes_each_unit: bool
    # Rounds between the checkpoints a round's closer publishes unasked (and the final
    # state); None: only when a peer asks (a fused checkpoint is a model's bytes twice over,
    # which every peer that applies the closes already has).
    checkpoint_every: int | None
    # A round of three or more contributions may be reduced in slices (``_slices``).
    sliced: bool
    # Every peer fetches a covered round's deltas at once (``FetchDeltas``), before its
    # close: a fused close is applied from them; an ensemble's members are checkpoints.
    fetches_ahead: bool
    # A follower weighs replaying the rounds it missed against asking for a checkpoint.
    weighs_replay: bool
    # A shard is a share of the data, read sample by sample where the task does; else each
    # shard (a member) reads the whole dataset in its own order.
    shards_split_data: bool
    # A job's shard may train on several local devices at once (a process group); an
    # ensemble unit trains one member in one worker.
    data_parallel: bool

    def __repr__(self) -> str:
        return f"Mode({self.name!r})"

    def problem(self, spec: Mapping[str, Any]) -> str | None:
        """What is wrong with a submitted spec for this mode (``members`` a count, as
        ``submit`` sends it), or None."""
        count = spec.get("members")
        if self is not ENSEMBLE:
            return None if count is None else "--members goes with --mode ensemble"
        if type(count) is not int or not 1 <= count <= MAX_MEMBERS:
            return f"an ensemble job needs --members between 1 and {MAX_MEMBERS}, got {count!r}"
        if spec.get("shards") not in (None, count):
            return "an ensemble job has one shard per member: leave --shards out"
        if spec.get("init"):
            return "--init warm-starts a fused job; an ensemble's members start fresh"
        return None

    def complete(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The job fields this mode fixes from a spec without a ``problem``: an ensemble
        lists each member's seed and variant, one shard per member; a fused job lists none."""
        if self is not ENSEMBLE:
            return {k: v for k, v in spec.items() if k != "members"}
        count = spec["members"]
        return {**spec, "shards": count,
                "members": member_variants(spec["seed"], count, spec["inner_lr"], spec["weight_decay"])}


CHECKPOINT_EVERY = 4  # rounds between the checkpoints an ensemble round's closer publishes

FUSED = Mode("fused", publishes_each_unit=False, checkpoint_every=None, sliced=True, fetches_ahead=True,
             weighs_replay=True, shards_split_data=True, data_parallel=True)
ENSEMBLE = Mode("ensemble", publishes_each_unit=True, checkpoint_every=CHECKPOINT_EVERY, sliced=False,
                fetches_ahead=False, weighs_replay=False, shards_split_data=False, data_parallel=False)
MODES = {m.name: m for m in (FUSED, ENSEMBLE)}


def mode_named(name: object) -> Mode:
    """Raises ``RecordError`` for a name that is no mode."""
    if not isinstance(name, str) or name not in MODES:
        raise RecordError(f"mode must be one of {', '.join(MODES)}, got {name!r}")
    return MODES[name]


@dataclass(frozen=True)
class JobSpec:
    """What the peers need of a job; ``record`` is the signed job itself."""

    record: Record = field(repr=False)
    id: str
    mode: Mode
    rounds: int
    shards: int
    inner_steps: int  # per shard and round (the wire's ``batches``): fixed jobs' size, auto jobs' first
    lease: float  # seconds a claim lives without a renewal, on the observer's clock
    steal: bool  # idle peers may run backup copies of stragglers' shards
    bits: int  # quantization of deltas (sizes the first checkpoint's estimate)
    overlap: bool  # round r trains on the base of round r-1
    init: str  # the initial state's hash
    init_blob: str  # and its sealed blob
    # The task and how one step trains it.
    task: str  # the task's name (``module:function`` or a file's)
    task_hash: str
    task_blob: str  # the sealed task file, "" for a task every peer imports
    batch_size: int
    seed: int
    inner_lr: float
    weight_decay: float
    outer_lr: float  # the outer step's, or with ``outer_auto`` where the first round starts
    outer_momentum: float
    step_timeout: float | None  # seconds one step may take; None: the executor's default
    data: str | None = None  # fingerprint of the task's data as the submitter built it
    datasets: Mapping[str, str] = field(default_factory=dict)  # name -> dataset id
    samples: Mapping[str, str] = field(default_factory=dict)  # read sample by sample: name -> index hash
    members: tuple[Mapping[str, Any], ...] = ()  # an ensemble's: each member's seed and variant
    holdout: int = 0  # an ensemble's samples no member trains on
    micro_batch: int | None = None  # forced on every peer; None: each picks from its memory
    checkpointing: bool = False  # activation checkpointing
    h_min: int | None = None  # auto cadence (``_cadence``): each round's inner steps within h_min..h_max
    h_max: int | None = None
    chunk: int | None = None  # deltas are chunked in runs of this many values; rounds reduce in slices
    slice_bits: int = 8  # a reduced slice's bits (a sliced job's ``slice_bits``; 8 where it is not named)
    slice_min: int | None = None  # slices only where they save a peer this many bytes a round (None: always)
    slow_links: bool = False  # slow authors reduce last (``_slices.slow_authors``): jobs that name slice_bits
    outer_auto: bool = False  # each close picks its outer lr and momentum (``_outer.py``)
    outer_agree: bool = False  # ... its momentum scaled by the peers' agreement (wire: ``outer_auto`` 2)
    params: int | None = None  # the model's parameters, and how many train (None: a job that says not)
    trainable: int | None = None

    @classmethod
    def of(cls, job: Record) -> JobSpec:
        """Raises ``RecordError`` if ``job`` is not a job record."""
        if job.kind != "job":
            raise RecordError(f"a {job.kind} record is not a job")
        b = job.body
        return cls(
            record=job, id=job.id, mode=mode_named(b["mode"]), rounds=b["rounds"], shards=b["shards"],
            inner_steps=b["batches"], lease=b["lease"], steal=b["steal"], bits=b["bits"],
            overlap=bool(b.get("overlap", 0)), init=b["init"], init_blob=b["init_blob"],
            task=b["task"], task_hash=b["task_hash"], task_blob=b["task_blob"], batch_size=b["batch_size"],
            seed=b["seed"], inner_lr=b["inner_lr"], weight_decay=b["weight_decay"], outer_lr=b["outer_lr"],
            outer_momentum=b["outer_momentum"], step_timeout=b.get("step_timeout"),
            data=b.get("data"), datasets=dict(b.get("datasets") or {}), samples=dict(b.get("samples") or {}),
            members=tuple(b.get("members") or ()), holdout=int(b.get("holdout", 0)),
            micro_batch=b.get("micro_batch"), checkpointing=bool(b.get("checkpointing", 0)),
            h_min=b.get("h_min"), h_max=b.get("h_max"), chunk=b.get("chunk"),
            slice_bits=b.get("slice_bits", 8), slice_min=b.get("slice_min"),
            slow_links="slice_bits" in b, outer_auto=bool(b.get("outer_auto")),
            outer_agree=b.get("outer_auto") == 2,
            params=b.get("params"), trainable=b.get("trainable"),
        )

    def __hash__(self) -> int:  # its mappings are not hashable; equal specs are one job's
        return hash(self.id)

    @property
    def body(self) -> Mapping[str, Any]:
        """The record's fields, for the training layer's readers of a job's recipe
        (``train.Recipe.of_job``, its schedules), which know no ``JobSpec``."""
        return self.record.body

    @property
    def auto(self) -> bool:
        """The pool picks each round's inner steps (``_cadence``)."""
        return self.h_min is not None
