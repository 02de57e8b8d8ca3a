"""The one funnel of the effects (``daemon/node/_effects.py``): a task handler yields its
reports and the runner feeds each to the machine when it is made, the effect's id on
every line logged; an error says what it means, reported before ``Failed``. And the
shards in training (``_activity``), which a ``Cancel`` stops."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from ttpeer.daemon._counters import Counters
from ttpeer.daemon._lifetime import Lifetime
from ttpeer.daemon.node._activity import Training
from ttpeer.daemon.node._effects import Effects
from ttpeer.daemon.node._slices import SliceMismatch
from ttpeer.errors import LocalWorkLost, StateMissing, TaskFailed, TtpeerError
from ttpeer.net import BlobCorrupt
from ttpeer.proto import (
    Declined,
    DeltaEncoded,
    DeltaPublished,
    Effect,
    Failed,
    JobFailed,
    JobSpec,
    PrepareJob,
    Progress,
    PublishDelta,
    Report,
    SliceRefused,
    StateLost,
    WorkLost,
    sign,
)

from .proto_helpers import Pool, hex64, job_body, key, state

JOB = JobSpec.of(sign("job", Pool("funnel").id, job_body(), key("funnel-author")))
DELTA = PublishDelta(JOB, 0, JOB.init, (0, 1), 16)


class _Machine:
    def __init__(self) -> None:
        self.reports: list[Report] = []
        self.pool = Pool("funnel").id

    def report(self, report: Report, now: float) -> list[Effect]:
        self.reports.append(report)
        return []


class _Executor:
    def __init__(self, raises: Exception | None) -> None:
        self.raises = raises
        self.released: list[str] = []

    async def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, Any]]:
        if self.raises is not None:
            raise self.raises
        return b"TTD1 delta", {"fp32_bytes": 40}

    async def release(self, job: str) -> None:
        self.released.append(job)


class _Blobs:
    def __init__(self, machine: _Machine) -> None:
        self.machine = machine
        self.reported_before_upload: list[Report] = []

    async def upload_delta(self, data: bytes, *, cut: bool = False) -> str:
        self.reported_before_upload = list(self.machine.reports)
        await trio.lowlevel.checkpoint()
        return "b" * 64


class _Node:
    """The collaborators of ``Effects`` that a ``PublishDelta`` uses (``_run`` gives None
    for the others)."""

    def __init__(self, raises: Exception | None = None) -> None:
        self.machine = _Machine()
        self.executor = _Executor(raises)
        self.blobs = _Blobs(self.machine)
        self.counters = Counters()
        self.life = Lifetime(on_stop=lambda: None)

    def now(self) -> float:
        return 0.0

    def process(self, effects: list[Effect]) -> None:
        assert effects == []


async def _run(node: _Node, eff: Effect) -> None:
    async with trio.open_nursery() as nursery:
        node.life.nursery = nursery
        effects = Effects(node.machine, node.executor, node.blobs, None, None, node.counters,  # type: ignore[arg-type]
                          node.life, records=None, relays=None, keys=None, replay=None, outbox=None, transport=None,
                          finished={}, now=node.now, process=node.process)
        effects.execute(eff)


async def test_a_report_reaches_the_machine_when_it_is_made_and_every_line_names_the_effect(caplog):  # noqa: ANN001
    node = _Node()
    with caplog.at_level(logging.DEBUG, logger="ttpeer.daemon"):
        await _run(node, DELTA)
    encoded = DeltaEncoded(JOB, 0, JOB.init, (0, 1))
    assert node.blobs.reported_before_upload == [encoded]  # the next shard trains during the upload
    assert node.machine.reports[0] == encoded
    assert isinstance(node.machine.reports[1], DeltaPublished) and len(node.machine.reports) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "ttpeer.daemon"]
    assert lines and all(line.startswith("[PublishDelta#1] ") for line in lines), lines
    assert "[PublishDelta#1] reports DeltaPublished" in lines


@pytest.mark.parametrize(("error", "said"), [
    (StateMissing(state("gone")), [StateLost(state("gone"))]),
    (LocalWorkLost(JOB.id, "the worker died"), [WorkLost(JOB.id)]),
    (SliceMismatch("r" * 64, "slice 0 does not hash"), [SliceRefused("r" * 64)]),
    (TtpeerError("the relay is away"), []),
])
async def test_an_error_of_the_tree_is_reported_as_what_it_says_then_failed(error: Exception, said: list[Report],
                                                                          caplog):  # noqa: ANN001
    node = _Node(raises=error)
    await _run(node, DELTA)
    assert node.machine.reports == [*said, Failed(DELTA)]
    assert f"[PublishDelta#1] failed: {error}" in caplog.text


@pytest.mark.parametrize(("error", "reason"), [
    (TaskFailed("loss raised ValueError at task.py:3"), "loss raised ValueError at task.py:3"),
    (RuntimeError("boom"), "internal error: RuntimeError: boom (a bug; see this peer's log)"),
])
async def test_a_task_failure_or_a_bug_ends_the_job_here(error: Exception, reason: str, caplog):  # noqa: ANN001
    node = _Node(raises=error)
    await _run(node, DELTA)
    assert node.machine.reports == [JobFailed(JOB.id, reason)]
    assert node.executor.released == [JOB.id]
    assert f"[PublishDelta#1] job {JOB.id[:12]} failed on this peer" in caplog.text


async def test_a_shard_in_training_stops_on_a_cancel_made_while_it_runs_not_before():
    training = Training()
    training.cancel("job", 0, 1)  # a cancel of an earlier try of the shard
    with training.shard(("job", 0, 1)) as progress:
        assert [progress.should_stop() for _ in range(3)] == [False, False, False]
        training.cancel("job", 0, 1)
        assert progress.should_stop()
        assert training.reports(progress.started + 2.0) == [Progress("job", 0, 1, 3, 1.5)]
    assert training.progress == {} and training.cancelled == set()


async def test_a_task_file_that_cannot_be_fetched_is_declined_naming_the_task_and_why():
    """As ``Failed(PrepareJob)`` would decline it, but saying which task's file and why: a
    broken task's job otherwise ends on "could not load the task", naming nothing."""
    job = JobSpec.of(sign("job", Pool("funnel").id, job_body(task="my_task.py", task_blob=hex64("task")),
                          key("funnel-author")))
    node = _Node()

    async def get(blob: str, max_size: int = 0, *, uploaders: list[str] | None = None) -> bytes:
        raise BlobCorrupt(blob, "its bytes do not hash to its name")

    node.blobs.get = get  # type: ignore[attr-defined]
    await _run(node, PrepareJob(job))
    (declined,) = node.machine.reports
    assert isinstance(declined, Declined) and declined.job == job.id and declined.code == ""
    assert "could not fetch the file of task 'my_task.py'" in declined.reason
    assert "its bytes do not hash to its name" in declined.reason
