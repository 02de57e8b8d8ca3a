"""Ensemble selection (train/_select.py): the held-out split, the greedy weights, the vote
that uses them, and the bundle that carries them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer import train
from ttpeer.train._select import HOLDOUT_MAX, HOLDOUT_MIN_TRAIN, holdout_scores, select, vote_loss

FIXTURES = Path(__file__).parent / "fixtures"


def _task(tmp_path: Path) -> train.LoadedTask:
    return train.load_task(str(FIXTURES / "task_linear.py"), tmp_path / "data")


@given(st.integers(0, 5000), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_the_split_is_a_pure_partition_of_the_training_set(n_train, seed):
    holdout = train.holdout_size(n_train)
    assert holdout <= min(HOLDOUT_MAX, n_train // 10) and (holdout == 0) == (n_train < HOLDOUT_MIN_TRAIN)
    if n_train == 0:
        return
    held, kept = train.holdout_split(n_train, holdout, seed)
    assert len(held) == holdout and sorted(held + kept) == list(range(n_train))
    assert held == sorted(held) and kept == sorted(kept)
    assert train.holdout_split(n_train, holdout, seed) == (held, kept)  # the same on every peer


def test_other_seeds_hold_out_other_samples_and_a_bad_size_is_refused():
    a, _ = train.holdout_split(1000, 100, 1)
    b, _ = train.holdout_split(1000, 100, 2)
    assert a != b
    with pytest.raises(ValueError, match="cannot hold out 1000 of 1000"):
        train.holdout_split(1000, 1000, 1)


def _probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_a_poor_member_gets_no_weight_and_the_vote_beats_the_best_member(tmp_path):
    task = _task(tmp_path)
    target = torch.tensor([0, 1, 0, 1])
    good = _probs([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4], [0.4, 0.6]])
    other = _probs([[0.6, 0.4], [0.2, 0.8], [0.8, 0.2], [0.45, 0.55]])  # right too, unlike where good is unsure
    poor = _probs([[0.3, 0.7], [0.7, 0.3], [0.5, 0.5], [0.6, 0.4]])
    weights = select(task, [good, other, poor], target)
    assert weights[2] == 0 and weights[0] > 0 and weights[1] > 0
    best_alone = min(vote_loss(task, [good, other, poor], [int(i == k) for i in range(3)], target) for k in range(3))
    assert vote_loss(task, [good, other, poor], weights, target) < best_alone
    # Uniform weights (the old vote) are worse here: the poor member drags the average down.
    assert vote_loss(task, [good, other, poor], [1, 1, 1], target) > vote_loss(task, [good, other, poor], weights,
                                                                                target)


@given(st.integers(1, 5), st.integers(1, 12), st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_the_vote_is_never_worse_than_its_best_member_on_the_held_out_samples(members, samples, seed):
    gen = torch.Generator().manual_seed(seed)
    probs = [F.softmax(torch.randn(samples, 3, generator=gen) * 3, dim=-1) for _ in range(members)]
    target = torch.randint(0, 3, (samples,), generator=gen)

    class Loss:  # a stand-in task: select reads only ``spec.loss``
        class spec:  # noqa: N801
            loss = staticmethod(F.nll_loss)

    weights = select(Loss, probs, target)  # type: ignore[arg-type]
    assert len(weights) == members and all(w >= 0 for w in weights) and sum(weights) >= 1
    alone = min(vote_loss(Loss, probs, [int(i == k) for i in range(members)], target)  # type: ignore[arg-type]
                for k in range(members))
    assert vote_loss(Loss, probs, weights, target) <= alone + 1e-7  # type: ignore[arg-type]
    assert select(Loss, probs, target) == weights  # type: ignore[arg-type]


def test_nothing_held_out_votes_with_every_member_once(tmp_path):
    assert select(_task(tmp_path), [_probs([[0.5, 0.5]])] * 3, torch.tensor([], dtype=torch.long)) == [1, 1, 1]


def test_the_weighted_vote_runs_only_the_members_that_count():
    a, b = torch.nn.Linear(2, 3), torch.nn.Linear(2, 3)
    x = torch.randn(4, 2)
    vote = train.Ensemble([a, b], [3, 0])
    assert len(vote.members) == 1
    assert torch.allclose(vote(x), F.softmax(a(x), dim=-1))
    mixed = train.Ensemble([a, b], [1, 2])(x)
    assert torch.allclose(mixed, (F.softmax(a(x), dim=-1) + 2 * F.softmax(b(x), dim=-1)) / 3)
    with pytest.raises(ValueError, match="one weight >= 0 per member"):
        train.Ensemble([a, b], [0, 0])


@pytest.mark.slow
def test_the_bundle_carries_the_weights_and_the_held_out_figures(tmp_path):
    task = _task(tmp_path)
    members = [{"seed": 1, "lr": 0.05, "weight_decay": 0.0}, {"seed": 2, "lr": 0.05, "weight_decay": 0.0}]
    state = train.init_ensemble(task, members)
    held, kept = train.holdout_split(task.n_train, 40, 7)
    for i, m in enumerate(members):
        ckpt, _ = train.train_unit(task, state, i, m, 0, 5, 16, kept=kept)
        state = train.combine(state, [(i, ckpt)])
    weights, models, (probs, target) = train.weigh_members(task, state, held)
    assert len(target) == 40
    scores = train.evaluate_ensemble(task, state, weights=weights, models=models)
    out = tmp_path / "final.safetensors"
    train.export_ensemble(state, task, members, out, {"job": "x"}, scores, weights,
                          holdout_scores(task, probs, target, weights))
    side = json.loads(out.with_suffix(".json").read_text())
    assert [m["weight"] for m in side["members"]] == weights
    assert all(set(m["holdout"]) == {"eval_loss", "accuracy"} for m in side["members"])
    assert side["ensemble"]["voting"] == sum(1 for w in weights if w)
    assert not math.isnan(side["ensemble"]["holdout"]["eval_loss"])
    vote = train.load_bundle(out, task)
    assert vote.weights == [w for w in weights if w]
    x = torch.randn(5, 8)
    with torch.no_grad():
        direct = sum(w * F.softmax(m(x), dim=-1) for w, m in zip(weights, models, strict=True) if w) / sum(weights)
        assert torch.allclose(vote(x), direct, atol=1e-6)


@pytest.mark.slow
def test_a_member_trains_only_on_the_samples_the_job_kept(tmp_path, monkeypatch):
    task = _task(tmp_path)
    member = {"seed": 1, "lr": 0.05, "weight_decay": 0.0}
    held, kept = train.holdout_split(task.n_train, 40, 7)
    seen: list[int] = []
    real = train._spec.fetch_batch

    def spy(data, indices):
        if data is task.train:
            seen.extend(indices)
        return real(data, indices)

    monkeypatch.setattr(train._inner, "fetch_batch", spy)
    train.train_unit(task, train.init_ensemble(task, [member]), 0, member, 0, 20, 16, kept=kept)
    assert seen and not set(seen) & set(held)
