"""Counters for this node's sealed messages, and the replay marks of its peers'.

Every pool-sealed gossip message carries ``(sender, counter)`` inside the seal;
receivers keep a ``ReplayWindow`` and drop counters already seen or too old.

Durability. A counter is ``boot << 32 | n``: ``boot`` is read from ``HOME/boot``,
incremented and written (fsync) before this node sends anything, so a restarted
sender always counts above every message it sent before (2**32 messages per
boot). The receiving side saves the highest counter accepted per sender to
``HOME/replay.json`` at most every ``SAVE_EVERY`` seconds and when the daemon
stops; on start it treats every counter up to those marks as seen. What a crash
can reopen: messages accepted in the last ``SAVE_EVERY`` seconds before it can be
replayed once more after the restart. They are signed records and digests, which
merge idempotently (set union), so such a replay changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ttpeer.errors import DiskError
from ttpeer.net._seal import ReplayWindow

from .._files import write_atomic

log = logging.getLogger("ttpeer.daemon")

SAVE_EVERY = 5.0


class ReplayGuard:
    def __init__(self, home: Path, *, durable: bool = True) -> None:
        self._marks_path = home / "replay.json"
        self._durable = durable
        self.window = ReplayWindow()
        self.dropped = 0
        self._saved_at = -float("inf")
        self._dirty = False
        try:
            marks = json.loads(self._marks_path.read_text())
            for sender, counter in marks.items():
                if isinstance(sender, str) and type(counter) is int:
                    self.window.floor(sender, counter)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("ignoring damaged replay marks %s: %s", self._marks_path, exc)
        boot_path = home / "boot"
        try:
            boot = int(boot_path.read_text()) + 1
        except (FileNotFoundError, ValueError):
            boot = 1
        self._write(boot_path, str(boot).encode())  # before anything is sent with it
        self._next = boot << 32

    def next_counter(self) -> int:
        self._next += 1
        return self._next

    def accept(self, sender: str, counter: int) -> bool:
        ok = self.window.accept(sender, counter)
        if ok:
            self._dirty = True
        else:
            self.dropped += 1
        return ok

    def maybe_save(self, now: float, *, force: bool = False) -> None:
        if not self._dirty or (not force and now < self._saved_at + SAVE_EVERY):
            return
        self._saved_at, self._dirty = now, False
        try:
            self._write(self._marks_path, json.dumps(self.window.marks()).encode())
        except (OSError, DiskError) as exc:
            log.warning("could not save replay marks: %s", exc)

    def _write(self, path: Path, data: bytes) -> None:
        if self._durable:
            write_atomic(path, data)
        else:  # the simulator: many peers in one process, no power cuts
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
