"""The outer step's settings for a round, picked by the pool (jobs with ``outer_auto``).

Theory of operation. The mean of n peers' pseudo-gradients is shorter than the step
synchronous training at n times the batch would take over the same inner steps: each peer's
AdamW steps are mostly its own batches' noise, and the mean cancels the noise but keeps only
one peer's share of the progress. The outer step makes up for it; how much depends on how
many trajectories are averaged. Over the rounds Nesterov momentum ``mu`` at outer lr ``lr``
moves a steady direction ``lr / (1 - mu)`` times the mean, and the noise of one round far
less, so the rule holds the lr and raises the momentum with the round's contributions.
``scripts/bench/convergence`` fitted it (docs/benchmarks.md, "Convergence lab").

The close of a round picks its settings from its own contributions and inner steps and
names them in the record (``outer_lr``, ``outer_momentum``); every peer that applies the
close reads them from there, so a later change of this rule never splits a pool's states.
A job that gives ``--outer-lr`` or ``--outer-momentum`` keeps its own for every round.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from typing import NamedTuple

from ttpeer_wire import Record

LR = 0.7  # the outer lr at every pool size
GAIN_EXPONENT = 0.6  # lr / (1 - momentum) = contributions ** GAIN_EXPONENT
MOMENTUM_MAX = 0.7  # past it charlm's rounds lost more than mnist1d's gained (8 peers: 0.8 never reached)


class Outer(NamedTuple):
    """One round's outer step: Nesterov SGD at ``lr`` with ``momentum``."""

    lr: float
    momentum: float


def outer_settings(contributions: int, inner_steps: int) -> Outer:
    """The outer step of a round closed from ``contributions`` contributions of
    ``inner_steps`` inner steps each. Rounded to 4 decimals: the record holds them as written."""
    n = max(1, contributions)
    gain = n ** GAIN_EXPONENT
    momentum = min(MOMENTUM_MAX, max(0.0, 1.0 - LR / gain))
    return Outer(LR, round(momentum, 4))


def close_outer(close: Record) -> Outer | None:
    """The outer step a close names (a job with ``outer_auto``); None: the job's own."""
    b = close.body
    return Outer(float(b["outer_lr"]), float(b["outer_momentum"])) if "outer_lr" in b else None
