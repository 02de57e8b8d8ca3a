"""The slicer: a sliced round's reductions and checks, and the results its close names.

Theory of operation. A fused job with ``chunk`` reduces a round of ``SLICES_FROM`` or
more authors in slices (``_slices.plan``): once the round is covered, slice ``s`` is
reduced by the author whose turn it is (``_slices.aggregators``, one lease each, on this
observer's clock since it saw the round covered), which signs a ``slice`` record naming
the contributions, the chunks, the blob and the hash of its result. A result counts by the
ledger's own rule (``_slices.counts``): once two authors signed its hash, or as the
slice's only hash when the slice is not spot-checked this round (``_slices.checked``, one
in ``CHECK_ONE_IN``). A result that does not count yet (checked, or hashes that disagree)
is recomputed by the next author in the slice's order that has not signed one (again one
lease each, from when this peer first saw a result): it signs the same hash naming the
same blob (nothing is uploaded), or its own result when the hashes differ, and a third
author then settles it. A checked slice's one result is recomputed on one chunk only
(``ReduceSlice.sample``), drawn by the checker once the result is signed: the whole slice
only when that chunk differs, and when hashes disagree. A checked slice of one chunk is
reduced from the start by the first two in its order at once (its check is a whole
reduction either way). A result whose blob did not hash
as its record says (``refused``) is made again at once by the peer that found it. The
close waits until every slice has a result that counts (``step`` returns them, in slice
order). Every peer fetches each result
as soon as it counts (``FetchSlices``), while slower slices are still being reduced, so
neither the closer's aggregate nor the others' apply waits for a reduced model's download.

It holds the reductions in flight, the results it refused, when it first saw each slice's
result, its retry time after a reduction that could not run, and the next turn that can
ask it for work; no record is made here (the machine signs what it reports).

What it promises: a sliced round closes only from results that count, so its close is
valid by the ledger's rule (I2 holds as for deltas: the close still names a covering set
of contributions); an aggregator that never publishes costs one lease; a result of a
checked slice that is wrong in every chunk (another version's arithmetic, a corrupted
input) never counts, one wrong in c of its k chunks counts with odds (k - c) / k. What
breaks it: a forged result in a slice nobody checks this round, or forged outside the
chunk its checker draws; the state hash then still makes every peer that follows the close agree (I3),
on the forged mean (members are trusted not to forge on purpose: SECURITY.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ttpeer_wire import Record

from ._effects import FetchSlices, ReduceSlice
from ._jobspec import JobSpec
from ._ledger import RecordSet
from ._reports import RETRY_AFTER
from ._slices import aggregators, checked, counts, fits, slow_of, turn

Key = tuple[str, int, str, tuple[str, ...]]  # job, round, the contributions' base, their ids


class Slicer:
    def __init__(self, me: str) -> None:
        self.me = me
        self.bad: set[str] = set()  # slice records refused here: another hash, or a blob that did not open
        self._busy: set[tuple[Key, int]] = set()
        self._retry: dict[tuple[Key, int], float] = {}
        self._seen: dict[tuple[Key, int], float] = {}  # when this peer first saw a result of the slice
        self._ready: dict[Key, float] = {}  # when every slice first had a result here
        self._ahead: dict[Key, set[str]] = {}  # results this peer was told to fetch ahead of the close
        self._next = math.inf  # the next turn that can ask this peer for work

    def deadlines(self) -> list[float]:
        return [self._next, *self._retry.values()]

    def deadline_key(self) -> object:
        return self._next, len(self._busy), len(self._retry)

    def ready_at(self, job: str, rnd: int, base: str, cover: Sequence[Record]) -> float | None:
        """When this peer first had a result for every slice of the round, if it did."""
        return self._ready.get((job, rnd, base, tuple(sorted(c.id for c in cover))))

    def step(self, job: JobSpec, rnd: int, cover: Sequence[Record], slices: list[tuple[int, int]],
             covered_at: float, now: float, records: RecordSet
             ) -> tuple[list[ReduceSlice | FetchSlices], tuple[Record, ...] | None]:
        """The reductions and checks of the covered round this peer makes now, and the
        results its close names once every slice has one (else None). Each result that
        counts is fetched once as soon as it does (``FetchSlices``), while other slices are
        still being reduced: what the close (or, on the closer, the aggregate) then reads."""
        ids = sorted(c.id for c in cover)
        base = cover[0]["base"]
        key: Key = (job.id, rnd, base, tuple(ids))
        authors = sorted({c.author for c in cover})
        slow = slow_of(job, cover)
        found = [r for r in records.in_round(job.id, "slice", rnd) if r["base"] == base and r["contribs"] == ids]
        out: list[ReduceSlice | FetchSlices] = []
        chosen: list[Record] = []
        self._next = math.inf
        for s, span in enumerate(slices):
            every = [r for r in found if fits(r, job, rnd, base, ids, s, span, len(slices))]
            got = [r for r in every if r.id not in self.bad]
            pick = self._pick(job, rnd, s, every, got)
            if pick is not None:
                chosen.append(pick)
                continue
            sk = (key, s)
            if sk in self._busy or now < self._retry.get(sk, 0.0):
                continue
            order = aggregators(job.id, rnd, authors, s, slow)
            sample = False
            if not got:
                # Nobody's turn but ours once a result here was refused: make it again at once.
                # A checked slice of one chunk is checked by a whole reduction, so the second
                # in its order makes it at once too, beside the first, rather than after the
                # first's result (one chunk of a small model on a long path: the round trips
                # of a check in sequence cost more than the bytes of one beside).
                since = covered_at
                now_turn = turn(order, now - since, job.lease)
                due = (any(r.id in self.bad for r in every) or order[now_turn] == self.me
                       or (now_turn == 0 and order[1:2] == [self.me] and span[1] - span[0] == 1
                           and checked(job.id, rnd, s)))
                against = None
            else:
                since = self._seen.setdefault(sk, now)
                makers = {r.author for r in every}
                # The checkers take turns from the first maker on: the ones before it in the
                # order had their turn at the slice already (a silent one would hold it twice).
                first = min((order.index(a) for a in makers if a in order), default=-1)
                order = [a for a in order[first + 1:] + order[:first + 1] if a not in makers]
                if not order:
                    continue  # every author made one and they disagree: nothing counts
                due = order[turn(order, now - since, job.lease)] == self.me
                against = min(got, key=lambda r: r.id)
                # A checked slice's one result is checked on one chunk, drawn by the checker
                # after the result is signed (``ReduceSlice.sample``): a reduction's worth of
                # downloads becomes a chunk's. Hashes that disagree are settled whole.
                sample = (span[1] - span[0] > 1 and len({r["sha256"] for r in every}) == 1
                          and len(got) == len(every))
            self._next = min(self._next, since + job.lease * (math.floor(max(0.0, now - since) / job.lease) + 1))
            if due:
                self._busy.add(sk)
                out.append(ReduceSlice(job, rnd, base, tuple(cover), s, len(slices), span[0], span[1],
                                       against, sample))
        ahead = self._ahead.setdefault(key, set())
        new = tuple(r for r in chosen if r.id not in ahead)
        if new:
            ahead.update(r.id for r in new)
            out.append(FetchSlices(job, rnd, new))
        if len(chosen) < len(slices):
            return out, None
        self._ready.setdefault(key, now)
        return out, tuple(chosen)

    def _pick(self, job: JobSpec, rnd: int, s: int, every: list[Record], got: list[Record]) -> Record | None:
        """The result of slice ``s`` a close names: one this peer did not refuse whose hash
        counts by the ledger's rule (``_slices.counts``, over every result signed), the
        hash most authors signed first."""
        makers: dict[str, set[str]] = {}
        for r in every:
            makers.setdefault(r["sha256"], set()).add(r.author)
        ok = [r for r in got if counts(job.id, rnd, s, r["sha256"], makers)]
        return min(ok, key=lambda r: (-len(makers[r["sha256"]]), r["sha256"], r.id)) if ok else None

    def reduced(self, eff: ReduceSlice) -> None:
        """This peer's ``ReduceSlice`` ended (its record is signed next)."""
        self._busy.discard((_key(eff), eff.slice))

    def failed(self, eff: ReduceSlice, now: float) -> None:
        sk = (_key(eff), eff.slice)
        self._busy.discard(sk)
        self._retry[sk] = now + RETRY_AFTER

    def refused(self, record: str) -> None:
        """The blob of slice record ``record`` did not hash or size as it says."""
        self.bad.add(record)

    def refutes(self, close: Record) -> bool:
        """Whether a close names a result whose blob did not open or hash here."""
        return any(rid in self.bad for rid in close.body.get("slices", ()))

    def forget_before(self, job: str, rnd: int) -> None:
        def old(k: Key) -> bool:
            return k[0] == job and k[1] < rnd

        for table in (self._retry, self._seen):
            for sk in [sk for sk in table if old(sk[0])]:
                del table[sk]
        for done in (self._ready, self._ahead):
            for key in [k for k in done if old(k)]:
                del done[key]


def _key(eff: ReduceSlice) -> Key:
    return eff.job.id, eff.round, eff.base, tuple(sorted(c.id for c in eff.contribs))
