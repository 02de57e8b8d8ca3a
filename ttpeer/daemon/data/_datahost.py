"""What the data parts use of the running node (``Host``), and their scratch files.

``Host`` is the node as ``Datasets`` and its parts see it (``_node.Node`` is one).
``WorkFiles`` names the files a piece is sealed into before an upload, or fetched into
before it is checked and written at its place: ``HOME/work/data/piece-N.<suffix>``,
removed when the block ends, whatever happened. An ``OSError`` inside the block becomes
``DiskError`` when the disk is full or read-only, else ``JobError`` (``disk_or_job``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ttpeer.proto import Effect, PeerMachine

from .._counters import Counters
from .._home import Home, PoolConfig
from .._workfiles import disk_or_job
from ..sealed._blobs import Blobs


class Host(Protocol):
    """What the data part uses of the running node (``_node.Node`` is one)."""

    machine: PeerMachine
    me: str
    cfg: PoolConfig
    home: Home
    blobs: Blobs
    counters: Counters
    node_key: Ed25519PrivateKey
    key_event: trio.Event

    @property
    def pool_key(self) -> bytes | None: ...
    nursery: trio.Nursery | None
    phases: dict[str, str]
    finished: dict[str, str]  # job -> the state whose final files this peer wrote

    def wall(self) -> float: ...
    def now(self) -> float: ...
    def process(self, effects: list[Effect], *, wake: bool = True) -> None: ...
    def broadcast_want(self, payload: bytes) -> None: ...


class WorkFiles:
    """Scratch files for pieces in flight, in ``folder`` (made on first use)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._names = 0

    @contextlib.contextmanager
    def file(self, suffix: str = "sealed") -> Iterator[Path]:
        """A fresh path, removed when the block ends. Raises ``DiskError``, ``JobError``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._names += 1
        path = self.folder / f"piece-{self._names}.{suffix}"
        try:
            yield path
        except OSError as exc:
            raise disk_or_job(self.folder, exc) from None
        finally:
            path.unlink(missing_ok=True)
