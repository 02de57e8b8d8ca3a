"""Learning-rate schedules over a whole job, as pure functions of the global inner step.

A fused job of R rounds with H inner steps per shard has ``R x H`` inner steps on
every shard's timeline: every shard of round ``r`` runs steps ``r*H .. r*H+H-1``
(``shard_indices`` gives each shard its H batches; the trainer takes one AdamW step
per batch). The lr of step ``s`` is ``base_lr x factor(s)``, and ``factor`` reads
nothing but ``s`` and the job's fields, so a shard that is requeued, stolen or run
as a backup trains with exactly the lr it would have had on its first peer, whatever
that peer did before.

``factor`` with ``warmup`` W over ``total`` T steps and a final ratio f:

    s < W        (s + 1) / (W + 1)             linear warm-up, never 0
    constant     1
    linear       1 - (1 - f) p                 p = (s - W) / (T - W), in [0, 1)
    cosine       f + (1 - f) (1 + cos(pi p)) / 2

Rules (``check``): W < T, 0 <= f <= 1. Steps past T (none in a job) keep the last value.

The outer lr has a schedule of its own (``LrSchedule.outer_of_job``): the same
shapes over the job's rounds (T = rounds, W in rounds), read at the round a close
computes. Every peer that closes or applies round r uses the same outer lr, so the
states stay bit-identical; the default is constant, the outer lr the job names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LrSchedule:
    """The lr factor of every global inner step of a job."""

    kind: str = "constant"
    warmup: int = 0
    total: int = 1
    final_ratio: float = 0.0

    def __post_init__(self) -> None:
        problem = check(self.kind, self.warmup, self.total, self.final_ratio)
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def of_job(cls, job: Mapping[str, Any]) -> LrSchedule:
        """The inner schedule a job record (or spec) asks for; absent fields: constant lr."""
        return cls(kind=job.get("lr_schedule", "constant"), warmup=job.get("warmup", 0),
                   total=job["rounds"] * job["batches"], final_ratio=job.get("final_lr_ratio", 0.0))

    @classmethod
    def outer_of_job(cls, job: Mapping[str, Any]) -> LrSchedule:
        """The outer schedule of a job record (or spec), over its rounds; absent fields:
        constant outer lr."""
        return cls(kind=job.get("outer_lr_schedule", "constant"), warmup=job.get("outer_warmup", 0),
                   total=job["rounds"], final_ratio=job.get("outer_final_lr_ratio", 0.0))

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at global inner step ``step`` (>= 0)."""
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        progress = min((step - self.warmup) / (self.total - self.warmup), 1.0)
        if self.kind == "linear":
            return 1.0 - (1.0 - self.final_ratio) * progress
        return self.final_ratio + (1.0 - self.final_ratio) * (1.0 + math.cos(math.pi * progress)) / 2


def check(kind: str, warmup: int, total: int, final_ratio: float) -> str | None:
    """None if the schedule is valid, else what to change (one line)."""
    return _check(kind, warmup, total, final_ratio, _INNER)


def check_outer(kind: str, warmup: int, rounds: int, final_ratio: float) -> str | None:
    """``check`` for the outer schedule, in its own flags' words."""
    return _check(kind, warmup, rounds, final_ratio, _OUTER)


@dataclass(frozen=True)
class _Words:
    schedule: str  # "lr schedule"
    flag: str  # the flags' prefix: "--" or "--outer-"
    unit: str  # what the warm-up counts
    total: str  # what the job has that many of
    fix: str  # how to make the job longer


_INNER = _Words("lr schedule", "--", "steps", "inner steps (rounds x inner steps)", "train longer")
_OUTER = _Words("outer lr schedule", "--outer-", "rounds", "rounds", "add --rounds")


def _check(kind: str, warmup: int, total: int, final_ratio: float, w: _Words) -> str | None:
    if kind not in KINDS:
        return f"unknown {w.schedule} {kind!r}: use one of {', '.join(KINDS)}"
    if type(warmup) is not int or warmup < 0:
        return f"{w.flag}warmup must be a whole number of {w.unit} >= 0, got {warmup!r}"
    if warmup >= total:
        return (f"{w.flag}warmup ({warmup} {w.unit}) must be shorter than the job, which has {total} {w.total}; "
                f"lower {w.flag}warmup or {w.fix}")
    if not 0.0 <= final_ratio <= 1.0:
        return f"{w.flag}final-lr-ratio must be between 0 and 1, got {final_ratio!r}"
    return None


def outer_lr(job: Mapping[str, Any], round: int) -> float:
    """The outer lr of the close of ``round`` (0-based): the job's ``outer_lr`` times its
    outer schedule's factor there (exactly ``outer_lr`` for a constant schedule)."""
    return job["outer_lr"] * LrSchedule.outer_of_job(job).factor(round)


def shard_first_step(round: int, batches_per_shard: int) -> int:
    """The global inner step of the first batch of any shard of ``round``."""
    return round * batches_per_shard
