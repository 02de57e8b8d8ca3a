"""The sync cadence: how many inner steps a round runs, so that the sync stays hidden.

Theory of operation. A fused job with ``h_min`` and ``h_max`` (``submit --inner-steps
auto``) keeps its budget of inner steps per shard (``rounds x inner_steps``) but lets the pool
divide it into rounds from what it measures. Smaller rounds are closer to synchronous
training (more outer steps for the same compute), so the pool wants the smallest rounds
the link allows: with overlap, a peer trains round r+1 while round r's deltas travel and
its close is made, so the sync is hidden when a round's compute is at least
``SYNC_MARGIN`` times the sync; without overlap every sync is waited for, so the compute
must be ``UTILIZATION / (1 - UTILIZATION)`` times the sync for the peer to spend
``UTILIZATION`` of its time in inner steps.

With overlap, a round costs steps in two ways (``scripts/bench/convergence``): the part
of it trained before the close of the round before lands, from an estimate of its base
(``daemon/worker/_overlap.py``), and the correction of every round, so more rounds for the same
budget cost more on some tasks. Measured at a sync of 6 steps, rounds of 2x the sync were
the best on mnist1d and needed 24-33% more steps than rounds of 4x on charlm; 3x was within 2%
of the best on mnist1d and 7% on charlm, the smallest worst case, so the margin is 3. It
also lets a sync run twice its median and still land inside the round: a close that lands
after the round ends is not corrected at all, which costs far more.

Each contribution of such a job carries two figures its peer machine measured on the
clock it is given: ``work_s``, the seconds its shards trained, and ``sync_s``, the last
sync it saw (uploading a round's delta, then waiting for the round's close). The close of
round r picks the inner steps per shard of round r+2 (round r+1 may already be training,
under overlap) with ``next_inner_steps``, from the contributions it names, and writes the
answer into the close record as ``next``; every peer reads it from the record (``Plan``),
so the sequence of round sizes is one for the whole pool whatever order the records
arrived in. Both figures are medians over the contributions (a straggler's backup copy
does not move them), and a peer's compute is its share of the round's shards among the
peers that contributed lately (``_closer.PEERS_OVER``): a round one peer trained alone,
the others still fetching its base, is a short round for a pool, not a long one. The sync
leaves out the time a peer waits for the others' deltas: it is its own upload, then from
the round covered (as it saw it) to the close applied, so stragglers, which stealing
handles, do not stretch the rounds. A round changes the size by at most ``MAX_CHANGE``
either way, so one noisy measurement cannot swing it.

Pure: no clocks are read here; the figures come from signed records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ttpeer_wire import Record

SYNC_MARGIN = 3.0  # overlap: a round's compute >= this x the sync
UTILIZATION = 0.9  # no overlap: the share of a peer's time in inner steps to aim for
MAX_CHANGE = 2.0  # a round's size moves by at most this factor from the round it follows


def hidden_ratio(overlap: bool) -> float:
    """A round's compute over its sync that keeps the sync out of the way."""
    return SYNC_MARGIN if overlap else UTILIZATION / (1.0 - UTILIZATION)


def steps_for(step_s: float, sync_s: float, *, overlap: bool, lo: int, hi: int) -> int:
    """Inner steps per round for one peer that hide a sync of ``sync_s`` behind steps of
    ``step_s`` seconds (``ttpeer advise`` asks this of a link it has not used yet)."""
    if step_s <= 0 or not math.isfinite(step_s) or not math.isfinite(sync_s):
        return hi
    return _clip(math.ceil(hidden_ratio(overlap) * max(0.0, sync_s) / step_s - 1e-9), lo, hi)


def next_inner_steps(current: int, contribs: Iterable[tuple[Mapping[str, float], int]], *, shards: int,
                     peers: int, overlap: bool, lo: int, hi: int) -> int:
    """Inner steps per shard for a later round, from (metrics, shards covered) of the
    contributions of a round that ran ``current`` inner steps per shard, in a job of ``shards``
    shards a round trained by ``peers`` peers. A peer's compute in a round is its share of
    the shards (``shards / peers``) at the median time a shard took, so a round that one
    peer trained alone (the others still fetching its base) does not count as a long round.
    Keeps ``current`` (within bounds) when no contribution carries both figures yet (the
    first rounds: nobody has synced)."""
    figures = list(contribs)
    per_shard = [w / n for m, n in figures if n > 0 and (w := _figure(m.get("work_s"))) is not None and w > 0]
    syncs = [s for m, _n in figures if (s := _figure(m.get("sync_s"))) is not None]
    if not per_shard or not syncs:
        return _clip(current, lo, hi)
    compute = statistics.median(per_shard) * shards / max(1, min(peers, shards))
    want = current * hidden_ratio(overlap) * statistics.median(syncs) / compute
    want = min(max(want, current / MAX_CHANGE), current * MAX_CHANGE)
    return _clip(math.ceil(want - 1e-9), lo, hi)


def round_size(want: int, left: int, hi: int) -> int:
    """Inner steps of a round that wants ``want`` with ``left`` of the budget to go: all
    that is left once less than half a round would remain after it (within ``hi``), else
    ``want`` (or what is left): a short last round ends the job with an outer step on a few
    noisy steps, which nothing after it corrects (docs/benchmarks.md, speedup runs 3-5)."""
    if left - want < want / 2 and left <= hi:
        return left
    return min(want, left)


def _clip(h: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, h))


def _figure(v: object) -> float | None:
    """A measured figure from a record's metrics: a finite number >= 0, else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    return None


@dataclass(frozen=True)
class Plan:
    """A job's rounds as far as its chain fixes them: round r runs ``inner_steps(r)`` inner steps
    per shard, the job's global inner steps ``first_step(r)`` on. A fixed job runs ``rounds``
    rounds of the job's ``inner_steps``. An auto-cadence job runs until its budget (``rounds x
    inner_steps`` per shard) is spent: rounds 0 and 1 run ``inner_steps``, round r >= 2 what the close of
    round r-2 picked (``next``), the last round what is left (``round_size``: a round takes
    the rest rather than leave less than half a round after it). The chain's ``closes`` fix the
    sizes up to round ``len(closes) + 1``; later ones are not known yet."""

    budget: int
    rounds: int  # a fixed job's round count; an auto job's at its first rounds' size
    sizes: tuple[int, ...]  # auto: the rounds fixed so far; fixed: empty (every round is ``step``)
    step: int  # a fixed job's size; an auto job's first rounds' size
    auto: bool
    lo: int = 1  # an auto job's bounds on a round's size
    hi: int = 1

    @classmethod
    def of(cls, job: Record, closes: Sequence[Record]) -> Plan:
        b = job.body
        rounds, first = int(b["rounds"]), int(b["batches"])  # the wire's name for inner_steps
        budget = rounds * first
        if "h_min" not in b:
            return cls(budget, rounds, (), first, False)
        lo, hi = int(b["h_min"]), int(b["h_max"])
        sizes: list[int] = []
        spent = 0
        for r in range(len(closes) + 2):
            want = first if r < 2 else _clip(int(closes[r - 2].body.get("next", sizes[-1])), lo, hi)
            if spent >= budget:
                break
            sizes.append(round_size(want, budget - spent, hi))
            spent += sizes[-1]
        return cls(budget, rounds, tuple(sizes), first, True, lo, hi)

    def size_after(self, closes: Sequence[Record]) -> int:
        """An auto job's size of round ``len(closes)``, before the budget cuts the last one
        (what ``of`` computes for that round, in constant time: for walking a chain)."""
        for i in range(len(closes) - 2, -1, -1):  # a close without ``next`` keeps the size before
            picked = closes[i].body.get("next")
            if picked is not None:
                return _clip(int(picked), self.lo, self.hi)
        return self.step

    def inner_steps(self, r: int) -> int:
        """Inner steps per shard of round ``r`` (a round the chain has fixed, or a fixed job)."""
        if not self.auto:
            return self.step
        return self.sizes[r] if r < len(self.sizes) else self.sizes[-1]

    def first_step(self, r: int) -> int:
        """The job's global inner step that round ``r``'s shards start at (lr schedules, data order)."""
        if not self.auto:
            return r * self.step
        return sum(self.sizes[:r]) + max(0, r - len(self.sizes)) * self.sizes[-1]

    def has_round(self, r: int) -> bool:
        """Whether the job has a round ``r`` (for an auto job: budget is left before it)."""
        return r < self.rounds if not self.auto else self.first_step(r) < self.budget

    def finished(self, closed: int) -> bool:
        """Whether ``closed`` closed rounds end the job."""
        return not self.has_round(closed)

    def expected_rounds(self) -> int:
        """The job's round count: exact for a fixed job, for an auto job the rounds fixed so
        far plus what is left at the last size fixed."""
        if not self.auto:
            return self.rounds
        left = self.budget - sum(self.sizes)
        return len(self.sizes) + max(0, -(-left // self.sizes[-1]))

    def max_rounds(self) -> int:
        """The most rounds the job can have (an auto job's: every round at its smallest)."""
        return self.rounds if not self.auto else -(-self.budget // self.lo)
