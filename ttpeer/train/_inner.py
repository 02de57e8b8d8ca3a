"""Local (inner) training of one peer, DiLoCo style.

Each round a peer copies the agreed outer parameters into its local model,
runs AdamW over its shard, and reports ``base - local`` as a pseudo-gradient.
The AdamW moments stay local and persist across rounds; only parameters are
replaced at ``start``. Torch runs in whichever thread calls these methods.

Thread use: ``evaluate`` works on its own copy of the model, so it may run in
one thread while ``train_shard`` runs in another; no method may run
concurrently with itself or with ``start``/``delta``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ._errors import CheckpointError, TaskError, TrainError
from ._spec import LoadedTask, fetch_batch
from ._state import OuterState, floating_state

GRAD_CLIP = 1.0
EVAL_BATCH = 1024


class InnerTrainer:
    """One peer's local model and its AdamW state, kept across rounds (DiLoCo:
    inner optimizer state is local)."""

    def __init__(self, task: LoadedTask, *, lr: float = 1e-3, weight_decay: float = 0.01,
                 device: str = "cpu", seed: int = 0) -> None:
        """Build the local model on ``device`` (seeded by ``seed``) and its AdamW.

        Raises ValueError for a non-positive ``lr`` or negative
        ``weight_decay``, RuntimeError if ``device`` is unavailable, and
        whatever the task's ``model()`` raises.
        """
        if not lr > 0 or not weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {lr}, {weight_decay}")
        self.task = task
        self.device = torch.device(device)
        self._lr, self._weight_decay = lr, weight_decay
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            self.model: nn.Module = task.spec.model().to(self.device)
        self._names = [n for n, t in self.model.state_dict().items() if t.is_floating_point()]
        # Evaluation has its own copy, made now: a round's close evaluates while the next
        # round trains (overlapped rounds), and must not copy a model in mid-step.
        self._eval_model = copy.deepcopy(self.model)
        self.optimizer = self._new_optimizer()
        self._loss_sum: Tensor | None = None  # training loss summed over the batches since start()
        self._loss_batches = 0

    @property
    def train_loss(self) -> float | None:
        """Mean training loss over the batches run since the last ``start`` (None: none).
        Published with the delta: with the eval loss it shows overfitting."""
        if self._loss_sum is None or not self._loss_batches:
            return None
        return float(self._loss_sum) / self._loss_batches

    def start(self, base: OuterState) -> None:
        """Copy ``base.params`` into the local model; the AdamW state is kept.

        Raises CheckpointError if ``base`` does not have the model's tensors.
        """
        _load(self.model, self._names, base.params)
        self._loss_sum, self._loss_batches = None, 0

    def train_shard(self, batches: Sequence[Sequence[int]],
                    should_stop: Callable[[], bool] | None = None) -> int:
        """Run one AdamW step per batch (gradients clipped to norm 1.0).

        ``should_stop()`` is asked before every batch; when it returns True the
        shard ends early. Returns the number of samples in completed batches.
        Raises TaskError if the task's loss is not a scalar, and TrainError if
        the loss became NaN/inf (the optimizer state is then reset, so the next
        ``start`` begins clean).
        """
        task = self.task
        self.model.train()
        diverged = torch.zeros((), dtype=torch.bool, device=self.device)
        samples = 0
        for batch in batches:
            if should_stop is not None and should_stop():
                break
            began = time.perf_counter()
            x, y = fetch_batch(task.train, batch)
            output = self.model(x.to(self.device))
            loss = task.spec.loss(output, y.to(self.device))
            if not isinstance(loss, Tensor) or loss.ndim != 0:
                raise TaskError(f"task {task.name}: loss must return a scalar tensor, got "
                                f"{getattr(loss, 'shape', type(loss).__name__)}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
            self.optimizer.step()
            # Accumulated on the device: a .item() per batch would stall a GPU.
            diverged |= ~torch.isfinite(loss.detach())
            self._loss_sum = loss.detach() if self._loss_sum is None else self._loss_sum + loss.detach()
            self._loss_batches += 1
            samples += len(batch)
            if task.slowdown > 0:
                _throttle(self.device, began, task.slowdown)
        if bool(diverged):
            self.optimizer = self._new_optimizer()
            raise TrainError(f"task {task.name}: training diverged (loss is NaN or inf); "
                             "try a lower inner learning rate")
        return samples

    def delta(self, base: OuterState) -> dict[str, Tensor]:
        """Return the pseudo-gradient ``base.params - local params`` (fp32, CPU).

        Raises CheckpointError if ``base`` does not have the model's tensors.
        """
        _check_names(self._names, base.params)
        local = floating_state(self.model)
        return {name: base.params[name] - local[name] for name in self._names}

    def evaluate(self, params: dict[str, Tensor]) -> tuple[float, float]:
        """Return ``(test loss, test metric)`` of ``params`` on the task's test set.

        Loss and metric are assumed to be batch means; they are averaged
        weighted by batch size. Raises CheckpointError if ``params`` does not
        have the model's tensors, TaskError if the metric is not a number.
        """
        model = self._eval_model
        _load(model, self._names, params)
        model.eval()
        task, n_test = self.task, self.task.n_test
        loss_sum = metric_sum = 0.0
        with torch.no_grad():
            for begin in range(0, n_test, EVAL_BATCH):
                indices = list(range(begin, min(begin + EVAL_BATCH, n_test)))
                x, y = fetch_batch(task.test, indices)
                y = y.to(self.device)
                output = model(x.to(self.device))
                loss_sum += float(task.spec.loss(output, y)) * len(indices)
                metric_sum += _number(task.spec.metric(output, y), task.name) * len(indices)
        return loss_sum / n_test, metric_sum / n_test

    def _new_optimizer(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self._lr, weight_decay=self._weight_decay)


def _load(model: nn.Module, names: list[str], params: dict[str, Tensor]) -> None:
    _check_names(names, params)
    target = model.state_dict()
    with torch.no_grad():
        for name in names:
            if target[name].shape != params[name].shape:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(params[name].shape)}, "
                                      f"the model has {tuple(target[name].shape)}")
            # state_dict tensors share storage with the module, so this updates it in place.
            target[name].copy_(params[name])


def _check_names(names: list[str], params: dict[str, Tensor]) -> None:
    if set(names) != params.keys():
        missing = sorted(set(names) - params.keys())[:5]
        extra = sorted(params.keys() - set(names))[:5]
        raise CheckpointError(f"parameters do not match the model: missing {missing}, "
                              f"unexpected {extra}")


def _number(value: object, task_name: str) -> float:
    try:
        result = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TaskError(f"task {task_name}: metric must return a number, got "
                        f"{type(value).__name__}") from exc
    return result


def _throttle(device: torch.device, began: float, slowdown: float) -> None:
    # Benchmarks only: stretch the batch to (1 + slowdown) x its real duration.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    time.sleep(slowdown * (time.perf_counter() - began))
