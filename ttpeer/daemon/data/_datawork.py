"""The data parts' scratch files.

``WorkFiles`` names the files a piece is sealed into before an upload, or fetched into
before it is checked and written at its place: ``HOME/work/data/piece-N.<suffix>``,
removed when the block ends, whatever happened. An ``OSError`` inside the block becomes
``DiskError`` when the disk is full or read-only, else ``JobError`` (``disk_or_job``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from .._workfiles import disk_or_job


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
