"""``ttpeer predict BUNDLE INPUT_FILE``: one line per input row.

Each line is the predicted class (argmax over the last dimension) and its
probability: the ensemble's averaged probability for a bundle, the softmax of the
model's outputs for a fused model. Inputs are a ``.npy`` array (its dtype kept) or
a text file with one row per line, values separated by commas or whitespace
(read as float32).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ttpeer.errors import UsageError


def read_inputs(path: Path):  # type: ignore[no-untyped-def]
    """The rows of ``path`` as a tensor. Raises UsageError."""
    import numpy as np
    import torch

    try:
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)
        else:
            text = path.read_text()
            rows = [line.replace(",", " ").split() for line in text.splitlines() if line.strip()]
            if not rows:
                raise UsageError(f"{path} has no input rows")
            if len({len(r) for r in rows}) != 1:
                raise UsageError(f"{path}: every row needs the same number of values")
            array = np.array(rows, dtype=np.float32)
    except FileNotFoundError:
        raise UsageError(f"input file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read inputs from {path}: {exc} (use .npy, or rows of numbers)") from None
    if array.ndim == 0 or array.size == 0:
        raise UsageError(f"{path} holds no input rows")
    if array.ndim == 1:
        array = array[None, :]
    if array.dtype.kind == "f":
        array = array.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(array))


def predict(bundle: Path, inputs: Path, task: str | None = None, home: Path | None = None) -> int:
    import torch

    from ttpeer import train
    from ttpeer._api import load

    model = load(bundle, task, home=home)
    x = read_inputs(inputs)
    ensemble = isinstance(model, train.Ensemble)
    try:
        with torch.no_grad():
            out = model(x)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        raise UsageError(f"the model cannot take the rows of {inputs} (shape {tuple(x.shape)}): {exc}") from None
    probs = out if ensemble else torch.softmax(out, dim=-1)
    conf, cls = probs.max(dim=-1)
    write = sys.stdout.write
    for c, p in zip(cls.reshape(len(x), -1).tolist(), conf.reshape(len(x), -1).tolist(), strict=True):
        write(" ".join(f"{ci}\t{pi:.4f}" for ci, pi in zip(c, p, strict=True)) + "\n")
    return 0
