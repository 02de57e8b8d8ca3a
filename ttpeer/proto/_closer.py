"""The closer: when this peer aggregates a covered round, and when it checkpoints.

Theory of operation. It holds when this peer first saw each round covered (on its own
clock), the round it is aggregating (at most one at a time), the checkpoints it has
started, and its own retry time after an aggregate that could not run (it delays only
the next aggregate). Once contributions cover every shard, the designated closer (the
smallest author among the canonical cover) aggregates at once; any other peer waits for
it a lease plus two digests from the cover (time for a close lost on the way to be
resent), or not at all once the closer has been silent for a lease (it died).

What it promises: some live covering peer closes every covered round (I2, I4), closes
are not made twice in parallel, and a fused job's checkpoints are made only when a member
asks for one (``answers``): no model is uploaded that nobody needs. It returns close and
checkpoint bodies; the machine signs them. What breaks it: a ``heard`` map that is not
updated on every message received (a live closer would look dead, and others would close
beside it: harmless but wasteful; so would a second checkpoint be made).
"""

from __future__ import annotations

import hashlib

from ttpeer_wire import Record

from ._cadence import Plan, next_inner_steps
from ._effects import Aggregate, FetchDeltas, PublishCheckpoint
from ._jobspec import JobSpec
from ._ledger import Chain, RecordSet, checkpoints
from ._outer import Outer, round_outer
from ._reports import RETRY_AFTER

CKPT_TRIES = 3  # uploads of one asked-for checkpoint this peer tries before it leaves the ask to others
PEERS_OVER = 3  # auto cadence: a round's peers are who contributed to it or the rounds this many before


class Closer:
    def __init__(self, me: str, digest_interval: float) -> None:
        self.me = me
        self.digest_interval = digest_interval
        self._covered_at: dict[tuple[str, int, str], float] = {}
        self._ready_at: dict[tuple[str, int, str], float] = {}  # a sliced round: when its slices were all here
        self._aggregating: tuple[str, int] | None = None
        self._ahead: set[tuple[str, int, str, tuple[str, ...]]] = set()  # covers whose deltas were fetched ahead
        self._ckpt_done: set[tuple[str, int]] = set()
        self._asks_seen: dict[str, float] = {}  # ask record id -> when this peer first saw it
        self._ask_deadlines: dict[str, float] = {}  # ask -> when this peer answers it, unless another did
        self._ckpt_retry: dict[tuple[str, int], float] = {}  # a checkpoint whose upload failed -> when to retry
        self._ckpt_failures: dict[tuple[str, int], int] = {}
        self.retry_at = 0.0

    def deadlines(self, job: JobSpec, rnd: int) -> list[float]:
        out = []
        for (jid, r, _base), at in [*self._covered_at.items(), *self._ready_at.items()]:
            if jid == job.id and r == rnd:
                out += [at + job.lease, at + self.grace(job)]
        return [*out, self.retry_at, *self._ask_deadlines.values()]

    def deadlines_of_asks(self) -> list[float]:
        return list(self._ask_deadlines.values())

    def deadline_key(self) -> object:
        return len(self._covered_at), len(self._ready_at), self.retry_at, tuple(sorted(self._ask_deadlines.values()))

    def covered_at(self, job: str, rnd: int) -> float | None:
        """When this peer first saw round ``rnd`` covered (on any base), if it did."""
        return min((at for (j, r, _b), at in self._covered_at.items() if j == job and r == rnd), default=None)

    def forget_before(self, job: str, rnd: int) -> None:
        for table in (self._covered_at, self._ready_at):
            for key in [k for k in table if k[0] == job and k[1] < rnd]:
                del table[key]
        self._ahead = {k for k in self._ahead if k[0] != job or k[1] >= rnd}

    def grace(self, job: JobSpec, closer: str | None = None, now: float = 0.0,
              heard: dict[str, float] | None = None) -> float:
        """How long others wait, from the moment the round is covered, for the designated
        closer before closing themselves: nothing once the closer has been silent for a
        lease (it died: every live peer sends a digest each ``digest_interval``, so others
        close at the latest one lease after its last word), else a lease plus two digests,
        time for a close lost on the way to be resent. Waiting a lease from the cover too
        cost a second lease when the closer died before the round was covered (its own
        later shard requeued: the kill in scripts/bench/straggler)."""
        if closer is not None and heard is not None and now - heard.get(closer, -float("inf")) >= job.lease:
            return 0.0
        return job.lease + 2 * self.digest_interval

    def covered(self, job: str, rnd: int, base: str, now: float) -> float:
        """When this peer first saw round ``rnd`` on ``base`` covered (now, if just now)."""
        return self._covered_at.setdefault((job, rnd, base), now)

    def fetch_ahead(self, job: JobSpec, rnd: int, cover: list[Record]) -> list[FetchDeltas]:
        """A round closed from all deltas is covered by ``cover``: fetch the deltas of it
        this peer did not make, once per cover, on every peer at once: the closer's
        aggregate reads them as they come, and every other peer holds them by the time the
        close lands."""
        if not job.mode.fetches_ahead:
            return []
        key = (job.id, rnd, cover[0]["base"], tuple(sorted(c.id for c in cover)))
        if key in self._ahead:
            return []
        self._ahead.add(key)
        others = tuple(c for c in cover if c.author != self.me)
        return [FetchDeltas(job, rnd, others)] if others else []

    def maybe_close(self, job: JobSpec, rnd: int, base: str, cover: list[Record], now: float,
                    heard: dict[str, float], slices: tuple[Record, ...] = (),
                    ready: float | None = None, outer: Outer | None = None) -> list[Aggregate]:
        """The round is covered by ``cover``: aggregate it if it is this peer's turn. A
        sliced round closes from its reduced ``slices``, the others' wait counted from
        ``ready``, when this peer first had them all. ``outer``: the round's outer step
        (``_outer.round_outer``; None: the job's)."""
        first = self.covered(job.id, rnd, base, now)
        if ready is not None:
            first = self._ready_at.setdefault((job.id, rnd, base), max(first, ready))
        if self._aggregating is not None or now < self.retry_at:
            return []
        closer = min(c.author for c in cover)
        if closer != self.me and now < first + self.grace(job, closer, now, heard):
            return []
        self._aggregating = (job.id, rnd)
        return [Aggregate(job, rnd, base, tuple(cover), slices, outer)]

    def aggregated(self, job: JobSpec, rnd: int, base: str, contribs: tuple[str, ...], state: str,
                   metrics: dict[str, float], records: RecordSet, chain: Chain, slices: tuple[str, ...] = (),
                   weights: tuple[int, ...] = (), outer: Outer | None = None) -> dict:
        """An ``Aggregate`` made ``state``: the close's body to sign. An auto-cadence job's
        close also picks round ``rnd + 2``'s size from its contributions' figures; an outer_auto
        job's names the ``outer`` step the aggregate took (and with ``outer_agree`` the energy
        of its mean, ``mean_sq`` among ``metrics``); an ensemble's, the members' ``weights``
        in the vote."""
        self._aggregating = None
        figures = dict(metrics)
        mean_sq = figures.pop("mean_sq", None)  # the agreement's figure: its own field, not an eval metric
        body = {"job": job.id, "round": rnd, "base": base, "contribs": sorted(contribs), "state": state,
                "metrics": figures}
        if job.outer_agree and mean_sq is not None:
            body["mean_sq"] = mean_sq
        if job.overlap:
            body["tbase"] = records.by_id[contribs[0]]["base"]
        if slices:
            body["slices"] = list(slices)
        if weights:
            body["weights"] = list(weights)
        if job.outer_auto:  # the step the state was made with (a report that names none: the rule's)
            step = outer or round_outer(job, rnd, len(contribs), Plan.of(job.record, chain.closes[:rnd]),
                                        chain.closes, records.by_id)
            body["outer_lr"], body["outer_momentum"] = step.lr, step.momentum
        if job.auto:
            assert job.h_min is not None and job.h_max is not None
            mine = [records.by_id[c] for c in sorted(contribs) if c in records.by_id]
            before = [c for close in chain.closes[max(0, rnd - PEERS_OVER):rnd] for c in close["contribs"]]
            peers = {c.author for c in mine} | {records.by_id[c].author for c in before if c in records.by_id}
            body["next"] = next_inner_steps(Plan.of(job.record, chain.closes[:rnd]).inner_steps(rnd),
                                        [(c["metrics"], len(c["shards"])) for c in mine], shards=job.shards,
                                        peers=len(peers), overlap=job.overlap, lo=job.h_min, hi=job.h_max)
        return body

    def aggregate_failed(self, now: float) -> None:
        """An ``Aggregate`` could not run: try again after ``RETRY_AFTER``."""
        self._aggregating = None
        self.retry_at = now + RETRY_AFTER

    def checkpoint(self, job: JobSpec, rnd: int, contribs: tuple[str, ...], records: RecordSet,
                   chain: Chain) -> bool:
        """Whether to publish a checkpoint of the state this peer's close of ``rnd`` made
        (once per round). Checkpoints (and one of the final state) let late joiners and
        repairing peers skip ahead; between them they replay the closes' deltas."""
        if not self.checkpoint_due(job, rnd, contribs, records, chain) or (job.id, rnd + 1) in self._ckpt_done:
            return False
        self._ckpt_done.add((job.id, rnd + 1))
        return True

    def checkpoint_published(self, job: str, rnd: int, blob: str | None, now: float = 0.0) -> bool:
        """A checkpoint upload ended; False if it failed (a later close, or the ask after
        ``RETRY_AFTER``, tries again: at most ``CKPT_TRIES`` times for an ask)."""
        if blob is None:
            tries = self._ckpt_failures[(job, rnd)] = self._ckpt_failures.get((job, rnd), 0) + 1
            if tries < CKPT_TRIES:
                self._ckpt_done.discard((job, rnd))
                self._ckpt_retry[(job, rnd)] = now + RETRY_AFTER
        return blob is not None

    def failed(self, job: str) -> None:
        if self._aggregating is not None and self._aggregating[0] == job:
            self._aggregating = None

    @staticmethod
    def checkpoint_due(job: JobSpec, rnd: int, contribs: tuple[str, ...], records: RecordSet, chain: Chain) -> bool:
        """Whether the closer of round ``rnd`` publishes a checkpoint of the state it made
        unasked: every ``checkpoint_every`` rounds of the job's mode and the final state
        (ensembles, whose contributions are member checkpoints); never where the mode names
        no such cadence (fused: a peer that would rather not replay the deltas asks for one,
        ``answers``)."""
        every = job.mode.checkpoint_every
        if every is None:
            return False
        if not Plan.of(job.record, chain.closes[:rnd]).has_round(rnd + 1):
            return True  # the final state
        return (rnd + 1) % every == 0

    def answers(self, job: JobSpec, chain: Chain, records: RecordSet, held: set[str], heard: dict[str, float],
                now: float) -> list[PublishCheckpoint]:
        """Checkpoints this peer publishes for the asks (``ckpt_want``) of ``job``. An ask
        names a state of the chain; it is answered with the newest state at or after it
        that this peer holds (an asker whose view was behind is served as well), unless a
        checkpoint at or after it exists. Who answers, in order: the peer that closed the
        round making the asked state, then the others that contributed to the chain up to
        it, in an order drawn from the ask; a peer answers once every peer before it has
        been silent for a lease since it saw the ask. So in the common case one peer uploads,
        however long its upload takes; if the ones before it are alive but do not answer
        (they no longer hold the state), nobody does, and the asker replays after its wait."""
        asks = records.of_job(job.id, "ckpt_want")
        if not asks:
            return []
        at = {s: k for k, s in enumerate(chain.states)}
        newest_ckpt = max((at[s] for s in checkpoints(records, job.record) if s in at), default=-1)
        mine = max((k for s, k in at.items() if k > 0 and s in held), default=-1)
        out = []
        for ask in sorted(asks, key=lambda r: r.id):
            self._ask_deadlines.pop(ask.id, None)
            k = at.get(ask["state"])
            if k is None or k == 0 or newest_ckpt >= k or mine < k or (job.id, mine) in self._ckpt_done:
                continue
            seen = self._asks_seen.setdefault(ask.id, now)
            if now < self._ckpt_retry.get((job.id, mine), 0.0):
                self._ask_deadlines[ask.id] = self._ckpt_retry[(job.id, mine)]
                continue
            first = chain.closes[k - 1].author
            by_id = records.by_id
            ran = {by_id[c].author for close in chain.closes[:k] for c in close["contribs"] if c in by_id}
            order = [first, *sorted(ran - {first, ask.author},
                                    key=lambda m: hashlib.sha256(f"{ask.id}:{m}".encode()).digest())]
            before = order[:order.index(self.me)] if self.me in order else order
            if before:
                due = max([seen, *(heard.get(p, -float("inf")) for p in before)]) + job.lease
                if now < due:
                    self._ask_deadlines[ask.id] = due
                    continue
            self._ckpt_done.add((job.id, mine))
            out.append(PublishCheckpoint(job, mine, chain.states[mine]))
        return out
