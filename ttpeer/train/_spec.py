"""What a task is: the user's ``TaskSpec`` and the validated ``LoadedTask``.

A task file returns a ``TaskSpec``; ``load_task`` checks it and turns it into a
``LoadedTask`` whose datasets are map-style and indexable by the shared data
schedule. Nothing here reads files; see ``_tasks.py`` for that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset, default_collate

from ._adapters import LoRA

DataSource = Dataset | tuple[Tensor, Tensor]


@dataclass(frozen=True)
class TaskSpec:
    """Everything a training run needs, as returned by a task file's ``task()``.

    ``model`` builds a fresh model and is called under ``torch.manual_seed`` so
    every peer starts from the same weights. ``train`` and ``test`` are map-style
    datasets yielding ``(x, y)`` pairs, or a pair of tensors with equal first
    dimension. ``loss(output, target)`` returns a scalar tensor (mean over the
    batch); ``metric(output, target)`` returns a float, higher is better, also a
    mean over the batch. ``info`` is provenance worth keeping next to the results
    (e.g. the hash of a corpus), strings only; the export sidecar records it.
    ``data_hash`` (hex) names what the task reads besides its own file (data files,
    a model folder): ``load_task`` folds it into the task's hash, so peers whose
    files differ decline the job as a different task. ``lora``: train low-rank adapters
    over the frozen model instead of all its parameters (``LoRA``); the adapters alone
    are then the job's state. Nothing is checked here; ``load_task`` checks.
    """

    model: Callable[[], torch.nn.Module]
    train: DataSource
    test: DataSource
    loss: Callable[[Tensor, Tensor], Tensor]
    metric: Callable[[Tensor, Tensor], float]
    metric_name: str = "accuracy"
    batch_size: int = 64
    info: Mapping[str, str] = field(default_factory=dict)
    data_hash: str = ""
    lora: LoRA | None = None


@dataclass(frozen=True)
class LoadedTask:
    """A validated task, ready to train.

    ``source_hash`` is the sha256 hex digest of the task file's bytes, with the
    spec's ``data_hash`` folded in when it has one (or, for a built-in task, of
    its data and model version); peers compare it
    to make sure they train the same thing (``own_hash``: the file's or built-in's
    alone, the name a task file is kept under). ``slowdown`` makes each training
    batch take ``1 + slowdown`` times as long, for benchmarks of slow peers;
    ``step_s`` makes each last at least that many seconds (emulated compute).
    """

    name: str
    spec: TaskSpec
    train: Dataset
    test: Dataset
    n_train: int
    n_test: int
    source_hash: str
    metric_name: str
    batch_size: int
    slowdown: float = 0.0
    step_s: float = 0.0
    own_hash: str = ""  # source_hash before the spec's data_hash and lora are folded in


def fetch_batch(dataset: Dataset, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Gather the samples at ``indices`` into one ``(x, y)`` batch.

    Tensor-pair datasets are gathered by fancy indexing (one copy, no Python
    loop); other datasets go item by item through torch's default collate.
    Raises IndexError for an index outside the dataset and whatever the
    user's dataset raises.
    """
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        index = torch.as_tensor(indices, dtype=torch.long)
        x, y = dataset.tensors
        return x[index], y[index]
    x, y = default_collate([dataset[i] for i in indices])
    return x, y
