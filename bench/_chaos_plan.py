"""What one chaos run does, drawn from its seed: the pool, the job and the faults.

Pure: ``draw(seed, root=...)`` returns the same ``Plan`` for the same seed on any machine
(faults a machine cannot inject are drawn all the same and then skipped by the runner,
which says so), so ``scripts/chaos --seed S --runs 1`` replays a run exactly as drawn.
Times are seconds after the job was submitted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Every fault the campaign draws from, with what it does (the summary's rows).
KINDS: dict[str, str] = {
    "kill": "SIGKILL a peer's daemon (restarted later, or never)",
    "stop": "SIGSTOP a peer's processes, SIGCONT them later",
    "kill_worker": "SIGKILL a peer's worker process",
    "relay_restart": "SIGKILL a relay, wipe its data (keeping its certificate), start it again",
    "relay_kill": "SIGKILL a relay for good",
    "disk_full": "fill a peer's home (a small tmpfs), free it later",
    "cut": "cut a peer off from both relays (connections reset, or bytes dropped), mend it later",
    "corrupt_blob": "flip bytes of a blob on a relay's disk",
    "revoke": "the admin revokes a peer",
    "join": "a new peer joins mid-job",
    "bad_task": "a task that raises is submitted beside the job",
}
NEEDS_ROOT = {"disk_full": "a tmpfs home needs mount (root)"}


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float  # seconds after submit
    target: int = 0  # a peer's index (0 is the admin) or a relay's
    hold: float | None = None  # seconds until it is undone (restart, SIGCONT, mend, free); None: never
    silent: bool = False  # a cut that drops bytes (a pulled cable) rather than resetting connections

    def describe(self, names: list[str]) -> str:
        who = f"relay{self.target}" if self.kind.startswith("relay") or self.kind == "corrupt_blob" else (
            names[self.target] if self.target < len(names) else f"peer{self.target}")
        if self.kind in ("join", "bad_task"):
            who = ""
        held = "" if self.hold is None else f" for {self.hold:.0f}s"
        if self.kind in ("kill", "relay_kill") and self.hold is None:
            held = " for good"
        return f"{self.kind}{'(' + who + ')' if who else ''}@{self.at:.0f}s{held}{' silently' if self.silent else ''}"


@dataclass(frozen=True)
class Plan:
    seed: int
    peers: int  # at the start, the admin included
    mode: str  # "fused" or "ensemble"
    rounds: int
    inner_steps: int
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    tmpfs_peer: int | None = None  # the peer whose home is a small tmpfs (disk_full's target)

    @property
    def names(self) -> list[str]:
        return [NAMES[i] for i in range(self.peers)] + ["late"]

    def describe(self) -> str:
        return ", ".join(f.describe(self.names) for f in self.faults) or "none"


NAMES = ("alice", "bob", "carol", "dave", "erin")


def draw(seed: int, *, root: bool = True) -> Plan:
    """The run a seed draws: 3-5 peers, a fused (2 in 3) or ensemble job, 1-3 faults.

    ``root`` only chooses whether a home is put on a tmpfs (it needs mount); the faults
    are drawn the same either way."""
    rng = random.Random(f"ttpeer-chaos:{seed}")
    peers = rng.randint(3, 5)
    mode = "fused" if rng.random() < 2 / 3 else "ensemble"
    kinds = rng.sample(sorted(KINDS), rng.randint(1, 3))
    others = list(range(1, peers))  # the admin (0) is never killed for good nor revoked
    rng.shuffle(others)
    gone: set[int] = set()  # peers that will not come back (killed for good, revoked)
    picked: set[int] = set()  # peers a kill, a revoke or a full disk already targets: one each
    faults: list[Fault] = []
    tmpfs = None
    for kind in kinds:
        at = round(rng.uniform(2.0, 14.0), 1)
        if kind in ("kill", "revoke"):
            target = next((p for p in others if p not in picked), None)
            if target is None:
                continue
            picked.add(target)
            hold = None if kind == "revoke" or rng.random() < 0.5 else round(rng.uniform(2.0, 8.0), 1)
            if hold is None:
                gone.add(target)
            faults.append(Fault(kind, at, target, hold))
        elif kind == "disk_full":
            tmpfs = next((p for p in others if p not in picked), None)
            if tmpfs is None:
                continue
            picked.add(tmpfs)
            faults.append(Fault(kind, at, tmpfs, round(rng.uniform(3.0, 8.0), 1)))
        elif kind in ("stop", "cut", "kill_worker"):
            target = rng.randrange(peers)
            hold = None if kind == "kill_worker" else round(rng.uniform(3.0, 10.0), 1)
            faults.append(Fault(kind, at, target, hold))
        elif kind in ("relay_restart", "relay_kill", "corrupt_blob"):
            hold = round(rng.uniform(1.0, 6.0), 1) if kind == "relay_restart" else None
            faults.append(Fault(kind, at, rng.randrange(2), hold))
        else:  # join, bad_task
            faults.append(Fault(kind, at))
    relays = [f for f in faults if f.kind in ("relay_restart", "relay_kill", "corrupt_blob")]
    dead = next((f.target for f in relays if f.kind == "relay_kill"), None)
    for f in relays:  # one relay each, and a blob is corrupted on a relay that lives
        if f.kind != "relay_kill" and dead is not None and f.target == dead:
            faults[faults.index(f)] = Fault(f.kind, f.at, 1 - f.target, f.hold)
    # Drawn apart, so that adding it left every other draw of a seed as it was.
    quiet = random.Random(f"ttpeer-chaos-silent:{seed}")
    faults = [Fault(f.kind, f.at, f.target, f.hold, quiet.random() < 0.5) if f.kind == "cut" else f for f in faults]
    rounds = rng.randint(4, 6)
    return Plan(seed=seed, peers=peers, mode=mode, rounds=rounds, inner_steps=rng.choice((40, 60, 80)),
                faults=tuple(sorted(faults, key=lambda f: f.at)), tmpfs_peer=tmpfs if root else None)
