"""The one error boundary of ``TorchExecutor`` (real torch, real task files in a real
home): whatever a task's code raises leaves an executor method as one ``TaskFailed``
whose reason names the user's file and line; ``submit``'s probe refuses a task that
fails on one batch and keeps no copy of it; a peer whose copy of the data differs
declines with that reason."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

from ttpeer import train
from ttpeer.daemon import Home
from ttpeer.daemon._executor import Decline
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.errors import TaskFailed
from ttpeer.proto import JobSpec, Train, sign

from .proto_helpers import Pool, hex64, key

torch.set_num_threads(1)
POOL, AUTHOR = Pool("executor-failures"), key("executor-failures")
SPEC = {"mode": "fused", "rounds": 2, "shards": 2, "batches": 4, "batch_size": 8, "inner_lr": 1e-3,
        "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 0, "lease": 10.0,
        "steal": False}
HEAD = """
import os
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec

CALLS = 0

def _data(count, seed, classes=4):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (count,), generator=gen)
    return torch.randn(count, 6, generator=gen) + y[:, None].float(), y

def _acc(o, t):
    return (o.argmax(-1) == t).float().mean().item()
"""


def _home(tmp_path, name: str = "home") -> Home:  # noqa: ANN001
    (tmp_path / name).mkdir()
    return Home(tmp_path / name)


def _source(body: str) -> bytes:
    return (textwrap.dedent(HEAD) + textwrap.dedent(body)).encode()


def _line(source: bytes, text: str) -> int:
    return next(i for i, line in enumerate(source.decode().splitlines(), 1) if text in line)


async def _job(ex: TorchExecutor, name: str, source: bytes) -> JobSpec:
    """Submit (``new_job``), then prepare the job and hold its initial state, as a peer does."""
    fixed, init = await ex.new_job({**SPEC, "task": name}, source)
    body = {**SPEC, "task": name, **fixed, "init_blob": hex64("init"), "task_blob": hex64("task"), "at": 1}
    job = JobSpec.of(sign("job", POOL.id, body, AUTHOR))
    assert await ex.prepare(job, source) is None
    assert await ex.import_state(job, job.init, init)
    return job


async def _train(ex: TorchExecutor, job: JobSpec, shard: int = 0) -> int:
    return await ex.train(Train(job, 0, shard, 0, job.init, fresh=True), lambda: False)


RAISES_LATER = _source("""
    def loss(output, target):
        global CALLS
        CALLS += 1
        if CALLS > 2:  # the probe at submit calls it once
            raise RuntimeError("boom")
        return F.cross_entropy(output, target)

    def task():
        return TaskSpec(model=lambda: nn.Linear(6, 4), train=_data(64, 1), test=_data(16, 2), loss=loss,
                        metric=_acc, batch_size=8)
""")


@pytest.mark.slow
async def test_a_loss_that_raises_in_training_fails_with_the_users_file_and_line(tmp_path):
    ex = TorchExecutor(_home(tmp_path))
    job = await _job(ex, "my_task.py", RAISES_LATER)
    with pytest.raises(TaskFailed) as info:
        await _train(ex, job)
    line = _line(RAISES_LATER, 'raise RuntimeError("boom")')
    assert info.value.reason == f"my_task.py:{line} in loss: RuntimeError: boom"
    assert str(info.value) == info.value.reason


@pytest.mark.slow
async def test_a_nan_loss_fails_as_diverged_with_what_to_do(tmp_path):
    source = _source("""
        def loss(output, target):
            global CALLS
            CALLS += 1
            return F.cross_entropy(output, target) * (float("nan") if CALLS > 2 else 1.0)

        def task():
            return TaskSpec(model=lambda: nn.Linear(6, 4), train=_data(64, 1), test=_data(16, 2), loss=loss,
                            metric=_acc, batch_size=8)
    """)
    ex = TorchExecutor(_home(tmp_path))
    job = await _job(ex, "nan.py", source)
    with pytest.raises(TaskFailed, match=r"^training diverged \(the loss was NaN or inf in this shard\): "
                                         r"try a lower --inner-lr$"):
        await _train(ex, job)


async def test_a_failure_inside_torch_names_the_part_of_the_task_that_ran(tmp_path):
    # The loss is F.cross_entropy itself (no frame in the file); class 3 only shows up after
    # the first batch, so the probe passes and training meets it.
    source = _source("""
        def task():
            x, y = _data(64, 1, classes=3)
            y[8:] = 3
            return TaskSpec(model=lambda: nn.Linear(6, 3), train=(x, y), test=_data(16, 2, classes=3),
                            loss=F.cross_entropy, metric=_acc, batch_size=8)
    """)
    ex = TorchExecutor(_home(tmp_path))
    job = await _job(ex, "three.py", source)
    with pytest.raises(TaskFailed, match=r"^three\.py: the task's loss raised IndexError: Target 3 is out of bounds"):
        await _train(ex, job)


async def test_submit_refuses_a_task_that_fails_on_one_batch_and_keeps_no_copy(tmp_path):
    source = _source("""
        def loss(output, target):
            return F.cross_entropy(output, target)

        def task():
            return TaskSpec(model=lambda: nn.Linear(6, 3), train=_data(64, 1), test=_data(16, 2), loss=loss,
                            metric=_acc, batch_size=8)
    """)
    home = _home(tmp_path)
    with pytest.raises(TaskFailed) as info:
        await TorchExecutor(home).new_job({**SPEC, "task": "three_outputs.py"}, source)
    line = _line(source, "return F.cross_entropy")
    assert info.value.reason.startswith(f"three_outputs.py:{line} in loss: IndexError: Target 3 is out of bounds")
    assert not list((home.path / "tasks").glob("*"))


@pytest.mark.parametrize("body,reason", [
    ("def task(:\n    pass\n", r"^bad_syntax\.py:{n}: syntax error: "),
    ("def task():\n    raise RuntimeError('no data here')\n",
     r"^task\(\) in task file bad_syntax\.py raised RuntimeError: no data here \(at bad_syntax\.py:{n2} in task\)$"),
])
async def test_task_file_errors_name_the_users_file_not_the_homes_copy(tmp_path, body, reason):
    source = _source(body)
    n = len(textwrap.dedent(HEAD).splitlines()) + 1
    home = _home(tmp_path)
    with pytest.raises(TaskFailed, match=reason.format(n=n, n2=n + 1)) as info:
        await TorchExecutor(home).new_job({**SPEC, "task": "bad_syntax.py"}, source)
    assert "tasks/" not in info.value.reason
    assert not list((home.path / "tasks").glob("*"))


async def test_a_peer_whose_data_differs_declines_with_that_reason(tmp_path):
    seeded = _source("""
        def task():
            return TaskSpec(model=lambda: nn.Linear(6, 4), train=_data(64, 1), test=_data(16, 2),
                            loss=F.cross_entropy, metric=_acc, batch_size=8)
    """)
    random = seeded.replace(b"train=_data(64, 1)", b"train=_data(64, int.from_bytes(os.urandom(4), 'big'))")
    ex = TorchExecutor(_home(tmp_path))
    await _job(ex, "same.py", seeded)  # prepare answers None: the fingerprint matches
    fixed, _init = await ex.new_job({**SPEC, "task": "urandom.py"}, random)
    body = {**SPEC, "task": "urandom.py", **fixed, "init_blob": hex64("i"), "task_blob": hex64("t"), "at": 1}
    job = JobSpec.of(sign("job", POOL.id, body, AUTHOR))
    decline = await TorchExecutor(_home(tmp_path, "other")).prepare(job, random)
    assert isinstance(decline, Decline) and decline.code == "data"
    assert decline.reason.startswith("your copy of the task's data differs from the submitter's: fingerprint ")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["mnist1d", "charlm"])
def test_the_data_fingerprint_of_the_built_ins_is_cheap_and_stable(builtin_data, spec):
    task = train.load_task(spec, builtin_data)
    began = time.perf_counter()
    first = train.data_fingerprint(task)
    assert time.perf_counter() - began < 1.0
    assert first == train.data_fingerprint(train.load_task(spec, builtin_data)) and len(first) == 64


@pytest.mark.slow
async def test_task_code_calling_sys_exit_fails_the_job_not_the_process(tmp_path):
    source = RAISES_LATER.replace(b'raise RuntimeError("boom")', b'raise SystemExit("bye")')
    ex = TorchExecutor(_home(tmp_path))
    job = await _job(ex, "exits.py", source)
    with pytest.raises(TaskFailed) as info:
        await _train(ex, job)
    assert info.value.reason == f"exits.py:{_line(source, 'raise SystemExit')} in loss: SystemExit: bye"
