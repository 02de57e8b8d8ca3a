"""``DeltasAhead``: a round's whole deltas fetched ahead of its close, against a fake
``Blobs`` (below the interface under test): a close takes what came and waits for what is
on its way; duplicates, failures, a new round and a job's end lose nothing and leave no
file or pending mark behind."""

from __future__ import annotations

import logging
from pathlib import Path

import trio
import trio.testing

from ttpeer.daemon.node._deltas import DeltasAhead
from ttpeer.net import RelayUnavailable
from ttpeer.proto import FetchDeltas, JobSpec, sign

from .proto_helpers import Pool, hex64, job_body, key

P = Pool("ahead-daemon")
K = key("ahead-daemon")
JOB = sign("job", P.id, job_body(shards=4), K)
SPEC = JobSpec.of(JOB)
LOG = logging.LoggerAdapter(logging.getLogger("test"), {})


def _contrib(i: int, blob: str | None = None):
    return sign("contrib", P.id, {"job": JOB.id, "round": 0, "base": JOB["init"], "shards": [i], "samples": 8,
                                  "blob": blob or hex64(("d", i)), "size": 100, "metrics": {}}, key(f"c{i}"))


class FakeBlobs:
    """Writes each delta's blob name into its file once ``release`` lets it; ``fail``: blobs
    whose fetch raises as a dropped connection does."""

    def __init__(self, root: Path) -> None:
        self.root, self.n, self.fetched = root, 0, []
        self.release = trio.Event()
        self.fail: set[str] = set()

    def work_path(self, job: str, what: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self.n += 1
        return self.root / f"{what}-{self.n}.bin"

    async def fetch_delta(self, contrib, path: Path) -> None:
        await self.release.wait()
        self.fetched.append(contrib["blob"])
        if contrib["blob"] in self.fail:
            raise RelayUnavailable("dropped (a test's fault)")
        path.write_text(contrib["blob"])


async def test_a_close_takes_what_came_and_waits_for_what_is_on_its_way(tmp_path):
    blobs = FakeBlobs(tmp_path / "work")
    ahead = DeltasAhead(blobs)  # type: ignore[arg-type]
    a, b = _contrib(0), _contrib(1)
    async with trio.open_nursery() as nursery:
        ahead.start(FetchDeltas(SPEC, 0, (a, b, _contrib(2, a["blob"]))), nursery, LOG)  # a's blob twice
        got: list[bool] = []

        async def close() -> None:
            got.append(await ahead.take(JOB.id, a, tmp_path / "in-a"))

        nursery.start_soon(close)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # on its way: the close waits rather than fetching it too
        blobs.release.set()
    assert got == [True] and (tmp_path / "in-a").read_text() == a["blob"]
    assert sorted(blobs.fetched) == sorted([a["blob"], b["blob"]])  # the duplicate fetched once
    assert await ahead.take(JOB.id, b, tmp_path / "in-b") and ahead.used == 2
    assert not await ahead.take(JOB.id, b, tmp_path / "again")  # taken: the close fetches it
    assert not list((tmp_path / "work").iterdir()) and not ahead._pending


async def test_a_failed_fetch_a_new_round_and_the_jobs_end_leave_nothing_behind(tmp_path):
    blobs = FakeBlobs(tmp_path / "work")
    blobs.release.set()
    blobs.fail = {hex64(("d", 1))}
    ahead = DeltasAhead(blobs)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        ahead.start(FetchDeltas(SPEC, 0, (_contrib(0), _contrib(1))), nursery, LOG)
    assert not await ahead.take(JOB.id, _contrib(1), tmp_path / "x")  # failed: left to the close
    assert [p.read_text() for p in (tmp_path / "work").iterdir()] == [hex64(("d", 0))]
    async with trio.open_nursery() as nursery:  # round 1: round 0's files go
        ahead.start(FetchDeltas(SPEC, 1, (_contrib(2),)), nursery, LOG)
    assert [p.read_text() for p in (tmp_path / "work").iterdir()] == [hex64(("d", 2))]
    ahead.forget_job(JOB.id)
    assert not list((tmp_path / "work").iterdir())


async def test_a_fetch_cancelled_on_its_way_clears_its_mark(tmp_path):
    blobs = FakeBlobs(tmp_path / "work")  # never released
    ahead = DeltasAhead(blobs)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        ahead.start(FetchDeltas(SPEC, 0, (_contrib(0), _contrib(1))), nursery, LOG)
        await trio.testing.wait_all_tasks_blocked()
        assert len(ahead._pending) == 2
        nursery.cancel_scope.cancel()
    assert not ahead._pending
    with trio.fail_after(1):  # nothing to wait for: the close fetches it
        assert not await ahead.take(JOB.id, _contrib(0), tmp_path / "x")


async def test_a_fetch_ending_late_leaves_a_later_fetch_of_the_same_blob_pending(tmp_path):
    # Round 0's first batch: X fails at once, Y hangs. A second cover of the round names X
    # again, which is fetched anew (held back). When the first batch ends, X's new fetch
    # is still on its way, and a close must wait for it rather than find nothing.
    x, y = _contrib(0), _contrib(1)
    gates = {x["blob"]: trio.Event(), y["blob"]: trio.Event()}

    class Gated(FakeBlobs):
        async def fetch_delta(self, contrib, path: Path) -> None:
            if contrib["blob"] == x["blob"] and not self.fetched:
                self.fetched.append("failed")
                raise RelayUnavailable("dropped (a test's fault)")
            await gates[contrib["blob"]].wait()
            path.write_text(contrib["blob"])

    blobs = Gated(tmp_path / "work")
    ahead = DeltasAhead(blobs)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        ahead.start(FetchDeltas(SPEC, 0, (x, y)), nursery, LOG)
        await trio.testing.wait_all_tasks_blocked()  # X failed; Y waits
        ahead.start(FetchDeltas(SPEC, 0, (x,)), nursery, LOG)  # X again, held at its gate
        gates[y["blob"]].set()  # the first batch ends
        await trio.testing.wait_all_tasks_blocked()
        got: list[bool] = []

        async def close() -> None:
            got.append(await ahead.take(JOB.id, x, tmp_path / "in-x"))

        nursery.start_soon(close)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # X's second fetch is still pending: the close waits for it
        gates[x["blob"]].set()
    assert got == [True] and (tmp_path / "in-x").read_text() == x["blob"]
