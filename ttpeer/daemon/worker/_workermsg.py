"""What the daemon and its worker processes say to each other: one message per executor
call, each with the type of its reply, written by one codec (``_codec``) into the
channel's frames (``_channel``).

    daemon -> worker   {"op": "config", ...}                   Configure, once, first
                       {"id": n, "op": ..., ...}               a request: one executor call
                       {"id": n, "op": "cancel"}               Cancel: stop the shard ``n`` trains
    worker -> daemon   {"op": "hello", ...}                    Hello, once, torch imported
                       {"id": n, "progress": batches}          while ``n`` trains
                       {"id": n, "ok": reply}                  the reply, of the request's type
                       {"id": n, "error": kind, "message", ...}  a failure (``_failures``)

A job (``JobSpec``) crosses as its record's bytes (in hex), read again on the other side; the
effects the machine made (``Train``, ``PublishDelta``) cross as themselves. Large values
never do: deltas, states and task files are files in the home, and a message names them.
A daemon and its workers are one install, started together: no other version is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttpeer import proto
from ttpeer.proto import JobSpec, Outer, PublishDelta, Record, RecordError, parse

from .._codec import Codec, Message
from .._executor import Decline

DeltaFiles = list[tuple[Path, int]]  # a round's contributions: (the file of a delta, samples trained)


@dataclass(frozen=True)
class Configure(Message[None]):
    op = "config"
    home: Path
    device: str
    task_options: dict[str, Any]
    memory_limit: int | None


@dataclass(frozen=True)
class Hello(Message[None]):
    op = "hello"
    pid: int
    torch: str
    cuda_devices: int


@dataclass(frozen=True)
class Cancel(Message[None]):
    op = "cancel"


# -- replies ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    fixed: dict[str, Any]  # the job fields the task fixes
    file: Path  # the initial state: the daemon removes it


@dataclass(frozen=True)
class DeltaFile:
    file: Path | None  # None from every worker of a group but the first: their copies are its
    metrics: dict[str, Any]


@dataclass(frozen=True)
class Aggregated:
    state: str
    metrics: dict[str, Any]


# -- requests: one per executor call (``daemon/_executor.py``) ----------------------------


@dataclass(frozen=True)
class Warm(Message[None]):
    """A spare, while it waits: torch's meta kernels, the default task's data."""

    op = "warm"


@dataclass(frozen=True)
class JoinGroup(Message[None]):
    op = "group"
    store: Path
    rank: int
    world: int
    device: str
    threads: int


@dataclass(frozen=True)
class Forget(Message[None]):
    """The job finished: drop its model, keep the process for the next."""

    op = "forget"
    job: str


@dataclass(frozen=True)
class NewJob(Message[Built]):
    op = "new_job"
    spec: dict[str, Any]
    task_file: Path | None
    out: Path


@dataclass(frozen=True)
class Prepare(Message[Decline | str | None]):
    op = "prepare"
    job: JobSpec
    task_file: Path | None


@dataclass(frozen=True)
class Train(Message[int]):
    op = "train"
    eff: proto.Train


@dataclass(frozen=True)
class Pieces(Message[dict[str, Any]]):
    op = "pieces"
    job: JobSpec
    round: int
    shards: list[int]
    inner_steps: int
    first: int


@dataclass(frozen=True)
class Delta(Message[DeltaFile]):
    op = "delta"
    eff: PublishDelta
    out: Path
    rank: int = 0


@dataclass(frozen=True)
class ReduceSlice(Message[Path]):
    op = "reduce_slice"
    job: JobSpec
    deltas: DeltaFiles
    first: int
    stop: int
    round: int
    out: Path


@dataclass(frozen=True)
class Aggregate(Message[Aggregated]):
    op = "aggregate"
    job: JobSpec
    base: str
    deltas: DeltaFiles
    round: int
    sliced: bool = False
    outer: Outer | None = None


@dataclass(frozen=True)
class Apply(Message[bool]):
    op = "apply"
    job: JobSpec
    base: str
    deltas: DeltaFiles
    expect: str
    round: int
    sliced: bool = False
    outer: Outer | None = None


@dataclass(frozen=True)
class ExportState(Message[None]):
    op = "export_state"
    job: JobSpec
    state: str
    out: Path


@dataclass(frozen=True)
class ImportState(Message[bool]):
    """The worker removes ``file`` once read."""

    op = "import_state"
    job: JobSpec
    state: str
    file: Path


@dataclass(frozen=True)
class Finish(Message[None]):
    op = "finish"
    job: JobSpec
    state: str
    metrics: dict[str, Any]


REQUESTS: tuple[type[Message[Any]], ...] = (Warm, JoinGroup, Forget, NewJob, Prepare, Train, Pieces, Delta,
                                            ReduceSlice, Aggregate, Apply, ExportState, ImportState, Finish)


def _record(text: str) -> Record:
    try:
        return parse(bytes.fromhex(text))
    except RecordError as exc:
        raise ValueError(f"not a record: {exc}") from None


def _job_hex(job: JobSpec) -> str:
    """A job crosses as its record: a spec that is not its record's as read (one made with
    ``dataclasses.replace``) would arrive as the record's, so it is refused here."""
    if job != JobSpec.of(job.record):
        raise ValueError(f"job {job.id[:12]} differs from its record: only a record's own JobSpec crosses")
    return job.record.raw.hex()


def _job(text: str) -> JobSpec:
    try:
        return JobSpec.of(_record(text))
    except RecordError as exc:  # a record, but not a job's
        raise ValueError(str(exc)) from None


CODEC = Codec((Configure, Hello, Cancel, *REQUESTS), convert={Record: (lambda rec: rec.raw.hex(), _record),
                                                              JobSpec: (_job_hex, _job)})
