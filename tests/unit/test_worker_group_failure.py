"""A call run in every worker of a group at once (``_workerproc._all``) fails with the
most telling of its workers' failures, as itself: a group of exceptions would reach the
effects' runner as a bug, and a full disk must stop the daemon."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import trio

from ttpeer.daemon.worker._workerproc import _all
from ttpeer.errors import DiskError, JobError, TaskFailed, TtpeerError


class _Failing:
    """A worker whose call fails with ``exc`` (None: never ends), at once (``delay`` 0: no
    checkpoint, so workers failing together all fail before any is cancelled) or later."""

    def __init__(self, exc: BaseException | None, delay: float = 0.0) -> None:
        self.exc, self.delay = exc, delay

    async def call(self, request: Any, **_kw: Any) -> Any:
        if self.exc is None:
            await trio.sleep_forever()
        if self.delay:
            await trio.sleep(self.delay)
        raise self.exc


def _disk() -> DiskError:
    return DiskError(Path("/home/x/work/delta"), OSError(errno.ENOSPC, "No space left on device"))


@pytest.mark.parametrize("others", [[], [JobError("a state is missing")], [None]])
async def test_a_full_disk_in_one_worker_is_raised_as_itself(others: list[BaseException | None]) -> None:
    group = [_Failing(_disk()), *(_Failing(e) for e in others)]
    with pytest.raises(DiskError):
        await _all(group, lambda rank: rank, timeout=10)  # type: ignore[arg-type]


async def test_a_full_disk_outranks_the_tasks_failure_in_another_worker() -> None:
    group = [_Failing(TaskFailed("my_task.py:3: boom")), _Failing(_disk())]
    with pytest.raises(DiskError):
        await _all(group, lambda rank: rank, timeout=10)  # type: ignore[arg-type]


async def test_a_lone_workers_other_ttpeer_error_comes_out_as_itself_not_as_a_group() -> None:
    with pytest.raises(JobError, match="a state is missing"):
        await _all([_Failing(JobError("a state is missing"))], lambda rank: rank, timeout=10)  # type: ignore[list-item]
    with pytest.raises(TtpeerError) as got:
        await _all([_Failing(TtpeerError("plain"))], lambda rank: rank, timeout=10)  # type: ignore[list-item]
    assert not isinstance(got.value, BaseExceptionGroup)


async def test_in_a_group_of_several_another_ttpeer_error_is_not_made_retryable() -> None:
    # The others may wait in a collective for the worker that failed: a retry would queue
    # behind them until the step's timeout, so the group's failure stays one (ends the job).
    with pytest.raises(BaseExceptionGroup):
        await _all([_Failing(JobError("a state is missing")), _Failing(None)],  # type: ignore[list-item]
                   lambda rank: rank, timeout=10)


@pytest.mark.parametrize("rid", [[1], {"a": 1}, "7", 1.5, True])
def test_a_reply_whose_id_is_not_a_number_breaks_the_channel_not_the_daemon(rid: object) -> None:
    # The reader ends the worker on a ChannelError; any other exception would escape it.
    from types import SimpleNamespace

    from ttpeer.daemon.worker._channel import ChannelError
    from ttpeer.daemon.worker._workerproc import _Worker

    worker = _Worker(SimpleNamespace(stdout=None))  # type: ignore[arg-type]
    with pytest.raises(ChannelError, match="id is not a number"):
        worker._on_frame({"id": rid, "ok": True})
