"""The follower: how this peer reaches the head of a job's canonical chain.

Theory of operation. It holds the model states the driver holds (``held``), the state
the ``Apply`` or ``FetchState`` in flight will make (at most one at a time), the states
this peer's own recomputation of a close did not reproduce, and its own retry time after
a sync that could not run or did not hash (it delays only the next sync). From the newest
held state on the chain it applies the next close, unless a checkpoint lets it skip
several rounds; holding nothing on the chain, it fetches the newest checkpoint, or the
job's initial state; a close it could not reproduce is fetched as a checkpoint instead.

Checkpoints of a fused job are made only when asked. Before it replays deltas that add
up to more than ``CHECKPOINT_DELTA_RATIO`` checkpoints (a late joiner, a peer back after a
long absence) or after a
close it could not reproduce, it signs a ``ckpt_want`` for the chain's head and waits up to
``ASK_WAIT`` leases for a holder to publish one (``Closer.answers``); if none comes, it
replays the deltas after all (or, for a close it cannot reproduce, waits on).

What it promises: a peer whose chain head moved always ends holding the head (I3: the
close names the state hash, so a state that differs is never counted held) or keeps
trying; it never asks for two syncs at once. What breaks it: a driver that reports a
state held that it does not hold (then ``StateLost`` must follow).
"""

from __future__ import annotations

from collections.abc import Callable

from ttpeer_wire import Record

from ._effects import Apply, Effect, FetchState, Sign
from ._jobspec import JobSpec
from ._ledger import Chain, RecordSet, checkpoints
from ._outer import close_outer
from ._reports import RETRY_AFTER

ASK_WAIT = 3.0  # leases a peer waits for the checkpoint it asked for before it replays instead
# A peer asks for a checkpoint rather than replay deltas that add up to more than this many
# checkpoints (and at least ``ASK_ROUNDS`` rounds): a checkpoint costs the pool its upload
# and the asker's download, and a peer a round or two behind replays.
CHECKPOINT_DELTA_RATIO = 2
ASK_ROUNDS = 3


class Follower:
    def __init__(self, refutes: Callable[[Record], bool] = lambda close: False) -> None:
        # Whether this peer knows a close names a reduced slice that does not reproduce
        # (``Slicer.refutes``): such a close is not applied, as one whose state did not hash.
        self._refutes = refutes
        self.held: set[str] = set()  # states the driver holds
        self._syncing: str | None = None  # target state of the Apply/Fetch in flight
        self._bad_apply: set[str] = set()  # states our own recomputation did not reproduce
        self.retry_at = 0.0
        self._asked: dict[str, tuple[str, float]] = {}  # job -> (state asked for, wait until)
        self._bad_ckpt: set[str] = set()  # checkpoints that did not fetch or import: replayed past

    def deadlines(self) -> list[float]:
        return [self.retry_at, *(until for _s, until in self._asked.values())]

    def deadline_key(self) -> object:
        return self.retry_at, tuple(self._asked.values())

    def sync(self, job: JobSpec, chain: Chain, records: RecordSet, now: float) -> list[Effect | Sign]:
        if self._syncing is not None or now < self.retry_at:
            return []
        states = chain.states
        ckpts = checkpoints(records, job.record)
        held = max((k for k, s in enumerate(states) if s in self.held), default=None)
        ckpt = max((k for k, s in enumerate(states) if k > 0 and s in ckpts and s not in self._bad_ckpt),
                   default=None)
        if held is not None and held < len(chain.closes) and self._refutes(chain.closes[held]):
            self._bad_apply.add(states[held + 1])
        bad = held is not None and states[held + 1] in self._bad_apply
        if ckpt is not None and (held is None or ckpt > held + 1 or (bad and ckpt > held)):
            self._syncing = states[ckpt]  # a checkpoint skips rounds (asked for or not)
            return [FetchState(job, states[ckpt], ckpts[states[ckpt]]["blob"])]
        if bad or (job.mode.weighs_replay and self._replay_costs_more(job, chain, records, held)):
            ask = self._ask(job, chain, now, bad=bad)
            if ask is not None:
                return ask
        if held is not None and not bad:
            close = chain.closes[held]
            parts = tuple(records.by_id[c] for c in close["contribs"])
            slices = tuple(records.by_id[s] for s in close.body.get("slices", ()))
            self._syncing = states[held + 1]
            return [Apply(job, close, parts, slices, close_outer(close))]
        if held is None:
            self._syncing = job.init
            return [FetchState(job, job.init, job.init_blob)]
        self.retry_at = now + RETRY_AFTER  # our recomputation failed; wait for a checkpoint
        return []

    def _ask(self, job: JobSpec, chain: Chain, now: float, *, bad: bool) -> list[Effect | Sign] | None:
        """Ask for a checkpoint of the head and wait for it: the ask to sign, or ``[]`` while
        an ask waits; None when the caller goes on without (it replays the deltas). A peer
        that could replay asks once a job: an ask nobody answered in ``ASK_WAIT`` leases
        means no holder is there to answer the next. One that cannot (``bad``: a close it
        did not reproduce) asks again for each new head."""
        asked = self._asked.get(job.id)
        if asked is not None and now < asked[1]:
            return []
        if asked is not None and (not bad or asked[0] == chain.head):
            return None
        self._asked[job.id] = (chain.head, now + ASK_WAIT * job.lease)
        return [Sign("ckpt_want", {"job": job.id, "state": chain.head})]

    @staticmethod
    def _replay_costs_more(job: JobSpec, chain: Chain, records: RecordSet, held: int | None) -> bool:
        """Whether the deltas from the newest held state (or the initial one) to the head
        add up to more than ``CHECKPOINT_DELTA_RATIO`` checkpoints, over ``ASK_ROUNDS``
        rounds or more: a checkpoint's size the largest known, else the fp32 parameters and
        momentum estimated from the largest delta and the job's bits."""
        if len(chain.closes) - (held or 0) < ASK_ROUNDS:
            return False  # a round or two to go: replaying them is what every peer does
        by_id = records.by_id
        sizes = [by_id[c]["size"] for close in chain.closes[held or 0:] for c in close["contribs"] if c in by_id]
        if not sizes:
            return False
        ckpt = max((c["size"] for c in records.of_job(job.id, "ckpt")), default=0)
        return sum(sizes) > CHECKPOINT_DELTA_RATIO * (ckpt or max(sizes) * 64 // job.bits)

    def applied(self, target: str, ok: bool, now: float) -> None:
        self._syncing = None
        if ok:
            self.held.add(target)
        else:
            self._bad_apply.add(target)
            self.retry_at = now + RETRY_AFTER

    def fetched(self, state: str, ok: bool, now: float) -> None:
        self._syncing = None
        if ok:
            self.held.add(state)
        else:  # a checkpoint that does not import is not fetched again (nobody makes another)
            self._bad_ckpt.add(state)
            self.retry_at = now + RETRY_AFTER

    def failed(self, now: float) -> None:
        """An ``Apply`` or ``FetchState`` could not run (a blob is not reachable yet)."""
        self._syncing = None
        self.retry_at = now + RETRY_AFTER

    def drop(self) -> None:
        """The sync in flight is of a job that ended here: its report changes nothing."""
        self._syncing = None
