"""Ensemble members: a unit continues a member from its checkpoint exactly, member
checkpoints survive the wire and refuse tampering, and the bundle round-trips
through ``ttpeer.load`` and ``ttpeer predict``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import ttpeer
from ttpeer import train
from ttpeer.cli import main
from ttpeer.errors import UsageError
from ttpeer.proto import member_variants

TASK_FILE = Path(__file__).parent / "fixtures" / "task_linear.py"
H, BATCH = 6, 16


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return train.load_task(str(TASK_FILE), tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def members():
    return member_variants(seed=5, count=3, lr=0.05, weight_decay=0.01)


def _run(task, members, units: int) -> train.OuterState:
    state = train.init_ensemble(task, members)
    for unit in range(units):
        parts = []
        for i, m in enumerate(members):
            ckpt, samples = train.train_unit(task, state, i, m, unit, H, BATCH)
            assert samples == H * BATCH
            parts.append(train.decode_member(train.encode_member(i, ckpt), state))
        state = train.combine(state, parts)
    return state


def test_members_differ_in_seed_and_variant(members):
    assert len({m["seed"] for m in members}) == 3
    assert len({(m["lr"], m["weight_decay"]) for m in members}) == 3
    assert member_variants(5, 3, 0.05, 0.01) == members  # a pure function of the job


@pytest.mark.slow
def test_a_unit_continues_the_member_exactly_as_one_uninterrupted_run(task, members):
    # Two units, each from the previous unit's published checkpoint, against one trainer
    # that never stopped: same weights bit for bit, and the step count carries on.
    state = _run(task, members, units=2)
    m = members[1]
    ref = train.InnerTrainer(task, lr=m["lr"], weight_decay=m["weight_decay"], seed=m["seed"])
    for unit in range(2):
        ref.train_shard(train.shard_indices(task.n_train, m["seed"], unit, 0, 1, H, BATCH))
    weights = {n: state.params[f"m0001/w/{n}"] for n in ("weight", "bias")}
    for name, tensor in ref.model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    assert [train.member_steps(state, i) for i in range(3)] == [2 * H] * 3


@pytest.mark.slow
def test_a_stopped_unit_publishes_nothing(task, members):
    state = train.init_ensemble(task, members)
    calls = iter(range(100))
    ckpt, samples = train.train_unit(task, state, 0, members[0], 0, H, BATCH, should_stop=lambda: next(calls) >= 3)
    assert (ckpt, samples) == (None, 0)


@pytest.mark.slow
def test_tampered_or_foreign_member_checkpoints_are_refused(task, members):
    state = train.init_ensemble(task, members)
    ckpt, _ = train.train_unit(task, state, 2, members[2], 0, H, BATCH)
    data = train.encode_member(2, ckpt)
    bad = [b"XXXX" + data[4:], data[:4] + (7).to_bytes(4, "little") + data[8:], data[:-9], data + b"\0",
           data[:8] + b"\x28\xb5\x2f\xfd" + b"\0" * 40]
    for blob in bad:
        with pytest.raises(train.CheckpointError):
            train.decode_member(blob, state)
    with pytest.raises(train.CheckpointError):
        train.combine(state, [(2, ckpt), (2, ckpt)])


@pytest.mark.slow
def test_the_bundle_round_trips_through_load_and_predict(task, members, tmp_path, capsys):
    state = _run(task, members, units=2)
    scores = train.evaluate_ensemble(task, state)
    out = tmp_path / "bundle.safetensors"
    train.export_ensemble(state, task, members, out, {"rounds": 2}, scores)
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["mode"] == "ensemble" and len(side["members"]) == 3
    assert [m["seed"] for m in side["members"]] == [m["seed"] for m in members]
    assert [m["steps"] for m in side["members"]] == [2 * H] * 3
    assert side["ensemble"]["accuracy"] == pytest.approx(scores[1][1], abs=1e-6)

    model = ttpeer.load(out, task=TASK_FILE)
    assert isinstance(model, train.Ensemble) and len(model.members) == 3
    x, y = task.test.tensors
    with torch.no_grad():
        probs = model(x)
    # The vote is the average of the members' probabilities, and scores as the sidecar says.
    expected = torch.stack([torch.softmax(m(x), -1) for m in train._ensemble.member_models(task, state)]).mean(0)
    assert torch.allclose(probs, expected, atol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(len(x)), atol=1e-5)
    assert (probs.argmax(-1) == y).float().mean().item() == pytest.approx(side["ensemble"]["accuracy"], abs=1e-6)

    inputs = tmp_path / "rows.npy"
    np.save(inputs, x[:5].numpy())
    capsys.readouterr()
    assert main(["predict", str(out), str(inputs), "--task", str(TASK_FILE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split("\t")[0]) for line in lines] == probs[:5].argmax(-1).tolist()
    text = tmp_path / "rows.csv"
    text.write_text("\n".join(",".join(str(v) for v in row) for row in x[:5].tolist()))
    assert main(["predict", str(out), str(text), "--task", str(TASK_FILE)]) == 0
    assert [int(line.split("\t")[0]) for line in capsys.readouterr().out.splitlines()] == probs[:5].argmax(-1).tolist()


def test_load_says_what_to_do_with_bad_input(task, members, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        ttpeer.load(tmp_path / "missing.safetensors")
    state = train.init_ensemble(task, members)
    out = tmp_path / "b.safetensors"
    train.export_ensemble(state, task, members, out, {}, train.evaluate_ensemble(task, state))
    with pytest.raises(UsageError, match="pass the original file"):
        ttpeer.load(out, home=tmp_path / "no-home")  # trained from a task file, which the bundle does not carry
    out.write_bytes(out.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(UsageError, match="sha256"):
        ttpeer.load(out, task=TASK_FILE)
    out.with_suffix(".json").unlink()
    with pytest.raises(UsageError, match="sidecar"):
        ttpeer.load(out, task=TASK_FILE)


def test_fused_models_load_through_the_same_api(task, tmp_path):
    state = train.init_state(task, 3)
    out = tmp_path / "fused.safetensors"
    train.export_model(state, task, out, {})
    model = ttpeer.load(out, task=TASK_FILE)
    assert isinstance(model, torch.nn.Linear)
    assert torch.equal(model.weight, state.params["weight"])
