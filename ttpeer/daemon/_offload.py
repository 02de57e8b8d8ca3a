"""Work the daemon keeps off its event loop, and awaits it runs side by side.

``off_span`` and ``off_loop`` run a function over bytes or a file in a thread when it is
large enough (``THREAD_FILE_BYTES``) that the event loop would notice, inline when not
(the thread hop costs more, and the simulator stays deterministic). ``in_order`` awaits
many calls at a bounded concurrency and returns their results in the calls' order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

T = TypeVar("T")
THREAD_FILE_BYTES = 4 * 2**20  # a larger state is sealed or opened in a thread


async def in_order(calls: Sequence[Callable[[], Awaitable[T]]], *, limit: int) -> list[T]:
    """Await ``calls``, at most ``limit`` at a time; their results in the calls' order. The
    first failure cancels the rest and is raised as itself (not in an exception group:
    callers catch ``NetError`` or ``SealError`` as from one call)."""
    results: list[Any] = [None] * len(calls)
    failed: list[Exception] = []
    gate = trio.Semaphore(limit)

    async def one(i: int, cancel: trio.CancelScope) -> None:
        async with gate:
            try:
                results[i] = await calls[i]()
            except Exception as exc:
                failed.append(exc)
                cancel.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i, nursery.cancel_scope)
    if failed:
        raise failed[0]
    return results


async def off_span(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on ``size`` bytes, returning what it returns: in a thread
    when large (as ``off_loop``), inline when small (the simulator stays exact)."""
    if size > THREAD_FILE_BYTES:
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    out = fn(*args, **kwargs)
    await trio.lowlevel.checkpoint()
    return out


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def off_loop(path: Path, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on a file at ``path``: in a thread when the file is large enough that
    the event loop would notice (a model state: about a second of ChaCha20), inline when not (the
    thread hop costs more, and the simulator stays deterministic)."""
    if path.stat().st_size > THREAD_FILE_BYTES:
        await trio.to_thread.run_sync(fn, *args)
    else:
        fn(*args)
        await trio.lowlevel.checkpoint()
