"""The follower: how this peer reaches the head of a job's canonical chain.

Theory of operation. It holds the model states the driver holds (``held``), the state
the ``Apply`` or ``FetchState`` in flight will make (at most one at a time), the states
this peer's own recomputation of a close did not reproduce, and its own retry time after
a sync that could not run or did not hash (it delays only the next sync). From the newest
held state on the chain it applies the next close, unless a checkpoint lets it skip
several rounds; holding nothing on the chain, it fetches the newest checkpoint, or the
job's initial state; a close it could not reproduce is fetched as a checkpoint instead.

What it promises: a peer whose chain head moved always ends holding the head (I3: the
close names the state hash, so a state that differs is never counted held) or keeps
trying; it never asks for two syncs at once. What breaks it: a driver that reports a
state held that it does not hold (then ``StateLost`` must follow).
"""

from __future__ import annotations

from ._effects import Apply, Effect, FetchState
from ._jobspec import JobSpec
from ._ledger import Chain, RecordSet, checkpoints
from ._reports import RETRY_AFTER


class Follower:
    def __init__(self) -> None:
        self.held: set[str] = set()  # states the driver holds
        self._syncing: str | None = None  # target state of the Apply/Fetch in flight
        self._bad_apply: set[str] = set()  # states our own recomputation did not reproduce
        self.retry_at = 0.0

    def sync(self, job: JobSpec, chain: Chain, records: RecordSet, now: float) -> list[Effect]:
        if self._syncing is not None or now < self.retry_at:
            return []
        states = chain.states
        ckpts = checkpoints(records, job.record)
        held = max((k for k, s in enumerate(states) if s in self.held), default=None)
        ckpt = max((k for k, s in enumerate(states) if k > 0 and s in ckpts), default=None)
        if held is not None and states[held + 1] not in self._bad_apply:
            # Apply the next close, unless a checkpoint lets us skip several rounds.
            if ckpt is None or ckpt <= held + 1:
                close = chain.closes[held]
                parts = tuple(records.by_id[c] for c in close["contribs"])
                self._syncing = states[held + 1]
                return [Apply(job.record, close, parts)]
        if ckpt is not None and (held is None or ckpt > held):
            self._syncing = states[ckpt]
            return [FetchState(job.record, states[ckpt], ckpts[states[ckpt]]["blob"])]
        if held is None:
            self._syncing = job.init
            return [FetchState(job.record, job.init, job.init_blob)]
        self.retry_at = now + RETRY_AFTER  # our recomputation failed; wait for a checkpoint
        return []

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
        else:
            self.retry_at = now + RETRY_AFTER

    def failed(self, now: float) -> None:
        """An ``Apply`` or ``FetchState`` could not run (a blob is not reachable yet)."""
        self._syncing = None
        self.retry_at = now + RETRY_AFTER

    def drop(self) -> None:
        """The sync in flight is of a job that ended here: its report changes nothing."""
        self._syncing = None
