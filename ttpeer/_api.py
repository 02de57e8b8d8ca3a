"""The Python API for using a trained model: ``ttpeer.load(path)``.

Works on what ``ttpeer export`` wrote: a fused model file or an ensemble bundle,
each with its ``.json`` sidecar beside it. No daemon is needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ttpeer.errors import UsageError

if TYPE_CHECKING:
    from torch import nn


def load(path: str | os.PathLike[str], task: str | os.PathLike[str] | None = None, *,
         data_dir: str | os.PathLike[str] | None = None, device: str = "cpu") -> nn.Module:
    """Load an exported model as a torch module in eval mode.

    An ensemble bundle gives a module whose output is the members' vote: the
    average of their softmax probabilities over the last dimension. A fused model
    gives the task's own model (its raw outputs, e.g. logits).

    ``task``: the task the model was trained on. Built-in tasks (``mnist1d``) are
    found from the sidecar; a job trained from a task file needs that file's path,
    and its hash must match the one the sidecar records. ``data_dir`` caches
    built-in task data (default: the user's cache directory).

    Raises ``UsageError`` if the file or its sidecar is missing or malformed, the
    task cannot be found or differs from the one trained, or the weights do not
    fit the task's model.
    """
    from ttpeer import train

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path} does not exist; give the .safetensors file 'ttpeer export' wrote")
    try:
        side = train.read_sidecar(path)
    except train.CheckpointError as exc:
        raise UsageError(str(exc)) from None
    spec = os.fspath(task) if task is not None else side["task"]
    cache = Path(data_dir) if data_dir is not None else _cache_dir()
    try:
        loaded = train.load_task(spec, cache)
    except train.TaskError as exc:
        hint = "" if task is not None else (
            f"; {path.name} was trained on task {side['task']!r}: pass its task file, "
            f"e.g. ttpeer.load(path, task='path/to/{side['task']}.py') or --task")
        raise UsageError(f"{exc}{hint}") from None
    try:
        return train.load_bundle(path, loaded).to(device)
    except train.CheckpointError as exc:
        raise UsageError(str(exc)) from None


def _cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("ttpeer", appauthor=False))
