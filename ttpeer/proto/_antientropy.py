"""Anti-entropy: the digest this peer broadcasts and the answers it gives to others'.

Theory of operation. It holds an index of the records worth comparing, by id prefix;
the claims and releases of each open round (dropped from the index once the round has
closed: they change nothing any more, and they are most records); when each peer was
last heard from; and the time of the next digest. Every ``digest_interval`` it
broadcasts a digest of the index (that is this peer's heartbeat); to a peer's digest it
answers with the records it holds that the digest lacks.

What it promises: every record admitted into the index is offered to any peer whose
digest lacks it, until its round closes, so loss and reordering heal within a digest or
two (I1). What breaks it: a caller that admits a record to the index that the record
set refused, or that never passes the jobs' current rounds (the index would only grow).
"""

from __future__ import annotations

from ttpeer_wire import Record

from . import _gossip
from ._effects import Broadcast, Send


class AntiEntropy:
    def __init__(self, digest_interval: float, now: float) -> None:
        self.interval = digest_interval
        self.heard: dict[str, float] = {}  # when each peer last sent us anything
        self.next_digest = now
        self._digests = 0
        self._index: dict[str, Record] = {}  # id prefix -> record, see ``_gossiped``
        self._open_claims: dict[tuple[str, int], list[Record]] = {}  # (job, round) -> claims, releases

    def admit(self, rec: Record) -> None:
        """A record new to the record set."""
        self._index[rec.id[: _gossip.ID_PREFIX]] = rec
        if rec.kind in ("claim", "release"):
            self._open_claims.setdefault((rec["job"], rec["round"]), []).append(rec)

    def tick(self, now: float, rounds: dict[str, int]) -> list[Broadcast]:
        """The digest, when it is due; ``rounds``: each job's current round."""
        if now < self.next_digest:
            return []
        self.next_digest = now + self.interval
        self._digests += 1
        return [Broadcast(_gossip.digest_payload(self._gossiped(rounds).keys(), self._digests))]

    def answer(self, sender: str, digest: tuple[set[str], int, int], rounds: dict[str, int]) -> list[Send]:
        """The records ``sender``'s digest lacks, in as few payloads as fit."""
        prefixes, lo, hi = digest
        held = self._gossiped(rounds)
        missing = held.keys() - prefixes  # set arithmetic in C: digests arrive often
        whole = (lo, hi) == (0, _gossip.WINDOW_SPAN)
        mine = [held[p].raw for p in missing if whole or _gossip.in_window(p, lo, hi)]
        return [Send(sender, p) for p in _gossip.records_payloads(mine)]

    def _gossiped(self, rounds: dict[str, int]) -> dict[str, Record]:
        """Records worth comparing, by id prefix: claims and releases of rounds that have
        closed change nothing any more."""
        for key in [k for k in self._open_claims if k[1] < rounds.get(k[0], 0)]:
            for r in self._open_claims.pop(key):
                self._index.pop(r.id[: _gossip.ID_PREFIX], None)
        return self._index
