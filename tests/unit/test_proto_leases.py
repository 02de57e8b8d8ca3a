"""The lease table (``proto._leases.LeaseTable``) driven as the peer machine drives it:
signed claim and release records admitted at times on this peer's own clock, then the
questions the machine asks (who owns a shard, when the next lease runs out, which shard
to claim or back up, the next attempt). Each test pins one promise; its comment says
which, and why it matters (``scripts/mutation`` measures what these tests guard)."""

from __future__ import annotations

from ttpeer.proto import public_hex, sign
from ttpeer.proto._jobspec import JobSpec
from ttpeer.proto._leases import LeaseTable

from .proto_helpers import Pool, job_body, key

P = Pool("leases")
ME_KEY, A_KEY, B_KEY = key("lt-me"), key("lt-a"), key("lt-b")
ME, A, B = (public_hex(k) for k in (ME_KEY, A_KEY, B_KEY))
MEMBERS = frozenset({ME, A, B})
LEASE = 30
JOB = JobSpec.of(sign("job", P.id, job_body(shards=4, batches=20, lease=LEASE, rounds=10), A_KEY))
OTHER_JOB = JobSpec.of(sign("job", P.id, job_body(shards=4, batches=20, lease=LEASE, rounds=10, seed=2), A_KEY))


def claim(author, rnd: int, shard: int, attempt: int = 0, *, n: int = 0, done: int = 0,  # noqa: ANN001
          rate: float = 0.0, backup: bool = False, job: JobSpec = JOB):
    return sign("claim", P.id, {"job": job.id, "round": rnd, "shard": shard, "attempt": attempt, "n": n,
                                "done": done, "rate": rate, "backup": backup}, author)


def release(author, rnd: int, shard: int, attempt: int = 0, *, job: JobSpec = JOB):  # noqa: ANN001
    return sign("release", P.id, {"job": job.id, "round": rnd, "shard": shard, "attempt": attempt}, author)


# -- forget_before: the rounds before, not the round itself ------------------------------------


def _round_answers(table: LeaseTable, rnd: int, now: float) -> dict[str, object]:
    """What the machine asks the table about a round."""
    return {
        "owner": table.owner(JOB, rnd, 0, now, MEMBERS, None),
        "expiry": table.earliest_expiry(JOB.id, rnd, LEASE, now),
        "next_attempt": table.next_attempt(JOB.id, rnd, 1),
        "free": table.free_shard(JOB, rnd, set(), now, MEMBERS),
    }


def test_forgetting_the_rounds_before_r_keeps_every_answer_about_round_r():
    """``forget_before(job, r)`` is called when round r becomes the one being trained:
    rounds before r are closed, but round r is live. If it also dropped round r's claims,
    heap entries, releases or data preferences, this peer would think a shard held by
    another free (two peers train it), would not wake when a lease runs out, would let a
    replayed claim resurrect a released shard or reuse a released attempt number, and
    would fetch data it need not. Round r-1's state, and other jobs', are what go (or stay)."""
    table = LeaseTable(ME)
    for rnd in (4, 5):
        table.admit(claim(A_KEY, rnd, 0), 1.0)  # A holds shard 0 (a heap entry: it is another's)
        table.admit(claim(B_KEY, rnd, 1, attempt=2), 1.0)
        table.admit(release(B_KEY, rnd, 1, attempt=2), 2.0)  # B gave shard 1 back
    table.admit(claim(A_KEY, 4, 0, job=OTHER_JOB), 1.0)
    now = 3.0
    default = table.free_shard(JOB, 5, set(), now, MEMBERS)
    assert default in (1, 2, 3)  # shard 0 is A's; the released shard 1 is free
    preferred = next(s for s in (1, 2, 3) if s != default)
    for rnd in (4, 5):  # the driver says the data of `preferred` is here, of the others not
        table.prefer[(JOB.id, rnd)] = {s: 0 if s == preferred else 3 for s in range(4)}
    before = _round_answers(table, 5, now)
    assert before == {"owner": A, "expiry": 1.0 + LEASE, "next_attempt": 3, "free": preferred}
    assert _round_answers(table, 4, now) == before

    table.forget_before(JOB.id, 5)

    assert _round_answers(table, 5, now) == before, "round 5's claims, leases, releases or preferences were lost"
    # B's release of round 5 still stands: a late copy of its claim holds nothing.
    table.admit(claim(B_KEY, 5, 1, attempt=2, n=1), now)
    assert table.owner(JOB, 5, 1, now, MEMBERS, None) is None, "a replayed claim revived a released shard"
    # Round 4 is answered as by a table that never heard of it.
    assert _round_answers(table, 4, now) == _round_answers(LeaseTable(ME), 4, now)
    # Another job's rounds are another job's business.
    assert table.owner(OTHER_JOB, 4, 0, now, MEMBERS, None) == A


# -- straggler: at most one backup per shard; unheld shards are not stragglers -------------------


def test_a_shard_that_already_has_a_backup_is_not_backed_up_again():
    """Stealing runs a backup copy of a slow peer's shard; the docstring promises at most one
    per shard. Without it every idle fast peer would pile onto the same slow shard (each
    backup costs a whole shard's training and a delta's upload) while it still projects to
    finish last, even when the backup itself turns out slow."""
    table = LeaseTable(ME)
    job = JobSpec.of(sign("job", P.id, job_body(shards=1, batches=20, lease=LEASE), A_KEY))
    table.admit(claim(A_KEY, 0, 0, rate=1.0, job=job), 0.0)  # 20 batches at 1/s: done at t=20
    assert table.straggler(job, 0, set(), 0.5, MEMBERS, rate=100.0) == 0  # we would finish at t=0.7
    table.admit(claim(B_KEY, 0, 0, rate=1.0, backup=True, job=job), 0.4)  # B backed it up (slowly)
    assert table.straggler(job, 0, set(), 0.5, MEMBERS, rate=100.0) is None, "a second backup of one shard"


def test_a_shard_nobody_holds_is_no_straggler_and_does_not_break_the_search():
    """A shard with no live claim (its claimer's lease ran out, or a non-member's claim) and
    not done is a free shard for ``free_shard``, not a straggler: ``straggler`` skips it and
    still names the held slow shard, rather than projecting the finish of nobody's claim."""
    table = LeaseTable(ME)
    job = JobSpec.of(sign("job", P.id, job_body(shards=3, batches=20, lease=LEASE), A_KEY))
    table.admit(claim(A_KEY, 0, 1, rate=1.0, job=job), 0.0)  # shard 1: A, slow
    table.admit(claim(B_KEY, 0, 2, rate=1.0, job=job), 0.0)  # shard 2: B, but it left the pool
    # Shard 0 is held by nobody; shard 2's claim holds nothing (B is no member now).
    assert table.straggler(job, 0, set(), 0.5, MEMBERS - {B}, rate=100.0) == 1


# -- admit: a renewal with the same progress still brings its news ---------------------------


def test_a_renewal_at_the_same_progress_replaces_the_claims_speed():
    """A claimer's first claim may carry no speed (rate 0: not measured yet), its renewal
    the speed it then measured, with no more batches done. The renewal must replace the
    claim: its rate is what ``projected_finish`` uses, so stealing sees the shard is slow
    and backs it up. Keeping the old claim (only a renewal with *more* progress replacing
    it) would assume the claimer as fast as this peer and never steal from it."""
    table = LeaseTable(ME)
    job = JobSpec.of(sign("job", P.id, job_body(shards=1, batches=20, lease=LEASE), A_KEY))
    table.admit(claim(A_KEY, 0, 0, n=0, done=5, rate=0.0, job=job), 0.0)
    assert table.straggler(job, 0, set(), 1.5, MEMBERS, rate=100.0) is None  # unknown speed: no steal
    table.admit(claim(A_KEY, 0, 0, n=1, done=5, rate=1.0, job=job), 1.0)  # 15 batches left at 1/s
    assert table.straggler(job, 0, set(), 1.5, MEMBERS, rate=100.0) == 0, "the renewal's rate was dropped"


# -- further survivors of comparison flips (found by hand, one at a time) ----------------------


def test_a_lease_lives_exactly_lease_seconds_from_its_last_renewal_and_wakes_the_peer_then():
    """A claim is live for ``lease`` seconds after this peer last heard of it, and
    ``earliest_expiry`` is the deadline the machine sleeps to. Three things must agree:
    the deadline is the *latest* renewal's end (an older, superseded heap entry would wake
    the peer early for nothing on every renewal); at that instant the shard is free (else
    the peer wakes, finds it still held, and with the entry popped never wakes for it
    again); and no deadline at ``now`` itself is returned (the machine would spin)."""
    table = LeaseTable(ME)
    table.admit(claim(A_KEY, 0, 0, n=0, done=1, rate=1.0), 1.0)
    assert table.earliest_expiry(JOB.id, 0, LEASE, 1.5) == 1.0 + LEASE
    table.admit(claim(A_KEY, 0, 0, n=1, done=9, rate=1.0), 10.0)  # A renews
    end = 10.0 + LEASE
    assert table.earliest_expiry(JOB.id, 0, LEASE, 10.5) == end, "a superseded renewal set the deadline"
    others = {1, 2, 3}
    assert table.owner(JOB, 0, 0, end - 0.001, MEMBERS, None) == A
    assert table.free_shard(JOB, 0, others, end - 0.001, MEMBERS) is None
    assert table.owner(JOB, 0, 0, end, MEMBERS, None) is None, "a lease outlived its lease seconds"
    assert table.free_shard(JOB, 0, others, end, MEMBERS) == 0
    assert table.earliest_expiry(JOB.id, 0, LEASE, end) is None, "a deadline at now: the machine would spin"


def test_the_owner_is_the_highest_attempt_then_the_lowest_node_id_and_never_a_backup():
    """Every peer must name the same owner of a shard from the same claims, or two peers
    train it and neither yields. A newer attempt (``next_attempt``: a claim after a lease
    ran out or a release) wins over an older one that comes back late; equal attempts go
    to the lowest node id; a backup copy never owns the shard."""
    table = LeaseTable(ME)
    table.admit(claim(A_KEY, 0, 0, attempt=0), 1.0)
    table.admit(claim(B_KEY, 0, 0, attempt=1), 1.0)
    assert table.owner(JOB, 0, 0, 2.0, MEMBERS, None) == B, "an older attempt won the shard"
    table.admit(claim(ME_KEY, 0, 0, attempt=1), 1.0)
    own = (JOB.id, 0, 0, 1)  # this peer trains attempt 1 of shard 0
    assert table.owner(JOB, 0, 0, 2.0, MEMBERS, own) == min(B, ME)
    assert table.owner(JOB, 0, 0, 2.0, MEMBERS, None) == B  # our claim counts only while we train it
    table.admit(claim(A_KEY, 0, 0, attempt=2, backup=True), 1.0)
    assert table.owner(JOB, 0, 0, 2.0, MEMBERS, None) == B  # a backup's higher attempt owns nothing
    assert table.next_attempt(JOB.id, 0, 0) == 3


def test_a_peer_that_has_not_measured_its_own_speed_steals_nothing():
    """An idle peer that has not trained a shard yet (rate 0) has no basis to compare its
    speed with a claimer's: ``straggler`` answers None rather than dividing by zero."""
    table = LeaseTable(ME)
    job = JobSpec.of(sign("job", P.id, job_body(shards=1, batches=20, lease=LEASE), A_KEY))
    table.admit(claim(A_KEY, 0, 0, rate=0.01, job=job), 0.0)  # very slow: any measured peer would steal
    assert table.straggler(job, 0, set(), 0.5, MEMBERS, rate=1.0) == 0
    assert table.straggler(job, 0, set(), 0.5, MEMBERS, rate=0.0) is None


def test_a_claimer_that_has_nearly_finished_its_shard_is_not_backed_up():
    """The projected finish counts the batches a claimer still has to train (its reported
    ``done``): a slow peer at its last batch finishes before any copy started now would,
    so backing it up only wastes a shard's training and upload."""
    table = LeaseTable(ME)
    job = JobSpec.of(sign("job", P.id, job_body(shards=1, batches=20, lease=LEASE), A_KEY))
    table.admit(claim(A_KEY, 0, 0, done=0, rate=1.0, job=job), 0.0)  # 20 s to go
    assert table.straggler(job, 0, set(), 0.5, MEMBERS, rate=10.0) == 0  # a copy takes 2 s
    table.admit(claim(A_KEY, 0, 0, n=1, done=19, rate=1.0, job=job), 0.4)  # 1 s to go
    assert table.straggler(job, 0, set(), 0.5, MEMBERS, rate=10.0) is None, "a nearly done shard was backed up"


def test_a_claim_without_a_speed_keeps_the_speed_its_author_published_before():
    """``peer_rates`` (the speeds peers publish with their claims) sizes new jobs and shows
    in the status. A claim with rate 0 (its author has not measured yet, say just restarted)
    says nothing about its speed: it must not erase the speed known from before."""
    table = LeaseTable(ME)
    table.admit(claim(A_KEY, 0, 0, rate=2.5), 0.0)
    assert table.peer_rates == {A: 2.5}
    table.admit(claim(A_KEY, 1, 0, rate=0.0), 5.0)
    assert table.peer_rates == {A: 2.5}, "a claim without a speed erased the published one"
