"""``OwnCopies``: what this peer made and uploaded, kept here so it is not downloaded back.

Three kinds, each bounded: its newest deltas (``OWN_DELTAS_KEPT`` files with their sha256,
linked or copied into a round's work files instead of fetching the blob), its newest
reduced slices (``OWN_SLICES_KEPT``, in memory: a slice is a fraction of one delta), and
the initial states it made (moved in, given out once). Each is only a saving: a copy that
is gone, or no longer hashes as it did, is fetched as anyone else's would be. The folder
is ``HOME/work/own``, cleared with the rest of ``work/`` at every start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import trio

from .._offload import file_sha256, off_span

log = logging.getLogger("ttpeer.daemon")

OWN_SLICES_KEPT = 8  # reduced slices this peer made, kept in memory for the closes that use them
OWN_DELTAS_KEPT = 32  # this peer's newest deltas kept to aggregate and apply with (no download)


class OwnCopies:
    """This peer's own deltas, slices and initial states; files in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._deltas: OrderedDict[str, tuple[Path, str]] = OrderedDict()  # blob -> its delta here, sha256
        self._states: dict[str, Path] = {}  # state -> an initial state this peer made
        self._slices: OrderedDict[str, bytes] = OrderedDict()  # blob -> a reduced slice made here

    def keep_state(self, state: str, path: Path) -> None:
        """Keep the state file at ``path`` (moved: an initial state this peer made and
        uploaded), so that fetching ``state`` here takes it instead of downloading it back."""
        dest = self._folder / f"{state.removeprefix('sha256:')}.state"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
        except OSError as exc:
            log.info("could not keep the initial state (%s); it is downloaded when needed", exc)
            return
        self._states[state] = dest

    async def take_state(self, state: str, dest: Path) -> bool:
        """``state`` at ``dest`` (moved there) if this peer kept it (``keep_state``); False
        otherwise. It is given once: a state that does not import is fetched."""
        own = self._states.pop(state, None)
        if own is None:
            return False
        try:
            os.replace(own, dest)  # one folder, one file system: a rename
        except OSError:
            own.unlink(missing_ok=True)
            return False
        await trio.lowlevel.checkpoint()
        return True

    async def keep_delta(self, blob: str, data: bytes) -> None:
        """Keep ``data``, this peer's delta just uploaded as ``blob``, for the closes that use
        it (the newest ``OWN_DELTAS_KEPT``)."""
        path = self._folder / f"{blob}.bin"
        try:
            await off_span(len(data), _write_own, path, data)
        except OSError as exc:  # only a saving: without the copy the delta is downloaded
            log.info("could not keep a copy of this peer's delta (%s); it is downloaded when needed", exc)
            return
        self._deltas[blob] = (path, hashlib.sha256(data).hexdigest())
        while len(self._deltas) > OWN_DELTAS_KEPT:
            _blob, (old, _digest) = self._deltas.popitem(last=False)
            old.unlink(missing_ok=True)

    async def copy_delta(self, blob: str, dest: Path, size: int) -> bool:
        """This peer's delta ``blob`` at ``dest``, if kept here and still ``size`` bytes that
        hash as they did; False otherwise (then the blob is downloaded)."""
        own = self._deltas.get(blob)
        return own is not None and bool(await off_span(size, _copy_own, *own, dest, size))

    def keep_slice(self, blob: str, data: bytes) -> None:
        """Keep a reduced slice this peer made (or checked: the same bytes), the plaintext of
        ``blob``, so the close that uses it need not download it back (the newest
        ``OWN_SLICES_KEPT``)."""
        self._slices[blob] = data
        while len(self._slices) > OWN_SLICES_KEPT:
            self._slices.popitem(last=False)

    def kept_slice(self, blob: str) -> bytes | None:
        return self._slices.get(blob)


def _write_own(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _copy_own(own: Path, digest: str, dest: Path, size: int) -> bool:
    """``own`` (this peer's delta) at ``dest``, linked or copied; False if it is gone, not
    ``size`` bytes or no longer hashes as it did (then the blob is downloaded)."""
    try:
        if own.stat().st_size != size:
            return False
        try:
            os.link(own, dest)
        except OSError:
            shutil.copyfile(own, dest)
        if file_sha256(dest) != digest:
            dest.unlink(missing_ok=True)
            return False
    except OSError:
        return False
    return True
