"""Broken tasks on real processes: a relay and two `ttpeer` daemons on loopback.

A task whose loss raises after a few calls and one whose loss turns NaN fail their
jobs on both peers, so for the pool: the daemons live on, `status` and `wait` (exit 1)
say why with the task file's name and line. A model with 3 outputs for 4 classes is
refused at `submit` (it runs one batch first) and nothing is published. A daemon
restarted afterwards does not run the failed jobs again, and the same pool then
finishes a good job with identical exports on both peers. On the way, a job is
cancelled by its submitter (another member is refused) and `wait` says who did it.
"""

from __future__ import annotations

import contextlib
import io
import signal
import textwrap
from pathlib import Path

import pytest

from ttpeer.cli import main
from ttpeer_harness import READY_TIMEOUT, Cluster, job_spec, make_pool, status, ttpeer, wait_for

from ._helpers import job_finished, job_of

pytestmark = pytest.mark.slow

_DATA = '''
import os
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec

def _data(count, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (count,), generator=gen)
    return torch.randn(count, 8, generator=gen) + y[:, None].float(), y

def _mark():  # the test counts the broken loss's calls across daemon restarts
    with open(os.environ["TTPEER_TEST_MARKS"], "a") as f:
        f.write("call\\n")

CALLS = 0

def task():
    return TaskSpec(model=lambda: nn.Linear(8, OUTPUTS), train=_data(256, 1), test=_data(64, 2),
                    loss=loss, metric=lambda o, t: (o.argmax(-1) == t).float().mean().item(),
                    batch_size=16)
'''
TASKS = {
    # The probe at submit calls the loss once; training calls it again and it raises.
    "boom_task.py": '''
OUTPUTS = 4

def loss(output, target):
    global CALLS
    CALLS += 1
    _mark()
    if CALLS > 3:
        raise RuntimeError("boom")
    return F.cross_entropy(output, target)
''',
    "nan_task.py": '''
OUTPUTS = 4

def loss(output, target):
    global CALLS
    CALLS += 1
    _mark()
    value = F.cross_entropy(output, target)
    return value * float("nan") if CALLS > 3 else value
''',
    "three_outputs.py": '''
OUTPUTS = 3  # the data has 4 classes

def loss(output, target):
    return F.cross_entropy(output, target)
''',
}
SPEC_ARGS = ("--rounds", "2", "--shards", "2", "--inner-steps", "3", "--batch-size", "16", "--lease", "10s")


def _write_tasks(folder: Path) -> dict[str, Path]:
    paths = {}
    for name, tail in TASKS.items():
        paths[name] = folder / name
        paths[name].write_text(textwrap.dedent(_DATA) + textwrap.dedent(tail))
    return paths


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _marks(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_broken_tasks_fail_their_jobs_and_the_pool_goes_on(tmp_path):
    marks = tmp_path / "marks"
    cluster = Cluster(tmp_path, env={"TTPEER_TEST_MARKS": str(marks)})
    try:
        tasks = _write_tasks(tmp_path)
        url, fp = cluster.start_relay()
        alice, bob = make_pool(cluster, url, fp, ["alice", "bob"])

        # Fail early: 3 outputs for 4 classes is refused at the submitting terminal.
        code, _out, err = _cli("submit", "--task", str(tasks["three_outputs.py"]), *SPEC_ARGS, "--home", str(alice))
        line = _line(tasks["three_outputs.py"], "return F.cross_entropy")
        assert code == 1
        assert err.startswith(f"error: three_outputs.py:{line} in loss: IndexError: Target 3 is out of bounds")
        assert status(alice)["jobs"] == [] and not list((alice / "tasks").glob("*.py"))

        # Fails on both peers (the first batches are fine), so for the pool.
        boom = ttpeer("submit", "--task", str(tasks["boom_task.py"]), *SPEC_ARGS, "--home", str(alice))[-1]
        # 'wait' answers as soon as the job ends here: "failed on this peer" while the other
        # peer may still train it; once both failed, the job failed for the pool.
        wait_for(lambda: (j := job_of(bob, boom)) and j["ended"], 90, "the job to fail for the pool")
        code, _out, err = _cli("wait", boom, "--timeout", "90s", "--home", str(bob))
        line = _line(tasks["boom_task.py"], 'raise RuntimeError("boom")')
        assert code == 1, err
        assert f"job {boom[:12]} failed on every peer: " in err
        for who in ("alice", "bob"):
            assert f"{who}: boom_task.py:{line} in loss: RuntimeError: boom" in err
        nan = ttpeer("submit", "--task", str(tasks["nan_task.py"]), *SPEC_ARGS, "--home", str(alice))[-1]
        code, _out, err = _cli("wait", nan, "--timeout", "90s", "--home", str(alice))
        assert code == 1 and "training diverged (the loss was NaN or inf in this shard): try a lower --inner-lr" in err
        wait_for(lambda: all(job_of(h, j)["state"] == "failed" for h in (alice, bob) for j in (boom, nan)),
                 30, "both peers to say both jobs failed")
        assert all(p.poll() is None for p in cluster.procs), "a daemon died"
        code, out, _err = _cli("status", "--home", str(bob))
        assert code == 0 and f"failed on alice ({status(alice)['node']['id'][:12]}): boom_task.py:{line}" in out

        # A cancel: only the submitter (alice) or the admin (alice too) may; bob is refused.
        long = ttpeer("submit", "--task", "mnist1d", "--rounds", "50", "--shards", "2", "--inner-steps", "20",
                      "--home", str(alice))[-1]
        wait_for(lambda: job_of(bob, long) and job_of(bob, long)["state"] == "running", 60, "bob to run the job")
        code, _out, err = _cli("cancel", long[:10], "--home", str(bob))
        assert code == 1 and "only the job's submitter (alice) or the pool's admin can cancel" in err
        assert ttpeer("cancel", long[:10], "--home", str(alice))[0].startswith(f"cancelled job {long[:12]}")
        code, _out, err = _cli("wait", long, "--timeout", "30s", "--home", str(bob))
        assert code == 1 and f"job {long[:12]} was cancelled by alice" in err
        wait_for(lambda: all(status(h)["jobs"][-1]["training_shard"] is None for h in (alice, bob)), 10,
                 "both peers to stop training it")

        # A restarted daemon replays the records and does not run the failed jobs again.
        before = _marks(marks)
        cluster.named["bob"].send_signal(signal.SIGTERM)
        cluster.named["bob"].wait(timeout=30)
        cluster.spawn("bob", "up", "--home", str(bob))
        wait_for(lambda: status(bob)["node"]["has_pool_key"], READY_TIMEOUT, "bob to be back")

        spec = {**job_spec(rounds=2), "shards": 2, "batches": 5}
        good = ttpeer("submit", "--task", "mnist1d", "--rounds", "2", "--shards", "2", "--inner-steps",
                      str(spec["batches"]), "--home", str(alice))[-1]
        wait_for(lambda: job_finished([alice, bob], good), 120, "the good job to finish on both peers")
        hashes = {ttpeer("export", good, str(h / "model.safetensors"), "--home", str(h))[-1] for h in (alice, bob)}
        assert len(hashes) == 1
        assert _marks(marks) == before  # jobs run in order: bob passed the failed ones by
        assert job_of(bob, boom)["state"] == job_of(bob, nan)["state"] == "failed"
        assert job_of(bob, long)["state"] == "cancelled" and job_of(bob, long)["round"] < 50
    finally:
        cluster.close()
