"""PeerMachine driven by hand: no trio, no clock; effects routed between machines by a tiny
event loop that moves ``now`` from one event or deadline to the next."""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import (
    Aggregate,
    Aggregated,
    Applied,
    Apply,
    Broadcast,
    Cancel,
    CheckpointPublished,
    Declined,
    DeltaEncoded,
    DeltaPublished,
    Effect,
    Failed,
    FetchDeltas,
    Fetched,
    FetchState,
    Holds,
    JobDone,
    JobSpec,
    PeerMachine,
    Persist,
    Prepared,
    PrepareJob,
    PublishCheckpoint,
    PublishDelta,
    Record,
    RecordSet,
    Send,
    StateLost,
    Train,
    Trained,
    canonical_chain,
    covered,
    public_hex,
    sign,
    train_base,
)
from ttpeer.proto._gossip import MAX_DIGEST_IDS, digest_payload, parse_payload

from .proto_helpers import Pool, hex64, job_body, key

BLOB = "ab" * 32


def derive(base: str, contribs: list[str]) -> str:
    """The state a round yields: a pure function of its base and contributions."""
    return "sha256:" + hashlib.sha256((base + "|" + ",".join(sorted(contribs))).encode()).hexdigest()


@dataclass
class Cluster:
    """Machines of one pool, a heap of pending deliveries and reports, and a clock."""

    n: int
    seed: int = 0
    latency: float = 0.05
    jitter: float = 0.0
    duplicate: float = 0.0
    train_time: float = 1.0
    now: float = 0.0
    pool: Pool = field(default_factory=lambda: Pool("peer"))
    machines: dict[str, PeerMachine] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)
    done: dict[str, str] = field(default_factory=dict)
    trains: list[tuple[str, Train]] = field(default_factory=list)
    cancels: list[tuple[str, Cancel]] = field(default_factory=list)
    aggregates: list[tuple[str, Aggregate]] = field(default_factory=list)
    aggregated_at: list[float] = field(default_factory=list)
    persisted: dict[str, set[str]] = field(default_factory=dict)
    fetches: list[tuple[str, FetchState]] = field(default_factory=list)
    ahead: list[tuple[str, FetchDeltas]] = field(default_factory=list)  # (me, the deltas it fetches ahead)
    blocked: set[frozenset[str]] = field(default_factory=set)  # partitioned pairs
    fail_apply: set[str] = field(default_factory=set)  # machines whose next Apply does not reproduce
    decline: set[str] = field(default_factory=set)  # machines that refuse every job
    encode: bool = False  # report DeltaEncoded before the upload (the daemon does)
    encode_time: float = 0.01
    upload_time: float = 0.1
    ckpt_size: int = 100
    lose_at: dict[str, int] = field(default_factory=dict)  # machine -> round whose training base it lacks
    lost: list[tuple[str, str]] = field(default_factory=list)  # (me, state) found missing
    still_held: list[bool] = field(default_factory=list)  # whether the machine still counted it held
    applies: list[tuple[str, str]] = field(default_factory=list)  # (me, target state)
    taking: dict[str, set[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)  # deltas being taken
    fail_upload: set[str] = field(default_factory=set)  # machines whose next upload fails
    uploads: list[tuple[str, PublishDelta, float]] = field(default_factory=list)  # (me, effect, started)
    train_at: list[tuple[str, float]] = field(default_factory=list)  # (me, when a Train was issued)
    steps: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.keys = [key(f"peer:{self.seed}:{i}") for i in range(self.n)]
        membership = self.pool.admit(self.keys)
        for k in self.keys:
            m = PeerMachine(self.pool.id, k, now=self.now)
            m.load([r.raw for r in membership], self.now)
            self.machines[m.me] = m
            self.order.append(m.me)
        self._heap: list[tuple[float, int, str, Callable[[float], list[Effect]]]] = []
        self._seq = itertools.count()

    def machine(self, i: int) -> PeerMachine:
        return self.machines[self.order[i]]

    def submit_job(self, i: int = 0, **over: object) -> Record:
        job = sign("job", self.pool.id, job_body(**over), self.keys[i])
        self.handle(self.order[i], self.machine(i).add_local(job, self.now))
        return job

    # -- routing ----------------------------------------------------------------------

    def later(self, delay: float, me: str, fn: Callable[[float], list[Effect]]) -> None:
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), me, fn))

    def deliver(self, sender: str, to: str, payload: bytes) -> None:
        if frozenset((sender, to)) in self.blocked or to in self.dead:
            return
        copies = 2 if self.rng.random() < self.duplicate else 1
        for _ in range(copies):
            delay = self.latency + self.rng.random() * self.jitter
            self.later(delay, to, lambda now, m=self.machines[to]: m.receive(sender, payload, now))

    def handle(self, me: str, effects: list[Effect]) -> None:
        m = self.machines[me]
        for e in effects:
            if isinstance(e, Broadcast):
                for other in self.order:
                    if other != me:
                        self.deliver(me, other, e.payload)
            elif isinstance(e, Send):
                self.deliver(me, e.peer, e.payload)
            elif isinstance(e, Persist):
                held = self.persisted.setdefault(me, set())
                assert e.record.id not in held, "asked to persist a record twice"
                held.add(e.record.id)
            elif isinstance(e, PrepareJob):
                answer = Prepared(e.job.id) if me not in self.decline else Declined(e.job.id, "too big")
                self.later(0.0, me, lambda now, a=answer: m.report(a, now))
            elif isinstance(e, FetchDeltas):
                assert all(c.author != me for c in e.contribs), "asked to fetch its own delta"
                assert (me, e) not in self.ahead, "asked to fetch the same deltas ahead twice"
                self.ahead.append((me, e))
            elif isinstance(e, FetchState):
                self.fetches.append((me, e))
                self.later(0.1, me, lambda now, s=e.state: m.report(Fetched(s, True), now))
            elif isinstance(e, Train):
                assert e.base in m.held, "asked to train on a state it does not hold"
                assert not self.taking.get(me), "asked to train while a delta is taken from the local model"
                if self.lose_at.get(me) == e.round:  # found missing once; the driver makes it anew
                    del self.lose_at[me]
                    self.lost.append((me, e.base))
                    def missing(now: float, t: Train = e) -> list[Effect]:
                        out = m.report(StateLost(t.base), now)
                        self.still_held.append(t.base in m.held)
                        return out + m.report(Failed(t), now)

                    self.later(0.01, me, missing)
                    continue
                self.trains.append((me, e))
                self.train_at.append((me, self.now))
                self.later(self.train_time * (1 + self.rng.random() * self.jitter), me,
                           lambda now, t=e: m.report(Trained(t.job.id, t.round, t.shard, 64), now))
            elif isinstance(e, Cancel):
                self.cancels.append((me, e))
            elif isinstance(e, PublishDelta):
                self.uploads.append((me, e, self.now))
                blob = BLOB
                if me in self.fail_upload:
                    self.fail_upload.discard(me)
                    blob = None
                taking = self.taking.setdefault(me, set())
                assert not taking, "asked to publish while another delta is taken from the local model"
                taking.add((e.round, e.shards))

                def encoded(now: float, d: PublishDelta = e, taking: set = taking) -> list[Effect]:
                    taking.discard((d.round, d.shards))
                    return m.report(DeltaEncoded(d.job, d.round, d.base, d.shards), now)

                def published(now: float, d: PublishDelta = e, b: str | None = blob, taking: set = taking
                              ) -> list[Effect]:
                    taking.discard((d.round, d.shards))
                    if b is None:
                        return m.report(Failed(d), now)
                    return m.report(DeltaPublished(d.job, d.round, d.base, d.shards, d.samples, b, 100, {"loss": 1.0}),
                                    now)

                if self.encode:
                    self.later(self.encode_time, me, encoded)
                self.later(self.encode_time + self.upload_time, me, published)
            elif isinstance(e, Aggregate):
                self.aggregates.append((me, e))
                self.aggregated_at.append(self.now)
                ids = tuple(c.id for c in e.contribs)
                self.later(0.1, me, lambda now, a=e, ids=ids: m.report(Aggregated(
                    a.job, a.round, a.base, ids, derive(a.base, list(ids)), {}), now))
            elif isinstance(e, Apply):
                self.applies.append((me, e.close["state"]))
                ok = derive(e.close["base"], [c.id for c in e.contribs]) == e.close["state"]
                if me in self.fail_apply:
                    self.fail_apply.discard(me)
                    ok = False
                assert [c.id for c in e.contribs] == list(e.close["contribs"])
                self.later(0.1, me, lambda now, s=e.close["state"], ok=ok: m.report(Applied(s, ok), now))
            elif isinstance(e, PublishCheckpoint):
                self.later(0.1, me, lambda now, c=e: m.report(CheckpointPublished(
                    c.job, c.round, c.state, hex64(c.state), self.ckpt_size), now))
            elif isinstance(e, JobDone):
                assert self.done.get(me) != e.state, "JobDone twice for the same state"
                self.done[me] = e.state
            else:  # pragma: no cover
                raise AssertionError(f"unknown effect {e!r}")

    def restart(self, i: int) -> PeerMachine:
        """Crash machine ``i`` (in-flight messages and reports are lost) and start a new one from
        its durable records and held states."""
        me = self.order[i]
        old = self.machines[me]
        self._heap = [h for h in self._heap if h[2] != me]
        heapq.heapify(self._heap)
        fresh = PeerMachine(self.pool.id, self.keys[i], now=self.now)
        fresh.load([r.raw for r in old.records], self.now)
        self.machines[me] = fresh
        for s in sorted(old.held):
            self.handle(me, fresh.report(Holds(s), self.now))
        return fresh

    def alive(self) -> list[str]:
        return [me for me in self.order if me not in self.dead]

    def working(self) -> list[str]:
        return [me for me in self.alive() if me not in self.decline]

    def run(self, until: float, *, stop: Callable[[], bool] | None = None) -> None:
        stop = stop or (lambda: all(me in self.done for me in self.working()))
        while not stop():
            self.steps += 1
            assert self.steps < 200_000, "no progress"
            due = min(self.machines[me].next_deadline() for me in self.alive())
            event = self._heap[0][0] if self._heap else float("inf")
            t = min(due, event)
            if t > until:
                return
            self.now = max(self.now, t)  # a revived machine's deadline may be stale
            if event <= due:
                _, _, me, fn = heapq.heappop(self._heap)
                if me not in self.dead:
                    self.handle(me, fn(self.now))
                continue
            for me in self.alive():
                m = self.machines[me]
                if m.next_deadline() <= self.now:
                    self.handle(me, m.tick(self.now))
                    assert m.next_deadline() > self.now, "next_deadline is not in the future after tick"


def check_finished(c: Cluster, job: Record) -> None:
    alive = c.working()
    assert set(c.done) >= set(alive)
    chains = {me: c.machines[me].chain(job) for me in alive}
    summaries = {(ch.states, tuple(x.id for x in ch.closes)) for ch in chains.values()}
    assert len(summaries) == 1, "machines follow different chains"
    chain = next(iter(chains.values()))
    assert chain.round == job["rounds"]
    assert {c.done[me] for me in alive} == {chain.head}
    rs = c.machines[alive[0]].records
    for rnd, close in enumerate(chain.closes):  # I2: every shard of every round in its close
        parts = [rs.by_id[cid] for cid in close["contribs"]]
        assert covered(parts) == set(range(job["shards"]))
        assert all(p["round"] == rnd and p["base"] == train_base(job, chain, rnd) for p in parts)
        assert close["state"] == derive(close["base"], list(close["contribs"]))
    for me in alive:
        assert chain.head in c.machines[me].held


@pytest.mark.parametrize(("n", "shards", "rounds"), [(1, 3, 2), (2, 4, 3), (3, 5, 3), (3, 1, 2)])
def test_machines_finish_every_round_with_identical_chains(n: int, shards: int, rounds: int) -> None:
    c = Cluster(n)
    job = c.submit_job(0, shards=shards, rounds=rounds, lease=30)
    c.run(until=10_000)
    check_finished(c, job)
    trained = {(t.round, t.shard) for _, t in c.trains}
    assert trained == {(r, s) for r in range(rounds) for s in range(shards)}
    assert c.now < 100, "a healthy pool should not wait for leases"
    # Every peer fetched each round's others' deltas ahead of its close, once, as they
    # were covered (a round one peer covered alone: nothing to fetch).
    rs = c.machines[c.order[0]].records
    for me in c.order:
        fetched = {(e.round, c_.id) for m, e in c.ahead if m == me for c_ in e.contribs}
        wanted = {(r, cid) for r, close in enumerate(c.machines[me].chain(job).closes)
                  for cid in close["contribs"] if rs.by_id[cid].author != me}
        assert fetched == wanted, me


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3), jitter=st.floats(0, 3), duplicate=st.floats(0, 0.5),
       submitter=st.integers(0, 2), overlap=st.integers(0, 1))
def test_any_delivery_order_and_duplication_reaches_the_same_end(
    seed: int, n: int, jitter: float, duplicate: float, submitter: int, overlap: int
) -> None:
    c = Cluster(n, seed=seed, jitter=jitter, duplicate=duplicate)
    job = c.submit_job(submitter % n, shards=4, rounds=3, lease=20, overlap=overlap)
    c.run(until=10_000)
    check_finished(c, job)


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_peer_that_dies_mid_round_loses_nothing(overlap: int) -> None:
    c = Cluster(3)
    job = c.submit_job(0, shards=6, rounds=2, lease=20, overlap=overlap)
    victim = c.order[2]
    c.run(until=10_000, stop=lambda: any(me == victim and t.round == 0 for me, t in c.trains))
    c.dead.add(victim)
    c.run(until=10_000)
    check_finished(c, job)


def test_others_close_the_round_when_the_closer_dies() -> None:
    c = Cluster(3)
    job = c.submit_job(0, shards=3, rounds=2, lease=20)
    c.run(until=10_000, stop=lambda: bool(c.aggregates))
    closer, agg = c.aggregates[0]
    assert closer == min(p.author for p in agg.contribs)
    c.dead.add(closer)
    t_dead = c.now
    c.run(until=10_000)
    check_finished(c, job)
    later = [(me, a, t) for (me, a), t in zip(c.aggregates[1:], c.aggregated_at[1:], strict=True)
             if a.round == agg.round]
    assert later and all(me != closer for me, _, _ in later)
    # The dead closer has been silent for a lease: the others wait that long, and not much more
    # (a live but slow closer would get two digests more; see the next test).
    for _, _, t in later:
        assert t_dead + 20 - 0.5 <= t <= t_dead + 20 + 0.5


def test_a_closer_dead_before_the_round_is_covered_costs_one_lease_not_two() -> None:
    """The closer publishes its contribution and dies before the round is covered: the
    third peer is cut off mid-shard, so the round is covered only once the second
    retrains that shard after its lease. It must close at once then, since the closer
    has been silent for a lease already (it used to wait a second lease)."""
    c = Cluster(3)
    job = c.submit_job(0, shards=3, rounds=1, lease=20)
    closer = min(c.order)
    y, z = [me for me in c.order if me != closer]
    # Cut z off once y knows z's claim: y then waits out z's lease before retraining it.
    c.run(until=10_000, stop=lambda: any(r.kind == "claim" and r.author == z for r in c.machines[y].records))
    c.blocked |= {frozenset((y, z)), frozenset((closer, z))}
    c.run(until=10_000, stop=lambda: any(r.kind == "contrib" and r.author == closer for r in c.machines[y].records))
    c.dead.add(closer)
    t_dead = c.now
    c.run(until=10_000, stop=lambda: any(me == y for me, _ in c.aggregates))
    agg = next(a for me, a in c.aggregates if me == y)
    at = next(t for (me, _), t in zip(c.aggregates, c.aggregated_at, strict=True) if me == y)
    assert closer in {p.author for p in agg.contribs}
    # One lease for the partitioned shard to be retrained, a shard's time, and no second lease.
    assert at <= t_dead + 20 + c.train_time + 3, at - t_dead
    c.blocked.clear()  # z closed alone meanwhile: the two closes converge on one chain
    c.run(until=c.now + 60, stop=lambda: False)
    assert len({c.machines[me].chain(job).head for me in (y, z)}) == 1


def without_the_last_peer(c: Cluster, until_round: int | None, **job: object) -> tuple[str, Record, PeerMachine]:
    """Run a job (shards 3, ``job``'s fields) with ``c``'s last peer away, until the chain
    reaches ``until_round`` (None: the job's end): (the peer away, the job, the first peer)."""
    late = c.order[-1]
    c.dead.add(late)
    rec = c.submit_job(0, **{"shards": 3, **job})
    first = c.machines[c.order[0]]
    c.run(until=10_000, stop=None if until_round is None else lambda: first.chain(rec).round >= until_round)
    return late, rec, first


@pytest.mark.parametrize("overlap", [0, 1])
def test_peer_offline_from_the_start_asks_for_a_checkpoint_and_starts_from_it(overlap: int) -> None:
    c = Cluster(3)
    late, job, first = without_the_last_peer(c, 20, rounds=30, lease=20, overlap=overlap)
    assert not first.records.of_job(job.id, "ckpt"), "nobody asked: no checkpoint"
    c.dead.discard(late)
    c.run(until=10_000)
    check_finished(c, job)
    rs = c.machines[late].records
    [ask] = [r for r in rs.of_job(job.id, "ckpt_want") if r.author == late]
    ckpts = rs.of_job(job.id, "ckpt")
    assert [k["state"] for k in ckpts] == [ask["state"]], "one checkpoint, of the state asked for"
    got = [f.state for me, f in c.fetches if me == late]
    assert got[0] == ask["state"], "the late peer starts from the checkpoint, not the initial state"
    assert job["init"] not in got
    chain = c.machines[late].chain(job)
    k = chain.states.index(ask["state"])
    # The peer that closed the round making that state answered (it holds it).
    assert ckpts[0].author == chain.closes[k - 1].author


def test_a_fused_job_publishes_no_checkpoint_nobody_asks_for() -> None:
    """No model is sent twice: every peer applies the closes, so a job whose peers all keep
    up (the final state too) uploads deltas only (and its initial state, at submit)."""
    c = Cluster(2, ckpt_size=1600)  # the cluster's deltas are 100 bytes
    job = c.submit_job(0, shards=2, rounds=40, lease=20, bits=4, steal=False)
    c.run(until=10_000)
    check_finished(c, job)
    c.run(until=c.now + 60, stop=lambda: False)
    rs = c.machines[c.order[0]].records
    assert not rs.of_job(job.id, "ckpt") and not rs.of_job(job.id, "ckpt_want")
    assert {me for me, _f in c.fetches} <= set(c.order) and all(f.state == job["init"] for _me, f in c.fetches)


def test_an_ask_whose_closer_is_gone_is_answered_by_another_holder_after_its_wait() -> None:
    c = Cluster(4)
    late, job, first = without_the_last_peer(c, 25, rounds=40, lease=10)
    closer = first.chain(job).closes[-1].author
    c.dead.add(closer)  # it made the head: the one that would answer at once
    live = [me for me in c.order if me not in c.dead]
    c.run(until=c.now + 1, stop=lambda: False)
    c.dead.discard(late)
    woke = c.now
    c.run(until=10_000, stop=lambda: bool(c.machines[late].records.of_job(job.id, "ckpt")))
    [ckpt] = c.machines[late].records.of_job(job.id, "ckpt")
    assert ckpt.author in live and ckpt.author != closer
    assert c.now - woke <= 4 * job["lease"] + 5  # its rank's wait, at most as many leases as peers
    c.run(until=10_000)
    check_finished(c, job)
    # The others wait their turn: the one that answered is the only one that uploaded.
    assert c.machines[late].records.of_job(job.id, "ckpt") == [ckpt]
    got = [f.state for me, f in c.fetches if me == late]
    assert ckpt["state"] in got  # (the initial state first, perhaps: the job's records came before its closes)
    chain = c.machines[late].chain(job)
    applied = [s for me, s in c.applies if me == late]
    assert len(applied) < chain.round - chain.states.index(ckpt["state"]) + 5, "it skipped the rounds before"


def test_a_peer_that_could_replay_a_round_or_two_asks_for_nothing() -> None:
    c = Cluster(3)
    me = c.order[2]
    job = c.submit_job(0, shards=3, rounds=12, lease=20)
    c.run(until=10_000, stop=lambda: c.machines[me].chain(job).round >= 3)
    c.dead.add(me)
    first = c.machines[c.order[0]]
    r = first.chain(job).round
    c.run(until=10_000, stop=lambda: first.chain(job).round >= r + 2)
    c.dead.discard(me)
    c.run(until=10_000)
    check_finished(c, job)
    assert not c.machines[me].records.of_job(job.id, "ckpt_want")


@pytest.mark.parametrize("heal_after", [8.0, 10.0, 12.0])
def test_partitioned_peers_converge_on_one_chain_after_healing(heal_after: float) -> None:
    c = Cluster(2, seed=3)
    a, b = c.order
    job = c.submit_job(0, shards=2, rounds=6, lease=5)
    c.run(until=0.06, stop=lambda: False)  # b hears of the job, then the link goes down
    c.blocked.add(frozenset((a, b)))
    c.run(until=heal_after, stop=lambda: False)
    forks = {me: c.machines[me].chain(job) for me in c.order}
    assert all(ch.round >= 1 for ch in forks.values()), "both sides progress alone"
    assert forks[a].states[1] != forks[b].states[1], "the partition made a fork"
    assert not c.done, "heal before either side finishes"
    c.blocked.clear()
    c.run(until=10_000)
    # A side may finish its own branch before the records meet; it repairs once they do
    # (see the next test), so convergence is judged after the digests had time to merge.
    c.run(until=c.now + 60, stop=lambda: False)
    check_finished(c, job)


def test_peer_that_finished_on_a_losing_branch_repairs_after_healing() -> None:
    c = Cluster(2, seed=3)
    a, b = c.order
    job = c.submit_job(0, shards=2, rounds=3, lease=5)
    c.run(until=0.06, stop=lambda: False)
    c.blocked.add(frozenset((a, b)))
    c.run(until=10_000)  # both finish alone
    assert c.done[a] != c.done[b]
    c.blocked.clear()
    c.run(until=c.now + 60, stop=lambda: False)  # digests merge the records
    heads = {c.machines[me].chain(job).head for me in c.order}
    assert len(heads) == 1, "views converge: the chain is a function of the records"
    assert {c.done[me] for me in c.order} == heads


def test_restarted_peer_resumes_from_its_durable_records() -> None:
    c = Cluster(3)
    job = c.submit_job(0, shards=4, rounds=3, lease=15)
    me = c.order[1]
    c.run(until=10_000, stop=lambda: any(m == me and t.round == 1 for m, t in c.trains))
    fresh = c.restart(1)
    assert fresh.chain(job).round >= 1
    c.run(until=10_000)
    check_finished(c, job)
    assert any(m == me and t.round == 2 for m, t in c.trains), "the restarted peer contributes again"


def test_peer_whose_apply_fails_repairs_from_a_checkpoint() -> None:
    c = Cluster(3)
    c.fail_apply = {c.order[1], c.order[2]}
    job = c.submit_job(0, shards=3, rounds=3, lease=15)
    c.run(until=10_000)
    check_finished(c, job)
    repaired = {me for me, f in c.fetches if f.state != job["init"]}
    assert repaired & {c.order[1], c.order[2]}


def test_jobs_run_one_after_another() -> None:
    c = Cluster(2)
    first = c.submit_job(0, shards=2, rounds=2, lease=10)
    c.run(until=10_000)
    check_finished(c, first)
    second = c.submit_job(1, shards=3, rounds=2, lease=10, at=2000, seed=5)
    c.run(until=10_000, stop=lambda: all(c.done.get(me) == c.machines[me].chain(second).head
                                         and c.machines[me].chain(second).round == 2 for me in c.order))
    check_finished(c, second)
    assert all(c.machines[me].chain(first).round == 2 for me in c.order)


def test_a_peer_that_declines_the_job_is_left_out() -> None:
    c = Cluster(3)
    c.decline = {c.order[2]}
    job = c.submit_job(0, shards=3, rounds=2, lease=10)
    c.run(until=10_000)
    check_finished(c, job)
    assert c.machines[c.order[2]].declined == {job.id: "too big"}
    assert not [t for me, t in c.trains if me == c.order[2]]
    assert c.machines[c.order[2]].chain(job).round == 2  # it still follows the ledger


def test_a_decline_is_published_once_and_every_peer_learns_who_and_why() -> None:
    c = Cluster(3)
    c.decline = {c.order[2]}
    job = c.submit_job(0, shards=3, rounds=2, lease=10)
    c.run(until=10_000)
    check_finished(c, job)
    for me in c.order:
        [rec] = c.machines[me].records.of_job(job.id, "decline")
        assert (rec.author, rec["reason"], rec["need"], rec["have"]) == (c.order[2], "too big", 0, 0)
    # Asked again (a restart re-prepares the job), it publishes nothing new.
    again = c.machines[c.order[2]].report(Declined(job.id, "too big", need=5, have=1), c.now)
    assert not [e for e in again if isinstance(e, Persist)]


def test_a_peer_holding_everything_is_sent_nothing() -> None:
    pool = Pool("digest-cap")
    k = key("digest-cap")
    membership = pool.admit([k])
    recs = membership + [sign("claim", pool.id, {"job": hex64("j"), "round": 0, "shard": 0, "attempt": 0, "n": i,
                                                 "done": 0, "rate": 0.0, "backup": False}, k)
                         for i in range(MAX_DIGEST_IDS + 20)]
    a = PeerMachine(pool.id, k, now=0.0)
    for r in recs:
        a.records.add(r)
    digest = digest_payload(r.id for r in recs)  # what a peer holding the same records broadcasts
    sent = [e for e in a.receive(key("other").public_key().public_bytes_raw().hex(), digest, 1.0)
            if isinstance(e, Send)]
    assert sent == []


# -- leases -------------------------------------------------------------------------------


def _records_in(effects: list[Effect]) -> list[Record]:
    return [e.record for e in effects if isinstance(e, Persist)]


def _broadcasts(effects: list[Effect]) -> list[bytes]:
    return [e.payload for e in effects if isinstance(e, Broadcast) and parse_payload(e.payload)[0] == "records"]


def _ready(m: PeerMachine, effects: list[Effect], now: float) -> list[Effect]:
    """Answer PrepareJob and FetchState until the machine asks for something else."""
    out: list[Effect] = []
    pending = list(effects)
    while pending:
        e = pending.pop(0)
        if isinstance(e, PrepareJob):
            pending += m.report(Prepared(e.job.id), now)
        elif isinstance(e, FetchState):
            pending += m.report(Fetched(e.state, True), now)
        else:
            out.append(e)
    return out


LEASE = 30.0


def _two_with_a_claim(
    a_is_member: bool = True,
) -> tuple[PeerMachine, PeerMachine, Record, Train, list[bytes], float]:
    """A claims the job's single shard at t=0; B hears of the job and the claim at t=1."""
    pool = Pool("lease")
    ka, kb = key("lease-a"), key("lease-b")
    membership = [r.raw for r in pool.admit([ka, kb] if a_is_member else [kb])]
    a, b = PeerMachine(pool.id, ka, now=0.0), PeerMachine(pool.id, kb, now=0.0)
    a.load(membership, 0.0)
    b.load(membership, 0.0)
    job = sign("job", pool.id, job_body(shards=1, rounds=1, lease=LEASE), kb)
    effects = _ready(a, a.add_local(job, 0.0), 0.0)  # A runs the job whether or not it is a member
    trains = [e for e in effects if isinstance(e, Train)]
    assert len(trains) == 1 and (trains[0].shard, trains[0].attempt) == (0, 0)
    claims = [r for r in _records_in(effects) if r.kind == "claim"]
    assert len(claims) == 1 and claims[0]["attempt"] == 0
    b.tick(0.3)  # B's digests fall at 5.3, 10.3, ...: off the lease expiry, which must be a deadline of its own
    seen = 1.0
    out: list[Effect] = []
    for payload in _broadcasts(effects):
        out += b.receive(a.me, payload, seen)
    out = _ready(b, out, seen)
    if a_is_member:
        assert not [e for e in out if isinstance(e, Train)], "B claimed a shard A holds a live lease on"
    b.last_effects = out  # type: ignore[attr-defined]
    return a, b, job, trains[0], _broadcasts(effects), seen


def test_silent_claimer_loses_its_shard_exactly_when_the_lease_expires() -> None:
    a, b, job, _, _, seen = _two_with_a_claim()
    now = seen
    ticks = 0
    while True:  # drive B only by its own deadlines: no polling
        nxt = b.next_deadline()
        assert ticks == 0 or nxt > now
        now = max(nxt, now)
        out = b.tick(now)
        ticks += 1
        assert ticks < 100
        trains = [e for e in out if isinstance(e, Train)]
        if now < seen + LEASE:
            assert not trains, f"B claimed at {now}, before the lease ran out at {seen + LEASE}"
            continue
        break
    assert now == pytest.approx(seen + LEASE), "B should wake exactly when the lease expires"
    assert len(trains) == 1 and (trains[0].shard, trains[0].attempt) == (0, 1)
    claim = [r for r in _records_in(out) if r.kind == "claim"]
    assert len(claim) == 1 and (claim[0]["shard"], claim[0]["attempt"], claim[0].author) == (0, 1, b.me)

    # A comes back and hears B's claim: the higher attempt owns the shard, A stops.
    back: list[Effect] = []
    for payload in _broadcasts(out):
        back += a.receive(b.me, payload, now + 1)
    assert Cancel(job.id, 0, 0) in back


def test_claims_of_a_non_member_hold_no_lease() -> None:
    a, b, _, _, _, seen = _two_with_a_claim(a_is_member=False)
    assert a.me not in b.records.members
    trains = [e for e in b.last_effects if isinstance(e, Train)]  # type: ignore[attr-defined]
    if not trains:
        trains = [e for e in b.tick(seen + 1) if isinstance(e, Train)]
    assert [t.shard for t in trains] == [0], "B must not wait for a non-member's lease"


def test_no_claim_just_before_the_lease_expires() -> None:
    _, b, _, _, _, seen = _two_with_a_claim()
    for t in (seen + 1, seen + LEASE / 2, seen + LEASE - 1e-6):
        out = b.tick(t)
        assert not [e for e in out if isinstance(e, Train)]
        assert b.next_deadline() > t


def test_renewed_claim_is_never_stolen() -> None:
    a, b, _, train, _, seen = _two_with_a_claim()
    t = seen
    while t < seen + 4 * LEASE:  # A stays alive and keeps renewing; its renewals reach B at once
        t = min(a.next_deadline(), b.next_deadline())
        out_a = a.tick(t) if a.next_deadline() <= t else []
        assert not [e for e in out_a if isinstance(e, Train)]
        for payload in _broadcasts(out_a):
            b.receive(a.me, payload, t)
        out_b = b.tick(t) if b.next_deadline() <= t else []
        assert not [e for e in out_b if isinstance(e, Train)], f"B stole a renewed lease at {t}"
    renewals = [r for r in a.records if r.kind == "claim" and r.author == a.me]
    assert len(renewals) >= 10 and max(r["n"] for r in renewals) >= 10


def test_next_deadline_is_never_in_the_past_after_a_tick() -> None:
    c = Cluster(2)
    job = c.submit_job(0, shards=3, rounds=2, lease=10)
    rng = random.Random(7)
    while not all(me in c.done for me in c.order):
        c.run(until=c.now + rng.random() * 3, stop=lambda: False)
        for me in c.order:  # ticks at arbitrary times, not only at deadlines
            m = c.machines[me]
            c.handle(me, m.tick(c.now))
            assert m.next_deadline() > c.now
        assert c.now < 1000
    check_finished(c, job)


def test_peer_ignores_hostile_payloads() -> None:
    c = Cluster(2)
    job = c.submit_job(0, shards=2, rounds=1, lease=10)
    m = c.machine(1)
    before = len(m.records)
    for junk in (b"", b"\x00" * 10, b'{"t":"records","r":["zz"]}', b'{"t":"records","r":["00"]}', b"[]"):
        assert m.receive(c.order[0], junk, 0.0) == []
    assert len(m.records) == before
    c.run(until=10_000)
    check_finished(c, job)


def test_non_member_job_is_ignored() -> None:
    c = Cluster(1)
    outsider_job = sign("job", c.pool.id, job_body(), key("peer-outsider"))
    m = c.machine(0)
    effects = m.add_local(outsider_job, 0.0)
    assert not [e for e in effects if isinstance(e, PrepareJob)]
    assert m.active_job() is None
    assert public_hex(key("peer-outsider")) not in m.records.members


def test_released_claim_is_free_at_once_and_the_releaser_claims_nothing_more() -> None:
    a, b, job, _, _, seen = _two_with_a_claim()
    out = a.release(seen)
    assert any(isinstance(e, Cancel) for e in out)
    releases = [r for r in _records_in(out) if r.kind == "release"]
    assert len(releases) == 1
    got: list[Effect] = []
    for payload in _broadcasts(out):
        got += b.receive(a.me, payload, seen + 0.1)  # long before the lease would expire
    trains = [e for e in got if isinstance(e, Train)]
    assert [(t.shard, t.attempt) for t in trains] == [(0, 1)]
    a.report(Trained(job.id, 0, 0, 0), seen + 0.2)
    assert not [e for e in a.tick(seen + 10 * LEASE) if isinstance(e, Train)]  # stopping: no new claims


def _straggler_pair(steal: bool = True, slow: float = 1.0, fast: float = 100.0):  # type: ignore[no-untyped-def]
    """A (slow, 1 batch/s) claims the only shard; B (fast, idle) hears the claim at t=0.5."""
    pool = Pool("steal")
    ka, kb = key("steal-a"), key("steal-b")
    membership = [r.raw for r in pool.admit([ka, kb])]
    a, b = PeerMachine(pool.id, ka, now=0.0), PeerMachine(pool.id, kb, now=0.0)
    a.load(membership, 0.0)
    b.load(membership, 0.0)
    a.rate, b.rate = slow, fast  # as measured on earlier shards
    job = sign("job", pool.id, job_body(shards=1, rounds=1, lease=LEASE, batches=20, steal=steal), kb)
    a_out = _ready(a, a.add_local(job, 0.0), 0.0)
    out: list[Effect] = []
    for payload in _broadcasts(a_out):
        out += b.receive(a.me, payload, 0.5)
    return a, b, job, _ready(b, out, 0.5)


def test_idle_fast_peer_runs_a_backup_of_the_stragglers_shard() -> None:
    a, b, job, out = _straggler_pair()
    trains = [e for e in out if isinstance(e, Train)]
    assert [(t.shard, t.attempt) for t in trains] == [(0, 0)]  # 20 batches: 0.2 s here vs 20 s there
    backup = [r for r in _records_in(out) if r.kind == "claim" and r.author == b.me]
    assert len(backup) == 1 and backup[0]["backup"] is True
    # The owner keeps training: a backup never takes the shard from it.
    back: list[Effect] = []
    for payload in _broadcasts(out):
        back += a.receive(b.me, payload, 0.6)
    assert not [e for e in back if isinstance(e, Cancel)]
    # The backup finishes first and publishes; the owner stops as soon as it hears.
    done = b.report(Trained(job.id, 0, 0, 160, batches=20, seconds=0.2), 0.7)
    pub = [e for e in done if isinstance(e, PublishDelta)]
    assert len(pub) == 1 and pub[0].shards == (0,)
    contrib = b.report(DeltaPublished(JobSpec.of(job), 0, pub[0].base, (0,), 160, hex64("b-blob"), 100, {}), 0.8)
    heard: list[Effect] = []
    for payload in _broadcasts(contrib):
        heard += a.receive(b.me, payload, 0.9)
    assert Cancel(job.id, 0, 0) in heard


def test_no_backup_when_the_owner_is_about_as_fast_or_stealing_is_off() -> None:
    _, _, _, out = _straggler_pair(slow=95.0, fast=100.0)  # B would gain less than 10% of its time
    assert not [e for e in out if isinstance(e, Train)]
    _, _, _, out = _straggler_pair(steal=False)
    assert not [e for e in out if isinstance(e, Train)]


def test_overlap_trains_the_next_round_while_a_round_closes() -> None:
    """With overlap, round r+1 trains on round r's base while round r closes: the same
    job takes less time, every close names the base of the round before as ``tbase``,
    and every contribution trained on it."""
    times = {}
    for overlap in (0, 1):
        c = Cluster(3, latency=0.3)
        job = c.submit_job(0, shards=3, rounds=5, lease=20, overlap=overlap)
        c.run(until=10_000)
        check_finished(c, job)
        times[overlap] = c.now
    chain = c.machines[c.order[0]].chain(job)
    rs = c.machines[c.order[0]].records
    for rnd, close in enumerate(chain.closes):
        assert close["tbase"] == chain.states[max(0, rnd - 1)]
        assert {rs.by_id[cid]["base"] for cid in close["contribs"]} == {close["tbase"]}
    assert times[1] < 0.9 * times[0], times


def test_an_overlapped_round_names_its_own_base_once_the_peer_holds_it() -> None:
    """A shard of the chain's own round (the close before it applied here) carries that
    round's base as ``ahead``, where the executor starts it exactly; a shard of the round
    after (trained while the round closes) has none yet and starts from an estimate."""
    c = Cluster(3, latency=0.3)
    job = c.submit_job(0, shards=4, rounds=5, lease=20, overlap=1)
    c.run(until=10_000)
    check_finished(c, job)
    chain = c.machines[c.order[0]].chain(job)
    ahead = [t for _me, t in c.trains if t.ahead is not None]
    assert ahead and all(t.ahead == chain.states[t.round] for t in ahead)
    assert any(t.ahead is None and t.round > 0 for _me, t in c.trains)
    c = Cluster(3, latency=0.3)
    c.submit_job(0, shards=4, rounds=3, lease=20, overlap=0)
    c.run(until=10_000)
    assert c.trains and all(t.ahead is None for _me, t in c.trains)


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_close_must_name_the_right_training_base(overlap: int) -> None:
    """In an overlapped job a close whose ``tbase`` is not the base of the round before
    (or that has none) is not part of the chain; in a job without overlap, neither is a
    close that has one. Shown by swapping round 1's close for a re-signed variant."""
    c = Cluster(2)
    job = c.submit_job(0, shards=2, rounds=3, lease=20, overlap=overlap)
    c.run(until=10_000)
    check_finished(c, job)
    m = c.machines[c.order[0]]
    chain = m.chain(job)
    real = chain.closes[1]

    def chain_with(close_body: dict) -> int:
        rs = RecordSet(c.pool.id)
        for r in m.records:
            if not (r.kind == "close" and r["round"] >= 1):
                rs.add(r)
        rs.add(sign("close", c.pool.id, close_body, c.keys[0]))
        return canonical_chain(rs, job).round

    assert chain_with(dict(real.body)) == 2  # the same body, re-signed: still valid
    wrong = dict(real.body)
    if overlap:
        wrong["tbase"] = chain.states[1]  # its own base, not the round before's
        assert chain_with(wrong) == 1
        del wrong["tbase"]
        assert chain_with(wrong) == 1
    else:
        wrong["tbase"] = chain.states[1]
        assert chain_with(wrong) == 1


def test_the_next_shard_trains_while_a_delta_uploads() -> None:
    """Once the driver has taken the delta from the local model (``DeltaEncoded``) the
    peer trains on during the upload: an overlapped job over slow uploads ends sooner,
    with every shard in its close and no shard trained twice by its own peer. (Without
    overlap a peer publishes when its round has nothing left to train: nothing to gain.)"""
    times = {}
    for encode in (False, True):
        c = Cluster(2, latency=0.1, encode=encode, upload_time=0.8)
        job = c.submit_job(0, shards=4, rounds=4, lease=30, overlap=1, steal=False)
        c.run(until=10_000)
        check_finished(c, job)
        times[encode] = c.now
        per_peer = [(me, t.round, t.shard) for me, t in c.trains]
        assert len(per_peer) == len(set(per_peer)), "a peer trained a shard it was still uploading"
    assert times[True] < times[False] - 0.5 * 4, times
    during = [(me, t) for me, t in c.train_at for up_me, _e, began in c.uploads
              if up_me == me and began < t < began + c.upload_time]
    assert during, "no shard started while its peer's upload was in flight"


def test_a_delta_given_up_after_release_is_trained_again() -> None:
    """The local model moved on once the delta was taken, so a failed upload cannot be
    retried from it: its shard is claimed and trained again and the job completes."""
    c = Cluster(2, latency=0.1, encode=True, upload_time=0.5)
    c.fail_upload.add(c.order[1])
    job = c.submit_job(0, shards=2, rounds=2, lease=5, overlap=0, steal=False)
    c.run(until=10_000)
    check_finished(c, job)
    first = next(e for me, e, _t in c.uploads if me == c.order[1])
    again = [(me, t) for me, t in c.trains if (t.round, t.shard) == (first.round, first.shards[0])]
    assert len(again) == 2, again


def test_an_upload_ending_never_frees_the_local_model_of_a_later_delta() -> None:
    """Uploads outlast a shard: delta 1's upload may end while delta 2 is still being taken
    from the local model; the peer must not train or publish again until delta 2 is
    taken. The cluster asserts that on every Train and PublishDelta (a version that let
    any upload's end free the local model published delta 2 twice here)."""
    c = Cluster(2, latency=0.05, encode=True, encode_time=0.2, upload_time=1.1, train_time=1.0)
    job = c.submit_job(0, shards=2, rounds=6, lease=30, overlap=1, steal=False)
    c.run(until=10_000)
    check_finished(c, job)


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_peer_whose_held_state_is_gone_recomputes_it(overlap: int) -> None:
    """The driver may not have a state the machine counts as held (two jobs share a state
    hash and the first pruned its file). ``StateLost`` makes the peer stop counting it,
    so it gets it again (from a close it can replay, or a checkpoint) or moves on, instead
    of retrying Train or Apply on it forever (the WAN bench's second job, before)."""
    c = Cluster(2)
    job = c.submit_job(0, shards=2, rounds=6, lease=20, overlap=overlap, steal=False)
    member = c.order[1]
    c.lose_at[member] = 3  # its driver lacks the base it is asked to train round 3 on
    c.run(until=10_000)
    check_finished(c, job)
    assert [me for me, _ in c.lost] == [member], "the lost state was never used: the test did not test"
    assert c.still_held == [False], "the machine should stop counting the lost state as held"
    if not overlap:  # an overlapped peer may also skip to the next round's base instead
        lost = c.lost[0][1]
        again = [s for me, s in c.applies if me == member] + [f.state for me, f in c.fetches if me == member]
        assert lost in again, "the peer should have recomputed or fetched the state it lost"
