"""The replicated ledger of a fused job: pure views over a set of records.

Theory of operation. A job fixes R rounds of S shards. Round r trains on top of
a base state s_r (s_0 is the job's ``init``). Peers publish *contributions*
(a delta blob covering some shards, computed against a base); a *close* names a
covering set of contributions for (r, s_r) and the state s_{r+1} that results.

Closes form a tree of states rooted at ``init``: a close is an edge
s_r -> s_{r+1}, valid only once every contribution it names is known and they
cover all S shards. The canonical chain is the longest path from the root; ties
go to the smallest state hash at the fork. That is a pure function of the set of
records, so every peer holding the same records follows the same chain (I1), and
a late or conflicting close can only win by being on a longer chain, which no
honest peer builds on a branch it did not follow. Two closes with equal base and
state are the same edge, whoever signed them.

What breaks it: a member that signs a close with a wrong state hash. Peers that
recompute a close check the hash and refuse to follow it (``Apply`` fails);
members are trusted not to do this on purpose (SECURITY.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

from ttpeer_wire import Member, Record

from ._cadence import Plan, round_size
from ._jobspec import JobSpec
from ._membership import members, provisional, revocations
from ._slices import counts, fits, plan


@dataclass
class RecordSet:
    """All verified records of one pool, by id, with indexes by kind and job."""

    pool: str
    by_id: dict[str, Record] = field(default_factory=dict)
    by_job: dict[str, dict[str, list[Record]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    _members: dict[str, Member] | None = None
    _provisional: frozenset[str] | None = None
    _kept: frozenset[str] = frozenset()  # records of revoked nodes that still count
    _any_revoke: bool = False
    _jobs: list[Record] = field(default_factory=list)
    _by_round: dict[tuple[str, str, int], list[Record]] = field(default_factory=lambda: defaultdict(list))
    _closed_rounds: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    # Bumped when a record that can change a job's ledger view arrives (and on any
    # membership change), so views can be cached until it moves.
    versions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    membership_version: int = 0
    # canonical_chain's verdict on each close whose contributions are all held, valid
    # for one membership_version (the verdict is a pure function of those records).
    _close_ok: dict[str, bool] = field(default_factory=dict)
    _close_ok_version: int = 0

    def add(self, rec: Record) -> bool:
        """Add ``rec``; returns False if already held or for another pool."""
        if rec.pool != self.pool or rec.id in self.by_id:
            return False
        self.by_id[rec.id] = rec
        if rec.kind in ("invite", "join", "revoke", "admit"):
            self._any_revoke = self._any_revoke or rec.kind == "revoke"
            self._members = self._provisional = None
            self.membership_version += 1
        elif rec.kind == "job":
            self._jobs.append(rec)
        job = rec.id if rec.kind == "job" else rec.body.get("job")
        if isinstance(job, str):
            self.by_job[job][rec.kind].append(rec)
            rnd = rec.body.get("round")
            if isinstance(rnd, int):
                self._by_round[(job, rec.kind, rnd)].append(rec)
            if rec.kind == "close":
                # A close's schema requires an int ``round`` (``_check_body``, which ``sign`` and
                # ``parse``, the only makers of a Record, both run), so ``rnd`` is an int here.
                self._closed_rounds[job].add(cast(int, rnd))
            # The chain depends on closes, and on contributions only once a close names them.
            if rec.kind in ("close", "ckpt", "job") or (
                rec.kind in ("contrib", "slice") and rnd in self._closed_rounds[job]
            ):
                self.versions[job] += 1
        return True

    def highest_closed_round(self, job: str) -> int:
        """The highest round any close names (valid or not yet), or -1. Once a node is
        revoked, a close that names one of its contributions the revocation did not keep
        never becomes valid (its round is redone), so it does not count here."""
        if not self._any_revoke:
            return max(self._closed_rounds.get(job, ()), default=-1)
        return max((c["round"] for c in self.of_job(job, "close")
                    if all(p is None or self.counts(p) for p in map(self.by_id.get, c["contribs"]))), default=-1)

    def in_round(self, job: str, kind: str, rnd: int) -> list[Record]:
        """Records of ``kind`` for round ``rnd`` of ``job`` whose author is a member."""
        mem, kept = self.members, self._kept  # hot: locals, not a call per record
        return [r for r in self._by_round.get((job, kind, rnd), ()) if r.author in mem or r.id in kept]

    def in_round_all(self, job: str, kind: str, rnd: int) -> list[Record]:
        """Records of ``kind`` for round ``rnd`` of ``job``, members or not: a cheap count
        of what arrived, for caches keyed on it."""
        return self._by_round.get((job, kind, rnd), [])

    def __contains__(self, rec_id: str) -> bool:
        return rec_id in self.by_id

    def __iter__(self) -> Iterator[Record]:
        return iter(self.by_id.values())

    def __len__(self) -> int:
        return len(self.by_id)

    @property
    def members(self) -> dict[str, Member]:
        if self._members is None:
            self._members = members(self.pool, self.by_id.values())
            revoked = revocations(self.pool, self.by_id.values())
            self._kept = frozenset().union(*revoked.values())
        return self._members

    @property
    def provisional(self) -> frozenset[str]:
        """Members whose join the admin has not acknowledged yet (``_membership.provisional``),
        kept until the membership changes."""
        if self._provisional is None:
            self._provisional = frozenset(provisional(self.pool, self.by_id.values()))
        return self._provisional

    def counts(self, rec: Record) -> bool:
        """Whether ``rec`` counts: its author is a member, or a revocation kept it."""
        return rec.author in self.members or rec.id in self._kept

    def of_job(self, job: str, kind: str) -> list[Record]:
        """Records of ``kind`` for ``job`` that count (see ``counts``)."""
        mem, kept = self.members, self._kept
        return [r for r in self.by_job.get(job, {}).get(kind, ()) if r.author in mem or r.id in kept]

    def jobs(self) -> list[Record]:
        """Jobs submitted by members (or kept by a revocation), oldest first (then by id)."""
        return sorted((r for r in self._jobs if self.counts(r)), key=lambda r: (r["at"], r.id))


def contributions(rs: RecordSet, job: Record, rnd: int, base: str) -> list[Record]:
    """Valid contributions to round ``rnd`` on ``base``, by id."""
    shards = job["shards"]
    out = [c for c in rs.in_round(job.id, "contrib", rnd) if c["base"] == base and c["shards"][-1] < shards]
    return sorted(out, key=lambda c: c.id)


def covered(contribs: Iterable[Record]) -> set[int]:
    return {s for c in contribs for s in c["shards"]}


def _all_held(by_id: dict[str, Record], ids: Iterable[str]) -> list[Record] | None:
    """The records named by ``ids``, in order, or ``None`` if any is not held."""
    got = [by_id.get(i) for i in ids]
    held = [r for r in got if r is not None]
    return held if len(held) == len(got) else None


def select_cover(job: Record, contribs: list[Record]) -> list[Record] | None:
    """The canonical covering set: walk contributions by id and keep each that adds
    a shard. ``None`` while the shards are not all covered."""
    chosen: list[Record] = []
    have: set[int] = set()
    for c in sorted(contribs, key=lambda r: r.id):
        if not set(c["shards"]) <= have:
            chosen.append(c)
            have.update(c["shards"])
    return chosen if have == set(range(job["shards"])) else None


@dataclass(frozen=True)
class Chain:
    """The canonical chain of a job: ``states[r]`` is the base of round r."""

    states: tuple[str, ...]
    closes: tuple[Record, ...]  # closes[r] takes states[r] to states[r+1]

    @property
    def round(self) -> int:
        return len(self.closes)

    @property
    def head(self) -> str:
        return self.states[-1]


def overlapped(job: Record) -> bool:
    """Whether ``job`` trains round r on the base of round r-1 (see ``train_base``)."""
    return bool(job.body.get("overlap", 0))


def train_base(job: Record, chain: Chain, rnd: int) -> str:
    """The state round ``rnd`` trains on: the round's own base, or with overlap the base
    of the round before (round 0 and 1 both train on the initial state), so that round
    r+1 can train while round r's deltas travel and its close is made."""
    if not overlapped(job):
        return chain.states[rnd]
    return chain.states[max(0, rnd - 1)]


def _slices_fit(job: Record, rnd: int, tbase: str, ids: list[str], parts: list[Record], sliced: list[Record],
                rs: RecordSet) -> bool | None:
    """Whether a close's ``slices`` are the round's plan (``plan``) of these contributions,
    one result per slice in order, each signed by a member; None while a named result does
    not count yet (``_slices.counts``: a checked slice waits for a second author of its
    hash, which may still arrive)."""
    spec = JobSpec.of(job)
    spans = plan(spec, parts)
    if spans is None or len(spans) != len(sliced):
        return False
    if not all(rs.counts(r) and fits(r, spec, rnd, tbase, ids, s, span, len(spans))
               for s, (span, r) in enumerate(zip(spans, sliced, strict=True))):
        return False
    results = rs.in_round(job.id, "slice", rnd)
    for s, (span, r) in enumerate(zip(spans, sliced, strict=True)):
        makers: dict[str, set[str]] = {}
        for other in results:
            if fits(other, spec, rnd, tbase, ids, s, span, len(spans)):
                makers.setdefault(other["sha256"], set()).add(other.author)
        if not counts(job.id, rnd, s, r["sha256"], makers):
            return None
    return True


def canonical_chain(rs: RecordSet, job: Record) -> Chain:
    """Longest valid chain of closes from the job's init state (ties: smallest hash).
    With overlap, a close of round r must name as ``tbase`` the base of round r-1 on
    its own branch (the initial state for round 0)."""
    by_id = rs.by_id
    edges: dict[tuple[int, str], dict[str, Record]] = defaultdict(dict)
    overlap = overlapped(job)
    parents: dict[tuple[int, str], set[str]] = defaultdict(set)  # (round, state) -> bases leading to it
    if rs._close_ok_version != rs.membership_version:
        rs._close_ok.clear()  # validity depends on who the members are
        rs._close_ok_version = rs.membership_version
    received = rs.of_job(job.id, "close")
    if overlap:
        received = sorted(received, key=lambda c: c["round"])  # a round's parents before its tbase check
    max_rounds = Plan.of(job, ()).max_rounds()
    for close in received:
        rnd = close["round"]
        if rnd >= max_rounds or ("tbase" in close.body) != overlap:
            continue
        tbase = close["tbase"] if overlap else close["base"]
        ok = rs._close_ok.get(close.id)
        if ok is None:
            parts = _all_held(by_id, close["contribs"])
            sliced = _all_held(by_id, close.body.get("slices", ()))
            if parts is None or sliced is None:
                continue  # may become valid when the missing contributions (or slices) arrive
            fit = True if not sliced else _slices_fit(job, rnd, tbase, close["contribs"], parts, sliced, rs)
            if fit is None:
                continue  # a named slice's check may still arrive
            ok = rs._close_ok[close.id] = fit and not any(
                p.kind != "contrib" or p["job"] != job.id or p["round"] != rnd
                or p["base"] != tbase or not rs.counts(p)
                or p["shards"][-1] >= job["shards"]
                for p in parts
            ) and covered(parts) == set(range(job["shards"]))
        if not ok:
            continue
        if overlap:
            on_branch = tbase == close["base"] == job["init"] if rnd == 0 else tbase in parents[(rnd, close["base"])]
            if not on_branch:
                continue
        parents[(rnd + 1, close["state"])].add(close["base"])
        best = edges[(rnd, close["base"])].get(close["state"])
        if best is None or close.id < best.id:
            edges[(rnd, close["base"])][close["state"]] = close

    # Depth of each state node = length of the longest chain below it, computed
    # from the last round backwards so deep chains need no recursion.
    depth: dict[tuple[int, str], int] = {}
    for rnd, base in sorted(edges, key=lambda k: -k[0]):
        children = edges[(rnd, base)]
        depth[(rnd, base)] = 1 + max(depth.get((rnd + 1, s), 1) for s in children)

    states = [job["init"]]
    closes: list[Record] = []
    plan, spent = Plan.of(job, ()), 0
    while True:
        kids = edges.get((len(closes), states[-1]))
        if not kids or (plan.auto and spent >= plan.budget):
            break  # the budget is spent (a fixed job's closes past its last round were never edges)
        nxt = min(kids, key=lambda s: (-depth.get((len(closes) + 1, s), 1), s))
        if plan.auto:
            spent += round_size(plan.size_after(closes), plan.budget - spent, plan.hi)
        closes.append(kids[nxt])
        states.append(nxt)
    return Chain(tuple(states), tuple(closes))


def checkpoints(rs: RecordSet, job: Record) -> dict[str, Record]:
    """Checkpoint records by the state they hold (lowest id when several)."""
    out: dict[str, Record] = {}
    for ck in sorted(rs.of_job(job.id, "ckpt"), key=lambda r: r.id):
        out.setdefault(ck["state"], ck)
    return out


def revocation_keep(rs: RecordSet, node: str) -> list[str]:
    """Ids of ``node``'s records that a revocation of it should keep: the jobs it
    submitted and cancelled, and the contributions, closes and checkpoints on each job's
    canonical chain. Its claims, releases and anything off the chain are dropped, so its
    unfinished work is requeued. Sorted; the caller checks the length cap."""
    keep: set[str] = set()
    for job in rs.jobs():
        if job.author == node:
            keep.add(job.id)
        chain = canonical_chain(rs, job)
        for close in chain.closes:
            if close.author == node:
                keep.add(close.id)
            keep.update(c for c in close["contribs"] if rs.by_id[c].author == node)
            keep.update(s for s in close.body.get("slices", ()) if rs.by_id[s].author == node)
        on_chain = set(chain.states)
        keep.update(ck.id for ck in rs.of_job(job.id, "ckpt") if ck.author == node and ck["state"] in on_chain)
        # A job it cancelled stays cancelled (``_outcome.cancel_of``): ended jobs never revive.
        keep.update(c.id for c in rs.of_job(job.id, "cancel") if c.author == node)
    return sorted(keep)
