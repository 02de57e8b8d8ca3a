"""The built-in ``mnist1d`` task: 16000/4000 one-dimensional digit signals, 40
features, 10 classes, and a small MLP.

The data is generated offline by the ``mnist1d`` package (deterministic, a few
seconds) and cached as ``data_dir/mnist1d.npz``, and in a machine-wide folder
(``shared``) when one is given, so that the homes of one machine make it once; a
cache that is unreadable or has the wrong shape is regenerated. ``source_hash``
covers the arrays and a version tag for the model, so peers whose data differ
notice.

``mnist1d:samples=N`` generates N signals instead of the default 20000 (80% train,
20% test, the same generator with more or fewer draws; about 5 s per 25,000 on an
idle core), cached as ``mnist1d-N.npz``. The default was the package's 5000 until
the demo's run (8 rounds x 6 shards x 60 steps) was measured overfitting its 4000
training signals from round 3 (eval loss 1.32 -> 12.4 while accuracy stayed near
0.65); with 16000 it falls over the run (three runs of 3 daemons on loopback:
1.34 -> 0.69, 1.39 -> 0.68, 1.39 -> 0.67, accuracy 0.77-0.78; the first ticked up
by 0.007 in its last round, the others fell every round).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import random
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._atomic import write_atomic
from ._errors import TaskError
from ._spec import TaskSpec

CACHE_NAME = "mnist1d.npz"
DEFAULT_SAMPLES = 20000  # 16000 train, 4000 test (the package's own 5000 overfit the demo's run)
MAX_SAMPLES = 2_000_000
FEATURES = 40
CLASSES = 10
# Bump when the model or the data preparation changes: it changes source_hash.
_VERSION_TAG = b"ttpeer-mnist1d-v1"
_KEYS = ("x", "y", "x_test", "y_test")


def mnist1d_task(data_dir: Path, samples: int = DEFAULT_SAMPLES, *,
                 shared: Path | None = None) -> tuple[TaskSpec, str]:
    """Return the mnist1d ``TaskSpec`` with ``samples`` signals in all, and its source hash.

    Raises OSError if the cache cannot be written to ``data_dir`` (a ``shared`` folder
    that cannot be written is only not used).
    """
    name = cache_name(samples)
    path = data_dir / name
    arrays = _load(path, samples)
    if arrays is None:
        with _machine_lock(shared):  # homes starting together (the demo) make it once, not each
            arrays = _load(shared / name, samples) if shared is not None else None
            if arrays is None:
                arrays = _generate(samples)
                if shared is not None:
                    try:
                        _save(shared / name, arrays)
                    except OSError:
                        pass  # the machine-wide copy only saves the next home the generation
        _save(path, arrays)
    spec = TaskSpec(
        model=build_model,
        train=(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])),
        test=(torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"])),
        loss=F.cross_entropy,
        metric=accuracy,
        metric_name="accuracy",
        batch_size=64,
    )
    return spec, _hash_arrays(arrays)


def build_model() -> nn.Module:
    """MLP 40 -> 256 -> 256 -> 10 with ReLU."""
    return nn.Sequential(
        nn.Linear(FEATURES, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, CLASSES),
    )


def cache_name(samples: int) -> str:
    return CACHE_NAME if samples == DEFAULT_SAMPLES else f"mnist1d-{samples}.npz"


def parse_samples(spec: str) -> int:
    """The signal count of ``mnist1d`` or ``mnist1d:samples=N``. Raises ValueError
    with a message for anything else."""
    name, _, options = spec.partition(":")
    if name != "mnist1d":
        raise ValueError(f"not an mnist1d task: {spec!r}")
    if not options:
        return DEFAULT_SAMPLES
    key, _, value = options.partition("=")
    if key != "samples" or not (value.isascii() and value.isdigit()) or not 100 <= int(value) <= MAX_SAMPLES:
        raise ValueError(f"bad mnist1d option {options!r}: the only option is samples=N, "
                         f"N from 100 to {MAX_SAMPLES:,} (e.g. 'mnist1d:samples=60000')")
    return int(value)


def accuracy(output: Tensor, target: Tensor) -> float:
    """Fraction of rows whose largest logit is the target class."""
    return (output.argmax(dim=-1) == target).float().mean().item()


@contextlib.contextmanager
def _machine_lock(shared: Path | None) -> Iterator[None]:
    """Hold ``shared``'s lock file (another home may be making the same data); no lock
    when there is no shared folder or it cannot be made."""
    fd = None
    if shared is not None:
        try:
            shared.mkdir(parents=True, exist_ok=True)
            fd = os.open(shared / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def _load(path: Path, samples: int) -> dict[str, np.ndarray] | None:
    """The cached arrays at ``path``, or None if missing, torn, foreign or of another size."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: np.array(npz[key]) for key in _KEYS}
        _check(arrays)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None  # a torn or foreign cache file: regenerated by the caller
    return arrays if len(arrays["x"]) + len(arrays["x_test"]) == samples else None


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, x=arrays["x"], y=arrays["y"], x_test=arrays["x_test"],
             y_test=arrays["y_test"])
    write_atomic(path, buffer.getvalue())


def _generate(samples: int) -> dict[str, np.ndarray]:
    try:  # only needed on a cold cache; an extra, as it brings scipy and matplotlib
        import mnist1d.data  # type: ignore[import-untyped]
    except ImportError:
        raise TaskError("the mnist1d task makes its data with the mnist1d package, which is not installed "
                        "here: pip install 'ttpeer[mnist1d]'") from None

    # make_dataset reseeds the global `random` and numpy generators; put them back
    # so that loading a task has no side effects on the rest of the process.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        args = mnist1d.data.get_dataset_args()
        args.num_samples = samples
        data = mnist1d.data.make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    arrays: dict[str, np.ndarray] = {
        "x": np.ascontiguousarray(data["x"], dtype=np.float32),
        "y": np.ascontiguousarray(data["y"], dtype=np.int64),
        "x_test": np.ascontiguousarray(data["x_test"], dtype=np.float32),
        "y_test": np.ascontiguousarray(data["y_test"], dtype=np.int64),
    }
    _check(arrays)
    return arrays


def _check(arrays: dict[str, np.ndarray]) -> None:
    for x_key, y_key in (("x", "y"), ("x_test", "y_test")):
        x, y = arrays[x_key], arrays[y_key]
        if x.dtype != np.float32 or y.dtype != np.int64:
            raise ValueError("mnist1d cache has wrong dtypes")
        if x.ndim != 2 or x.shape[1] != FEATURES or y.shape != (x.shape[0],) or x.shape[0] == 0:
            raise ValueError("mnist1d cache has wrong shapes")
        if y.min() < 0 or y.max() >= CLASSES:
            raise ValueError("mnist1d cache has labels out of range")


def _hash_arrays(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256(_VERSION_TAG)
    for key in _KEYS:
        array = arrays[key]
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        digest.update(f"\0{key}:{little.dtype.str}:{array.shape}\0".encode())
        digest.update(np.ascontiguousarray(little).tobytes())
    return digest.hexdigest()
