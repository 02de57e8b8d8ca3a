"""Which members an ensemble's vote keeps, and how much each counts.

Theory of operation. An ensemble job holds out ``holdout`` samples of its training data
(``holdout_split``: the same ones on every peer, from the job's seed) that no member trains
on. After each round the closer scores every member's predicted probabilities on them and
builds the vote greedily, as in ensemble selection (Caruana et al., 2004): it starts from
the best member alone and adds members one at a time, with replacement, each time the one
whose addition lowers the vote's held-out loss most, for ``2 x members`` additions, and
keeps the best vote it saw. Weights are whole counts; the close record names them, so every
peer votes, and writes its bundle, with the same ones.

What it promises: on the held-out samples the vote's loss is never above its best member's
(the best member alone is the first candidate). A member trained at a poor variant gets
weight 0 rather than dragging the average down. The held-out split is a fair sample of the
training data, so test figures follow, but are not promised.

The vote averages each member's softmax over the output's last dimension; its loss is the
task's own loss on the log of that average (what ``evaluate`` scores). Held-out outputs are
kept in memory for the search: at most ``PROBS_BYTES`` of them, so a task with large outputs
(a language model's vocabulary at every position) is scored on fewer held-out samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._ensemble import member_models
from ._schedule import _epoch_order
from ._spec import LoadedTask, fetch_batch
from ._state import OuterState

HOLDOUT_FRACTION = 0.1
HOLDOUT_MAX = 2048  # held-out samples at most, however large the training set
HOLDOUT_MIN_TRAIN = 50  # a smaller training set holds nothing out: every member uses it all
PROBS_BYTES = 64 * 2**20  # held-out probabilities kept for the search, all members together
SCORE_BATCH = 256
_SPLIT_STREAM = 0x686F6C64  # "hold": the split's own stream, apart from any data order


def holdout_size(n_train: int) -> int:
    """How many training samples an ensemble job of this training set holds out."""
    if n_train < HOLDOUT_MIN_TRAIN:
        return 0
    return min(HOLDOUT_MAX, int(n_train * HOLDOUT_FRACTION))


def holdout_split(n_train: int, holdout: int, seed: int) -> tuple[list[int], list[int]]:
    """(held out, kept): ``holdout`` training indices drawn by the job's ``seed``, sorted, and
    the rest in order. Pure: the same on every machine. Raises ValueError if ``holdout`` is
    not below ``n_train``."""
    if not 0 <= holdout < n_train:
        raise ValueError(f"cannot hold out {holdout} of {n_train} training samples")
    if holdout == 0:
        return [], list(range(n_train))
    order = _epoch_order(n_train, (seed ^ _SPLIT_STREAM) % 2**31, 0)
    held = np.sort(order[:holdout])
    mask = np.ones(n_train, dtype=bool)
    mask[held] = False
    return held.tolist(), np.flatnonzero(mask).tolist()


def member_probs(task: LoadedTask, models: Sequence[nn.Module], indices: Sequence[int],
                 device: str = "cpu") -> tuple[list[Tensor], Tensor]:
    """Each member's softmax on the training samples ``indices`` (the first of them, as many
    as ``PROBS_BYTES`` holds), and their targets; fp32 on the CPU."""
    probs: list[list[Tensor]] = [[] for _ in models]
    targets: list[Tensor] = []
    limit = len(indices)
    with torch.no_grad():
        for begin in range(0, limit, SCORE_BATCH):
            if begin >= limit:
                break
            x, y = fetch_batch(task.train, list(indices[begin:min(begin + SCORE_BATCH, limit)]))
            outs = [F.softmax(m(x.to(device)).float(), dim=-1).cpu() for m in models]
            if begin == 0:  # the outputs' size sets how many samples the search keeps
                limit = min(limit, max(1, PROBS_BYTES // (4 * sum(o[0].numel() for o in outs))))
                outs, y = [o[:limit] for o in outs], y[:limit]
            for k, o in enumerate(outs):
                probs[k].append(o)
            targets.append(y)
    return [torch.cat(p) for p in probs], torch.cat(targets)


def vote_loss(task: LoadedTask, probs: Sequence[Tensor], weights: Sequence[int], target: Tensor) -> float:
    """The task's loss of the vote ``weights`` (counts per member) on held-out ``probs``."""
    total = sum(weights)
    mix = sum(w * p for w, p in zip(weights, probs, strict=True) if w) / total
    assert isinstance(mix, Tensor)
    return float(task.spec.loss(mix.clamp_min(1e-12).log(), target))


def select(task: LoadedTask, probs: Sequence[Tensor], target: Tensor) -> list[int]:
    """Greedy ensemble selection with replacement (the module's docstring): whole-number
    weights, one per member, the best vote seen within ``2 x members`` additions. Ties go to
    the lower member index, so the same inputs give the same weights."""
    m = len(probs)
    if m == 0:
        raise ValueError("an ensemble has at least one member")
    if len(target) == 0:
        return [1] * m  # nothing held out: every member counts the same (the vote as before)

    def loss_of(total: Tensor, count: int) -> float:
        return float(task.spec.loss((total / count).clamp_min(1e-12).log(), target))

    alone = [loss_of(p, 1) for p in probs]
    first = min(range(m), key=lambda k: (alone[k], k))
    counts = [int(k == first) for k in range(m)]
    total = probs[first].clone()  # the vote's running sum: one add per candidate, not m
    best, best_loss = list(counts), alone[first]
    for added in range(2, 2 * m + 2):
        loss, k = min((loss_of(total + probs[k], added), k) for k in range(m))
        counts[k] += 1
        total += probs[k]
        if loss < best_loss:
            best, best_loss = list(counts), loss
    return best


def holdout_scores(task: LoadedTask, probs: Sequence[Tensor], target: Tensor,
                   weights: Sequence[int]) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """Held-out ``(loss, metric)`` of every member and of the vote ``weights``, as
    ``_ensemble.evaluate`` scores the test set."""
    def score(p: Tensor) -> tuple[float, float]:
        logp = p.clamp_min(1e-12).log()
        return float(task.spec.loss(logp, target)), float(task.spec.metric(logp, target))

    if len(target) == 0:
        return [], (float("nan"), float("nan"))
    total = sum(weights)
    mix = sum(w * p for w, p in zip(weights, probs, strict=True) if w) / total
    assert isinstance(mix, Tensor)
    return [score(p) for p in probs], score(mix)


def weigh_members(task: LoadedTask, state: OuterState, held: Sequence[int], device: str = "cpu"
                  ) -> tuple[list[int], list[nn.Module], tuple[list[Tensor], Tensor]]:
    """The vote's weights for ensemble ``state`` from its members' outputs on the held-out
    training samples ``held``; the members' models and those outputs, for scoring."""
    models = member_models(task, state, device)
    probs, target = member_probs(task, models, held, device)
    return select(task, probs, target), models, (probs, target)
