"""One exception tree for everything a ttpeer user can meet.

    TtpeerError                      (ttpeer_wire: the root, shared with the relay)
     +-- RecordError                 a record is malformed, forged or tampered with
     +-- ProofError                  a membership proof does not chain to the pool root
     +-- TokenError                  a join token is malformed, expired or for a fake pool
     +-- SealError                   sealed bytes do not authenticate
     +-- UsageError                  a command was given something it cannot use
     |    +-- ConfigError            a setting (file, environment, flag) is invalid (ttpeer.config)
     |    +-- DataError              'ttpeer data': a path that cannot be added, an unknown dataset
     +-- ServiceError                installing or removing the systemd unit failed (ttpeer.daemon.service._units)
     +-- HomeError                   the home directory is missing, not enrolled, or locked
     +-- DiskError                   a write failed (disk full, read-only); nothing written is lost
     +-- DaemonNotRunning            a command needs the running daemon and found none
     +-- MembershipEnded             this machine was revoked, or its token went to others (exit 3)
     +-- JobError                    a job failed, was declined, or is unknown
     |    +-- StateMissing           a state counted as held is not on disk
     |    +-- TaskFailed             the task's code (or torch under it) failed on this peer: the job ends here
     |    +-- LocalWorkLost          the worker holding this peer's local model died
     +-- TrainError                  the training layer refuses or cannot do something (ttpeer.train)
     +-- DatasetMissing              a task asked for a dataset this peer does not hold (yet): fetched
     +-- NetError                    anything between this machine and the relay
          +-- (see ttpeer.net)

Foreign exceptions (OSError, httpx, ssl) are translated where they cross into
ttpeer code; the command line prints ``error: <message>`` and exits non-zero.
"""

from __future__ import annotations

from pathlib import Path

# From the wire, not ttpeer.proto: the client commands import this module and no protocol.
from ttpeer_wire import ProofError, RecordError, TokenError, TtpeerError


class UsageError(TtpeerError):
    """A command was given something it cannot use (bad flag value, unknown job)."""


class DataError(UsageError):
    """``ttpeer data add`` met a path it cannot add (missing, empty, unreadable, changed while
    read), or a dataset command named no dataset this pool knows."""


class HomeError(TtpeerError):
    """The ttpeer home directory is missing, not enrolled in a pool, or in use."""


class DiskError(TtpeerError):
    """Writing to disk failed (full, read-only). What was already written is intact."""

    def __init__(self, path: Path, exc: OSError) -> None:
        hint = " (the disk is full: free some space and run again)" if exc.errno == 28 else ""
        super().__init__(f"could not write {path}: {exc.strerror or exc}{hint}")
        self.path = path


class DaemonNotRunning(TtpeerError):
    """A command needs the running daemon (``ttpeer up``) and none answers."""


class MembershipEnded(TtpeerError):
    """The records say this machine is no member of its pool and never will be again: it
    was revoked, or its token was used up by other machines. Final, so the daemon exits
    with ``exit_code`` (3), which the systemd unit does not restart."""

    exit_code = 3


class JobError(TtpeerError):
    """A job failed, timed out, was declined, or is not known to this peer."""


class TaskFailed(JobError):
    """Raised out of an executor when the task's code, or torch running it, failed on this
    peer: the job ends here (this peer sits it out with ``reason``), never the daemon.

    ``reason`` is one line a user can act on, naming the task file and line when the
    failure is in their code (``my_task.py:31 in loss: RuntimeError: boom``). It is the
    only state, a plain string, so the error crosses a process boundary as it is."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __reduce__(self) -> tuple[type[TaskFailed], tuple[str]]:
        return (TaskFailed, (self.reason,))


class StateMissing(JobError):
    """A state the protocol counted as held is not on this peer's disk: states are named
    by their hash, so two jobs can share one, and each job keeps only its newest few."""

    def __init__(self, state: str) -> None:
        super().__init__(f"state {state[:19]} is not on this peer")
        self.state = state


class LocalWorkLost(JobError):
    """The worker process that held this peer's local model (the shards it trained this
    round and has not published) died and was restarted: that work must be trained again."""

    def __init__(self, job: str, reason: str) -> None:
        super().__init__(reason)
        self.job = job


__all__ = [
    "DaemonNotRunning",
    "DataError",
    "DiskError",
    "HomeError",
    "JobError",
    "LocalWorkLost",
    "MembershipEnded",
    "StateMissing",
    "TaskFailed",
    "ProofError",
    "RecordError",
    "TokenError",
    "TtpeerError",
    "UsageError",
]
