"""A peer that rewrites a job's final files for another state (the pool settled on
another branch after a fork at the job's end) is not exportable in between: ``done.json``
for the old state goes before the new files are written, so ``ttpeer export`` says the job
is still finishing instead of copying the losing branch's model (real torch, a real home)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ttpeer import train
from ttpeer.cli import main
from ttpeer.daemon import Home
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.errors import DiskError
from ttpeer.proto import JobSpec, sign

from .proto_helpers import Pool, hex64, key

torch.set_num_threads(1)
POOL, AUTHOR = Pool("final-rewrite"), key("final-rewrite")
SPEC = {"mode": "fused", "rounds": 2, "shards": 2, "batches": 4, "batch_size": 8, "inner_lr": 1e-3,
        "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 0, "lease": 10.0,
        "steal": False, "task": "mnist1d:samples=200"}


async def test_export_refuses_while_the_final_files_are_rewritten_for_another_state(tmp_path, capsys,
                                                                                 monkeypatch):
    home = Home(tmp_path / "home")
    home.create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())
    ex = TorchExecutor(home)
    fixed, init = await ex.new_job(SPEC, None)
    body = {**SPEC, **fixed, "init_blob": hex64("init"), "task_blob": hex64("task"), "at": 1}
    job = JobSpec.of(sign("job", POOL.id, body, AUTHOR))
    assert await ex.prepare(job, None) is None
    assert await ex.import_state(job, job.init, init)
    # A second state of the same model: the other branch's final state.
    other = train.state_from_bytes(init)
    for tensor in other.params.values():
        tensor.add_(0.5)
    other_hash = train.state_hash(other)
    assert await ex.import_state(job, other_hash, train.state_to_bytes(other))

    await ex.finish(job, job.init, {"state": job.init})
    done = home.states(job.id) / "done.json"
    assert json.loads(done.read_text())["state"] == job.init
    assert main(["export", job.id[:12], str(tmp_path / "a"), "--home", str(home.path)]) == 0
    capsys.readouterr()

    # The rewrite for the other state fails half way (a full disk while writing the model).
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train, "export_model", full)
    with pytest.raises(DiskError):
        await ex.finish(job, other_hash, {"state": other_hash})
    assert not done.exists()
    assert main(["export", job.id[:12], str(tmp_path / "b"), "--home", str(home.path)]) == 1
    assert "has not finished on this peer" in capsys.readouterr().err
    assert not (tmp_path / "b.safetensors").exists()

    monkeypatch.undo()
    await ex.finish(job, other_hash, {"state": other_hash})  # the same state again: kept as it is
    await ex.finish(job, other_hash, {"state": other_hash})
    assert json.loads(done.read_text())["state"] == other_hash
    assert main(["export", job.id[:12], str(tmp_path / "c"), "--home", str(home.path)]) == 0
    assert (tmp_path / "c.safetensors").read_bytes() != (tmp_path / "a.safetensors").read_bytes()
