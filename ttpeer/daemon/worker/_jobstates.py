"""The model states one job holds on this peer: files first, memory where the mode needs it.

Every held state is written to ``HOME/states/<job>/<hash>.state`` atomically before it is
reported held, so a peer killed at any moment restarts from a state the pool agreed on;
only the newest ``KEEP_STATES`` are kept on disk (and the job's initial state, which a
later job of the same task and seed starts from). A state's hash is checked the first
time this peer reads a file it did not write.

A fused job keeps no state in memory (``keep_one=False``): a state is read from its file
where it is used, a tensor at a time where it can be. An ensemble keeps the one in use
(every unit of a round reads its members from it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ttpeer import train
from ttpeer.errors import JobError, StateMissing
from ttpeer.train import OuterState

from .._files import write_atomic
from .._home import Home

KEEP_STATES = 3


class JobStates:
    """The held states of job ``job`` (its id; ``init``: its initial state's hash), each
    checked against ``like`` (names and shapes, on the meta device)."""

    def __init__(self, home: Home, job: str, init: str, like: OuterState, *, keep_one: bool) -> None:
        self.home, self.job, self.init, self.like = home, job, init, like
        self._keep_one = keep_one
        self._memory: dict[str, OuterState] = {}
        self._verified: set[str] = set()  # states whose file's hash was checked here

    @property
    def in_memory(self) -> int:
        """How many states are kept in memory (0 or 1)."""
        return len(self._memory)

    def held(self) -> set[str]:
        return self.home.held_states(self.job)

    def file(self, state: str) -> Path:
        """Where ``state`` is (or would be) written, unchecked."""
        return self.home.state_file(self.job, state)

    def path(self, state: str) -> Path:
        """The file of ``state``, its hash checked (once: a file written or checked here is
        not hashed again). Raises StateMissing, JobError if it is corrupt."""
        path = self.file(state)
        if not path.exists():
            # States are named by their hash, so another job's file with this name holds
            # the same bytes (two jobs of one task and seed start from one state).
            path = next((p for p in (self.home.path / "states").glob(f"*/{path.name}")), path)
        if state not in self._verified or not path.exists():
            try:
                digest = train.file_state_hash(path)
            except FileNotFoundError:
                raise StateMissing(state) from None
            except train.CheckpointError:
                digest = None
            if digest != state:
                raise JobError(f"state file for {state[:19]} is corrupt")
            self._verified.add(state)
        return path

    def load(self, state: str) -> OuterState:
        """``state`` in memory: read from its file at every call, unless this job keeps the
        one in use (then it replaces the one kept)."""
        if state not in self._memory:
            try:
                loaded = train.state_from_file(self.path(state), like=self.like)
            except FileNotFoundError:
                raise StateMissing(state) from None
            if not self._keep_one:
                return loaded
            self._memory = {state: loaded}
        return self._memory[state]

    def params(self, state: str) -> Iterator[tuple[str, torch.Tensor]]:
        """``state``'s params one tensor at a time, from its file."""
        try:
            for name, param, _momentum in train.iter_state_file(self.path(state), self.like):
                yield name, param
        except FileNotFoundError:
            raise StateMissing(state) from None

    def stream(self, state: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """``state``'s (name, param, momentum) one at a time (``train.iter_state_file``)."""
        return train.iter_state_file(self.path(state), self.like)

    def forget(self, state: str) -> None:
        """Drop ``state`` from memory (it stays on disk)."""
        self._memory.pop(state, None)

    def hold(self, state: OuterState) -> str:
        """Write ``state`` and return its hash; older files beyond ``KEEP_STATES`` go."""
        digest = train.state_hash(state)
        write_atomic(self.file(digest), train.state_chunks(state))
        self._verified.add(digest)
        self._memory = {digest: state} if self._keep_one else {}
        files = sorted((p for p in self.home.states(self.job).glob("*.state") if "sha256:" + p.stem != self.init),
                       key=lambda p: p.stat().st_mtime)
        for old in files[:-KEEP_STATES]:
            old.unlink(missing_ok=True)
        return digest
