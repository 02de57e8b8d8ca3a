"""The sync cadence: how many inner steps a round runs, so that the sync stays hidden.

Theory of operation. A fused job with ``h_min`` and ``h_max`` (``submit --inner-steps
auto``) keeps its budget of inner steps per shard (``rounds x batches``) but lets the pool
divide it into rounds from what it measures. Smaller rounds are closer to synchronous
training (more outer steps for the same compute), so the pool wants the smallest rounds
the link allows: with overlap, a peer trains round r+1 while round r's deltas travel and
its close is made, so the sync is hidden when a round's compute is at least
``SYNC_MARGIN`` times the sync; without overlap every sync is waited for, so the compute
must be ``UTILIZATION / (1 - UTILIZATION)`` times the sync for the peer to spend
``UTILIZATION`` of its time in inner steps.

Each contribution carries its peer's time in inner steps for the round (``train_s``) and
the last sync it measured (``sync_s``: from publishing a round's delta to holding that
round's close applied). The close of round r picks the batches per shard of round r+2
(round r+1 may already be training, under overlap) with ``next_batches``, from the
contributions it names, and writes the answer into the close record; every peer reads the
answer from the record, so the sequence of round sizes is one for the whole pool whatever
order the records arrived in. The compute of a round is the median of its contributions'
``train_s`` (a straggler's backup copy does not move it); the sync is the smallest
``sync_s`` reported (the last peer to publish waits for nobody, so its figure is upload,
close and apply alone; the others include waiting for it). A round changes the size by at
most ``MAX_CHANGE`` either way, so one noisy measurement cannot swing it.

Pure: no clocks are read here; the figures come from signed records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

SYNC_MARGIN = 1.5  # overlap: a round's compute >= this x the sync
UTILIZATION = 0.9  # no overlap: the share of a peer's time in inner steps to aim for
MAX_CHANGE = 2.0  # a round's size moves by at most this factor from the round it follows
DEFAULT_H_MIN, DEFAULT_H_MAX = 5, 1000  # ``--inner-steps auto``'s bounds unless given


def hidden_ratio(overlap: bool) -> float:
    """A round's compute over its sync that keeps the sync out of the way."""
    return SYNC_MARGIN if overlap else UTILIZATION / (1.0 - UTILIZATION)


def steps_for(step_s: float, sync_s: float, *, overlap: bool, lo: int, hi: int) -> int:
    """Inner steps per round for one peer that hide a sync of ``sync_s`` behind steps of
    ``step_s`` seconds (``ttpeer advise`` asks this of a link it has not used yet)."""
    if step_s <= 0 or not math.isfinite(step_s) or not math.isfinite(sync_s):
        return hi
    return _clip(math.ceil(hidden_ratio(overlap) * max(0.0, sync_s) / step_s - 1e-9), lo, hi)


def next_batches(current: int, contribs: Iterable[Mapping[str, float]], *, overlap: bool, lo: int,
                 hi: int) -> int:
    """Batches per shard for a later round, from the metrics of the contributions of a round
    that ran ``current`` batches per shard. Keeps ``current`` (within bounds) when no
    contribution carries both figures yet (the first rounds: nobody has synced)."""
    metrics = list(contribs)
    compute = [float(m["train_s"]) for m in metrics if _positive(m.get("train_s"))]
    syncs = [float(m["sync_s"]) for m in metrics if _finite(m.get("sync_s"))]
    if not compute or not syncs:
        return _clip(current, lo, hi)
    want = current * hidden_ratio(overlap) * max(0.0, min(syncs)) / statistics.median(compute)
    want = min(max(want, current / MAX_CHANGE), current * MAX_CHANGE)
    return _clip(math.ceil(want - 1e-9), lo, hi)


def _clip(h: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, h))


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _positive(v: object) -> bool:
    return _finite(v) and float(v) > 0  # type: ignore[arg-type]
