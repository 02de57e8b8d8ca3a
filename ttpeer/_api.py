"""The Python API for using a trained model: ``ttpeer.load(path)``.

Works on what ``ttpeer export`` wrote: a fused model file or an ensemble bundle,
each with its ``.json`` sidecar beside it. No daemon is needed.

A job trained from a task file needs that exact file to build its model. The
sidecar records the file's sha256 (``source_hash``) and the user's file name
(``task_file``), so the file is found by its hash: the copy ``export`` wrote
beside the model (``model.task.py``), the user's file beside it, or the copy a
ttpeer home keeps (``HOME/tasks/<sha256>.py``). A file whose bytes differ (one
added comment is enough) is another task, and the message says so.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ttpeer.errors import UsageError

if TYPE_CHECKING:
    from torch import nn


def load(path: str | os.PathLike[str], task: str | os.PathLike[str] | None = None, *,
         data_dir: str | os.PathLike[str] | None = None, device: str = "cpu",
         home: str | os.PathLike[str] | None = None) -> nn.Module:
    """Load an exported model as a torch module in eval mode.

    An ensemble bundle gives a module whose output is the members' vote: the
    average of their softmax probabilities over the last dimension. A fused model
    gives the task's own model (its raw outputs, e.g. logits). A folder that
    ``export --format hf`` or ``--format peft`` wrote gives the Hugging Face model
    (for peft: over the base folder the job trained on), taking token ids to logits
    as the task's model does; ``task`` is not needed.

    ``task``: the task the model was trained on. Built-in tasks (``mnist1d``) are
    found from the sidecar, and so is a task file that lies beside the model or in
    ``home`` (a ttpeer home; default ``$TTPEER_HOME`` or the per-user one); else
    pass its path: its hash must match the one the sidecar records. ``data_dir``
    caches built-in task data (default: the user's cache directory).

    Raises ``UsageError`` if the file or its sidecar is missing or malformed, the
    task cannot be found or differs from the one trained, or the weights do not
    fit the task's model.
    """
    from ttpeer import train

    path = Path(path)
    if path.is_dir():  # export --format hf or peft: the folder holds its sidecar
        from ttpeer._export import load_folder

        try:
            return load_folder(path).to(device)
        except (train.TrainError, OSError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    if not path.is_file():
        raise UsageError(f"{path} does not exist; give the .safetensors file 'ttpeer export' wrote, or the folder "
                         "of --format hf or peft")
    try:
        side = train.read_sidecar(path)
    except train.CheckpointError as exc:
        raise UsageError(str(exc)) from None
    if task is not None:
        spec = os.fspath(task)
        if spec.endswith(".py"):
            _check_given(Path(spec), side)
    elif _is_task_file(side):
        spec = str(find_task_file(path, side, Path(home) if home is not None else None))
    else:
        spec = side["task"]
    cache = Path(data_dir) if data_dir is not None else _cache_dir()
    try:
        with train.resolving(_home_datasets(Path(home) if home is not None else None)):
            loaded = train.load_task(spec, cache)
    except train.DatasetMissing as exc:
        raise UsageError(f"the task reads dataset {exc.name!r} (dataset_path), which this machine's ttpeer home "
                         f"does not hold{' whole' if exc.pieces else ''}: load on a peer that trained the job, or "
                         "pass home= (--home) of one") from None
    except train.TaskError as exc:
        raise UsageError(str(exc)) from None
    try:
        return train.load_bundle(path, loaded).to(device)
    except train.CheckpointError as exc:
        raise UsageError(str(exc)) from None


def _home_datasets(home: Path | None) -> Any:
    """``dataset_path`` for a task loaded here, without a daemon: the dataset of that name
    that ``home`` holds (added or fetched there; the one used last if several)."""
    from ttpeer import train
    from ttpeer.config import default_home
    from ttpeer.daemon import DataStore

    return train.held_resolver(DataStore((home if home is not None else default_home()).expanduser() / "datasets"))


def _is_task_file(side: dict[str, Any]) -> bool:
    from ttpeer.train._tasks import BUILTIN, CHARLM

    return side["task"].partition(":")[0] not in (BUILTIN, CHARLM)


def _user_name(side: dict[str, Any]) -> str:
    """The name the user gave the task file when submitting it (older sidecars: metrics)."""
    name = side.get("task_file") or (side.get("metrics") or {}).get("task") or f"{side['task']}.py"
    return Path(str(name)).name


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def find_task_file(model: Path, side: dict[str, Any], home: Path | None) -> Path:
    """The task file ``model`` was trained on, by hash. Raises ``UsageError`` naming
    where it looked, and any file there that has the right name but other bytes."""
    from ttpeer._export import task_copy_path
    from ttpeer.config import default_home

    want = side.get("task_sha256") or side.get("source_hash")
    user = _user_name(side)
    kept = (home if home is not None else default_home()).expanduser() / "tasks" / f"{want}.py"
    candidates = [task_copy_path(model), model.parent / user, kept]
    differ = []
    for candidate in candidates:
        got = _sha256(candidate)
        if got is not None and got == want:
            return candidate
        if got is not None:
            differ.append(candidate)
    looked = ", ".join(str(c) for c in candidates)
    other = (f"; {', '.join(str(d) for d in differ)} is a different file (its sha256 is not "
             "the one trained: any edit, even a comment, makes another task)") if differ else ""
    raise UsageError(f"{model.name} was trained on task file {user} (sha256 {str(want)[:12]}...), "
                     f"which is not in {looked}{other}: pass the original file with "
                     f"task='path/to/{user}' (or --task), or the --home of a peer that ran the job")


def _check_given(given: Path, side: dict[str, Any]) -> None:
    want = side.get("task_sha256") or side.get("source_hash")
    got = _sha256(given)
    if got is not None and want is not None and got != want and _is_task_file(side):
        raise UsageError(f"{given} is a different file from the task file this model was trained on "
                         f"({_user_name(side)}, sha256 {want[:12]}..., this one {got[:12]}...): any edit, "
                         "even a comment, makes another task; pass the original (export wrote a copy "
                         "beside the model, *.task.py)")


def _cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("ttpeer", appauthor=False))
