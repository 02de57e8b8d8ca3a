"""Views the peer machine reads on every step, cached until the records they rest on move.

Theory of operation. It holds nothing of its own but two memos over the record set: the
canonical chain of each job (``canonical_chain``), kept while the job's ledger version
and the membership stay the same, and each round's contributions with their canonical
cover and the shards they cover, kept while that round's contribution count, its base
and the members stay the same. What it promises: every answer equals the pure function
of the records it caches (``_ledger``), so caching changes no decision. What breaks it:
a change to the records that bumps neither ``RecordSet.versions`` nor the membership
(``RecordSet.add`` bumps them for every kind that can move a chain).
"""

from __future__ import annotations

from ttpeer_wire import Record

from ._cadence import Plan
from ._jobspec import JobSpec
from ._ledger import Chain, RecordSet, canonical_chain, contributions, covered, select_cover


class Views:
    def __init__(self, records: RecordSet) -> None:
        self.records = records
        self._chains: dict[str, tuple[tuple[int, int], Chain]] = {}
        self._plans: dict[str, tuple[Chain, Plan]] = {}
        self._contribs: dict[tuple[str, int], tuple] = {}

    def chain(self, job: Record) -> Chain:
        version = (self.records.versions[job.id], self.records.membership_version)
        cached = self._chains.get(job.id)
        if cached is None or cached[0] != version:
            cached = (version, canonical_chain(self.records, job))
            self._chains[job.id] = cached
        return cached[1]

    def plan(self, job: Record) -> Plan:
        """The job's rounds as its canonical chain fixes them (``_cadence.Plan``)."""
        chain = self.chain(job)
        cached = self._plans.get(job.id)
        if cached is None or cached[0] is not chain:
            cached = self._plans[job.id] = (chain, Plan.of(job, chain.closes))
        return cached[1]

    def rounds(self) -> dict[str, int]:
        """Each job's current round (the length of its chain)."""
        return {job.id: self.chain(job).round for job in self.records.jobs()}

    def round_contribs(self, job: JobSpec, rnd: int, base: str) -> tuple[list[Record], list[Record] | None, set[int]]:
        """The round's contributions, its cover and the shards covered. The machine steps
        on every batch of messages; these change only when a contribution arrives or the
        members change, so they are kept until then."""
        members = self.records.members
        key = (base, len(self.records.in_round_all(job.id, "contrib", rnd)))
        memo = self._contribs.get((job.id, rnd))
        if memo is None or memo[0] != key or memo[1] is not members:
            if len(self._contribs) > 8:
                self._contribs.clear()
            contribs = contributions(self.records, job.record, rnd, base)
            memo = self._contribs[(job.id, rnd)] = (
                key, members, contribs, select_cover(job.record, contribs), covered(contribs))
        return memo[2], memo[3], memo[4]
