"""The durable record log: every record this peer holds, appended as it arrives.

Frames are ``length (4 bytes, big endian) | crc32 (4) | record bytes``, appended
and fsynced before the record is acted on. A crash can only leave a torn frame at
the end; ``load`` keeps every whole frame, reports the torn or corrupt tail, and
cuts it off so appends continue from a clean end. Anything lost that way is
repaired by gossip: peers send what our digest lacks. Records are verified again
on load (``PeerMachine.load``), so a tampered log cannot inject anything.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

from ttpeer.errors import DiskError
from ttpeer.proto import MAX_RECORD_BYTES

from .._files import fsync_dir

log = logging.getLogger(__name__)
_HEAD = struct.Struct(">II")


class RecordLog:
    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = path
        self._fsync = fsync  # False only in the simulator, which tests the protocol, not the disk
        self._fd: int | None = None

    def load(self) -> list[bytes]:
        """Every whole record in the log; a torn or corrupt tail is reported and cut."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        out: list[bytes] = []
        pos = 0
        while pos + _HEAD.size <= len(data):
            length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if length > MAX_RECORD_BYTES or end > len(data):
                break
            body = data[pos + _HEAD.size : end]
            if zlib.crc32(body) != crc:
                break
            out.append(body)
            pos = end
        if pos != len(data):
            log.warning(
                "record log %s: %d bytes after record %d are torn or corrupt; cut them off "
                "(peers will resend what they held)", self.path, len(data) - pos, len(out),
            )
            try:
                with open(self.path, "r+b") as f:
                    f.truncate(pos)
                    os.fsync(f.fileno())
            except OSError as exc:
                raise DiskError(self.path, exc) from None
        return out

    def append(self, raw: bytes) -> None:
        """Append one record and fsync. Raises ``DiskError``; the log stays whole."""
        try:
            if self._fd is None:
                new = not self.path.exists()
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                if new:
                    fsync_dir(self.path.parent)
            start = os.lseek(self._fd, 0, os.SEEK_END)
            frame = _HEAD.pack(len(raw), zlib.crc32(raw)) + raw
            try:
                view = memoryview(frame)
                while view:  # a nearly full disk writes part of a frame and fails on the rest
                    view = view[os.write(self._fd, view) :]
                if self._fsync:
                    os.fsync(self._fd)
            except OSError:
                os.ftruncate(self._fd, start)  # never leave half a frame after a full disk
                raise
        except OSError as exc:
            raise DiskError(self.path, exc) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
