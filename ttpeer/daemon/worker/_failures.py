"""How a call that failed in a worker process fails in the daemon: one table, kind <->
exception, read at both ends of the channel (the shape of httpx's
``map_httpcore_exceptions``: one map, walked in one place on each side).

    kind           exception        carried besides its message
    task           TaskFailed       reason         the task's code failed: the job ends here
    state_missing  StateMissing     state          the machine recomputes or fetches it
    work_lost      LocalWorkLost    job            those shards train again
    disk           DiskError        path           the daemon stops
    dataset        DatasetMissing   name, dataset, pieces, whole, moved   fetched, then asked again
    job            JobError         -              this step failed; the protocol tries again
    error          TtpeerError      -              any other of ttpeer's errors (a peer's malformed
                                                   delta or checkpoint): as ``job``, by its message

The worker answers a call that raised with ``failure(exc)``: the kind of the first row
whose class ``exc`` is (so the rows go from the narrowest class to the widest), its
message and the attributes that row names. The daemon raises ``error(frame)``: the same
class, built without its ``__init__`` (which would word the message anew), so the
message and the attributes are the worker's, word for word.

Before the table, what the worker's own code raised is translated as the executor
translates the task's (``_torchutil.in_thread``): CUDA running out of memory anywhere in
the exception's chain is ``TaskFailed`` saying so, an ``OSError`` is ``DiskError`` or
``JobError`` (``os_error``). An exception still outside the table is a bug in the worker:
it is the task's failure on this peer (``task``, naming its type and the line that
raised it), never the daemon's, and the worker logs its traceback. A kind the daemon does
not know, or a frame that is not one, is a ``JobError``: a daemon and its workers are
one install, started together, so this table need not read another version's.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ttpeer.errors import DiskError, JobError, LocalWorkLost, StateMissing, TaskFailed, TtpeerError
from ttpeer.proto import DatasetMissing

from .._codec import Codec, MessageError
from .._workfiles import DISK_ERRNOS

log = logging.getLogger("ttpeer.worker")

KINDS: dict[str, tuple[type[TtpeerError], dict[str, Any]]] = {
    "task": (TaskFailed, {"reason": str}),
    "state_missing": (StateMissing, {"state": str}),
    "work_lost": (LocalWorkLost, {"job": str}),
    "disk": (DiskError, {"path": Path}),
    "dataset": (DatasetMissing, {"name": str, "dataset": str, "pieces": list[int], "whole": bool, "moved": bool}),
    "job": (JobError, {}),
    # Last, the widest: what ``in_thread`` lets pass as the protocol's to retry (a peer's
    # malformed delta, ``train.DeltaError``) is retried here too, not the task's failure.
    "error": (TtpeerError, {}),
}
MAX_ITEMS = 4096  # a list crosses cut to this many (a dataset's missing pieces: the rest are asked for next)
_VALUES = Codec(())


def failure(exc: BaseException) -> dict[str, Any]:
    """The failure frame for ``exc``: its kind, its message, and what its kind carries."""
    exc = _translated(exc)
    kind = next(kind for kind, (cls, _fields) in KINDS.items() if isinstance(exc, cls))
    carried = {name: _VALUES.to_json(getattr(exc, name)) for name in KINDS[kind][1]}
    return {"error": kind, "message": str(exc),
            **{name: v[:MAX_ITEMS] if isinstance(v, list) else v for name, v in carried.items()}}


def error(frame: Mapping[str, Any]) -> Exception:
    """The exception a failure frame says, as the worker raised it."""
    kind, message = frame.get("error"), frame.get("message")
    row = KINDS.get(kind) if isinstance(kind, str) else None
    if row is None or not isinstance(message, str):
        return JobError(str(message) if message else f"the worker failed ({kind!r})")
    cls, fields = row
    try:
        carried = {name: _VALUES.value(hint, frame.get(name), f"{kind}.{name}") for name, hint in fields.items()}
    except MessageError as exc:
        return JobError(f"the worker's failure is malformed ({exc}): {message}")
    made = cls.__new__(cls, message)
    for name, value in carried.items():
        setattr(made, name, value)
    return made


def os_error(exc: OSError) -> DiskError | JobError:
    """A full, read-only or failing disk stops the daemon (``DiskError``); any other
    failure of a file is this step's (``JobError``)."""
    if exc.errno in DISK_ERRNOS:
        return DiskError(Path(exc.filename or "a file in the ttpeer home"), exc)
    return JobError(f"{exc.filename or 'a file'}: {exc.strerror or exc}")


def _translated(exc: BaseException) -> TtpeerError:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # a nursery's wrapping says nothing of what failed
    oom = _cuda_oom(exc)
    if oom is not None:
        return TaskFailed(oom)
    if isinstance(exc, OSError):  # the worker's own files: the disk's problem, not the task's
        return os_error(exc)
    if isinstance(exc, tuple(cls for cls, _fields in KINDS.values())):
        return exc  # type: ignore[return-value]  # one of the table's classes
    # Nothing else should reach here (the executor translates task code's exceptions);
    # if it does, it is still the task's failure on this peer, never the daemon's.
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    log.error("unexpected error in the worker", exc_info=exc)
    return TaskFailed(f"{type(exc).__name__}: {exc}{at}")


def _cuda_oom(exc: BaseException) -> str | None:
    """The message for CUDA running out of memory anywhere in ``exc``'s chain, else None."""
    torch = sys.modules.get("torch")  # never imported here: the daemon has none
    if torch is None:
        return None
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    seen: BaseException | None = exc
    while seen is not None:
        if oom_type is not None and isinstance(seen, oom_type):
            found = re.search(r"GPU (\d+)", str(seen))
            device = f"cuda:{found.group(1)}" if found else "the GPU"
            return (f"out of GPU memory on {device}: try a smaller --micro-batch / --batch-size "
                    f"({str(seen).splitlines()[0][:200]})")
        seen = seen.__cause__ or seen.__context__
    return None
