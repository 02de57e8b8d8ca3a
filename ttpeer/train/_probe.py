"""Checks a task passes before a job is published: one batch through it, and a
fingerprint of its data.

``probe`` runs the model, the loss (and its backward) and the metric on one
training batch and one test batch, so a shape mismatch or a loss that raises is
refused at the submitting terminal instead of being found by every peer.
``data_fingerprint`` hashes the datasets' sizes and a fixed sample of their items:
the job carries it, and a peer whose copy of the data differs (a task seeded from
``os.urandom``, a local file that is not the same everywhere) declines the job
instead of training on different data without anyone noticing.
"""

from __future__ import annotations

import hashlib
import random

import torch

from ._errors import Diverged
from ._inner import check_scalar, number
from ._samples import Samples
from ._spec import LoadedTask, fetch_batch

SAMPLE = 16  # items hashed per dataset: cheap, and any per-run randomness shows in them
PROBE_SAMPLES = 2  # a big model's probe: enough to run every op (2: batch norm needs more than one)


def probe(task: LoadedTask, *, batch_size: int, seed: int = 0, device: str = "cpu") -> None:
    """Run the model, loss (forward and backward) and metric on one training batch and
    one test batch of ``task``, on ``device``. A Hugging Face task or one with adapters
    (ttpeer's own model code, which takes any batch) is probed on ``PROBE_SAMPLES``
    samples only: its model may be a 7B base that one full batch's activations would
    not fit beside, where the job trains it in micro-batches. Raises what they raise
    (the caller names the task's line, see ``_failure.describe``), TaskError if the
    loss is not a scalar tensor or the metric not a number, and Diverged if the loss
    is already NaN/inf."""
    if task.spec.lora is not None or task.spec.info.get("hf"):
        batch_size = min(batch_size, PROBE_SAMPLES)
    try:
        _run(task, batch_size, seed, device)
    finally:
        if device.startswith("cuda"):  # what the probe's model held goes back for training
            torch.cuda.empty_cache()


def _run(task: LoadedTask, batch_size: int, seed: int, device: str) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = task.spec.model().to(device)
        x, y = (t.to(device) for t in fetch_batch(task.train, list(range(min(batch_size, task.n_train)))))
        output = model(x)
        loss = task.spec.loss(output, y)
        check_scalar(loss, task.name)
        if not bool(torch.isfinite(loss.detach())):
            raise Diverged("the loss is NaN or inf on the first batch, before any training")
        loss.backward()
        number(task.spec.metric(output.detach(), y), task.name)
        with torch.no_grad():
            xt, yt = (t.to(device) for t in fetch_batch(task.test, list(range(min(batch_size, task.n_test)))))
            out = model(xt)
            float(task.spec.loss(out, yt))
            number(task.spec.metric(out, yt), task.name)


def data_fingerprint(task: LoadedTask) -> str:
    """sha256 (hex) over both datasets' sizes and the bytes, dtypes and shapes of a fixed
    sample of their items. Equal data gives an equal fingerprint on every machine."""
    digest = hashlib.sha256(b"ttpeer/data/v1\n")
    for dataset, size in ((task.train, task.n_train), (task.test, task.n_test)):
        digest.update(f"{size}\n".encode())
        if isinstance(dataset, Samples):  # its pieces are verified by hash: named, not read
            digest.update(f"samples:{dataset.identity()}\n".encode())
            continue
        for i in sorted(random.Random(size).sample(range(size), min(SAMPLE, size))):
            for part in dataset[i]:
                t = torch.as_tensor(part).detach().cpu().contiguous()
                digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
                digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
