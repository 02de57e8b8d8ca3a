"""Warm starts: a job's initial state from a safetensors file, checked tensor by tensor
against the task's model, and built by the submitter's executor as ``new_job`` returns it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ttpeer.daemon import Home
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.errors import JobError
from ttpeer.train import (
    CheckpointError,
    export_model,
    init_state,
    load_task,
    state_from_bytes,
    state_hash,
    warm_state,
)

torch.set_num_threads(1)
SMALL = "charlm:n_layer=2,d_model=32,block_size=16"


@pytest.fixture(scope="module")
def task():
    return load_task(SMALL, Path("/nonexistent"))


def test_an_export_of_this_project_starts_a_job_from_exactly_its_weights(task, tmp_path):
    trained = init_state(task, 3)
    trained.params["head.bias"] += 0.5  # not what a fresh model of any seed holds
    export_model(trained, task, tmp_path / "m.safetensors", {})
    warm = warm_state(task, tmp_path / "m.safetensors")
    assert list(warm.params) == list(trained.params)  # the model's order, as init_state's
    assert state_hash(warm) == state_hash(trained)  # same weights, zero outer momentum
    assert all(not m.any() for m in warm.momentum.values())


def test_a_half_precision_state_dict_widens_to_fp32_exactly(task, tmp_path):
    state = init_state(task, 0)
    half = {n: t.to(torch.bfloat16) for n, t in state.params.items()}
    save_file(half, str(tmp_path / "bf16.safetensors"))
    warm = warm_state(task, tmp_path / "bf16.safetensors")
    assert all(warm.params[n].dtype == torch.float32 and torch.equal(warm.params[n], half[n].float()) for n in half)


@pytest.mark.parametrize(("change", "error"), [
    # another model: the first tensor of the task's model that the file lacks
    (lambda p: {n: t for n, t in p.items() if not n.startswith("blocks.1.")},
     "it has no tensor 'blocks.1.ln1.weight'"),
    (lambda p: {**p, "tok.weight": torch.zeros(256, 64)},
     "tensor 'tok.weight' has shape (256, 64), the model's is (256, 32)"),
    (lambda p: {**p, "pos.weight": p["pos.weight"].double()},
     "tensor 'pos.weight' is float64, the model's is float32; convert the file to float32"),
    (lambda p: {**p, "head.weight": p["head.weight"].long()}, "tensor 'head.weight' is int64"),
    (lambda p: {**p, "lm_head.weight": torch.zeros(3)},
     "it has a tensor 'lm_head.weight' that the model does not have"),
])
def test_a_file_of_another_model_names_the_first_tensor_that_does_not_match(task, tmp_path, change, error):
    path = tmp_path / "other.safetensors"
    save_file(change(dict(init_state(task, 0).params)), str(path))
    with pytest.raises(CheckpointError, match=f"does not match task {SMALL}'s model") as exc:
        warm_state(task, path)
    assert error in str(exc.value)


def test_a_file_that_is_not_safetensors_or_not_there_says_so(task, tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"not a model at all")
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        warm_state(task, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="no such file"):
        warm_state(task, tmp_path / "missing.safetensors")


def _spec(**changes) -> dict:
    return {"task": SMALL, "mode": "fused", "rounds": 2, "shards": 2, "batches": 4, "batch_size": 8,
            "inner_lr": 1e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 0,
            "lease": 5.0, "steal": True, **changes}


async def test_the_submitter_builds_the_initial_state_from_the_file(task, tmp_path):
    home = Home(tmp_path / "a")
    home.create_pool("https://relay.test.invalid", "sha256:" + "0" * 64, "a", time.time())
    executor = TorchExecutor(home)
    start = init_state(task, 9)
    export_model(start, task, tmp_path / "m.safetensors", {})
    fixed, data = await executor.new_job(_spec(init=str(tmp_path / "m.safetensors")), None)
    assert fixed["init"] == state_hash(start) == state_hash(state_from_bytes(data))
    cold, _ = await executor.new_job(_spec(), None)
    assert cold["init"] == state_hash(init_state(task, 0)) != fixed["init"]
    other = load_task("charlm:n_layer=1,d_model=32,block_size=16", Path("/nonexistent"))
    export_model(init_state(other, 0), other, tmp_path / "o.safetensors", {})
    with pytest.raises(JobError, match="it has no tensor 'blocks.1.ln1.weight'"):
        await executor.new_job(_spec(init=str(tmp_path / "o.safetensors")), None)
    with pytest.raises(JobError, match="--warmup .8 steps. must be shorter than the job, which has 8 inner steps"):
        await executor.new_job(_spec(warmup=8), None)
