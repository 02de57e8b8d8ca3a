"""Loading a task: a built-in (``mnist1d``, ``charlm``) or a user's ``.py`` task file.

A task file is trusted code: it runs with the daemon's rights. Load only files
you wrote or read; never a file received from a peer. What peers exchange is
the file's sha256 (``LoadedTask.source_hash``), so they can refuse to train
together on different tasks.

Every problem with a task surfaces as ``TaskError`` naming the file and saying
what to fix; exceptions raised by the user's code are chained as the cause.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ._adapters import LoRA, adapted
from ._charlm import charlm_task
from ._errors import DatasetMissing, TaskError
from ._failure import one_line, register_task_file, where_in_task
from ._mnist1d import mnist1d_task, parse_samples
from ._spec import LoadedTask, TaskSpec

BUILTIN = "mnist1d"
CHARLM = "charlm"  # also "charlm:key=int,...", see _charlm.py
_OPTIONS = frozenset({"slowdown", "step_s"})
_SPEC_FIELDS = {f.name for f in fields(TaskSpec)}
_REQUIRED_FIELDS = {"model", "train", "test", "loss", "metric"}
_module_ids = itertools.count()


def load_task(spec: str | os.PathLike[str], data_dir: Path,
              options: Mapping[str, Any] | None = None, *, shown_as: str | None = None,
              shared_data: Path | None = None) -> LoadedTask:
    """Load the task named by ``spec``: ``"mnist1d"`` (or ``"mnist1d:samples=N"``),
    ``"charlm"`` (or ``"charlm:key=int,..."``) or a path ending in ``.py``.

    ``data_dir`` holds cached data of built-in tasks; ``shared_data``, if given, is a
    machine-wide copy of it that homes on one machine share (made once, not per home).
    ``options`` may set
    ``slowdown`` (float >= 0): each training batch then takes ``1 + slowdown``
    times as long, to imitate a slow peer in benchmarks; ``step_s`` (float >= 0): each
    batch then lasts at least that many seconds, whatever else the machine's cores are
    doing, to emulate a peer's compute when many peers share one machine.

    Raises TaskError if the spec names no known task, the file is missing or
    does not import, it has no ``task()`` function, ``task()`` raises or returns
    something other than a valid ``TaskSpec`` (or dict of its fields), or an
    option is unknown or out of range. Raises OSError if the mnist1d cache
    cannot be written.

    ``shown_as``: the name a task file is compiled under and named by in errors
    (the daemon passes the user's own file name, not its copy's path in the home),
    so a traceback or a syntax error points at the file the user edits.
    """
    slowdown, step_s = _check_options(options)
    spec = os.fspath(spec)
    if spec == BUILTIN or spec.startswith(BUILTIN + ":"):
        try:
            samples = parse_samples(spec)
        except ValueError as exc:
            raise TaskError(str(exc)) from None
        task_spec, source_hash = mnist1d_task(Path(data_dir), samples, shared=shared_data)
        name, origin = spec, BUILTIN
    elif spec == CHARLM or spec.startswith(CHARLM + ":"):
        task_spec, source_hash = charlm_task(spec)
        name, origin = spec, CHARLM
    elif spec.endswith(".py"):
        path = Path(spec)
        shown = shown_as or str(path)
        task_spec, source_hash = _run_task_file(path, shown)
        name, origin = Path(shown).stem, f"task file {shown}"
    else:
        raise TaskError(f"unknown task {spec!r}: use {BUILTIN!r}, {CHARLM!r} or the path of a .py task file")
    return _validate(task_spec, name=name, origin=origin, source_hash=source_hash,
                     slowdown=slowdown, step_s=step_s)


def _check_options(options: Mapping[str, Any] | None) -> tuple[float, float]:
    options = dict(options or {})
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TaskError(f"unknown task option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    values = []
    for name in ("slowdown", "step_s"):
        value = options.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TaskError(f"task option {name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise TaskError(f"task option {name} must be finite and >= 0, got {value!r}")
        values.append(float(value))
    return values[0], values[1]


def _run_task_file(path: Path, shown: str) -> tuple[TaskSpec, str]:
    where = f"task file {shown}"
    try:
        source = path.read_bytes()
    except FileNotFoundError:
        raise TaskError(f"{where} does not exist") from None
    except OSError as exc:
        raise TaskError(f"{where} cannot be read: {exc}") from exc
    source_hash = hashlib.sha256(source).hexdigest()
    # Compile the bytes we hashed rather than re-reading the file, so the hash
    # names exactly the code that ran even if the file changes meanwhile; under
    # the user's name for it, so tracebacks and messages name their file.
    try:
        code = compile(source, shown, "exec")
    except SyntaxError as exc:
        raise TaskError(f"{shown}:{exc.lineno}: syntax error: {exc.msg} (in the task file)") from exc
    except ValueError as exc:  # e.g. NUL bytes in the source
        raise TaskError(f"{where} is not valid Python source: {exc}") from exc
    register_task_file(shown, source)

    module_name = f"_ttpeer_task_{source_hash[:16]}_{next(_module_ids)}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None:
        raise TaskError(f"{where} cannot be imported as a module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running: dataclasses and pickling in the file look
    # their module up in sys.modules.
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except (Exception, SystemExit) as exc:
        del sys.modules[module_name]
        raise TaskError(f"{where} failed while importing: {_located(exc)}") from exc

    task_fn = getattr(module, "task", None)
    if not callable(task_fn):
        raise TaskError(f"{where} defines no task() function; add `def task() -> TaskSpec:`")
    try:
        result = task_fn()
    except DatasetMissing:
        raise  # not the task's mistake: the daemon fetches the dataset and loads the task again
    except TaskError as exc:  # a task helper's own error (ttpeer.tasks) already says what to fix
        raise TaskError(f"{where}: {exc}") from exc
    except (Exception, SystemExit) as exc:
        raise TaskError(f"task() in {where} raised {_located(exc)}") from exc
    return _as_spec(result, where), source_hash


def _located(exc: BaseException) -> str:
    """``Type: message``, after the task file's line it came from when there is one."""
    where = where_in_task(exc)
    return f"{one_line(exc)} (at {where})" if where else one_line(exc)


def _as_spec(result: object, where: str) -> TaskSpec:
    if isinstance(result, TaskSpec):
        return result
    if isinstance(result, Mapping):
        keys = set(result)
        if not all(isinstance(key, str) for key in keys):
            raise TaskError(f"task() in {where} returned a dict with non-string keys")
        missing, unknown = _REQUIRED_FIELDS - keys, keys - _SPEC_FIELDS
        if missing:
            raise TaskError(f"task() in {where} returned a dict missing {sorted(missing)}")
        if unknown:
            raise TaskError(f"task() in {where} returned a dict with unknown keys "
                            f"{sorted(unknown)}; allowed: {sorted(_SPEC_FIELDS)}")
        return TaskSpec(**result)
    raise TaskError(f"task() in {where} returned {type(result).__name__}; "
                    "expected ttpeer.train.TaskSpec or a dict of its fields")


def _validate(spec: TaskSpec, *, name: str, origin: str, source_hash: str,
              slowdown: float, step_s: float = 0.0) -> LoadedTask:
    for field in ("model", "loss", "metric"):
        if not callable(getattr(spec, field)):
            raise TaskError(f"{origin}: {field} must be callable, "
                            f"got {type(getattr(spec, field)).__name__}")
    if not isinstance(spec.metric_name, str) or not spec.metric_name:
        raise TaskError(f"{origin}: metric_name must be a non-empty string")
    if isinstance(spec.batch_size, bool) or not isinstance(spec.batch_size, int) \
            or spec.batch_size < 1:
        raise TaskError(f"{origin}: batch_size must be a positive int, got {spec.batch_size!r}")
    if not isinstance(spec.info, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in spec.info.items()):
        raise TaskError(f"{origin}: info must be a dict of strings to strings")
    if not isinstance(spec.data_hash, str) or spec.data_hash.strip("0123456789abcdef"):
        raise TaskError(f"{origin}: data_hash must be a lower-case hex string, got {spec.data_hash!r}")
    own_hash = source_hash
    if spec.data_hash:  # the files it reads are part of the task, as charlm's corpus is
        source_hash = hashlib.sha256(f"{source_hash}\n{spec.data_hash}".encode()).hexdigest()
    if spec.lora is not None:
        if not isinstance(spec.lora, LoRA):
            raise TaskError(f"{origin}: lora must be a ttpeer.train.LoRA, got {type(spec.lora).__name__}")
        spec.lora.check(origin)
        source_hash = hashlib.sha256(f"{source_hash}\n{spec.lora.key()}".encode()).hexdigest()
        spec = replace(spec, model=adapted(spec.model, spec.lora, origin))
    train = _as_dataset(spec.train, "train", origin)
    test = _as_dataset(spec.test, "test", origin)
    check_model(spec, origin)
    return LoadedTask(name=name, spec=spec, train=train, test=test,
                      n_train=len(train),  # type: ignore[arg-type]
                      n_test=len(test),  # type: ignore[arg-type]
                      source_hash=source_hash, own_hash=own_hash,
                      metric_name=spec.metric_name, batch_size=spec.batch_size,
                      slowdown=slowdown, step_s=step_s)


def _as_dataset(source: object, which: str, origin: str) -> Dataset:
    if isinstance(source, tuple | list):
        if len(source) != 2:
            raise TaskError(f"{origin}: {which} must be an (x, y) pair, got {len(source)} items")
        try:
            x, y = (torch.as_tensor(part) for part in source)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TaskError(f"{origin}: {which} (x, y) are not tensors: {exc}") from exc
        if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
            raise TaskError(f"{origin}: {which} x and y must have the same first dimension, "
                            f"got shapes {tuple(x.shape)} and {tuple(y.shape)}")
        source = TensorDataset(x, y)
    if isinstance(source, IterableDataset) or not (
            hasattr(source, "__getitem__") and hasattr(source, "__len__")):
        raise TaskError(f"{origin}: {which} must be a map-style Dataset (with __len__ and "
                        f"__getitem__) or an (x, y) pair of tensors, "
                        f"got {type(source).__name__}")
    try:
        size = len(source)  # type: ignore[arg-type]
        first = source[0] if size > 0 else None  # type: ignore[index]
    except DatasetMissing:
        raise  # a sample whose pieces are not here yet: the daemon fetches them and loads again
    except Exception as exc:
        raise TaskError(f"{origin}: reading {which}[0] failed: "
                        f"{type(exc).__name__}: {exc}") from exc
    if size == 0:
        raise TaskError(f"{origin}: {which} dataset is empty")
    if not isinstance(first, tuple | list) or len(first) != 2:
        raise TaskError(f"{origin}: {which}[0] must be an (x, y) pair, "
                        f"got {type(first).__name__}")
    return source  # type: ignore[return-value]


def check_model(spec: TaskSpec, origin: str) -> nn.Module:
    """Build the task's model without allocating its weights and check it.

    The model is built on torch's meta device, so even a large model costs
    nothing; a ``model()`` that cannot run there is built on the CPU instead.
    Raises TaskError if ``model()`` raises, returns something other than an
    ``nn.Module``, or a module without floating-point parameters.
    """
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = spec.model()
        except TaskError:
            raise  # what the task's own checks refuse: building on the CPU would refuse it too
        except Exception:
            try:
                model = spec.model()
            except Exception as exc:
                raise TaskError(f"{origin}: model() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise TaskError(f"{origin}: model() returned {type(model).__name__}, "
                        "expected a torch.nn.Module")
    if not any(p.is_floating_point() for p in model.parameters()):
        raise TaskError(f"{origin}: model() has no floating-point parameters to train")
    return model
