"""A peer's workers agree before every batch (train/_localdp.py): on stopping, and on the
state an overlapped round's local model moves onto, which only the first worker learns
(it alone closes rounds). Two real processes in a gloo group on the CPU."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STATE = "sha256:" + "ab" * 32


def _rank(store: str, rank: int, out: str) -> None:
    import torch.distributed as dist

    from ttpeer import train

    train.join_group(Path(store), rank, 2, "cpu")
    ask = train.agreed_signal("cpu")
    got = [
        ask(False, None),  # nobody stops, nothing landed
        ask(rank == 1, None),  # one worker stops: all stop
        ask(False, STATE if rank == 0 else None),  # the first names the close: every worker gets it
    ]
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(repr(got))


def test_every_worker_gets_the_stop_and_the_state_one_of_them_names(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(str(tmp_path / "store"), r, str(tmp_path / f"out{r}"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    want = repr([(False, None), (True, None), (False, STATE)])
    assert (tmp_path / "out0").read_text() == want == (tmp_path / "out1").read_text()
