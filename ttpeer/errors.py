"""One exception tree for everything a ttpeer user can meet.

    TtpeerError                      (ttpeer.proto: the root, shared with the relay)
     +-- RecordError                 a record is malformed, forged or tampered with
     +-- ProofError                  a membership proof does not chain to the pool root
     +-- TokenError                  a join token is malformed, expired or for a fake pool
     +-- SealError                   sealed bytes do not authenticate
     +-- UsageError                  a command was given something it cannot use
     |    +-- ConfigError            a setting (file, environment, flag) is invalid (ttpeer.config)
     +-- ServiceError                installing or removing the systemd unit failed (ttpeer.daemon._units)
     +-- HomeError                   the home directory is missing, not enrolled, or locked
     +-- DiskError                   a write failed (disk full, read-only); nothing written is lost
     +-- DaemonNotRunning            a command needs the running daemon and found none
     +-- MembershipEnded             this machine was revoked or lost its token's race (exit 3)
     +-- JobError                    a job failed, was declined, or is unknown
     +-- NetError                    anything between this machine and the relay
          +-- (see ttpeer.net)

Foreign exceptions (OSError, httpx, ssl) are translated where they cross into
ttpeer code; the command line prints ``error: <message>`` and exits non-zero.
"""

from __future__ import annotations

from pathlib import Path

from ttpeer.proto import ProofError, RecordError, TokenError, TtpeerError


class UsageError(TtpeerError):
    """A command was given something it cannot use (bad flag value, unknown job)."""


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
    was revoked, or its token enrolled another machine first. Final, so the daemon exits
    with ``exit_code`` (3), which the systemd unit does not restart."""

    exit_code = 3


class JobError(TtpeerError):
    """A job failed, timed out, was declined, or is not known to this peer."""


class StateMissing(JobError):
    """A state the protocol counted as held is not on this peer's disk: states are named
    by their hash, so two jobs can share one, and each job keeps only its newest few."""

    def __init__(self, state: str) -> None:
        super().__init__(f"state {state[:19]} is not on this peer")
        self.state = state


__all__ = [
    "DaemonNotRunning",
    "DiskError",
    "HomeError",
    "JobError",
    "MembershipEnded",
    "StateMissing",
    "ProofError",
    "RecordError",
    "TokenError",
    "TtpeerError",
    "UsageError",
]
