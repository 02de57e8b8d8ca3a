"""The lease table: who holds which shard, as this peer has heard it.

Theory of operation. It holds, for every (job, round, shard), the claims heard from each
(author, attempt) with the time this peer last heard of them, on its own monotonic clock
(no clock is shared), and their reported progress and speed; the releases heard; and a
heap of others' renewals in the order they expire, so the next expiry is found without
a scan. It answers who owns a shard (among live non-backup claims: the highest attempt,
then the lowest node id), which shard to claim next, which straggler to back up, and the
next attempt number.

What it promises: a claim is live for ``lease`` seconds after this peer last heard of it,
and this peer's own claim is live exactly while its local worker trains it (the caller
says which, ``own``); a release frees its shard at once and for good; a claim of a
non-member holds nothing. Every answer is a function of the claims heard and the times
they were heard, so replays and duplicates change nothing. What breaks it: a caller that
passes a ``now`` earlier than one it passed before (leases would come back to life).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Container, Iterable
from dataclasses import dataclass

from ttpeer_wire import Record

from ._jobspec import JobSpec
from ._ledger import RecordSet

Own = tuple[str, int, int, int]  # (job, round, shard, attempt) of the claim this peer trains


@dataclass
class Claim:
    """What this peer knows of someone's claim: when it last heard of it (its own clock)."""

    seen: float
    done: int = 0
    rate: float = 0.0
    backup: bool = False

    def projected_finish(self, inner_steps: int, default_rate: float) -> float:
        rate = self.rate if self.rate > 0 else default_rate
        return self.seen + max(0, inner_steps - self.done) / rate


class LeaseTable:
    def __init__(self, me: str) -> None:
        self.me = me
        self.peer_rates: dict[str, float] = {}  # speeds peers published with their claims
        # Claims by (job, round, shard), then by (author, attempt).
        self._claims: dict[tuple[str, int, int], dict[tuple[str, int], Claim]] = {}
        self._released: set[tuple[str, int, int, str, int]] = set()
        # (job, round) -> heap of (seen, shard, author, attempt): others' lease renewals in
        # the order they expire; entries a later renewal superseded are skipped lazily.
        self._heap: dict[tuple[str, int], list[tuple[float, int, str, int]]] = {}
        # (job, round) -> {shard: pieces of its data this peer lacks}, told by the driver
        # (``PeerMachine.prefer``): a free shard whose data is here is claimed first.
        self.prefer: dict[tuple[str, int], dict[int, int]] = {}

    def admit(self, rec: Record, now: float) -> None:
        """A new claim or release record, heard at ``now``."""
        key = (rec["job"], rec["round"], rec["shard"], rec.author, rec["attempt"])
        on_shard = self._claims.setdefault(key[:3], {})
        if rec.kind == "release":
            self._released.add(key)
            on_shard.pop(key[3:], None)
        elif key not in self._released:
            if rec["rate"] > 0:
                self.peer_rates[rec.author] = rec["rate"]
            old = on_shard.get(key[3:])
            if old is None or rec["done"] >= old.done:
                on_shard[key[3:]] = Claim(now, rec["done"], rec["rate"], rec["backup"])
            else:
                old.seen = now
            if rec.author != self.me:
                heapq.heappush(self._heap.setdefault(key[:2], []), (now, key[2], key[3], key[4]))

    def forget_before(self, job: str, rnd: int) -> None:
        """Claims and releases of rounds before ``rnd`` no longer matter."""
        for key in [k for k in self._claims if k[0] == job and k[1] < rnd]:
            del self._claims[key]
        for top in [k for k in self._heap if k[0] == job and k[1] < rnd]:
            del self._heap[top]
        self._released = {k for k in self._released if not (k[0] == job and k[1] < rnd)}
        for old in [k for k in self.prefer if k[0] == job and k[1] < rnd]:
            del self.prefer[old]

    def earliest_expiry(self, job: str, rnd: int, lease: float, now: float) -> float | None:
        """When the first of others' running leases on this round expires: the heap's
        top, once renewals that superseded it and leases already past are popped."""
        heap = self._heap.get((job, rnd))
        while heap:
            seen, shard, author, attempt = heap[0]
            claim = self._claims.get((job, rnd, shard), {}).get((author, attempt))
            if claim is not None and claim.seen == seen and seen + lease > now:
                return seen + lease
            heapq.heappop(heap)
        return None

    def live(self, job: JobSpec, rnd: int, shard: int, now: float, members: Container[str],
             own: Own | None) -> list[tuple[tuple[int, str], Claim]]:
        """Live claims on a shard as ((attempt, author), claim); ours only while we train it."""
        live = []
        for (author, attempt), claim in self._claims.get((job.id, rnd, shard), {}).items():
            if author == self.me:
                if own == (job.id, rnd, shard, attempt):
                    live.append(((attempt, author), claim))
            elif now < claim.seen + job.lease and author in members:
                live.append(((attempt, author), claim))
        return live

    def owner(self, job: JobSpec, rnd: int, shard: int, now: float, members: Container[str],
              own: Own | None) -> str | None:
        """Who owns a shard: among live non-backup claims, the highest attempt, then the
        lowest node id."""
        owners = [key for key, c in self.live(job, rnd, shard, now, members, own) if not c.backup]
        if not owners:
            return None
        return min(owners, key=lambda k: (-k[0], k[1]))[1]

    def next_attempt(self, job: str, rnd: int, shard: int) -> int:
        attempts = [att for _author, att in self._claims.get((job, rnd, shard), {})]
        attempts += [k[4] for k in self._released if k[:3] == (job, rnd, shard)]
        return max(attempts) + 1 if attempts else 0

    def free_shard(self, job: JobSpec, rnd: int, taken: Container[int], now: float,
                   members: Container[str], sharers: Iterable[str] = ()) -> int | None:
        """A shard not ``taken`` (covered, or trained here) that no live claim holds: the
        one whose data this peer lacks least (``prefer``), then one of its share of the
        round (``share``, among ``sharers``), then in this peer's own hashed order; the
        last two spread concurrent claimers over shards. Which shard a peer trains never
        changes what the shard trains. Asked only while this peer trains nothing."""
        free = [s for s in range(job.shards) if s not in taken and not self.live(job, rnd, s, now, members, None)]
        if not free:
            return None
        lacking = self.prefer.get((job.id, rnd), {})
        mine = set(self.share(job.id, rnd, job.shards, sharers))
        return min(free, key=lambda s: (lacking.get(s, 0), s not in mine, self.claim_order(rnd, s)))

    def share(self, job: str, rnd: int, shards: int, sharers: Iterable[str]) -> list[int]:
        """The shards of round ``rnd`` this peer is the first choice for, in claim order: the
        ``sharers`` (``sharers_of``: the members that have not declined the job) and this
        peer, in an order every peer computes alike, take the round's shards in turn. Only a
        preference: a peer whose share is taken claims what is free; but peers that prefetch
        their share's data seldom fetch for a shard someone else trains."""
        ranked = sorted(set(sharers) | {self.me}, key=lambda p: hashlib.sha256(f"{job}:{p}".encode()).digest())
        me = ranked.index(self.me)
        picked = [s for s in range(shards) if (s + rnd) % len(ranked) == me]
        return sorted(picked, key=lambda s: self.claim_order(rnd, s))

    def claim_order(self, rnd: int, shard: int) -> bytes:
        """This peer's own order of a round's shards (the last tie-break of ``free_shard``)."""
        return hashlib.sha256(f"{self.me}:{rnd}:{shard}".encode()).digest()

    def straggler(self, job: JobSpec, rnd: int, done: Container[int], now: float,
                  members: Container[str], rate: float) -> int | None:
        """Stealing: the shard projected to finish last, if this peer (speed ``rate``),
        starting now, would finish a copy of it clearly sooner. At most one backup per
        shard. Asked only while this peer trains nothing."""
        if rate <= 0:
            return None  # no measurement of our own speed yet: no basis to compare
        mine = now + job.inner_steps / rate
        best: tuple[float, int] | None = None
        for s in range(job.shards):
            if s in done:
                continue
            live = self.live(job, rnd, s, now, members, None)
            if not live or any(c.backup for _, c in live):
                continue
            # A claimer whose speed is unknown is assumed as fast as we are: no steal.
            finish = min(c.projected_finish(job.inner_steps, rate) for _, c in live)
            if best is None or finish > best[0]:
                best = (finish, s)
        if best is None or mine * 1.0 + 0.1 * (mine - now) >= best[0]:
            return None
        return best[1]


def sharers_of(records: RecordSet, job: str) -> list[str]:
    """The members that share a job's rounds (``LeaseTable.share``): all but those that
    declined it. The same on every peer that holds the same records."""
    declined = {r.author for r in records.of_job(job, "decline")}
    return [m for m in records.members if m not in declined]
