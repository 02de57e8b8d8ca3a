"""The built-in ``mnist1d`` task: 4000/1000 one-dimensional digit signals, 40
features, 10 classes, and a small MLP.

The data is generated offline by the ``mnist1d`` package (deterministic, about
a second) and cached as ``data_dir/mnist1d.npz``; a cache that is unreadable or
has the wrong shape is regenerated. ``source_hash`` covers the arrays and a
version tag for the model, so peers whose data differ notice.

``mnist1d:samples=N`` generates N signals instead of the package's 5000 (80%
train, 20% test, the same generator with more draws; about 5 s per 25,000 here),
cached as ``mnist1d-N.npz``: the 4000 training signals of the default are
overfitted within a few epochs, which hides what more peers buy.
"""

from __future__ import annotations

import hashlib
import io
import random
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._atomic import write_atomic
from ._spec import TaskSpec

CACHE_NAME = "mnist1d.npz"
DEFAULT_SAMPLES = 5000  # the mnist1d package's own default: 4000 train, 1000 test
MAX_SAMPLES = 2_000_000
FEATURES = 40
CLASSES = 10
# Bump when the model or the data preparation changes: it changes source_hash.
_VERSION_TAG = b"ttpeer-mnist1d-v1"
_KEYS = ("x", "y", "x_test", "y_test")


def mnist1d_task(data_dir: Path, samples: int = DEFAULT_SAMPLES) -> tuple[TaskSpec, str]:
    """Return the mnist1d ``TaskSpec`` with ``samples`` signals in all, and its source hash.

    Raises OSError if the cache cannot be written to ``data_dir``.
    """
    arrays = _load_or_make(data_dir / cache_name(samples), samples)
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


def _load_or_make(path: Path, samples: int) -> dict[str, np.ndarray]:
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {key: np.array(npz[key]) for key in _KEYS}
            _check(arrays)
            if len(arrays["x"]) + len(arrays["x_test"]) == samples:
                return arrays
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            pass  # a torn or foreign cache file: regenerate it below
    arrays = _generate(samples)
    buffer = io.BytesIO()
    np.savez(buffer, x=arrays["x"], y=arrays["y"], x_test=arrays["x_test"],
             y_test=arrays["y_test"])
    write_atomic(path, buffer.getvalue())
    return arrays


def _generate(samples: int) -> dict[str, np.ndarray]:
    import mnist1d.data  # type: ignore[import-untyped]  # only needed on a cold cache

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
