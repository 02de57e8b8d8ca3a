"""Eval-loss curves of plain AdamW training at one batch size: the measurement behind the
data-parallel gain (``ttpeer advise``'s scaling probe and ``scripts/bench/scaling``).

Runs of one task at batch B and k*B start from the same weights (``seed``) and draw
batches from their own generator of the same seed, so two machines or two runs of the
bench see the same curves; several runs advance a block of steps at a time, side by side
in one process, so a time limit cuts them all at the same step. fp32, gradients clipped
to norm 1.0 (the inner loop's clip); the learning rate is not scaled with the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from ._inner import GRAD_CLIP
from ._spec import LoadedTask, fetch_batch

EVAL_CHUNK = 512  # test samples a forward pass of an evaluation takes


class LossCurve:
    """One run: ``advance(steps)`` trains, ``evaluate()`` appends ``(step, eval loss)`` to
    ``points``. Raises what the task's model and loss raise; RuntimeError for a device
    torch cannot use."""

    def __init__(self, task: LoadedTask, batch: int, *, lr: float, weight_decay: float, seed: int = 0,
                 device: str = "cpu", eval_samples: int = 4000) -> None:
        self.task, self.batch, self.device = task, batch, torch.device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = task.spec.model().to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self._gen = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._eval = list(range(min(task.n_test, eval_samples)))
        self.step = 0
        self.points: list[tuple[int, float]] = []

    def advance(self, steps: int) -> None:
        task = self.task
        self.model.train()
        for _ in range(steps):
            if len(self._order) < self.batch:  # a new epoch; the remainder of the last is dropped
                self._order = torch.randperm(task.n_train, generator=self._gen)
                if task.n_train < self.batch:  # a batch larger than the data: draw it with repeats
                    self._order = self._order.repeat(-(-self.batch // task.n_train))
            idx, self._order = self._order[:self.batch], self._order[self.batch:]
            x, y = fetch_batch(task.train, idx.tolist())
            self.optimizer.zero_grad(set_to_none=True)
            task.spec.loss(self.model(x.to(self.device)), y.to(self.device)).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
            self.optimizer.step()
            self.step += 1

    def evaluate(self) -> float:
        """The mean loss on the first ``eval_samples`` test samples, appended to ``points``."""
        self.model.eval()
        total = 0.0
        with torch.no_grad():
            for begin in range(0, len(self._eval), EVAL_CHUNK):
                part = self._eval[begin:begin + EVAL_CHUNK]
                x, y = fetch_batch(self.task.test, part)
                total += float(self.task.spec.loss(self.model(x.to(self.device)), y.to(self.device))) * len(part)
        loss = total / len(self._eval)
        self.points.append((self.step, loss))
        return loss
