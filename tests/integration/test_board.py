"""TensorBoard events from the records: two real torch peers in one process train a job;
each writes every closed round's scalars under HOME/tensorboard/<job>/, read back with
tensorboard's own EventAccumulator. (The daemon writing them live, with this peer's own
figures, is in test_hf_processes.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ttpeer.daemon.service._board import Board
from ttpeer.daemon.service._views import history

from .test_torch_nodes import TASK_FILE, _homes, _spec, run_jobs

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

# These nodes run a bare TorchExecutor: their contributions carry no time split, so there is
# no pool/samples_per_s or pool/utilization here (the daemon's are in test_hf_processes).
# The task's metric comes as eval/<metric_name> besides these.
RECORD_TAGS = {"eval/loss", "train/loss", "train/lr", "pool/contributions", "pool/samples"}


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


async def test_every_closed_round_becomes_scalars_the_same_on_every_peer(tmp_path):
    homes = _homes(tmp_path)
    spec = _spec(rounds=3, shards=2, batches=6, steal=True, inner_lr=0.05)
    (job,), nodes = await run_jobs(homes, [spec], TASK_FILE.read_bytes())
    seen = []
    for home, node in zip(homes, nodes, strict=True):
        board = Board(home.path / "tensorboard", node)
        board.update()
        board.close()
        got = scalars(home.path / "tensorboard" / job.id)
        # Rounds caught up after the fact carry no figure of this daemon's own (peer/*).
        assert set(got) == RECORD_TAGS | {"eval/accuracy"}, sorted(got)
        assert all([step for step, _ in points] == [1, 2, 3] for points in got.values())
        rows = history(node.machine.records, node.machine.chain(job))
        assert [v for _, v in got["eval/loss"]] == pytest.approx([r["eval_loss"] for r in rows])
        assert [v for _, v in got["eval/accuracy"]] == pytest.approx([r["eval_metric"] for r in rows])
        assert [v for _, v in got["train/lr"]] == pytest.approx([0.05] * 3)
        losses = [v for _, v in got["train/loss"]]
        assert 0 < losses[-1] < losses[0], losses  # the inner steps' own loss, as it fell
        assert [v for _, v in got["pool/contributions"]] == [r["contributions"] for r in rows]
        seen.append(got)
        # A second writer (a restart) appends nothing: the rounds are written already.
        again = Board(home.path / "tensorboard", node)
        again.update()
        again.close()
        assert len(list((home.path / "tensorboard" / job.id).glob("events.out.tfevents.*"))) == 1
    assert seen[0] == seen[1]  # from signed records: every peer writes the same numbers


def test_the_writer_imports_neither_torch_nor_tensorflow():
    # What _board imports to write (the daemon is to be torch-free once training lives in
    # workers; tensorboardX, the other writer without TensorFlow, imports torch).
    code = ("import sys; from tensorboard.summary.writer import event_file_writer; "
            "from tensorboard.compat.proto import event_pb2, summary_pb2; "
            "print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split()[-1] == "[]"
