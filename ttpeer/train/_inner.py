"""Local (inner) training of one peer, DiLoCo style.

Each round a peer copies the agreed outer parameters into its local model,
runs AdamW over its shard, and reports ``base - local`` as a pseudo-gradient.
The AdamW moments stay local and persist across rounds; only parameters are
replaced at ``start``. Torch runs in whichever thread calls these methods.

A step trains on one batch of the job, whatever the peer: the batch is split into
micro-batches (``Recipe.micro_batch``, chosen from this peer's memory) whose losses
are weighted by their share of the batch, so the accumulated gradient is the
gradient of the whole batch's mean loss. Forward and backward run under autocast
(``Recipe.precision``); the weights, AdamW and the delta stay fp32. The lr of each
step is the job's schedule at the step's global number (``_lr.py``).

Thread use: ``evaluate`` works on its own copy of the model, so it may run in
one thread while ``train_shard`` runs in another; no method may run
concurrently with itself or with ``start``/``delta``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from . import _precision
from ._errors import CheckpointError, Diverged, TaskError
from ._recipe import Recipe, enable_checkpointing, split
from ._spec import LoadedTask, fetch_batch
from ._state import OuterState

GRAD_CLIP = 1.0
EVAL_BATCH = 1024


class InnerTrainer:
    """One peer's local model and its AdamW state, kept across rounds (DiLoCo:
    inner optimizer state is local)."""

    def __init__(self, task: LoadedTask, *, lr: float = 1e-3, weight_decay: float = 0.01,
                 device: str = "cpu", seed: int = 0, recipe: Recipe | None = None) -> None:
        """Build the local model on ``device`` (seeded by ``seed``) and its AdamW.
        ``lr`` is the base lr the ``recipe``'s schedule multiplies.

        Raises ValueError for a non-positive ``lr`` or negative
        ``weight_decay``, RuntimeError if ``device`` is unavailable, TaskError if
        the recipe asks for checkpointing the model does not support, and
        whatever the task's ``model()`` raises.
        """
        if not lr > 0 or not weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {lr}, {weight_decay}")
        self.task = task
        self.device = torch.device(device)
        self.recipe = recipe or Recipe()
        self._lr, self._weight_decay = lr, weight_decay
        self._seed = seed
        self.model: nn.Module = self._build()
        self._names = [n for n, t in self.model.state_dict().items() if t.is_floating_point()]
        if self.recipe.checkpointing:
            enable_checkpointing(self.model, task.name)
        self.optimizer = self._new_optimizer()
        # Training loss since the last ``take_train_loss``, summed on the device (no sync a batch).
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self._loss_batches = 0
        # fp16 only; like the AdamW moments, its scale is local and carries across rounds.
        self._scaler = _precision.scaler(self.recipe.precision, self.device)

    def start(self, base: OuterState) -> None:
        """Copy ``base.params`` into the local model; the AdamW state is kept.

        Raises CheckpointError if ``base`` does not have the model's tensors.
        """
        _load(self.model, self._names, base.params)
        self._loss_sum.zero_()  # a new contribution starts its own mean
        self._loss_batches = 0

    def train_shard(self, batches: Sequence[Sequence[int]],
                    should_stop: Callable[[], bool] | None = None, first_step: int = 0) -> int:
        """Run one AdamW step per batch (gradients clipped to norm 1.0); batch ``i`` is
        the job's global inner step ``first_step + i``, which sets its lr.

        ``should_stop()`` is asked before every batch; when it returns True the
        shard ends early. Returns the number of samples in completed batches.
        Raises TaskError if the task's loss is not a scalar, and Diverged if
        the loss became NaN/inf (the optimizer state is then reset, so the next
        ``start`` begins clean).
        """
        task = self.task
        self.model.train()
        # The sum of the batches' losses, kept on the device (a .item() per batch would stall
        # a GPU): it is NaN or inf exactly when some batch's loss was (or the losses are
        # beyond 1e38, diverged too). One in-place add per step: the loop's only overhead op.
        losses = torch.zeros((), device=self.device)
        samples = steps = 0
        for index, batch in enumerate(batches):
            if should_stop is not None and should_stop():
                break
            began = time.perf_counter()
            self._step(batch, first_step + index, losses)
            steps += 1
            samples += len(batch)
            if task.slowdown > 0 or task.step_s > 0:
                _throttle(self.device, began, task.slowdown, task.step_s)
        self._loss_sum += losses
        self._loss_batches += steps
        if not bool(torch.isfinite(losses)):
            self.optimizer = self._new_optimizer()
            self._scaler = _precision.scaler(self.recipe.precision, self.device)
            raise Diverged("the loss was NaN or inf in this shard")
        return samples

    @property
    def train_loss(self) -> float | None:
        """Mean training loss over the batches since the last ``start`` or
        ``take_train_loss`` (None: none ran)."""
        return float(self._loss_sum) / self._loss_batches if self._loss_batches else None

    def take_train_loss(self) -> float | None:
        """The mean training loss of the batches since the last call (None if none ran),
        and start counting again: a contribution reports the loss of the shards it covers."""
        if not self._loss_batches:
            return None
        mean = float(self._loss_sum) / self._loss_batches
        self._loss_sum.zero_()
        self._loss_batches = 0
        return mean

    def _step(self, batch: Sequence[int], step: int, losses: Tensor) -> None:
        """One optimizer step on ``batch``; adds its mean loss to ``losses``."""
        task, recipe, scaler = self.task, self.recipe, self._scaler
        lr = self._lr * recipe.schedule.factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = fetch_batch(task.train, batch)
        x, y = x.to(self.device), y.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        sizes = split(len(batch), recipe.micro_batch)
        parts = zip(x.split(sizes), y.split(sizes), strict=True) if len(sizes) > 1 else [(x, y)]
        for xs, ys in parts:
            with _precision.autocast(recipe.precision, self.device):
                loss = task.spec.loss(self.model(xs), ys)
            check_scalar(loss, task.name)
            # The loss is a mean over its micro-batch: weighted by the micro-batch's share,
            # the gradients sum to those of the whole batch's mean. One micro-batch: no
            # multiply at all, so the step is exactly the unsplit one.
            if len(sizes) > 1:
                loss = loss * (len(xs) / len(batch))
            (scaler.scale(loss) if scaler is not None else loss).backward()
            losses += loss.detach()
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        if scaler is not None:
            scaler.step(self.optimizer)  # skipped when a gradient is inf/NaN
            scaler.update()
        else:
            self.optimizer.step()

    def shift(self, onto: Iterable[tuple[str, Tensor]], start: dict[str, Tensor]) -> None:
        """Move the local model by ``onto - start``, tensor by tensor (``onto`` may come
        from a state file one tensor at a time): the progress made since ``start`` is kept,
        now measured from ``onto``. The AdamW state is kept.

        Raises CheckpointError if ``onto`` does not have the model's tensors, each once."""
        target = self.model.state_dict()
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in onto:
                if name not in start or name in seen or tensor.shape != target[name].shape:
                    raise CheckpointError(f"parameters do not match the model at {name!r}")
                seen.add(name)
                move = tensor.to(torch.float32) - start[name]
                target[name].add_(move.to(target[name].device, target[name].dtype))
        if seen != set(self._names):
            raise CheckpointError(f"parameters do not match the model: missing {sorted(set(self._names) - seen)[:5]}")

    def delta(self, base: OuterState) -> dict[str, Tensor]:
        """Return the pseudo-gradient ``base.params - local params`` (fp32, CPU).

        Raises CheckpointError if ``base`` does not have the model's tensors.
        """
        _check_names(self._names, base.params)
        return self.delta_from(base.params.items())

    def delta_from(self, params: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """``delta`` of a base given tensor by tensor (``train.iter_state_file``): neither
        the base nor a copy of the local model is ever whole beside the delta.

        Raises CheckpointError if ``params`` does not have the model's tensors, each once.
        """
        local = self.model.state_dict()
        out: dict[str, Tensor] = {}
        for name, base in params:
            if name not in self._names or name in out or base.shape != local[name].shape:
                raise CheckpointError(f"parameters do not match the model at {name!r}")
            # As ``floating_state``'s copy, one tensor at a time: the same bits.
            mine = local[name].detach().to(device="cpu", dtype=torch.float32, copy=True,
                                           memory_format=torch.contiguous_format)
            out[name] = base - mine
        if len(out) != len(self._names):
            _check_names(self._names, out)
        return {name: out[name] for name in self._names}

    def evaluate(self, params: dict[str, Tensor], *, consume: bool = False) -> tuple[float, float]:
        """Return ``(test loss, test metric)`` of ``params`` on the task's test set.

        Loss and metric are assumed to be batch means; they are averaged
        weighted by batch size. ``consume``: empty ``params`` once the evaluation
        model has them (the caller's last use: the model's copy is then the only
        one while the test set runs). Raises CheckpointError if ``params`` does not
        have the model's tensors, TaskError if the metric is not a number.
        """
        model = self._eval_model()
        _load(model, self._names, params)
        if consume:
            params.clear()
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
                metric_sum += number(task.spec.metric(output, y), task.name) * len(indices)
        return loss_sum / n_test, metric_sum / n_test

    def _build(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(self._seed)
            return self.task.spec.model().to(self.device)

    def _eval_model(self) -> nn.Module:
        """A model for one evaluation, dropped after it. A round's close evaluates while
        the next round trains (overlapped rounds), so it cannot borrow the local model;
        a copy kept for the whole job cost 4 bytes per parameter of host memory for a
        second a round. Built on the meta device (no init, no draw from the global RNG
        that the training thread is using), then given memory; ``evaluate`` loads the
        floating state, and every other buffer (step counters, constant masks) is
        copied from the local model. A model with a frozen base outside its state
        (adapters) is copied instead, the base's tensors shared, not copied: it is read,
        never written, and may be of a kind (4-bit) that no model built here would match."""
        names = set(self._names)
        frozen = {id(p): p for n, p in self.model.named_parameters() if not p.requires_grad and n not in names}
        if frozen:
            return copy.deepcopy(self.model, memo=dict(frozen))
        try:
            with torch.device("meta"):
                model = self.task.spec.model()
            model = model.to_empty(device=self.device)
        except Exception:  # noqa: BLE001 - a task's model that cannot be built on meta: copy ours
            return copy.deepcopy(self.model)
        _tie_like(model, self.model)
        own = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name not in self._names and name in own:
                    buf.copy_(own[name])
        return model

    def _new_optimizer(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self._lr, weight_decay=self._weight_decay)


def _tie_like(model: nn.Module, like: nn.Module) -> None:
    """Gives ``model`` the parameter sharing of ``like``. ``to_empty`` from the meta
    device makes a new Parameter for every name, so a tied head (GPT-2's ``lm_head``
    is ``wte``) becomes a second, uninitialised tensor that the loaded state (which
    names each shared tensor once) never fills."""
    first: dict[int, str] = {}
    for name, param in like.named_parameters(remove_duplicate=False):
        if id(param) not in first:
            first[id(param)] = name
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        setattr(module, attr, model.get_parameter(first[id(param)]))


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


def check_scalar(loss: object, task_name: str) -> None:
    """Raises TaskError unless the task's loss returned a scalar tensor."""
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        raise TaskError(f"task {task_name}: loss must return a scalar tensor, got "
                        f"{getattr(loss, 'shape', type(loss).__name__)}")


def number(value: object, task_name: str) -> float:
    try:
        result = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TaskError(f"task {task_name}: metric must return a number, got "
                        f"{type(value).__name__}") from exc
    return result


def _throttle(device: torch.device, began: float, slowdown: float, step_s: float = 0.0) -> None:
    # Benchmarks only: stretch the batch to (1 + slowdown) x its real duration, and to at
    # least step_s seconds.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = time.perf_counter() - began
    time.sleep(max(slowdown * took, step_s - took, 0.0))
