"""The local worker: what this peer's one local model is doing, and what it trained.

Theory of operation. The driver keeps one local model per peer. Its state is one of
``Local`` and moves only along ``TRANSITIONS`` (below, one screen): the machine starts a
``Train`` under a fresh claim or a ``PublishDelta`` of what the model holds, cancels a
``Train`` that lost its shard, and the driver's reports bring the model back to idle. It
also holds the round's work (``RoundWork``: the shards trained into the local model and
not yet published), the shards whose delta is uploading (taken from the model, so the
next shard may train meanwhile), this peer's measured speed, and its own retry time after
a training or upload that could not run (it delays only its next claim or publish).

What it promises: at most one ``Train`` or ``PublishDelta`` uses the local model at a
time; a claim is renewed every lease/3 while it trains; shards count as this peer's work
only when a ``Train`` that was not cancelled reports samples; shards whose upload fails
are trained again (the model has moved on). What breaks it: a driver that trains while a
delta is taken from the model, or reports a ``Train`` it was never asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

from ._effects import Cancel, Effect, PublishDelta, Sign, Train
from ._jobspec import JobSpec
from ._leases import LeaseTable, Own, sharers_of
from ._ledger import RecordSet
from ._reports import RETRY_AFTER


class Local(Enum):
    IDLE = "idle"  # the local model is free
    TRAINING = "training"  # a Train runs under this peer's live claim
    CANCELLING = "cancelling"  # a Cancel is out; the Train's report is awaited
    PUBLISHING = "publishing"  # a PublishDelta is taking the delta from the local model


IDLE, TRAINING, CANCELLING, PUBLISHING = Local.IDLE, Local.TRAINING, Local.CANCELLING, Local.PUBLISHING
# (state, event) -> next state. Events the machine makes: train, cancel, publish; the
# driver's reports: trained (a Train ended, or could not run), encoded (the delta is out of
# the model), published (uploaded, or given up), lost (the worker lost the model); failed:
# the job's task failed here, whatever the model was doing for it is dropped.
TRANSITIONS: dict[tuple[Local, str], Local] = {
    (IDLE, "train"): TRAINING,
    (IDLE, "publish"): PUBLISHING,
    (TRAINING, "cancel"): CANCELLING,
    (TRAINING, "trained"): IDLE,
    (TRAINING, "failed"): IDLE,
    (CANCELLING, "trained"): IDLE,
    (CANCELLING, "failed"): IDLE,
    (PUBLISHING, "encoded"): IDLE,
    (PUBLISHING, "published"): IDLE,
    (PUBLISHING, "lost"): IDLE,
    (PUBLISHING, "failed"): IDLE,
}


@dataclass
class Training:
    """The shard under this peer's claim, while ``Local.TRAINING`` or ``CANCELLING``."""

    job: str
    round: int
    shard: int
    attempt: int
    n: int  # the claim's renewal count
    renewed_at: float
    backup: bool = False
    done: int = 0  # batches finished, as last reported by the driver
    rate: float = 0.0


@dataclass
class RoundWork:
    """What this peer trained into its local model in the current round."""

    job: str = ""
    round: int = -1
    base: str = ""
    shards: list[int] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0  # the driver's time in those shards' ``Train`` (the cadence's compute)


class LocalWorker:
    def __init__(self) -> None:
        self.state = Local.IDLE
        self.claim: Training | None = None  # set exactly while TRAINING or CANCELLING
        # The PublishDelta whose delta the local model still holds, as (job, round, shards);
        # set exactly while PUBLISHING.
        self.publishing: tuple[str, int, tuple[int, ...]] | None = None
        self.work = RoundWork()
        # (job, round, shard) whose delta the driver has taken from the local model and is
        # uploading: not this peer's to train again unless the upload fails.
        self.uploading: set[tuple[str, int, int]] = set()
        self.rate = 0.0  # this peer's measured training speed, batches per second (EMA)
        self.wasted_batches = 0  # batches trained that no close used (cancelled copies)
        self.stopping = False  # shutting down: leaves IDLE no more
        self.retry_at = 0.0
        # The sync this peer measured (``_cadence``): when it started and ended uploading each
        # round's delta, and per job the last sync (upload, then from the round covered to its
        # close applied here: the time waiting for other peers is not the link's).
        self.sent_at: dict[tuple[str, int], float] = {}
        self.uploaded: dict[tuple[str, int], float] = {}
        self.last_sync: dict[str, float] = {}
        # Of each delta out: the seconds its shards trained, and when its publish began.
        self.publish_seconds: dict[tuple[str, int, tuple[int, ...]], tuple[float, float]] = {}

    def _go(self, event: str) -> None:
        self.state = TRANSITIONS[(self.state, event)]  # a KeyError here is a bug in this file

    # -- queries -------------------------------------------------------------------------

    def own(self) -> Own | None:
        """The claim this peer holds live: the shard it trains (not one it cancelled)."""
        t = self.claim
        return (t.job, t.round, t.shard, t.attempt) if t is not None and self.state is TRAINING else None

    @property
    def busy(self) -> bool:
        """The local model is in use, or holds work not yet published."""
        return self.state is not IDLE or bool(self.work.shards)

    def deadlines(self, lease: float) -> list[float]:
        t = self.claim
        renew = [t.renewed_at + lease / 3] if t is not None and self.state is TRAINING else []
        return [*renew, self.retry_at]

    def deadline_key(self) -> object:
        t = self.claim
        return self.state, t and (t.job, t.round, t.shard, t.attempt, t.renewed_at), self.retry_at

    # -- what the machine does -------------------------------------------------------------

    def cancel(self, keep: tuple[str, int] | None) -> list[Effect]:
        """Stop the shard in training unless it is of (job, round) ``keep``."""
        t = self.claim
        if t is None or self.state is not TRAINING or (t.job, t.round) == keep:
            return []
        self._go("cancel")
        return [Cancel(t.job, t.round, t.shard)]

    def renew(self, lease: float, now: float) -> list[Effect | Sign]:
        """Renew the claim in training once a third of its lease has passed."""
        t = self.claim
        if t is None or self.state is not TRAINING or now < t.renewed_at + lease / 3:
            return []
        t.n += 1
        t.renewed_at = now
        return [self._claim_record(t)]

    def new_work(self, job: str, rnd: int, base: str) -> bool:
        """Start this peer's work on round ``rnd`` (trained on ``base``). True when it moves
        on to a later round or another job: older rounds' leases no longer matter."""
        older = self.work.job != job or self.work.round < rnd
        self.work = RoundWork(job, rnd, base)
        return older

    def round_train(self, job: JobSpec, rnd: int, base: str, done: set[int], now: float,
                    leases: LeaseTable, records: RecordSet, inner_steps: int, first_step: int,
                    ahead: str | None = None) -> tuple[list[Effect | Sign], bool]:
        """Train in round ``rnd`` (``work``): renew or stop the shard in training, else
        claim the next shard (or back a straggler up), else publish what was trained.
        ``inner_steps`` is the round's size and ``first_step`` its first global inner step
        (``_cadence.Plan``); ``ahead``: see ``Train``. Returns the effects and whether there
        was nothing to do at all."""
        out: list[Effect | Sign] = []
        if self.uploading:  # shards whose delta is on its way count as done for this peer
            done = done | {s for j, r, s in self.uploading if (j, r) == (job.id, rnd)}
        t = self.claim
        members = records.members
        if t is not None:
            # A backup copy stops only when the shard is covered; an owner's claim also
            # when another claim wins the shard (a higher attempt, or a lower node id).
            lost = not t.backup and leases.owner(job, rnd, t.shard, now, members, self.own()) != leases.me
            if self.state is TRAINING and (t.shard in done or lost):
                out += self.cancel(None)
            else:
                out += self.renew(job.lease, now)
            return out, False
        if self.state is PUBLISHING or self.stopping or now < self.retry_at:
            return out, False
        w = self.work
        if records.highest_closed_round(job.id) >= rnd:
            # Some branch is longer than ours: we are catching up (just joined, restarted,
            # or missing contributions a close names). Training this round would be wasted.
            return out, not w.shards
        if job.mode.publishes_each_unit and w.shards:
            # Ensemble: a shard is a member and its contribution is the member's checkpoint,
            # published after every unit, so whoever trains the member next continues it.
            return [self._publish(job, rnd, base, tuple(w.shards), now)], False
        shard = leases.free_shard(job, rnd, done | set(w.shards), now, members, sharers_of(records, job.id))
        backup = False
        if shard is None and not w.shards and job.steal:
            sized = replace(job, inner_steps=inner_steps)  # the round's own size, for the projections
            shard, backup = leases.straggler(sized, rnd, done, now, members, self.rate), True
        if shard is not None:
            attempt = leases.next_attempt(job.id, rnd, shard) - (1 if backup else 0)
            self.claim = Training(job.id, rnd, shard, attempt, 0, now, backup=backup, rate=self.rate)
            self._go("train")
            return [self._claim_record(self.claim), Train(job, rnd, shard, attempt, base, fresh=not w.shards,
                                                          inner_steps=inner_steps, first_step=first_step,
                                                          ahead=ahead)], False
        if w.shards:
            return [self._publish(job, rnd, base, tuple(sorted(w.shards)), now)], False
        return out, True

    def _publish(self, job: JobSpec, rnd: int, base: str, shards: tuple[int, ...], now: float) -> PublishDelta:
        self.publishing = (job.id, rnd, shards)
        self.sent_at.setdefault((job.id, rnd), now)
        self._go("publish")
        self.publish_seconds[(job.id, rnd, shards)] = (self.work.seconds, now)
        return PublishDelta(job, rnd, base, shards, self.work.samples)

    def _claim_record(self, t: Training) -> Sign:
        return Sign("claim", {
            "job": t.job, "round": t.round, "shard": t.shard, "attempt": t.attempt, "n": t.n,
            "done": t.done, "rate": round(t.rate, 3), "backup": t.backup,
        })

    def _release_record(self, t: Training) -> Sign:
        return Sign("release", {"job": t.job, "round": t.round, "shard": t.shard, "attempt": t.attempt})

    def release(self) -> list[Effect | Sign]:
        """This peer is shutting down: stop training, release its claim, claim no more."""
        self.stopping = True
        t = self.claim
        if t is None or self.state is not TRAINING:
            return []
        return [*self.cancel(None), self._release_record(t)]

    def synced(self, job: str, closed: int, now: float, covered_at: Callable[[str, int], float | None]) -> None:
        """This peer holds the job's state after ``closed`` closed rounds: the rounds it
        uploaded a delta for before that are synced. A round's sync is its upload's time
        plus the time from the round covered (as this peer saw it; ``covered_at``) to now;
        the latest such figure is the one its next contribution carries."""
        for key in sorted(k for k in self.uploaded if k[0] == job and k[1] < closed):
            sent, done = self.sent_at.pop(key, None), self.uploaded.pop(key)
            seen = covered_at(*key)
            upload = 0.0 if sent is None else max(0.0, done - sent)
            self.last_sync[job] = upload + max(0.0, now - (done if seen is None else max(seen, done)))

    # -- the driver's reports --------------------------------------------------------------

    def progress(self, job: str, rnd: int, shard: int, done: int, rate: float) -> None:
        t = self.claim
        if t is not None and (t.job, t.round, t.shard) == (job, rnd, shard):
            t.done = done
            if rate > 0:
                t.rate = rate

    def trained(self, job: str, rnd: int, shard: int, samples: int, now: float, *, batches: int = 0,
                seconds: float = 0.0, failed: bool = False) -> None:
        """A ``Train`` ended (``samples`` trained; 0: stopped before one batch), or could
        not run (``failed``: wait a little before claiming again)."""
        t, cancelled = self.claim, self.state is CANCELLING
        if t is not None:
            self._go("trained")
        self.claim = None
        if failed:
            self.retry_at = now + RETRY_AFTER
        if batches > 0 and seconds > 0:
            measured = batches / seconds
            self.rate = measured if self.rate <= 0 else 0.7 * self.rate + 0.3 * measured
        if t is not None and (t.job, t.round, t.shard) == (job, rnd, shard) and samples > 0:
            if (self.work.job, self.work.round) == (job, rnd) and not cancelled:
                self.work.shards.append(shard)
                self.work.samples += samples
                self.work.seconds += seconds
            elif cancelled:
                self.wasted_batches += batches or 1

    def encoded(self, job: str, rnd: int, base: str, shards: tuple[int, ...]) -> bool:
        """The delta of ``shards`` is out of the local model and uploading; False if that is
        not the publish in flight (nothing changes)."""
        if self.publishing != (job, rnd, tuple(shards)):
            return False
        self.publishing = None
        self._go("encoded")
        self.uploading |= {(job, rnd, s) for s in shards}
        if (self.work.job, self.work.round, self.work.base) == (job, rnd, base):
            self.work.shards, self.work.samples, self.work.seconds = [], 0, 0.0
        return True

    def published(self, job: str, rnd: int, base: str, shards: tuple[int, ...], samples: int,
                  now: float, *, ok: bool) -> tuple[float, float]:
        """The upload of a delta ended: ``ok``, or given up (those shards train again).
        Returns the seconds its shards trained (the contribution's ``work_s``) and the
        seconds since its publish began (``up_s``: encoding, sealing and the upload)."""
        if self.publishing == (job, rnd, tuple(shards)):
            self.publishing = None
            self._go("published")
        self.uploading -= {(job, rnd, s) for s in shards}
        seconds, began = self.publish_seconds.pop((job, rnd, tuple(shards)), (0.0, now))
        if ok:
            self.uploaded[(job, rnd)] = now
        if not ok:
            self.retry_at = now + RETRY_AFTER
            return 0.0, 0.0
        w = self.work
        if (w.job, w.round, w.base) == (job, rnd, base) and set(shards) <= set(w.shards):
            # Not released by ``encoded``: the published shards leave the work now.
            w.shards, w.samples = [x for x in w.shards if x not in shards], max(0, w.samples - samples)
            if not w.shards:
                w.seconds = 0.0
        return seconds, max(0.0, now - began)

    def lost(self, job: str) -> None:
        """The driver lost the local model: its unpublished shards are gone."""
        if self.work.job == job:
            self.work.shards, self.work.samples = [], 0
        if self.publishing is not None and self.publishing[0] == job:
            self.publishing = None
            self._go("lost")

    def failed(self, job: str) -> list[Effect | Sign]:
        """The job's task failed here: drop what the model does for it; release a claim
        that still trains, so others need not wait for its lease."""
        out: list[Effect | Sign] = []
        t = self.claim
        if t is not None and t.job == job:
            if self.state is TRAINING:
                out.append(self._release_record(t))
            self._go("failed")
            self.claim = None
        if self.publishing is not None and self.publishing[0] == job:
            self.publishing = None
            self._go("failed")
        if self.work.job == job:
            self.work = RoundWork()
        self.uploading = {k for k in self.uploading if k[0] != job}
        self.sent_at = {k: t for k, t in self.sent_at.items() if k[0] != job}
        self.uploaded = {k: t for k, t in self.uploaded.items() if k[0] != job}
        self.publish_seconds = {k: t for k, t in self.publish_seconds.items() if k[0] != job}
        return out
