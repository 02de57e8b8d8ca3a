"""Startup check of everything the daemon will trust on disk.

Theory of operation. Files are written atomically and fsynced (``_files``,
``_recordlog``), so SIGKILL leaves whole files and at most a torn last log frame.
What that cannot rule out (a bad disk, a hand edit, a copy cut short) is caught
here before the daemon uses anything, and each finding is logged at error level
and returned (``ttpeer status`` shows them):

- ``records.log``: frames are parsed; a torn last frame is cut (a crash mid-append,
  expected); a frame whose checksum or length is wrong is corruption: the log is
  cut there and the bytes after it are kept in ``records.log.damaged-<time>``.
  Records lost either way come back from peers through gossip.
- ``states/<job>/<hash>.state``: each is decoded and hashed; one that does not
  hash to its name moves to ``quarantine/<job>/``, so the peer fetches that state
  from its peers (a checkpoint, or replaying closes from an older state).
- ``states/<job>/final.safetensors``: must match the sha256 its ``final.json``
  records, else the final files move to quarantine and the daemon writes them
  again once it holds the final state.
- ``tasks/<sha256>.py``: must hash to its name, else quarantined (fetched again).
- temporary files left by a write that a crash interrupted are removed.

Raises ``DiskError`` if the home cannot be repaired (read-only, full).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from ttpeer.errors import DiskError
from ttpeer.proto import MAX_RECORD_BYTES

from .._files import fsync_dir, write_atomic
from .._home import Home
from ..node._recordlog import _HEAD

log = logging.getLogger("ttpeer.integrity")


@dataclass(frozen=True)
class LogScan:
    frames: list[bytes]
    good_end: int  # bytes of whole, valid frames
    size: int
    problem: str | None  # None, "torn" or "corrupt: <why>"


def scan_log(data: bytes) -> LogScan:
    """Parse record-log frames (``length | crc32 | bytes``) up to the first bad one."""
    frames: list[bytes] = []
    pos, problem = 0, None
    while pos < len(data):
        if pos + _HEAD.size > len(data):
            problem = "torn"
            break
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if length == 0 or length > MAX_RECORD_BYTES:
            problem = f"corrupt: a frame length of {length} bytes at offset {pos}"
            break
        if end > len(data):
            problem = "torn"
            break
        body = data[pos + _HEAD.size : end]
        if zlib.crc32(body) != crc:
            problem = f"corrupt: checksum mismatch in the frame at offset {pos}"
            break
        frames.append(body)
        pos = end
    return LogScan(frames, pos, len(data), problem)


def _quarantine(home: Home, path: Path, group: str) -> Path:
    folder = home.path / "quarantine" / group
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{path.name}.{int(time.time())}"
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def _check_log(home: Home) -> list[str]:
    path = home.records_log
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    scan = scan_log(data)
    if scan.problem is None:
        return []
    lost = scan.size - scan.good_end
    if scan.problem == "torn":
        msg = (f"record log {path}: the last {lost} bytes are a torn frame (a write cut short by a crash); "
               f"cut them off, kept {len(scan.frames)} records; peers resend what was lost")
        log.warning("%s", msg)
    else:
        kept = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        write_atomic(kept, data[scan.good_end :], 0o600)
        msg = (f"record log {path} is damaged ({scan.problem.removeprefix('corrupt: ')}); "
               f"kept the {len(scan.frames)} records before it, moved the other {lost} bytes to {kept.name}; "
               "peers resend the records that were there")
        log.error("%s", msg)
    with open(path, "r+b") as f:
        f.truncate(scan.good_end)
        os.fsync(f.fileno())
    return [msg]


def _is_temp(p: Path) -> bool:
    return p.name.startswith(".") and ".tmp" in p.name


def _check_states(home: Home) -> list[str]:
    from ttpeer import train

    out: list[str] = []
    root = home.path / "states"
    if not root.exists():
        return out
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for tmp in [p for p in folder.iterdir() if _is_temp(p)]:
            tmp.unlink(missing_ok=True)
            log.info("removed %s, left by a write that a crash interrupted", tmp)
        for path in sorted(folder.glob("*.state")):
            why = None
            try:
                state = train.state_from_bytes(path.read_bytes())
                got = train.state_hash(state)
                if got != "sha256:" + path.stem:
                    why = f"it hashes to {got[:19]}..."
            except train.CheckpointError as exc:
                why = str(exc)
            if why is not None:
                moved = _quarantine(home, path, folder.name)
                msg = (f"state file {path} is corrupt ({why}); moved it to {moved}; "
                       "this peer will fetch that state from its peers")
                log.error("%s", msg)
                out.append(msg)
        out += _check_final(home, folder)
    return out


def _check_final(home: Home, folder: Path) -> list[str]:
    model, sidecar = folder / "final.safetensors", folder / "final.json"
    if not model.exists() and not sidecar.exists():
        return []
    why = None
    try:
        want = json.loads(sidecar.read_text())["model_sha256"]
        if hashlib.sha256(model.read_bytes()).hexdigest() != want:
            why = "the model does not match the sha256 in final.json"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why is None:
        return []
    for p in (model, sidecar, folder / "done.json"):
        if p.exists():
            _quarantine(home, p, folder.name)
    msg = f"final model in {folder} is damaged ({why}); moved to quarantine, it is written again"
    log.error("%s", msg)
    return [msg]


def _check_tasks(home: Home) -> list[str]:
    out: list[str] = []
    folder = home.path / "tasks"
    if not folder.exists():
        return out
    for path in sorted(folder.iterdir()):
        if _is_temp(path):
            path.unlink(missing_ok=True)
        elif path.suffix == ".py" and hashlib.sha256(path.read_bytes()).hexdigest() != path.stem:
            moved = _quarantine(home, path, "tasks")
            msg = f"task file {path} does not match its hash; moved it to {moved}; it is fetched again"
            log.error("%s", msg)
            out.append(msg)
    return out


def check_home(home: Home, *, states: bool = True) -> list[str]:
    """Check and repair the home (see the module doc); returns what was found.
    ``states=False`` leaves out the state files, whose check needs torch."""
    try:
        return _check_log(home) + (_check_states(home) if states else []) + _check_tasks(home)
    except OSError as exc:
        raise DiskError(Path(exc.filename or home.path), exc) from None


async def check_home_apart(home: Home, python: str = sys.executable) -> list[str]:
    """``check_home`` for the daemon, which does not load torch: the state files are
    checked by a short-lived child process (``python -m ttpeer.daemon.service._integrity``),
    the rest here in a worker thread."""
    import trio

    found = await trio.to_thread.run_sync(lambda: check_home(home, states=False))
    if not any((home.path / "states").glob("*/*.state")):
        return found
    done = await trio.run_process([python, "-m", "ttpeer.daemon.service._integrity", str(home.path)],
                                  capture_stdout=True, check=False)
    if done.returncode != 0:
        raise DiskError(home.path / "states", OSError(done.returncode, "checking the state files failed "
                                                       "(see the log above)"))
    return found + json.loads(done.stdout or b"[]")


def _main() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    home = Home(Path(sys.argv[1]))
    try:
        print(json.dumps(_check_states(home)))
    except OSError as exc:
        log.error("%s", DiskError(Path(exc.filename or home.path), exc))
        sys.exit(1)


if __name__ == "__main__":
    _main()
