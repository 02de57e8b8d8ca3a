"""TensorBoard event files, one folder per job: ``HOME/tensorboard/<job id>/``.

Theory of operation. Every ``EVERY`` seconds (and once more when the daemon stops) the
daemon looks at each job's chain of closes and writes the rounds it has not written
yet, one TensorBoard step per round (step = rounds closed, as in ``status``'s history):

    eval/loss, eval/<metric>, eval/...   the close's metrics (the closer's evaluation)
    train/loss                           the round's contributions' training loss, by samples
    train/lr                             their reported lr, else the job's inner lr
    pool/samples_per_s                   the contributing peers' training speeds, summed
    pool/utilization                     their time in inner steps over their wall time
    pool/contributions, pool/samples     what the close combined
    peer/bytes_sent, peer/bytes_received this daemon's totals when it saw the close
    peer/utilization                     this peer's time in inner steps over wall, on this job

Everything but ``peer/*`` comes from signed records, so every peer writes the same
numbers for a round; ``peer/*`` describe this daemon and are written only for rounds
that closed while it ran (a round caught up from the record log after a restart has
no such figure). The last round written is kept in ``.written`` beside the event files,
so a restart appends instead of writing every round again (a crash between the two may
write one round twice). A close replaced by a conflicting one after it was written is
not rewritten. The writer is the ``tensorboard`` package's own (no TensorFlow, no torch),
imported when the first round is written.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ttpeer.errors import DiskError
from ttpeer.proto import Record

from .._files import write_atomic

if TYPE_CHECKING:
    from ..node._node import Node
    from ._usage import Usage

log = logging.getLogger("ttpeer.daemon")
EVERY = 1.0
FOLDER = "tensorboard"
MARK = ".written"


def round_scalars(node: Node, job: Record, close: Record) -> dict[str, float]:
    """The record-derived scalars of one closed round (the same on every peer)."""
    out = {("eval/loss" if k == "eval_loss" else f"eval/{k}"): float(v) for k, v in close["metrics"].items()}
    contribs = [c for c in map(node.machine.records.by_id.get, close["contribs"]) if c is not None]
    samples = sum(c["samples"] for c in contribs)
    out["pool/contributions"] = float(len(contribs))
    out["pool/samples"] = float(samples)
    with_loss = [c for c in contribs if "train_loss" in c["metrics"]]
    weight = sum(c["samples"] for c in with_loss)
    if weight:
        out["train/loss"] = sum(c["metrics"]["train_loss"] * c["samples"] for c in with_loss) / weight
    rates = [c["metrics"]["lr"] for c in contribs if "lr" in c["metrics"]]
    lr = sum(rates) / len(rates) if rates else job.body.get("inner_lr")
    if isinstance(lr, int | float):
        out["train/lr"] = float(lr)
    speeds: dict[str, list[float]] = {}
    for c in contribs:
        if "samples_per_s" in c["metrics"]:
            speeds.setdefault(c.author, []).append(float(c["metrics"]["samples_per_s"]))
    if speeds:
        out["pool/samples_per_s"] = sum(sum(v) / len(v) for v in speeds.values())
    wall = sum(float(c["metrics"].get("wall_s", 0.0)) for c in contribs)
    if wall > 0:
        out["pool/utilization"] = min(1.0, sum(float(c["metrics"].get("train_s", 0.0)) for c in contribs) / wall)
    return out


class _JobBoard:
    def __init__(self, folder: Path, written: int, live_from: int) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # type: ignore[import-untyped]  # no hints

        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.writer = EventFileWriter(str(folder), max_queue_size=1000, flush_secs=60)
        self.written = written
        self.live_from = live_from  # rounds past this one closed while this daemon watched

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event  # type: ignore[import-untyped]  # no type hints
        from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]  # no type hints

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in sorted(scalars.items())])
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self.written = step

    def flush(self) -> None:
        self.writer.flush()
        write_atomic(self.folder / MARK, f"{self.written}\n".encode())


class Board:
    """Writes each job's closed rounds as TensorBoard scalars (see the module docstring)."""

    def __init__(self, root: Path, node: Node, usage: Usage | None = None) -> None:
        self.root = root
        self.node = node
        self.usage = usage
        self._jobs: dict[str, _JobBoard] = {}
        # Rounds already closed in the record log this daemon started from (made before the
        # node runs, after it loaded its log): their peer/* figures are not this run's to give.
        m = node.machine
        self._closed_at_start = {job.id: len(m.chain(job).closes) for job in m.records.jobs()}
        self._disabled = False

    def update(self) -> None:
        """Write every round closed since the last call. Never raises: a board is a view."""
        if self._disabled:
            return
        try:
            self._update()
        except ImportError:
            self._disabled = True
            log.warning("no TensorBoard event files: the tensorboard package is not installed "
                        "(pip install 'ttpeer[board]')")
        except (OSError, DiskError) as exc:  # a full disk: the next round tries again
            log.warning("could not write TensorBoard events under %s: %s", self.root, exc)
        except Exception:  # a bug here must not take the daemon down: stop writing, say so once
            self._disabled = True
            log.exception("writing TensorBoard events failed; no more are written until the daemon restarts")

    def _update(self) -> None:
        m = self.node.machine
        for job in m.records.jobs():
            chain = m.chain(job)
            board = self._board(job.id, len(chain.closes))
            if board is None or board.written >= len(chain.closes):
                continue
            for step in range(board.written + 1, len(chain.closes) + 1):
                scalars = round_scalars(self.node, job, chain.closes[step - 1])
                if step > board.live_from:
                    scalars.update(self._peer(job.id))
                board.write(step, scalars)
            board.flush()

    def _board(self, job: str, closed: int) -> _JobBoard | None:  # None: nothing to write yet
        board = self._jobs.get(job)
        if board is None:
            folder = self.root / job
            try:
                written = int((folder / MARK).read_text())
            except (OSError, ValueError):
                written = 0
            if written >= closed:
                return None  # nothing new (a job finished before this start): no empty event file
            board = self._jobs[job] = _JobBoard(folder, written, live_from=self._closed_at_start.get(job, 0))
        return board

    def _peer(self, job: str) -> dict[str, float]:
        out = {"peer/bytes_sent": float(self.node.bytes_sent),
               "peer/bytes_received": float(self.node.bytes_received)}
        ju = self.usage.jobs.get(job) if self.usage is not None else None
        util = ju.utilization(self.usage.clock()) if ju is not None and self.usage is not None else None
        if util is not None:
            out["peer/utilization"] = util
        return out

    def close(self) -> None:
        for board in self._jobs.values():
            board.writer.close()
        self._jobs.clear()


async def run_board(board: Board) -> None:
    """Keep ``board`` current until cancelled; the last rounds are written on the way out."""
    try:
        while True:
            await trio.sleep(EVERY)
            board.update()
    finally:
        board.update()
        board.close()
