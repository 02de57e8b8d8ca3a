"""The arithmetic of ``ttpeer advise``: over N machines, will a job finish sooner, and why.

Theory of operation. Figures come in (measured by ``_advise_cmd`` on this machine, or
given); a table and one sentence go out. Pure: no torch, no clock, no I/O, so every
figure of the verdict can be checked by hand and by the tests.

The model, for a fused job over ``n`` peers, each with the same link and device:

- one peer alone is plain local training: ``S1`` steps of ``step_s`` each, no sync;
- a sync, by the path the pool itself picks for the round (``proto.sliced``: slices from
  ``SLICES_FROM`` = 3 peers when the model has two chunks or more and, for a job with
  ``slice_min`` (submit's default), where they save each peer that many bytes a round,
  ``proto.pays``; else all deltas):

  - all deltas (``sync_seconds``): each peer uploads its delta of ``D`` wire bytes and
    downloads the other ``n - 1`` (every peer fetches them side by side as soon as the
    round is covered, while the close is made), plus ``ROUND_TRIPS`` = 2 round trips (an
    empirical fit on the speedup bench; it under-predicts the sync more as peers grow on
    one machine's shared cores), plus ``ROUND_FIXED_S`` for the close itself (aggregate,
    evaluate, sign, apply)::

        sync_s(n) = D / up + (n - 1) * D / down + 2 * rtt + ROUND_FIXED_S

  - slices (``sliced_sync_seconds``), ``s = min(n, chunks)`` of them: each peer uploads
    its delta, reduces its slice from the other ``n - 1`` deltas' ``1/s`` (three range
    requests each in two round trips, the table and then the head and the chunks, for
    ``F = FETCHES_AT_ONCE`` deltas at a time, as the daemon fetches them), uploads its reduced
    slice (``R / s``: the reduced model ``R`` is at the job's ``slice_bits`` without error
    feedback, and the mean of many deltas hardly compresses: ``scripts/bench/exchange``
    measured R at 1.3x a delta for 4 peers and 2x for 16 at 8 bits, about 0.6x at 16 at
    4 bits and 0.3x at 3) and downloads the other ``s - 1`` slices. One slice
    in ``CHECK_ONE_IN`` is checked: a round has one with probability
    ``p = 1 - (1 - 1/CHECK_ONE_IN)^s``, and once its result is out a second peer fetches
    one chunk of each other delta (of ``C`` chunks in all) and the result, and signs it;
    a slice of one chunk (``C < 2s`` here) is checked by a second whole reduction from the
    start, beside the first, whose peer's link then carries two slices' ranges::

        reduce(n)  = (n - 1) * D / (s * down) + 2 ceil((n - 1) / F) * rtt
        check(n)   = (n - 1) * D / (C * down) + R / (s * down) + (2 ceil((n - 1) / F) + 2) * rtt
                     (C >= 2s; else (n - 1) * D / (s * down))
        sync_s(n)  = D / up + reduce(n) + p * check(n)
                     + R / (s * up) + (s - 1) * R / (s * down)
                     + (n + 7 + ceil((s - 1) / F)) * rtt + ROUND_FIXED_S

    the round trips: the delta's 3 and every other peer's record (as above; its GETs are
    the ranges in ``reduce``), the slice's PUT (2), its record out and in (2), the other
    slices' GETs (``F`` at a time) and the close's record. ``scripts/bench/exchange`` with
    a 137,216-parameter charlm at 20 Mbit/s and 50 ms round trips took 1.8-2.0 s a round
    on slices and on all deltas with 4 peers, 3.1 against 3.4 s with 8 (this predicts
    1.15 against 0.96 s of sync, and 1.46 against 1.77 s); fetched one at a time (before
    ``F``), the slices took 2.3 and 4.6 s;
- ``H(n)``: the inner steps a round runs, by the pool's own rule for ``--inner-steps
  auto`` (``proto/_cadence.steps_for``): the smallest round whose compute hides the sync;
- a round takes ``max(H * step_s, sync_s)`` with overlap (the deltas travel while the
  next round trains), ``H * step_s + sync_s`` without; utilization ``u`` is the share
  of it spent in inner steps;
- steps to the same loss: ``S1 / g_eff`` per peer. Synchronous data parallelism over
  ``n`` peers gains ``g(n)`` (steps at batch B over steps at n*B, measured by the scaling
  probe or assumed); periodic averaging keeps part of it: all of it where the gain is as
  large as the peers (the steps are mostly noise, which the mean cancels as a larger batch
  would), less where it is smaller (``(g/n)^K``), and less the longer the rounds and the
  more peers drift apart between averages; with overlap, the part of a round trained
  before the close of the round before lands (``lag``, the sync in steps, at most H) is
  trained from an estimate of its base and costs steps, more so the more peers::

      g_eff = (1 + (g(n) - 1) * e) / c,   e = (min(1, g(n) / n))^K / (1 + (n - 1) * H / H_HALF)
      c     = 1 + OVERLAP_COST * (1 - 1/n) * lag / H      (1 without overlap)

- the time to the loss against one peer: ``(S1 / g_eff) * (round_s / H) / (S1 * step_s)
  = 1 / (g_eff * u)``.

Calibration (docs/advise.md). ``H_HALF`` = 375, ``K`` = 0.45 and ``OVERLAP_COST`` = 0.35 are
the least-squares fit (in the log of steps) of the convergence lab's runs of the pool's outer
rule (``scripts/bench/advise-fit``: mnist1d at batch 4 and 16, charlm at batch 32, 2-8 peers,
rounds of 6 to 25 steps, overlapped and waiting, 3 seeds each); over those 37 cells the
model's steps are within 0.83-1.12x of the measured. The sync's terms come from
``scripts/bench/speedup`` (batch 4, 20 Mbit/s, 100 ms round trips, steps of 100 ms, every
peer fetching the deltas ahead): the cadence's rounds put the median sync at about 0.3, 0.5
and 0.63 s for 2, 4 and 8 peers, where the model gives 0.38, 0.41 and 0.46 s; measured over
predicted times are 0.98 (2 peers), 0.97-1.08 (4) and 1.26-1.31 (8: 8 daemons on 2
shared cores, which the model does not see). H is a whole number of steps, rounded up, so
between two links the figures can move by a step's worth.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ttpeer._parser import DEFAULT_H_MAX, DEFAULT_H_MIN

# ttpeer.proto is imported where it is used: every command's parser reads this module's
# link forms, and the client commands import no protocol (tests/unit/test_client_imports.py).

H_HALF = 375.0  # e(H_HALF, 2) = 1/2 where the gain is as large as the peers (fitted: the module's docstring)
NOISE_EXPONENT = 0.45  # the share kept where the gain is below the peers: (g / n) ** this
OVERLAP_COST = 0.35  # overlap: steps x (1 + this x (1 - 1/n) x the share of a round trained before its close lands
ROUND_TRIPS = 2  # a sync's round trips with all deltas (fitted: the docstring)
ROUND_FIXED_S = 0.15  # the close of a small model: aggregate, evaluate, sign, apply (seconds)
FETCHES_AT_ONCE = 8  # contributions (or reduced slices) a peer fetches at once: daemon RANGES_AT_ONCE
HELPS_BELOW = 0.95  # a predicted time under this fraction of one peer's is "helps"
ASSUMED_RATE = 20e6 / 8  # bytes/s (20 Mbit/s) when nothing is given or measured
ASSUMED_RTT = 0.050  # seconds

LINK_FORMS = "20mbit, 20Mbit/s, 500kbit, 1gbit (bits per second) or 2.5MB/s, 800KiB/s (bytes per second)"
_BITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_BYTES = {"B": 1.0, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30}
_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]+)\s*(?:/\s*s|ps)?\s*")


def parse_link(text: str) -> float:
    """Bytes per second of a link rate written as ``20mbit``, ``20Mbit/s``, ``1gbit``,
    ``500kbit`` (bits, any case) or ``2.5MB/s``, ``800KiB/s`` (bytes: a capital B).
    Raises ValueError, with the accepted forms, for anything else: no unit, a zero or
    negative rate, an unknown or ambiguous unit (``mb``: megabits or megabytes?)."""
    m = _RATE.fullmatch(text)
    if m is not None:
        number, unit = float(m.group(1)), m.group(2)
        if unit.lower() in _BITS:
            rate = number * _BITS[unit.lower()] / 8
        else:
            rate = number * _BYTES[unit] if unit in _BYTES else 0.0
        if rate > 0 and math.isfinite(rate):
            return rate
    raise ValueError(f"not a link rate: {text!r}; use a positive rate with its unit, e.g. {LINK_FORMS}")


def parse_rtt(text: str) -> float:
    """Seconds of a round trip given in milliseconds (``50``, ``12.5``, ``50ms``).
    Raises ValueError unless it is a positive, finite number."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:ms)?\s*", text)
    if m is None or not 0 < float(m.group(1)) < 1e6:
        raise ValueError(f"not a round trip: {text!r}; give milliseconds, more than 0 (e.g. 50 or 12.5)")
    return float(m.group(1)) / 1000


def rate_words(bytes_per_s: float) -> str:
    """``20 Mbit/s``: a rate the way people write links."""
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


@dataclass(frozen=True)
class Link:
    """One peer's path to the relay: bytes per second each way, and a round trip in seconds."""

    up: float
    down: float
    rtt: float


@dataclass(frozen=True)
class Job:
    """What the prediction needs of the job and this machine."""

    step_s: float  # one inner step at the job's batch
    delta_bytes: int  # one delta on the wire
    overlap: bool
    h_min: int = DEFAULT_H_MIN
    h_max: int = DEFAULT_H_MAX
    chunks: int = 1  # of a chunked delta (ceil(values / chunk)); 1: closed from all deltas (--no-slices)
    reduced_bytes: int = 0  # the reduced model on the wire, all its slices together
    slice_min: int | None = None  # the job's slice_min (None: slices whatever they save, --slices)
    bits: int = 8  # a delta's bits, and a reduced slice's: what the pool's rule weighs (``proto.pays``)
    slice_bits: int = 8

    def slices(self, peers: int) -> int:
        """How many slices a round of ``peers`` contributions is reduced in, by the pool's
        own rule (``proto.sliced``, ``proto.pays``); 0: all deltas."""
        from ttpeer.proto import pays, sliced

        if not sliced(peers, self.chunks):
            return 0
        s = min(peers, self.chunks)
        least = self.slice_min
        return s if least is None or pays(peers, s, self.delta_bytes, self.slice_bits, self.bits, least) else 0


@dataclass(frozen=True)
class Row:
    peers: int
    sync_s: float
    slices: int  # 0: the round closes from all deltas
    received: float  # wire bytes a peer downloads a round
    h: int | None  # None: one peer, no rounds to size
    utilization: float
    gain: float  # g(n): synchronous data parallelism's
    kept: float  # g_eff: what averaging every H steps keeps of it
    time: float  # to the same loss, over one peer's time


def sync_seconds(peers: int, delta_bytes: int, link: Link, fixed: float = ROUND_FIXED_S) -> float:
    """One round's sync for each of ``peers`` peers: upload one delta, download the others,
    ``ROUND_TRIPS`` round trips and the close's ``fixed`` cost (the formula in the module's
    docstring). 0 for one peer."""
    if peers <= 1:
        return 0.0
    return (delta_bytes / link.up + (peers - 1) * delta_bytes / link.down + ROUND_TRIPS * link.rtt + fixed)


def sliced_sync_seconds(peers: int, slices: int, delta_bytes: int, reduced_bytes: int, link: Link,
                        fixed: float = ROUND_FIXED_S, chunks: int | None = None) -> float:
    """One round's sync for each of ``peers`` peers reduced in ``slices`` slices of a
    delta of ``chunks`` chunks (None: as many as slices): upload one delta, reduce a slice
    from the others' ranges, upload it, download the other slices, and the expected cost
    of a spot check, which waits for the result (the formula in the module's docstring)."""
    from ttpeer.proto import CHECK_ONE_IN

    n, s, d, r, c = peers, slices, delta_bytes, reduced_bytes, chunks or slices
    trips = 2 * math.ceil((n - 1) / FETCHES_AT_ONCE)
    reduce = (n - 1) * d / (s * link.down) + trips * link.rtt
    if c >= 2 * s:  # a chunk of a slice of several, once the result is out
        check = (n - 1) * d / (c * link.down) + r / (s * link.down) + (trips + 2) * link.rtt
    else:  # a slice of one chunk (most of them): a whole reduction, beside the first
        check = (n - 1) * d / (s * link.down)
    p = 1.0 - (1.0 - 1.0 / CHECK_ONE_IN) ** s
    rest = n + 7 + math.ceil((s - 1) / FETCHES_AT_ONCE)
    return (d / link.up + reduce + p * check + r / (s * link.up) + (s - 1) * r / (s * link.down)
            + rest * link.rtt + fixed)


def received(peers: int, slices: int, delta_bytes: int, reduced_bytes: int, chunks: int | None = None) -> float:
    """Wire bytes one peer downloads a round: the other deltas, or with slices its slice of
    them, the other reduced slices, and its expected share of the spot checks (one chunk
    of each other delta, of ``chunks``; None: as many as slices)."""
    if peers <= 1:
        return 0.0
    if not slices:
        return float((peers - 1) * delta_bytes)
    from ttpeer.proto import CHECK_ONE_IN

    checks = slices / CHECK_ONE_IN  # slices checked a round, each by some peer
    return ((peers - 1) * delta_bytes * (1.0 / slices + checks / (peers * (chunks or slices)))
            + (slices - 1) * reduced_bytes / slices)


def kept(h: float, peers: int = 2, gain: float | None = None, *, h_half: float | None = None,
         noise: float | None = None) -> float:
    """e(H, n, g): the share of synchronous data parallelism's gain ``gain`` (g(n); None:
    as much as the peers, n) that ``peers`` peers averaging every H steps keep: all of it
    where the gain is as large as the peers (the steps are mostly noise, which averaging
    cancels as a larger batch would), less where it is smaller, and less the longer the
    rounds and the more peers drift apart between averages. ``h_half``, ``noise``: other
    constants than ``H_HALF`` and ``NOISE_EXPONENT`` (the fit tries them)."""
    n = max(2, peers)
    exponent = NOISE_EXPONENT if noise is None else noise
    share = 1.0 if gain is None else min(1.0, max(1.0, gain) / n) ** exponent
    return share / (1.0 + (n - 1) * h / (H_HALF if h_half is None else h_half))


def lag_cost(lag: float, h: float, peers: int, cost: float | None = None) -> float:
    """What overlap multiplies the steps by when ``lag`` of a round's ``h`` steps are trained
    before the close of the round before lands: ``1 + OVERLAP_COST (1 - 1/n) lag / h``
    (``cost``: another constant, as the fit tries)."""
    per = OVERLAP_COST if cost is None else cost
    return 1.0 + per * (1.0 - 1.0 / max(1, peers)) * min(lag, h) / h if h > 0 else 1.0


def overlap_cost(job: Job, sync_s: float, h: int, peers: int) -> float:
    """What overlap multiplies the steps by: a round's steps trained before the close of the
    round before lands (the sync in steps, at most the round) are trained from an estimate
    of its base, beside the pool's model; the more peers, the further the estimate is off.
    1 without overlap."""
    if not job.overlap or h <= 0:
        return 1.0
    return lag_cost(h if job.step_s <= 0 else sync_s / job.step_s, h, peers)


def sqrt_gain(k: int) -> float:
    """The gain ``--quick`` assumes for k times the batch."""
    return math.sqrt(k)


def predict(job: Job, link: Link, peers: int, gain: Callable[[int], float],
            fixed: float = ROUND_FIXED_S) -> list[Row]:
    """One row per peer count 1..``peers``; ``gain(k)`` is g(k) (g(1) = 1); ``fixed``: a
    close's own seconds (0 asks what a sync that costs nothing would give)."""
    from ttpeer.proto import steps_for

    rows = [Row(1, 0.0, 0, 0.0, None, 1.0, 1.0, 1.0, 1.0)]
    for n in range(2, peers + 1):
        s = job.slices(n)
        sync = (sliced_sync_seconds(n, s, job.delta_bytes, job.reduced_bytes, link, fixed, job.chunks) if s
                else sync_seconds(n, job.delta_bytes, link, fixed))
        h = steps_for(job.step_s, sync, overlap=job.overlap, lo=job.h_min, hi=job.h_max)
        compute = h * job.step_s
        round_s = max(compute, sync) if job.overlap else compute + sync
        u = compute / round_s if round_s > 0 else 1.0
        g = max(1.0, gain(n))
        g_eff = (1.0 + (g - 1.0) * kept(h, n, g)) / overlap_cost(job, sync, h, n)
        rows.append(Row(n, sync, s, received(n, s, job.delta_bytes, job.reduced_bytes, job.chunks), h, u, g,
                        g_eff, 1.0 / (g_eff * u)))
    return rows


def verdict(rows: Sequence[Row], job: Job, link: Link) -> str:
    """One plain sentence for the last row (the peer count asked about): how much sooner,
    or why not: the task (free communication would not help either), the steps (even a
    free network leaves each round's close, which a step this short cannot hide in few
    steps), or the link."""
    last = rows[-1]
    n = last.peers
    if n == 1:
        return "one machine is one machine: give --peers N (2 or more) to ask about a pool"
    if last.time < HELPS_BELOW:
        best = min(rows, key=lambda r: r.time)
        also = (f"; {best.peers} machines would do best, {best.time:.2f}x"
                if best.peers != n and best.time < last.time - 0.02 else "")
        return f"over {n} machines this job is predicted to finish in {last.time:.2f}x the time of one{also}"
    free = predict(job, Link(math.inf, math.inf, 0.0), n, lambda k: last.gain if k == n else 1.0, fixed=0.0)[-1]
    if free.time >= HELPS_BELOW:
        return (f"will not help: {last.time:.2f}x the time over {n} machines, because of the task: perfect "
                f"data parallelism over {n} machines would gain only {last.gain:.2f}x (its loss falls "
                f"hardly faster per step at {n}x the batch), whatever the network")
    net_free = predict(job, Link(math.inf, math.inf, 0.0), n, lambda k: last.gain if k == n else 1.0)[-1]
    if net_free.time >= HELPS_BELOW:
        return (f"will not help: {last.time:.2f}x the time over {n} machines, because its steps are short: "
                f"{job.step_s * 1000:.3g} ms a step against a sync of {last.sync_s:.2f} s, most of it each "
                f"round's close ({ROUND_FIXED_S:g} s, whatever the network), so a round needs H={last.h} steps, "
                f"and averaging that seldom keeps {kept(last.h or 1, n, last.gain):.0%} of the task's {last.gain:.2f}x "
                f"gain; a larger --batch-size or model (more work per step) helps")
    return (f"will not help: {last.time:.2f}x the time over {n} machines, because of the link: a sync "
            f"takes {last.sync_s:.2f} s against {job.step_s * 1000:.3g} ms a step, so a round needs "
            f"H={last.h} steps to hide it, and averaging that seldom keeps {kept(last.h or 1, n, last.gain):.0%} of "
            f"the task's {last.gain:.2f}x gain")


def table(rows: Sequence[Row]) -> list[str]:
    """The rows as aligned text lines, a header first."""
    head = (f"{'peers':>5}  {'path':>9}  {'receives':>9}  {'sync s':>7}  {'H':>5}  {'utilization':>11}  "
            f"{'gain kept':>11}  {'time vs one peer':>16}")
    lines = [head]
    for r in rows:
        one = r.h is None
        path = "-" if one else (f"{r.slices} slices" if r.slices else "deltas")
        got = "-" if one else size_words(r.received)
        sync = "-" if one else f"{r.sync_s:.2f}"
        h = "-" if one else str(r.h)
        gain = "-" if one else f"{r.kept:.2f}/{r.gain:.2f}"
        lines.append(f"{r.peers:>5}  {path:>9}  {got:>9}  {sync:>7}  {h:>5}  {r.utilization:>11.0%}  {gain:>11}  "
                     f"{r.time:>15.2f}x")
    return lines


def size_words(n: float) -> str:
    """``3.4 MiB``: a byte count the way the rest of advise writes them."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def steps_to(curve: Sequence[tuple[int, float]], loss: float) -> float | None:
    """Steps until the eval loss first reaches ``loss``, linear between evaluations."""
    before = (0, float("inf"))
    for step, value in curve:
        if value <= loss:
            if before[1] == float("inf"):
                return float(step)
            return before[0] + (before[1] - loss) / (before[1] - value) * (step - before[0])
        before = (step, value)
    return None


def gain_of(one: Sequence[tuple[int, float]], wide: Sequence[tuple[int, float]], k: int) -> float | None:
    """g(k) from two eval-loss curves (at batch B and k*B, same steps): the median ratio of
    steps to the lower half of 8 losses evenly spaced between the first evaluation both
    passed and the lowest loss both reached (late training, where gains are smallest),
    within [1, k]. None when the curves share no range of losses."""
    if len(one) < 2 or len(wide) < 2:
        return None
    top, bottom = min(one[0][1], wide[0][1]), max(min(v for _, v in one), min(v for _, v in wide))
    if not top > bottom:
        return None
    ratios = []
    for i in range(5, 9):
        loss = top - (top - bottom) * i / 8
        s1, sk = steps_to(one, loss), steps_to(wide, loss)
        if s1 is not None and sk is not None and sk > 0:
            ratios.append(s1 / sk)
    if not ratios:
        return None
    ratios.sort()
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return min(float(k), max(1.0, median))


def interpolate(measured: dict[int, float], k: int) -> float:
    """g(k) between measured peer counts, linear in log k (g(1) = 1); beyond the last,
    the last measured gain (no extrapolation upwards)."""
    points = sorted({1: 1.0, **measured}.items())
    if k in measured:
        return measured[k]
    for (k0, g0), (k1, g1) in zip(points, points[1:], strict=False):
        if k0 < k < k1:
            return g0 + (g1 - g0) * (math.log(k) - math.log(k0)) / (math.log(k1) - math.log(k0))
    return points[-1][1]
