"""The job lifecycle on this peer: which job it works on, prepared, declined or done.

Theory of operation. It holds, per job, whether the driver was asked to prepare it and
its answer; the reasons of the jobs this peer declined; and the final state it reported
for each job it finished. The active job is the first job (in the records' order) that
this peer has not declined, that has not ended for the pool (``_outcome.job_ended``:
cancelled, or failed everywhere), and that it has not finished on the chain's current
head (a job that finished on the losing side of a partition is active again, to repair).
A finished job that this peer joined the pool after, and took no part in, is skipped:
there is nothing of it here to finish, and loading its task would only cost memory
(``skipped``; a peer that trained it exports it).

What it promises: a job is prepared once; a decline is signed once per job, and a
decline "for good" (its task's code failed here) is read back from the records on
restart, so a restarted peer does not prepare it again (no crash loop); ``JobDone`` is
emitted once per final state. It returns decline bodies; the machine signs them. What
breaks it: a driver that reports a job it was not asked to prepare.
"""

from __future__ import annotations

from ttpeer_wire import Record

from ._effects import Effect, JobDone, PrepareJob
from ._jobspec import JobSpec
from ._ledger import RecordSet
from ._outcome import failed_here, job_ended, joined_after
from ._views import Views


class Lifecycle:
    def __init__(self, me: str) -> None:
        self.me = me
        self.prepared: dict[str, bool | None] = {}  # None = asked, not answered
        self.declined: dict[str, str] = {}
        self.done_jobs: dict[str, str] = {}  # job -> the final state reported
        self.skipped: set[str] = set()  # jobs that had finished before this peer took part

    def load(self, records: RecordSet) -> None:
        """Jobs whose task failed here before stay declined."""
        for job in records.jobs():
            failed = failed_here(records, job, self.me)
            if failed is not None:
                self.prepared[job.id] = False
                self.declined[job.id] = failed["reason"]

    def active(self, records: RecordSet, views: Views) -> Record | None:
        for job in records.jobs():
            if self.prepared.get(job.id) is False:
                continue
            if job_ended(records, job) is not None:
                continue  # cancelled, or failed for the whole pool: nobody works on it
            # A finished job becomes active again if the chain moved away from the state
            # it finished on (it ended on the losing side of a partition): repair it.
            if job.id in self.done_jobs and self.done_jobs[job.id] == views.chain(job).head:
                continue
            if job.id in self.skipped:
                continue
            if job.id not in self.done_jobs and views.plan(job).finished(views.chain(job).round) and \
                    joined_after(records, job, self.me):
                self.skipped.add(job.id)
                continue
            return job
        return None

    def prepare(self, job: JobSpec) -> list[Effect] | None:
        """None once ``job`` is prepared here; until then, what to do (ask, or wait)."""
        if job.id not in self.prepared:
            self.prepared[job.id] = None
            return [PrepareJob(job)]
        if self.prepared[job.id] is None:
            return []
        return None

    def finish(self, job: JobSpec, head: str) -> JobDone:
        self.done_jobs[job.id] = head
        return JobDone(job, head)

    def answered(self, job: str, ok: bool, reason: str, records: RecordSet, *, need: int = 0, have: int = 0,
                 code: str = "") -> dict | None:
        """The driver's answer to ``PrepareJob``; the decline's body to sign, if any: it is
        published once, so the pool sees who sits the job out and why. Nobody waits for a
        decliner, since only contributions' authors close rounds and leases requeue work."""
        self.prepared[job] = ok
        if ok:
            return None
        self.declined[job] = reason
        if any(r.author == self.me for r in records.of_job(job, "decline")):
            return None
        body = {"job": job, "reason": reason[:1000], "need": min(need, 2**53), "have": min(have, 2**53)}
        return {**body, "code": code} if code else body

    def failed(self, job: str, reason: str, records: RecordSet) -> dict | None:
        """The task failed here: sit the job out for good; the decline's body, once."""
        self.prepared[job] = False
        self.declined[job] = reason
        rec = records.by_id.get(job)
        if rec is None or failed_here(records, rec, self.me) is not None:
            return None
        return {"job": job, "reason": reason[:1000], "need": 0, "have": 0, "code": "failed"}
