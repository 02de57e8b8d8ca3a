"""How one peer runs a job's inner steps: precision, micro-batch, lr schedule, checkpointing.

The job record fixes what a step means (its batch, its lr at every global step);
the recipe adds what each peer may choose for itself without changing that meaning:
the autocast precision its device runs best (when the job leaves it open) and the
micro-batch its memory holds. ``Recipe.of_job`` reads the job's fields once, so
nothing below indexes a record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ttpeer.proto import PRECISION_CODES

from . import _precision
from ._errors import TaskError
from ._lr import LrSchedule, check_outer
from ._spec import LoadedTask
from ._tasks import check_model


@dataclass(frozen=True)
class Recipe:
    """``micro_batch``: samples per forward/backward pass, None for the whole batch."""

    precision: str = "fp32"
    micro_batch: int | None = None
    schedule: LrSchedule = field(default_factory=LrSchedule)
    checkpointing: bool = False

    @classmethod
    def of_job(cls, job: Mapping[str, Any], device: torch.device | str,
               micro_batch: int | None = None) -> Recipe:
        """The recipe of a fused job on ``device``, with the micro-batch this peer chose
        (the job's ``micro_batch`` wins when it forces one). Raises ValueError when the
        device cannot run the job's precision (the message says what to submit instead)."""
        forced = job.get("micro_batch")
        chosen = forced if forced is not None else micro_batch
        return cls(precision=_precision.resolve(job.get("precision", _precision.AUTO), torch.device(device)),
                   micro_batch=chosen if chosen is not None and chosen < job["batch_size"] else None,
                   schedule=LrSchedule.of_job(job), checkpointing=bool(job.get("checkpointing", 0)))

    def metrics(self, batch_size: int) -> dict[str, float]:
        """What a contribution tells the pool about how it was trained (numbers only)."""
        return {"precision": float(PRECISION_CODES[self.precision]),
                "micro_batch": float(self.micro_batch or batch_size)}


def check_job(task: LoadedTask, job: Mapping[str, Any]) -> None:
    """What the submitter checks before a job exists, so a job no peer could train is
    never published. Raises TaskError saying what to change."""
    try:
        LrSchedule.of_job(job)
    except ValueError as exc:
        raise TaskError(str(exc)) from None
    problem = check_outer(job.get("outer_lr_schedule", "constant"), job.get("outer_warmup", 0), job["rounds"],
                          job.get("outer_final_lr_ratio", 0.0))
    if problem is not None:
        raise TaskError(problem)
    if task.spec.lora is not None and job.get("mode") == "ensemble":
        raise TaskError(f"task {task.name} trains LoRA adapters over a frozen base: that is a fused job (--mode "
                        "fused); an ensemble's members would each hold their own copy of the base")
    if job.get("checkpointing"):
        model = check_model(task.spec, f"task {task.name}")
        if not callable(getattr(model, "gradient_checkpointing_enable", None)):
            raise TaskError(_NO_CHECKPOINTING.format(task=task.name))


_NO_CHECKPOINTING = ("task {task}: its model has no gradient_checkpointing_enable(), so it cannot "
                     "checkpoint activations; submit without --checkpointing")


def enable_checkpointing(model: torch.nn.Module, task_name: str) -> None:
    """Turn on activation checkpointing the way Hugging Face models spell it. Raises
    TaskError for a model without ``gradient_checkpointing_enable``."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        raise TaskError(_NO_CHECKPOINTING.format(task=task_name))
    enable()


def split(batch_size: int, micro_batch: int | None) -> list[int]:
    """Sizes of the micro-batches of one batch: as equal as possible, none above
    ``micro_batch``, in order, summing to ``batch_size``."""
    if micro_batch is None or micro_batch >= batch_size:
        return [batch_size]
    count = -(-batch_size // micro_batch)
    small, extra = divmod(batch_size, count)
    return [small + 1] * extra + [small] * (count - extra)
