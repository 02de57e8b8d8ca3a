"""Anti-entropy: the digest this peer broadcasts and the answers it gives to others'.

Theory of operation. It holds an index of the records worth comparing, by id prefix;
the claims and releases of each open round (dropped from the index once the round has
closed: they change nothing any more, and they are most records); when each peer was
last heard from; and the time of the next digest. Every ``digest_interval`` it
broadcasts a digest of the index (that is this peer's heartbeat); to a peer's digest it
answers with the records it holds that the digest lacks, but not every holder at once.

Most records a digest lacks are on their way: made a moment ago, their broadcast has not
reached the digest's sender yet. If every holder answered, each would arrive up to n - 1
more times (measured at 16 peers: twice the bytes of the records themselves), and a peer
that joins late would get the whole history n - 1 times. So each missing record has
``ANSWERERS`` designated answerers for each sender: the peers that follow a point drawn
from the record's id and the sender in the sorted ring of live peers (heard from within
``LIVE_DIGESTS`` digest intervals, this one and not the sender), as this peer sees it.
They answer at once, and at every digest it is still missing from. Each
``FALLBACK_DIGESTS`` intervals that it stays missing from that sender's digests, the
answerers double (the next ones in the ring: the designated ones were dead, lacked it,
or their answers were lost), until every holder answers; doubling rather than all at
once, so a late joiner still downloading a long history is not sent it n - 1 times
after a few seconds. A view of the live peers that differs from another's costs a
duplicate or a delay, never a record.

It also keeps which peers sent a packed payload (``_gossip.pack``): those read them. An
answer to such a peer goes packed; a broadcast (a digest, a new record) goes packed once
every live peer is one of them, and every other digest goes packed anyway: the probe
from which the others learn that this peer reads them. A peer of a version before
packing drops what it cannot read and so misses only those probes, and sends none.

What it promises: every record admitted into the index is offered to any peer whose
digest lacks it, until its round closes: by its designated answerers at once, by more
holders the longer it stays missing and by all of them within a few digest intervals
(log2 of the pool's size over two, ``FALLBACK_DIGESTS`` each), so loss and reordering
heal within a digest or a few (I1).
What breaks it: a caller that admits a record to the index that the record set refused,
or that never passes the jobs' current rounds (the index would only grow).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

from ttpeer_wire import Record

from . import _gossip
from ._effects import Broadcast, Send

# What ``AntiEntropy.traffic`` counts, payload bytes: digests sent and received, records
# broadcast as they were made, records sent in answer to a digest, and records received,
# new here or already held (a copy that crossed in flight, or one answer of several).
GOSSIP_TRAFFIC = ("digests_out", "digests_in", "records_out", "answers_out", "records_in_new", "records_in_held")
ANSWERERS = 2  # holders that answer a digest's lack of a record at once (see above)
LIVE_DIGESTS = 3  # a peer heard from within this many digest intervals is live, for the ring
FALLBACK_DIGESTS = 2  # the answerers double each time a record stays missing this many intervals


class AntiEntropy:
    def __init__(self, digest_interval: float, now: float, me: str) -> None:
        self.interval = digest_interval
        self.me = me
        self.heard: dict[str, float] = {}  # when each peer last sent us anything
        self.next_digest = now
        self._digests = 0
        self._index: dict[str, Record] = {}  # id prefix -> record, see ``_gossiped``
        self._open_claims: dict[tuple[str, int], list[Record]] = {}  # (job, round) -> claims, releases
        # Gossip payload bytes by what they carried (``GOSSIP_TRAFFIC``), before sealing: what
        # ``ttpeer status`` and scripts/bench/exchange show of the control traffic.
        self.traffic: Counter[str] = Counter()
        # sender -> id prefix -> when this peer first saw it missing from that sender's
        # digests (records it holds and did not answer at once)
        self._missing: dict[str, dict[str, float]] = {}
        self.packs: set[str] = set()  # peers that sent a packed payload: they read them (``_gossip.pack``)

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
        payload = _gossip.digest_payload(self._gossiped(rounds).keys(), self._digests)
        if self._digests % _gossip.PROBE_EVERY == 1 or self._all_pack(now):
            payload = _gossip.pack(payload)  # the probe: how the others learn this peer reads them
        self.traffic["digests_out"] += len(payload)
        return [Broadcast(payload)]

    def broadcast(self, raws: Iterable[bytes], now: float) -> list[Broadcast]:
        """New records to broadcast, packed when every live peer reads packed payloads."""
        pack = self._all_pack(now)
        out = [Broadcast(_gossip.pack(p) if pack else p) for p in _gossip.records_payloads(raws)]
        self.traffic["records_out"] += sum(len(b.payload) for b in out)
        return out

    def _all_pack(self, now: float) -> bool:
        live = self._live(now)
        return bool(live) and live <= self.packs

    def answer(self, sender: str, digest: tuple[set[str], int, int], rounds: dict[str, int],
               now: float = 0.0) -> list[Send]:
        """The records ``sender``'s digest lacks that this peer answers now (as one of their
        designated answerers, doubled for each ``FALLBACK_DIGESTS`` intervals a record has
        been missing), in as few payloads as fit."""
        if sender == self.me:
            return []  # its own digest, echoed back by a relay
        prefixes, lo, hi = digest
        held = self._gossiped(rounds)
        missing = held.keys() - prefixes  # set arithmetic in C: digests arrive often
        whole = (lo, hi) == (0, _gossip.WINDOW_SPAN)
        if not whole:
            missing = {p for p in missing if _gossip.in_window(p, lo, hi)}
        seen = self._missing.setdefault(sender, {})
        for p in [p for p in seen if p not in missing and (whole or _gossip.in_window(p, lo, hi))]:
            del seen[p]  # it came, or left the index
        ring = self._ring(sender, now)
        at = ring.index(self.me)
        mine = []
        for p in sorted(missing):
            waited = int((now - seen.setdefault(p, now)) // (FALLBACK_DIGESTS * self.interval))
            if _designated(p, sender, len(ring), at, ANSWERERS << min(waited, 20)):
                mine.append(held[p].raw)
        payloads = _gossip.records_payloads(mine)
        out = [Send(sender, _gossip.pack(p) if sender in self.packs else p) for p in payloads]
        self.traffic["answers_out"] += sum(len(s.payload) for s in out)
        return out

    def _ring(self, sender: str, now: float) -> list[str]:
        """The live peers as this peer sees them, sorted: itself, and those heard from
        within ``LIVE_DIGESTS`` intervals, less ``sender``."""
        return sorted((self._live(now) | {self.me}) - {sender})

    def _live(self, now: float) -> set[str]:
        """The peers heard from within ``LIVE_DIGESTS`` intervals."""
        return {p for p, t in self.heard.items() if now - t <= LIVE_DIGESTS * self.interval}

    def _gossiped(self, rounds: dict[str, int]) -> dict[str, Record]:
        """Records worth comparing, by id prefix: claims and releases of rounds that have
        closed change nothing any more."""
        for key in [k for k in self._open_claims if k[1] < rounds.get(k[0], 0)]:
            for r in self._open_claims.pop(key):
                self._index.pop(r.id[: _gossip.ID_PREFIX], None)
        return self._index


def _designated(prefix: str, sender: str, size: int, at: int, count: int) -> bool:
    """Whether the peer at place ``at`` of a ring of ``size`` is one of the ``count`` that
    follow the point drawn from ``prefix`` and ``sender``."""
    if size <= count:
        return True
    start = int.from_bytes(hashlib.sha256(f"{prefix}:{sender}".encode()).digest()[:8], "big") % size
    return (at - start) % size < count

