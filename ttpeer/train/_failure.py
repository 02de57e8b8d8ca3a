"""Saying in one line where a task's code failed: the user's file and line, not ours.

Task files are compiled under the name the user gave them (``my_task.py``, see
``_tasks.py``), which this module remembers, so a traceback's frames in a task
file are recognisable whatever folder the copy lies in. ``describe`` turns any
exception into ``my_task.py:31 in loss: RuntimeError: boom``; when no frame of
the traceback is in a task file (the task's loss *is* ``F.cross_entropy``), it
names which part of the task ran instead, from the line of ttpeer's training code
that called it. Pure Python: no torch here.
"""

from __future__ import annotations

import linecache
import re
import traceback
from pathlib import Path

_TASK_FILES: set[str] = set()  # names task files were compiled under
_TRAIN_DIR = str(Path(__file__).parent)
MAX_MESSAGE = 300
# What a line of ttpeer's training code calls, by the text of that line: the part of
# the task that raised when the traceback has no frame in the task file itself.
_ROLES = (
    (re.compile(r"spec\.loss\("), "loss"),
    (re.compile(r"spec\.metric\("), "metric"),
    (re.compile(r"spec\.model\("), "model()"),
    (re.compile(r"\bmodel\("), "model's forward"),
    (re.compile(r"fetch_batch\(|dataset\[|source\["), "dataset"),
)


def register_task_file(filename: str, source: bytes) -> None:
    """Remember that ``filename`` names a task file's code, and put its source in
    ``linecache`` so tracebacks (and ``describe``) can quote its lines."""
    _TASK_FILES.add(filename)
    text = source.decode("utf-8", errors="replace")
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)


def one_line(exc: BaseException) -> str:
    """``Type: message``, the message cut to its first line and ``MAX_MESSAGE`` characters."""
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def where_in_task(exc: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of ``exc`` (or of what caused it)
    that lies in a task file, else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = [f for f in traceback.extract_tb(current.__traceback__) if f.filename in _TASK_FILES]
        if frames:
            f = frames[-1]
            return f"{f.filename}:{f.lineno} in {f.name}"
        current = current.__cause__ or current.__context__
    return None


def _role(exc: BaseException) -> str | None:
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(_TRAIN_DIR)]
    for frame in reversed(ours):
        for pattern, role in _ROLES:
            if pattern.search(frame.line or ""):
                return role
    return None


def describe(exc: BaseException, task: str) -> str:
    """One line for a user: where in the task ``exc`` came from, and what it was.
    ``task``: the task's name, for when no frame is in a task file."""
    where = where_in_task(exc)
    if where is not None:
        return f"{where}: {one_line(exc)}"
    role = _role(exc)
    if role is not None:
        return f"{task}: the task's {role} raised {one_line(exc)}"
    return f"{task}: {one_line(exc)}"
