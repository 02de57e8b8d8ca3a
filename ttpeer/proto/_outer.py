"""The outer step's settings for a round, picked by the pool (jobs with ``outer_auto``).

Theory of operation. The mean of n peers' pseudo-gradients is shorter than the step
synchronous training at n times the batch would take over the same inner steps: each peer's
AdamW steps are mostly its own batches' noise, and the mean cancels the noise but keeps only
one peer's share of the progress. The outer step makes up for it; how much depends on how
many trajectories are averaged. Over the rounds Nesterov momentum ``mu`` at outer lr ``lr``
moves a steady direction ``lr / (1 - mu)`` times the mean, and the noise of one round far
less, so the rule holds the lr and raises the momentum with the round's contributions.
``scripts/bench/convergence`` fitted it (docs/benchmarks.md, "Convergence lab").

That momentum is a ceiling. Where the peers' deltas agree, their mean is about as long as
each of them, and momentum would amplify a step that averaging did not shorten; where they
disagree, averaging cancelled the noise and the momentum makes up for it. A job with
``outer_agree`` (``outer_auto`` 2 on the wire) scales the momentum by the pool's agreement:
the share of one delta's energy that the round before's mean kept (``agreement``: the
close's ``mean_sq`` over its contributions' mean ``delta_sq``), from 1/n for n deltas of pure
noise to 1 for n copies of one delta. A round's signal adds up over its inner steps and its
noise only as their square root, so a long round agrees more than a short one of the same
steps; ``signal`` reads the agreement per inner step, as the share of one step's energy that
is signal: none of the momentum from ``AGREE_FULL`` up, all of it at ``AGREE_NONE`` and
below, and none before a round has closed. The figures are in the signed records (each peer's
``delta_sq``, the closer's ``mean_sq``), so every peer finds the same.

The close of a round picks its settings from its own contributions and inner steps (and
the round before's close and contributions) and names them in the record (``outer_lr``,
``outer_momentum``); every peer that applies the close reads them from there, so a later
change of this rule never splits a pool's states.
A job that gives ``--outer-lr`` or ``--outer-momentum`` keeps its own for every round.

Pure: numbers and signed records in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ttpeer_wire import Record

from ._cadence import Plan
from ._jobspec import JobSpec

LR = 0.7  # the outer lr at every pool size
GAIN_EXPONENT = 0.6  # lr / (1 - momentum) = contributions ** GAIN_EXPONENT
MOMENTUM_MAX = 0.7  # past it charlm's rounds lost more than mnist1d's gained (8 peers: 0.8 never reached)
AGREE_FULL = 0.3  # ``outer_agree``: steps whose signal share (``signal``) is this or more: no momentum
AGREE_NONE = 0.1  # ... this or less: the pool size's momentum (mnist1d at batch 16: 0.03-0.1)


class Outer(NamedTuple):
    """One round's outer step: Nesterov SGD at ``lr`` with ``momentum``."""

    lr: float
    momentum: float


def outer_settings(contributions: int, inner_steps: int, agreed: float | None = None, *,
                   agree: bool = False) -> Outer:
    """The outer step of a round closed from ``contributions`` contributions of
    ``inner_steps`` inner steps each; with ``agree`` (a job with ``outer_agree``) its
    momentum scaled by how far the round before's deltas ``agreed``, from 0 to 1
    (``signal``; None: no round has closed, or it lacks the figures: no momentum). Rounded
    to 4 decimals: the record holds them as written."""
    n = max(1, contributions)
    gain = n ** GAIN_EXPONENT
    momentum = min(MOMENTUM_MAX, max(0.0, 1.0 - LR / gain))
    if agree and n > 1:  # one contribution: nothing averaged, the ceiling is plain local training
        share = 0.0 if agreed is None else (AGREE_FULL - agreed) / (AGREE_FULL - AGREE_NONE)
        momentum *= min(1.0, max(0.0, share))
    return Outer(LR, round(momentum, 4))


def signal(agreement: float, contributions: int, inner_steps: int) -> float:
    """The share of one inner step's energy that is signal, from the ``agreement`` of a
    round of ``contributions`` deltas of ``inner_steps`` steps each: a delta's energy is
    signal S plus noise N, its mean's S + N/n, so S/N = (agreement - 1/n) / (1 - agreement)
    over the round, and 1/inner_steps of it over one step. 0 for pure noise (the mean kept
    1/n); 1 for deltas that are one (and for one contribution)."""
    n = max(1, contributions)
    if n == 1 or agreement >= 1.0:
        return 1.0
    ratio = max(0.0, agreement - 1.0 / n) / (1.0 - agreement) / max(1, inner_steps)
    return ratio / (1.0 + ratio)


def round_outer(job: JobSpec, rnd: int, contributions: int, plan: Plan, closes: Sequence[Record],
                by_id: Mapping[str, Record]) -> Outer:
    """The outer step the pool picks for round ``rnd`` of an ``outer_auto`` job, closed from
    ``contributions`` contributions; ``plan``: the job's rounds as far as its chain fixes
    them (at least to ``rnd``), ``closes``: the chain (the closes of rounds 0, 1, ...),
    ``by_id``: the records known here. With ``outer_agree``, the agreement is the close of
    round ``rnd - 1``'s, when it and every contribution it names are known here."""
    agreed = None
    if job.outer_agree and 1 <= rnd <= len(closes):
        before = closes[rnd - 1]
        contribs = [by_id[c] for c in before["contribs"] if c in by_id]
        kept = agreement(before, contribs) if len(contribs) == len(before["contribs"]) else None
        agreed = None if kept is None else signal(kept, len(contribs), plan.inner_steps(rnd - 1))
    return outer_settings(contributions, plan.inner_steps(rnd), agreed, agree=job.outer_agree)


def agreement(close: Record, contribs: Sequence[Record]) -> float | None:
    """How much of one delta's energy the mean of ``close``'s round kept: its ``mean_sq``
    over the sample-weighted mean of its ``contribs``' ``delta_sq`` (the records the close
    names). None when a figure is missing or not a finite number above 0."""
    return mean_kept(close.body.get("mean_sq"), [(c["samples"], c["metrics"].get("delta_sq")) for c in contribs])


def mean_kept(mean_sq: object, deltas: Sequence[tuple[int, object]]) -> float | None:
    """``mean_sq`` over the sample-weighted mean of ``deltas``' energies, given as (samples,
    delta_sq) pairs: the arithmetic of ``agreement``. None when a figure is missing or not a
    finite number above 0, or there are no samples."""
    mean = _figure(mean_sq)
    figures = [_figure(sq) for _n, sq in deltas]
    total = sum(n for n, _sq in deltas)
    if mean is None or not deltas or total <= 0 or any(f is None for f in figures):
        return None
    return mean / (sum(n * f for (n, _sq), f in zip(deltas, figures, strict=True) if f is not None) / total)


def _figure(v: object) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


def close_outer(close: Record) -> Outer | None:
    """The outer step a close names (a job with ``outer_auto``); None: the job's own."""
    b = close.body
    return Outer(float(b["outer_lr"]), float(b["outer_momentum"])) if "outer_lr" in b else None
