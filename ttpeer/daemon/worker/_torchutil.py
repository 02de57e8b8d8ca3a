"""What the torch executor needs besides its own methods: the one boundary where what task
code and torch raise is translated for the node (``in_thread``), the memory a peer has,
reading a slice of a chunked delta from its file, and the small file rules of a job's
final files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import trio

from ttpeer import train
from ttpeer.errors import TaskFailed, TtpeerError

from .._executor import DeltaRef
from ._failures import os_error

log = logging.getLogger("ttpeer.train")
T = TypeVar("T")


def unfinish(folder: Path, state: str) -> None:
    """Before writing ``state``'s final files, drop a ``done.json`` that names another state.

    A peer wrote its final files for one branch, then the pool settled on another (a fork
    at the job's end, repaired): until the new files are complete, ``export`` must say the
    job is still finishing here rather than copy the losing branch's model."""
    done = folder / "done.json"
    try:
        written = json.loads(done.read_text()).get("state")
    except (OSError, ValueError, AttributeError):
        return  # none yet (or unreadable: it is rewritten last either way)
    if written != state:
        done.unlink(missing_ok=True)


def need_pieces(task: train.LoadedTask, pieces: list[int], world: int, device: str) -> None:
    """Raise ``DatasetMissing`` naming the pieces of ``pieces`` not here, before a step is
    taken: the daemon fetches them and asks again, and the local model has not moved. A
    peer's workers decide together (one may look just before a piece lands, another after)."""
    if not pieces or not isinstance(task.train, train.Samples):
        return
    missing = task.train.missing(pieces)
    if world > 1 and train.agreed_stop(lambda: bool(missing), device)():
        missing = missing or list(pieces[:1])  # the others miss some: all raise, none steps
    if missing:
        index = task.train.index
        raise train.DatasetMissing(index.name, dataset=index.dataset, pieces=missing)


def values_of(like: train.OuterState) -> int:
    return sum(t.numel() for t in like.params.values())


def chunk_run(ref: DeltaRef, numel: int, first: int, stop: int) -> tuple[train.ChunkIndex, bytes]:
    """A chunked delta's checked index and the bytes of its chunks ``first`` .. ``stop``-1:
    from a file, only those bytes are read (an aggregator holds its slice of each delta,
    not the deltas). Raises DeltaError for a delta that is not chunked for this model."""
    def run_of(index: train.ChunkIndex) -> tuple[int, int]:
        if not 0 <= first < stop <= index.nchunks:
            raise train.DeltaError(f"delta has {index.nchunks} chunks; the slice wants [{first}, {stop})")
        return index.span(first, stop)

    if isinstance(ref, bytes):
        index = train.read_index(ref, numel)
        begin, end = run_of(index)
        return index, ref[begin:end]
    with open(ref, "rb") as f:
        prefix = f.read(train.CHUNK_HEADER)
        head = prefix + f.read(train.head_size(prefix) - len(prefix))
        index = train.read_index(head, numel)
        begin, end = run_of(index)
        f.seek(begin)
        data = f.read(end - begin)
    if len(data) != end - begin:
        raise train.DeltaError(f"delta is cut short: chunks [{first}, {stop}) need {end - begin} bytes")
    return index, data


async def in_thread(fn: Callable[[], T], task: str) -> T:
    """Run ``fn`` (which calls into the task ``task`` and torch) in a worker thread: the
    one place where what they raise is translated, once, for the node (a worker process
    sends what comes out across its channel as it is: ``_failures``).

    - an ``OSError`` becomes a ``DiskError`` (which stops the daemon) when the disk is
      full, read-only or failing, else a ``JobError`` (the step fails and the protocol
      tries again): ``_failures.os_error``;
    - ttpeer's own errors pass as they are (a state missing, a peer's malformed delta or
      checkpoint: not the task's fault, the protocol tries again), except:
    - non-finite training (``train.Diverged``) and a task that does not load or keep its
      contract (``train.TaskError``) become ``TaskFailed``;
    - anything else the task's code or torch raises becomes ``TaskFailed`` naming the task
      file's line (``train.describe``). Nothing else leaves an executor method."""
    try:
        return await trio.to_thread.run_sync(fn)
    except OSError as exc:
        raise os_error(exc) from None
    except train.Diverged as exc:
        raise TaskFailed(f"training diverged ({exc.where}): try a lower --inner-lr") from None
    except train.TaskError as exc:
        raise TaskFailed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    except TtpeerError:
        raise
    except (Exception, SystemExit) as exc:  # task code calling sys.exit() must not end the daemon
        log.debug("task %s failed", task, exc_info=True)
        raise TaskFailed(train.describe(exc, task)) from None


def available_memory(device: str, limit: int | None) -> tuple[int, int, bool]:
    """Bytes free on ``device`` and in host memory, and whether ``limit`` capped the first."""
    host = host_available()
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        device_free = int(free)
    else:
        device_free = host
    if limit is not None and limit < device_free:
        return limit, (min(host, limit) if device == "cpu" else host), True
    return device_free, host, False


def host_available() -> int:
    # MemAvailable counts the page cache the kernel would give back; free pages alone do not.
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 2**62
