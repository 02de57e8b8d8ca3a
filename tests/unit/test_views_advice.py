"""Overfitting advice: a pure function of the closed rounds (their eval loss, and the
training loss their contributions report); and the training loss the inner trainer
reports with each delta."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ttpeer.daemon.service._views import OVERFIT_ROUNDS, advice
from ttpeer.train import InnerTrainer, init_state, load_task, shard_indices

FIXTURE = Path(__file__).parent / "fixtures" / "task_linear.py"


def _rows(evals: list[float], trains: list[float | None]) -> list[dict[str, float | None]]:
    pairs = enumerate(zip(evals, trains, strict=True))
    return [{"round": i + 1, "eval_loss": e, "train_loss": t} for i, (e, t) in pairs]


def test_eval_loss_rising_for_several_rounds_while_train_loss_falls_is_overfitting() -> None:
    # The default fused mnist1d of the issue: eval loss 1.21 -> 11.19 while training fit better.
    got = advice(_rows([1.3, 1.21, 2.0, 4.1, 11.19], [1.6, 1.1, 0.6, 0.2, 0.05]))
    assert got is not None and "overfitting" in got
    assert "1.21 -> 11.19" in got and "0.05" in got  # the window's figures
    for change in ("more data", "--rounds", "--inner-steps", "--inner-lr", "--weight-decay"):
        assert change in got


def test_no_advice_while_learning_too_early_or_without_train_loss() -> None:
    assert advice(_rows([2.0, 1.5, 1.2, 1.1, 1.0], [2.1, 1.6, 1.3, 1.1, 1.0])) is None  # learning
    assert advice(_rows([1.0, 1.1, 1.2], [1.0, 0.9, 0.8])) is None  # too few rounds to say
    assert advice(_rows([1.0, 1.1, 1.2, 1.3], [1.0, 0.9, None, 0.7])) is None  # a round without it
    assert advice(_rows([1.0, 1.1, 1.2, 1.3], [1.0, 1.2, 1.4, 1.6])) is None  # diverging, not overfitting
    assert advice(_rows([1.0, 1.1, 1.05, 1.3], [1.0, 0.9, 0.8, 0.7])) is None  # one rise was not a rise
    assert advice([]) is None
    assert OVERFIT_ROUNDS == 3


@pytest.mark.slow
def test_the_inner_trainer_reports_its_mean_training_loss_since_the_last_start() -> None:
    torch.set_num_threads(1)
    task = load_task(str(FIXTURE), Path("/nonexistent"))
    state = init_state(task, seed=0)
    trainer = InnerTrainer(task, seed=0)
    trainer.start(state)
    assert trainer.train_loss is None
    first = trainer.train_shard(shard_indices(task.n_train, 0, 0, 0, 1, 5, task.batch_size))
    assert first and trainer.train_loss is not None and trainer.train_loss > 0
    after_one = trainer.train_loss
    trainer.train_shard(shard_indices(task.n_train, 0, 0, 0, 1, 50, task.batch_size))
    assert trainer.train_loss < after_one  # the mean over both shards: it learnt
    trainer.start(state)
    assert trainer.train_loss is None  # a new contribution starts its own mean
